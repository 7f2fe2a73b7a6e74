//! Tern's async Rust client.
//!
//! ```no_run
//! # async fn demo() -> tern_client::Result<()> {
//! let client = tern_client::Client::connect("127.0.0.1:9060").await?;
//! let mut file = client.create("/data/hello", true).await?;
//! file.write(b"hello, tern").await?;
//! file.close().await?;
//! let bytes = client.open("/data/hello").await?.read_to_end().await?;
//! assert_eq!(bytes, b"hello, tern");
//! # Ok(()) }
//! ```
//!
//! Files are written once through a [`FileWriter`] (blocks pipelined to the storage servers, a
//! bounded number in flight) and become readable when closed; a [`FileReader`] streams them back
//! with read-ahead. A [`JobSession`] owns `/jobs/<job>/` and keeps its lease alive; its token
//! (held by the client, see [`Client::job_token`]) is what lets the job's data frames through.

mod admin;
mod auth;
mod conn;
mod error;
mod job;
mod liveness;
mod location;
mod reader;
mod shuffle;
mod writer;

use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tern_proto::v1::admin_client::AdminClient;
use tern_proto::v1::metadata_client::MetadataClient;
use tern_proto::v1::{self as pb};
use tern_transport::failover::{self, Failover};
use tonic::transport::{Channel, Endpoint};

pub use auth::{CREDENTIAL_ENV, TENANT_ENV, TOKEN_ENV};
pub use error::{Error, ErrorKind, Result};
pub use job::JobSession;
pub use reader::FileReader;
pub use shuffle::{
    CommitOutcome, MapWriter, MapWriterOptions, Shuffle, ShuffleBatch, ShuffleOptions, ShuffleReader, SpaceWait,
    SpaceWaitHook,
};
pub use tern_proto::v1::{BlockLocation, EntryKind, FileInfo, JobStatus, ServerMode, ServerStatus, StatusResponse};
pub use tern_proto::{BlockId, FileId, ServerId, ShuffleId, StorageClass, Tier};
pub use tern_transport::tls::{PemOrigin, TlsMaterial};
pub use tern_transport::TransportKind;
pub use writer::FileWriter;

/// Most metadata addresses one client takes (the replicas of one metadata service).
pub use tern_transport::failover::MAX_METADATA_ADDRESSES;
/// Default [`ClientOptions::rdma_connect_timeout`] (defined by the transport that applies it).
pub use tern_transport::rdma_or::DEFAULT_RDMA_CONNECT_TIMEOUT;

/// Default [`ClientOptions::connect_timeout`]: a handshake on a live network takes milliseconds.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default [`ClientOptions::request_timeout`]: metadata calls are small but some walk many
/// entries (a recursive delete, a shuffle's locations).
pub const DEFAULT_RPC_TIMEOUT: Duration = Duration::from_secs(30);
/// Shortest deadline of a lease renewal (see [`renewal_deadline`]).
const MIN_RENEWAL_DEADLINE: Duration = Duration::from_secs(1);

/// Each lease renewal's deadline (its grpc-timeout) for a lease of `lease`: a third of it, from
/// [`MIN_RENEWAL_DEADLINE`] to [`DEFAULT_RPC_TIMEOUT`]. Renewals go every third of the lease, and
/// given several metadata addresses a leader whose packets vanish holds each try only this long
/// before the next address is asked (`tern_transport::failover`): the renewal reaches the new
/// leader, which counts the lease from its election, before the lease runs out there. With the
/// request timeout alone a renewal could wait 30 s on the silent leader, past a shorter lease.
pub(crate) fn renewal_deadline(lease: Duration) -> Duration {
    (lease / 3).clamp(MIN_RENEWAL_DEADLINE, DEFAULT_RPC_TIMEOUT)
}

/// Default [`ClientOptions::block_request_timeout`]: a 1 MiB block takes about 10 ms at 1 Gbit/s,
/// and the requests queued ahead of it on a connection (64 by default) about 0.6 s; 10 s leaves
/// room for a loaded server and a 100 Mbit/s link, and is short enough that a job stalls on a
/// server cut off from it for about twice the metadata server's default 5 s heartbeat timeout.
pub const DEFAULT_BLOCK_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Tuning knobs; the defaults suit a client on the same 10-100 Gbit/s network as the servers.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Blocks a writer has in flight to storage servers at once (memory: this many blocks).
    pub writes_in_flight: usize,
    /// Blocks a reader fetches ahead of the one being consumed (memory: this many blocks).
    pub read_ahead_blocks: usize,
    /// Connections opened to each storage server.
    pub connections_per_server: usize,
    /// Requests in flight on one connection.
    pub requests_per_connection: usize,
    /// Largest number of blocks a writer asks the metadata server for at once.
    pub max_allocate_batch: u32,
    /// Deadline for opening a connection, handshake included: to the metadata server and to
    /// each storage server (TCP, TLS or QUIC). Default [`DEFAULT_CONNECT_TIMEOUT`].
    pub connect_timeout: Duration,
    /// Deadline for an RDMA connect to a storage server (`--transport rdma`, or `auto` with a
    /// device), after which the client falls back to TCP for that server. It is part of
    /// `connect_timeout`, which covers the fallback too. Default
    /// [`DEFAULT_RDMA_CONNECT_TIMEOUT`].
    pub rdma_connect_timeout: Duration,
    /// Deadline for each control-plane call (one metadata or admin RPC). Default
    /// [`DEFAULT_RPC_TIMEOUT`].
    pub request_timeout: Duration,
    /// Deadline for each data-plane request to a storage server: a job token's Auth, a block
    /// read or write, a shuffle push or fetch. A connection on which one is missed is given up,
    /// and the caller asks the metadata server what became of the server. Default
    /// [`DEFAULT_BLOCK_REQUEST_TIMEOUT`].
    pub block_request_timeout: Duration,
    /// Transport of block traffic: `auto` (default: plain TCP to servers on loopback, TLS over
    /// TCP to others when `tls_dir` is given), `tcp`, `tls` or `quic` (both need `tls_dir`).
    pub transport: TransportKind,
    /// TLS material (`tern cert init`): the metadata channel uses mutual TLS with it (unless the
    /// address says `http://`), and QUIC needs it.
    pub tls_dir: Option<PathBuf>,
    /// The tenant jobs started by this client count against ("" = "default"). Default: the
    /// `TERN_TENANT` environment variable, else "".
    pub tenant: String,
    /// The credential this client acts with on the control plane (`tern_proto::identity`: an
    /// operator's or a tenant's, as `tern up` writes them under `DIR/credentials/`); none: a
    /// client of the default tenant. Default: the `TERN_CREDENTIAL` environment variable (a
    /// task's, set by its executor), else none (the CLI's `--as` or `TERN_AS` comes first).
    pub credential: Option<String>,
}

impl Default for ClientOptions {
    fn default() -> ClientOptions {
        ClientOptions {
            writes_in_flight: 16,
            read_ahead_blocks: 16,
            connections_per_server: 2,
            requests_per_connection: 64,
            max_allocate_batch: 256,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            rdma_connect_timeout: DEFAULT_RDMA_CONNECT_TIMEOUT,
            request_timeout: DEFAULT_RPC_TIMEOUT,
            block_request_timeout: DEFAULT_BLOCK_REQUEST_TIMEOUT,
            transport: TransportKind::Auto,
            tls_dir: None,
            tenant: std::env::var(auth::TENANT_ENV).unwrap_or_default(),
            credential: std::env::var(auth::CREDENTIAL_ENV).ok().filter(|c| !c.trim().is_empty()),
        }
    }
}

/// How a new file is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CreateOptions {
    /// Which tiers its blocks may use.
    pub class: StorageClass,
    /// Copies of each block, each on a different storage server: 1 or 2. The writer stores every
    /// copy before a block counts as written; readers fail over between copies, and the file is
    /// `DataLost` only when every copy of some block is gone.
    pub replicas: u32,
}

impl Default for CreateOptions {
    fn default() -> CreateOptions {
        CreateOptions { class: StorageClass::Any, replicas: 1 }
    }
}

/// A connection to a Tern cluster. Cheap to clone; clones share connections.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    metadata_addr: String,
    metadata: MetadataClient<auth::Calls>,
    /// Operators' calls, on the same channel.
    admin: AdminClient<auth::Calls>,
    blocks: conn::BlockPool,
    options: ClientOptions,
    /// This host's address as the cluster sees it, so placement can prefer a local server.
    host: String,
    /// The cluster's block size, asked once.
    block_size: tokio::sync::OnceCell<u32>,
    /// Job tokens held, by job.
    tokens: Arc<auth::Tokens>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The liveness watcher holds the client weakly; this ends it.
        self.blocks.stalls().close();
    }
}

/// The block connector of `kind`; TLS and QUIC need the TLS material. An RDMA connect falls back
/// after `rdma_timeout`.
fn connector(
    kind: TransportKind,
    tls: Option<&tern_transport::tls::TlsMaterial>,
    rdma_timeout: Duration,
) -> Result<Arc<dyn tern_transport::Connector>> {
    let needs_tls = || {
        Error::invalid(format!(
            "the {kind} transport needs TLS material: pass --tls-dir DIR (made by `tern cert init --dir DIR`)"
        ))
    };
    let auto = || -> Result<Arc<dyn tern_transport::Connector>> {
        Ok(Arc::new(
            tern_transport::tls_tcp::AutoConnector::new(tls).map_err(|e| Error::invalid(format!("{kind}: {e:#}")))?,
        ))
    };
    Ok(match kind {
        // Without TLS material the network is a trusted one (plain frames): RDMA where both ends
        // have it. With TLS material, never: RDMA frames are not encrypted.
        // The same-host path first, for a server on this host.
        TransportKind::Auto if tls.is_none() => Arc::new(tern_transport::local::LocalFirst::new(
            tern_transport::rdma_or::RdmaOr::connector(auto()?, "TCP", false, rdma_timeout),
        )),
        TransportKind::Auto => Arc::new(tern_transport::local::LocalFirst::new(auto()?)),
        TransportKind::Local => Arc::new(tern_transport::local::LocalConnector),
        TransportKind::Rdma => tern_transport::rdma_or::RdmaOr::connector(auto()?, "TCP", true, rdma_timeout),
        TransportKind::Tcp => Arc::new(tern_transport::tcp::TcpConnector),
        TransportKind::Tls => Arc::new(
            tern_transport::tls_tcp::TlsTcpConnector::new(tls.ok_or_else(needs_tls)?)
                .map_err(|e| Error::invalid(format!("{kind}: {e:#}")))?,
        ),
        TransportKind::Quic => Arc::new(
            tern_transport::quic::QuicConnector::new(
                tls.ok_or_else(needs_tls)?,
                &tern_transport::quic::QuicTuning::default(),
            )
            .map_err(|e| Error::invalid(format!("{kind}: {e:#}")))?,
        ),
    })
}

impl Client {
    /// Connects to the metadata server at `addr`: `host:port`, `https://host:port` (TLS, needs
    /// `ClientOptions::tls_dir`) or `http://host:port` (plain). A bare `host:port` uses TLS when
    /// `tls_dir` is given.
    pub async fn connect(addr: &str) -> Result<Client> {
        Client::connect_with(addr, ClientOptions::default()).await
    }

    pub async fn connect_with(addr: &str, options: ClientOptions) -> Result<Client> {
        let tls = load_tls(options.tls_dir.as_deref())?;
        Client::connect_with_tls(addr, options, tls).await
    }

    /// As [`Client::connect_with`], with TLS material already loaded (for example from PEM given
    /// in a Spark configuration) instead of `options.tls_dir`, which is ignored.
    pub async fn connect_with_tls(addr: &str, options: ClientOptions, tls: Option<TlsMaterial>) -> Result<Client> {
        // Several addresses (`a,b,c`): the replicas of a replicated metadata service, the
        // leader followed (`failover`). The scheme (if any) decides TLS; the bare host:port of the
        // first is what the client reports.
        let given = failover::metadata_addresses(addr).map_err(Error::invalid)?;
        let addr = failover::bare_address(given[0]).to_string();
        let socket_addr = resolve(&addr).map_err(|e| e.context("metadata server"))?;
        let tune = |endpoint: Endpoint| {
            endpoint
                .connect_timeout(options.connect_timeout)
                .timeout(options.request_timeout)
                .initial_connection_window_size(Some(64 << 20))
                .initial_stream_window_size(Some(16 << 20))
        };
        let channel = if given.len() == 1 {
            // One server, connected now: a wrong address fails here, naming it.
            let channel = grpc_channel(given[0], tls.as_ref(), "the metadata server", tune).await?;
            Failover::new(vec![addr.clone()], vec![channel])
        } else {
            failover::lazy_failover(&given, tls.as_ref(), |endpoint| tune(endpoint.tcp_nodelay(true)))
                .map_err(|e| Error::invalid(format!("address of a metadata server: {e:#}")))?
        };
        let connector = connector(options.transport, tls.as_ref(), options.rdma_connect_timeout)?;
        let tokens = Arc::new(auth::Tokens::default());
        tokens.add_from_env()?;
        let channel = auth::calls(channel, options.credential.as_deref(), tokens.clone())?;
        let admin = AdminClient::new(channel.clone());
        let metadata = MetadataClient::new(channel)
            .max_decoding_message_size(tern_proto::MAX_GRPC_MESSAGE_BYTES)
            .max_encoding_message_size(tern_proto::MAX_GRPC_MESSAGE_BYTES);
        let blocks = conn::BlockPool::new(
            connector,
            options.connections_per_server,
            options.requests_per_connection,
            options.connect_timeout,
            options.block_request_timeout,
        );
        let stalls = blocks.stalls().clone();
        let client = Client {
            inner: Arc::new(Inner {
                metadata_addr: addr,
                metadata,
                admin,
                blocks,
                host: local_host_towards(socket_addr),
                options,
                block_size: tokio::sync::OnceCell::new(),
                tokens,
            }),
        };
        tokio::spawn(liveness::watch(Arc::downgrade(&client.inner), stalls));
        Ok(client)
    }

    /// The metadata server's address.
    pub fn metadata_addr(&self) -> &str {
        &self.inner.metadata_addr
    }

    pub fn options(&self) -> &ClientOptions {
        &self.inner.options
    }

    /// A pooled block connection to a storage server over the client's transport.
    pub(crate) async fn block_connection(&self, holder: &location::Holder) -> Result<Arc<conn::BlockConnection>> {
        let addr = match self.inner.options.transport {
            // RDMA listens on the block service's own address (rdma_cm's port space).
            TransportKind::Auto
            | TransportKind::Local
            | TransportKind::Tcp
            | TransportKind::Tls
            | TransportKind::Rdma => &holder.address,
            TransportKind::Quic if holder.quic_address.is_empty() => {
                return Err(Error::invalid(format!(
                    "storage server {} ({}) has no QUIC endpoint: start it with --tls-dir",
                    holder.id, holder.address
                )))
            }
            TransportKind::Quic => &holder.quic_address,
        };
        self.inner.blocks.get(addr).await
    }

    fn metadata(&self) -> MetadataClient<auth::Calls> {
        self.inner.metadata.clone()
    }

    /// Creates a directory; with `parents`, missing parents too and an existing directory is fine.
    pub async fn mkdir(&self, path: &str, parents: bool) -> Result<()> {
        self.metadata().mkdir(pb::MkdirRequest { path: path.into(), parents, ..Default::default() }).await?;
        Ok(())
    }

    /// Creates a file for writing; it becomes readable once the writer is closed. Refused with
    /// `AlreadyExists` if the path exists.
    pub async fn create(&self, path: &str, parents: bool) -> Result<FileWriter> {
        self.create_with_class(path, parents, StorageClass::Any).await
    }

    /// Creates a file whose blocks go to the tiers `class` allows (`Any`: DRAM first, NVMe when
    /// no live server has DRAM room). `OutOfSpace` comes at allocation, when no allowed tier has room.
    pub async fn create_with_class(&self, path: &str, parents: bool, class: StorageClass) -> Result<FileWriter> {
        self.create_with_options(path, parents, CreateOptions { class, ..CreateOptions::default() }).await
    }

    /// Creates a file stored as `options` say (storage class, copies of each block). With 2
    /// replicas, allocation is refused (`Unavailable`) while fewer than 2 storage servers are live.
    pub async fn create_with_options(&self, path: &str, parents: bool, options: CreateOptions) -> Result<FileWriter> {
        if !(1..=tern_proto::MAX_REPLICAS).contains(&options.replicas) {
            return Err(Error::invalid(format!(
                "create {path}: replicas must be 1 to {}, not {}",
                tern_proto::MAX_REPLICAS,
                options.replicas
            )));
        }
        let request = pb::CreateRequest {
            path: path.into(),
            parents,
            sealed: false,
            storage_class: options.class.name().to_string(),
            replicas: options.replicas,
            ..Default::default()
        };
        let created = self.metadata().create(request).await?.into_inner();
        Ok(FileWriter::new(
            self.clone(),
            path.to_string(),
            created.job,
            FileId::from_wire(created.file_id),
            created.block_size,
            options.replicas,
            Duration::from_millis(created.writer_lease_ms),
        ))
    }

    /// Creates an empty, sealed file in one round trip (markers, empty outputs). Refused with
    /// `AlreadyExists` if the path exists.
    pub async fn create_empty(&self, path: &str, parents: bool) -> Result<()> {
        self.metadata()
            .create(pb::CreateRequest { path: path.into(), parents, sealed: true, ..Default::default() })
            .await?;
        Ok(())
    }

    /// Opens a sealed file for reading. `DataLost` if a block sits on a dead storage server.
    pub async fn open(&self, path: &str) -> Result<FileReader> {
        let opened = self.metadata().open(pb::OpenRequest { path: path.into() }).await?.into_inner();
        let info =
            opened.info.ok_or_else(|| Error::new(ErrorKind::Internal, format!("open {path}: reply without info")))?;
        let blocks = opened.blocks.into_iter().map(location::BlockCopy::from).collect();
        FileReader::new(self.clone(), info, blocks, opened.block_size)
    }

    pub async fn stat(&self, path: &str) -> Result<FileInfo> {
        Ok(self.stat_with_blocks(path, false).await?.0)
    }

    /// Stat plus where each block lives and whether its server is alive.
    pub async fn stat_with_blocks(
        &self,
        path: &str,
        with_blocks: bool,
    ) -> Result<(FileInfo, Vec<(BlockLocation, bool)>)> {
        let reply = self.metadata().stat(pb::StatRequest { path: path.into(), with_blocks }).await?.into_inner();
        let info =
            reply.info.ok_or_else(|| Error::new(ErrorKind::Internal, format!("stat {path}: reply without info")))?;
        let blocks =
            reply.blocks.into_iter().zip(reply.blocks_alive.into_iter().chain(std::iter::repeat(true))).collect();
        Ok((info, blocks))
    }

    /// Every entry of a directory (or the file itself), sorted by name, fetched page by page.
    pub async fn list(&self, path: &str) -> Result<Vec<FileInfo>> {
        let mut entries: Vec<FileInfo> = Vec::new();
        loop {
            let start_after = entries.last().map(|e| e.path.rsplit('/').next().unwrap_or_default().to_string());
            let page = self
                .metadata()
                .list(pb::ListRequest { path: path.into(), start_after: start_after.unwrap_or_default(), limit: 0 })
                .await?
                .into_inner();
            entries.extend(page.entries);
            if !page.truncated {
                return Ok(entries);
            }
        }
    }

    /// Deletes a file, or a directory (non-empty ones only with `recursive`); frees the blocks.
    pub async fn delete(&self, path: &str, recursive: bool) -> Result<pb::DeleteResponse> {
        Ok(self.metadata().delete(pb::DeleteRequest { path: path.into(), recursive }).await?.into_inner())
    }

    pub async fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.metadata().rename(pb::RenameRequest { from: from.into(), to: to.into() }).await?;
        Ok(())
    }

    /// The cluster's block size (asked once, then remembered).
    pub async fn block_size(&self) -> Result<u32> {
        let size =
            self.inner.block_size.get_or_try_init(|| async { self.status().await.map(|s| s.block_size) }).await?;
        Ok(*size)
    }

    /// Tells the metadata server that the storage server at `address` (its block or QUIC
    /// address) cannot be reached from here, `why`: while it is alive, placement avoids it for a
    /// while. Returns whether the metadata server still lists it alive (false: dead already, its
    /// data re-placed or lost).
    pub async fn report_unreachable(&self, address: &str, why: &Error) -> Result<bool> {
        let request = pb::ReportUnreachableRequest { address: address.to_string(), reason: why.to_string() };
        Ok(self.metadata().report_unreachable(request).await?.into_inner().alive)
    }

    /// [`Client::report_unreachable`] for a request to `address` that failed with `error`, if
    /// it failed for want of the server (Unavailable); a failure to report is only logged, the
    /// caller's own error being the one that matters.
    pub(crate) async fn report_if_unreachable(&self, address: &str, error: &Error) {
        if error.kind() != ErrorKind::Unavailable {
            return;
        }
        match self.report_unreachable(address, error).await {
            Ok(true) => tracing::info!("reported storage server {address} unreachable: {error}"),
            Ok(false) => tracing::debug!("storage server {address} is dead already: {error}"),
            Err(e) => tracing::debug!("could not report storage server {address} unreachable: {e}"),
        }
    }

    /// Storage servers with their tiers, and jobs.
    pub async fn status(&self) -> Result<StatusResponse> {
        Ok(self.metadata().status(pb::StatusRequest {}).await?.into_inner())
    }

    /// Registers a job (name generated when `None`) for the client's tenant
    /// ([`ClientOptions::tenant`]) whose lease is renewed in the background until the session
    /// ends or is dropped. The client holds the job's token from now on.
    pub async fn start_job(&self, name: Option<&str>, lease: Duration) -> Result<JobSession> {
        let tenant = self.inner.options.tenant.clone();
        JobSession::start(self.clone(), &tenant, name, lease).await
    }

    /// [`Client::start_job`] for tenant `tenant` ("" = "default"). A tenant at its `max_jobs`
    /// quota is refused with `QuotaExceeded`.
    pub async fn start_job_for(&self, tenant: &str, name: Option<&str>, lease: Duration) -> Result<JobSession> {
        JobSession::start(self.clone(), tenant, name, lease).await
    }

    /// Appends `data` at `offset` of an allocated block: one block-write round trip, the data
    /// plane without [`FileWriter`]'s buffering. Blocks are append-only, so `offset` must be the
    /// bytes the block already holds, and `offset + data.len()` at most the cluster block size.
    /// For tools that measure or drive the data plane (`tern bench io`); files are written with
    /// [`Client::create`].
    /// `job` owns the block's file ("" outside `/jobs`).
    pub async fn write_block(&self, job: &str, block: &BlockLocation, offset: u32, data: bytes::Bytes) -> Result<()> {
        let access = self.access(job, &block.grant).await?;
        let conn = self.inner.blocks.get(&block.address).await?;
        conn.write(&access, block.block_id, offset, data)
            .await
            .map(|_| ())
            .map_err(|e| e.context(format_args!("write block {} at offset {offset}", block.block_id)))
    }

    /// Writes `data` to a new file (creating missing parents) in one call.
    pub async fn put(&self, path: &str, data: bytes::Bytes) -> Result<()> {
        self.put_with_class(path, data, StorageClass::Any).await
    }

    /// [`Client::put`] into storage class `class`.
    pub async fn put_with_class(&self, path: &str, data: bytes::Bytes, class: StorageClass) -> Result<()> {
        self.put_with_options(path, data, CreateOptions { class, ..CreateOptions::default() }).await
    }

    /// [`Client::put`] stored as `options` say.
    pub async fn put_with_options(&self, path: &str, data: bytes::Bytes, options: CreateOptions) -> Result<()> {
        if data.is_empty() {
            return self.create_empty(path, true).await;
        }
        let mut writer = self.create_with_options(path, true, options).await?;
        if let Err(e) = writer.write_bytes(data).await {
            if let Err(abort) = writer.abort().await {
                tracing::warn!("{abort}");
            }
            return Err(e);
        }
        writer.close().await.map(|_| ())
    }
}

/// The first address `addr` (`host:port`) resolves to; the error says whether it is not
/// host:port at all or its host does not resolve.
pub fn resolve(addr: &str) -> Result<SocketAddr> {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(Error::invalid(format!("address {addr:?} is not host:port (no port)")));
    };
    if port.parse::<u16>().is_err() {
        return Err(Error::invalid(format!("address {addr:?} is not host:port ({port:?} is not a port)")));
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match addr.to_socket_addrs() {
        Ok(mut found) => {
            found.next().ok_or_else(|| Error::unavailable(format!("cannot resolve host {host}: it has no address")))
        }
        Err(e) => Err(Error::unavailable(format!("cannot resolve host {host}: {e}"))),
    }
}

/// The local IP this host uses to reach `server`: what placement compares with servers' hosts.
fn local_host_towards(server: SocketAddr) -> String {
    let unspecified: IpAddr = if server.is_ipv4() { [0, 0, 0, 0].into() } else { [0u16; 8].into() };
    UdpSocket::bind((unspecified, 0))
        .and_then(|s| s.connect(server).and_then(|_| s.local_addr()))
        .map(|a| a.ip().to_string())
        .unwrap_or_default()
}

/// TLS material from `dir` (`tern cert init`), if one is given.
pub fn load_tls(dir: Option<&Path>) -> Result<Option<TlsMaterial>> {
    dir.map(|dir| TlsMaterial::load(dir).map_err(|e| Error::invalid(format!("{e:#}")))).transpose()
}

/// A gRPC channel to `peer` (named in errors, e.g. "the scheduler") at `addr` (`host:port`,
/// `http://` or `https://`; mutual TLS with `tls`), TCP_NODELAY on, with `tune` applied to the
/// endpoint before connecting. Every Tern gRPC client connects through this.
pub async fn grpc_channel(
    addr: &str,
    tls: Option<&TlsMaterial>,
    peer: &str,
    tune: impl FnOnce(Endpoint) -> Endpoint,
) -> Result<Channel> {
    let endpoint = tern_transport::tls::grpc_endpoint(addr, tls)
        .map_err(|e| Error::invalid(format!("address of {peer}: {e:#}")))?;
    tune(endpoint.tcp_nodelay(true))
        .connect()
        .await
        .map_err(|e| Error::unavailable(format!("cannot reach {peer} at {addr}: {}", source_chain(&e))))
}

/// "a: b: c" from an error and its sources, each said once: tonic hides the cause in the sources,
/// and says "transport error: tcp connect error: tcp connect error" before it.
fn source_chain(e: &dyn std::error::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(e);
    while let Some(error) = next {
        let text = error.to_string();
        if text != "transport error" && parts.last() != Some(&text) {
            parts.push(text);
        }
        next = error.source();
    }
    parts.join(": ")
}
