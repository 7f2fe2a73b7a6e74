//! `tern metadata-server` and `tern storage-server`: a TOML config overridden by flags.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;
use tern_common::ByteSize;

#[derive(Args)]
pub struct MetadataArgs {
    /// TOML config file (keys as in the README); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// gRPC listen address [default: 127.0.0.1:9060].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// State directory [default: tern-data/metadata].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Prometheus metrics endpoint [default: 127.0.0.1:9061].
    #[arg(long)]
    admin: Option<SocketAddr>,
    /// Cluster block size, a power of two from 4KiB to 64MiB [default: 1MiB].
    #[arg(long)]
    block_size: Option<ByteSize>,
    /// How often storage servers heartbeat [default: 1000].
    #[arg(long)]
    heartbeat_interval_ms: Option<u64>,
    /// A storage server silent this long is dead [default: 5000].
    #[arg(long)]
    server_timeout_ms: Option<u64>,
    /// Lease of a job that asks for none [default: 30000].
    #[arg(long)]
    default_lease_ms: Option<u64>,
    /// TLS material (`tern cert init`): serve gRPC over mutual TLS [default: none].
    #[arg(long)]
    tls_dir: Option<PathBuf>,
    /// Allow plain gRPC beyond loopback without TLS [default: false].
    #[arg(long)]
    trusted_network: bool,
    /// Snapshot the state (and cut the log) this often when the log grew [default: 60000].
    #[arg(long)]
    snapshot_interval_ms: Option<u64>,
    /// Snapshot as soon as the log grew by this much [default: 64MiB].
    #[arg(long)]
    snapshot_log_size: Option<ByteSize>,
    /// Acknowledge changes without syncing the log: a machine crash may lose them [default: sync].
    #[arg(long)]
    no_fsync: bool,
    /// Most open gRPC connections; further ones are closed as they arrive [default: 4096].
    #[arg(long)]
    max_connections: Option<u32>,
    /// Most RPCs in flight on one gRPC connection (HTTP/2 streams) [default: 1024].
    #[arg(long)]
    max_concurrent_streams: Option<u32>,
    /// Largest gRPC message received or sent, 64KiB to 16MiB [default: 16MiB].
    #[arg(long)]
    max_message_size: Option<ByteSize>,
}

pub async fn run_metadata(args: MetadataArgs) -> anyhow::Result<()> {
    let mut config: tern_metadata::Config = tern_common::config::load(args.config.as_deref())?;
    override_with(&mut config.listen, args.listen);
    override_with(&mut config.dir, args.dir);
    override_with(&mut config.admin_listen, args.admin);
    override_with(&mut config.block_size, args.block_size);
    override_with(&mut config.heartbeat_interval_ms, args.heartbeat_interval_ms);
    override_with(&mut config.server_timeout_ms, args.server_timeout_ms);
    override_with(&mut config.default_lease_ms, args.default_lease_ms);
    if args.tls_dir.is_some() {
        config.tls_dir = args.tls_dir;
    }
    config.trusted_network |= args.trusted_network;
    override_with(&mut config.snapshot_interval_ms, args.snapshot_interval_ms);
    override_with(&mut config.snapshot_log_size, args.snapshot_log_size);
    config.fsync &= !args.no_fsync;
    override_with(&mut config.max_connections, args.max_connections);
    override_with(&mut config.max_concurrent_streams, args.max_concurrent_streams);
    override_with(&mut config.max_message_size, args.max_message_size);
    tern_metadata::run(config).await
}

#[derive(Args)]
pub struct StorageArgs {
    /// TOML config file (keys as in the README); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Metadata server address [default: 127.0.0.1:9060].
    #[arg(long)]
    metadata: Option<String>,
    /// Block-service listen address; port 0 picks a free port [default: 127.0.0.1:9070].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Address clients use to reach this server [default: the bound address].
    #[arg(long)]
    advertise: Option<String>,
    /// Size of the DRAM tier, e.g. 4GiB [default: 1GiB].
    #[arg(long)]
    dram: Option<ByteSize>,
    /// Prometheus metrics endpoint [default: 127.0.0.1:9071].
    #[arg(long)]
    admin: Option<SocketAddr>,
    /// Most client connections served at once, TCP and QUIC together [default: 1024].
    #[arg(long)]
    max_connections: Option<usize>,
    /// Replies queued per connection before the server stops reading it (backpressure)
    /// [default: 64].
    #[arg(long)]
    max_in_flight_per_connection: Option<usize>,
    /// NVMe tier: a file (created and preallocated if missing) or block device, opened with
    /// O_DIRECT [default: none].
    #[arg(long)]
    nvme: Option<PathBuf>,
    /// Bytes of the NVMe file or device to use, e.g. 100GiB; required for a new file
    /// [default: the existing file's or device's size].
    #[arg(long)]
    nvme_size: Option<ByteSize>,
    /// NVMe io engine: uring, psync, or auto (uring if it works here, else psync) [default: auto].
    #[arg(long)]
    io_engine: Option<tern_storage::config::IoEngineChoice>,
    /// TLS material (`tern cert init`): also serve the block protocol over QUIC, and use TLS
    /// to the metadata server unless its address says http:// [default: none].
    #[arg(long)]
    tls_dir: Option<PathBuf>,
    /// QUIC (UDP) listen address [default: the block service's host and port].
    #[arg(long)]
    quic_listen: Option<SocketAddr>,
    /// Allow the plain-TCP block service beyond loopback without TLS [default: false].
    #[arg(long)]
    trusted_network: bool,
}

pub async fn run_storage(args: StorageArgs) -> anyhow::Result<()> {
    let mut config: tern_storage::Config = tern_common::config::load(args.config.as_deref())?;
    override_with(&mut config.metadata, args.metadata);
    override_with(&mut config.listen, args.listen);
    if args.advertise.is_some() {
        config.advertise = args.advertise;
    }
    override_with(&mut config.dram, args.dram);
    override_with(&mut config.admin_listen, args.admin);
    override_with(&mut config.max_connections, args.max_connections);
    override_with(&mut config.max_in_flight_per_connection, args.max_in_flight_per_connection);
    if args.nvme.is_some() {
        config.nvme = args.nvme;
    }
    if args.nvme_size.is_some() {
        config.nvme_size = args.nvme_size;
    }
    override_with(&mut config.io_engine, args.io_engine);
    if args.tls_dir.is_some() {
        config.tls_dir = args.tls_dir;
    }
    if args.quic_listen.is_some() {
        config.quic_listen = args.quic_listen;
    }
    config.trusted_network |= args.trusted_network;
    tern_storage::run(config).await
}

fn override_with<T>(field: &mut T, flag: Option<T>) {
    if let Some(value) = flag {
        *field = value;
    }
}
