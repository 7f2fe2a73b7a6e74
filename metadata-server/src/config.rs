//! The metadata server's configuration: one typed struct, loaded from TOML by the `tern` binary.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use tern_common::config::Serve;
use tern_common::ByteSize;

/// Configuration of `tern metadata-server`. Read it with `tern_common::config::load`, which lays
/// a file and settings over [`Config::default`], the one place the defaults are written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `listen`: the gRPC service (clients and storage servers); `tls_dir`: serve it over mutual
    /// TLS; `trusted_network`: allow plain gRPC beyond loopback without TLS.
    #[serde(flatten)]
    pub serve: Serve,
    /// Directory for the server's state, created if missing; a `LOCK` file there keeps two servers
    /// from sharing it.
    pub dir: PathBuf,
    /// Cluster block size: a power of two from 4KiB to 64MiB.
    pub block_size: ByteSize,
    /// How often storage servers heartbeat, told to them at registration.
    pub heartbeat_interval_ms: u64,
    /// A storage server silent for this long is declared dead and its blocks lost.
    pub server_timeout_ms: u64,
    /// Lease of a job registered without one.
    pub default_lease_ms: u64,
    /// Longest lease a job may hold; longer requests are clamped.
    pub max_lease_ms: u64,
    /// Writer lease of an unsealed file: one whose writer neither allocated blocks nor renewed
    /// for this long (the writer died) is deleted and its blocks freed. Writers renew at a third
    /// of it.
    pub writer_lease_ms: u64,
    /// Deadline of a drain that names none (`tern admin drain` without --timeout): the server is
    /// told to exit then even if data it holds is still needed.
    pub drain_timeout_ms: u64,
    /// Bytes per second that re-replication (second copies of blocks and shuffle segments whose
    /// other copy's server died) and drains (blocks copied off a draining server) may copy, all
    /// servers together;
    /// 0 = no limit. A limit keeps copying from crowding out jobs' reads and writes.
    pub copy_rate: ByteSize,
    /// Place files created with class `any` (the default) on NVMe, as class `nvme`, so they
    /// survive a restart of their storage servers; `dram` files stay in DRAM and shuffles are
    /// not affected. Every storage server then needs an NVMe tier for such files.
    pub durable_files: bool,
    /// Most entries one List call returns.
    pub max_list_entries: u32,
    /// Most jobs registered at once.
    pub max_jobs: u32,
    /// Most files and directories in the namespace.
    pub max_entries: u64,
    /// Sync the write-ahead log before acknowledging a change. Turning it off keeps the log but
    /// lets a crash of the machine (not just of the process) lose acknowledged changes; for
    /// throwaway clusters only.
    pub fsync: bool,
    /// Snapshot the state (and cut the log) this often when the log has grown.
    pub snapshot_interval_ms: u64,
    /// Snapshot as soon as the log has grown by this much.
    pub snapshot_log_size: ByteSize,
    /// Most open gRPC connections (clients and storage servers together); further ones are
    /// closed as they arrive, logged.
    pub max_connections: u32,
    /// Most RPCs in flight on one gRPC connection (HTTP/2 concurrent streams); the client's
    /// HTTP/2 layer queues the rest.
    pub max_concurrent_streams: u32,
    /// Largest gRPC message received or sent, 64KiB to 16MiB; larger ones are refused with a
    /// status (a List or Locate reply that would be larger fails, so keep it above their
    /// pages).
    pub max_message_size: ByteSize,
    /// The cluster secret, with which every caller's credential is checked (`tern up`, `tern cert
    /// init` and `tern cert secret` make it). Unset: `cluster.secret` in `tls_dir` when that is
    /// set, else in `dir` (made on first start).
    pub cluster_secret_file: Option<PathBuf>,
    /// Quotas per tenant, `[tenants.<name>]` tables; a tenant not listed is unlimited.
    pub tenants: BTreeMap<String, TenantQuota>,
    /// The replicas of a replicated metadata service (Raft, `raft/`), each `"ID=HOST:PORT"` (the
    /// gRPC address the others reach it at), this server's own among them (`node_id`). Empty:
    /// one replica, the write-ahead log alone.
    pub peers: Vec<String>,
    /// This server's id among `peers` (ignored without peers). 0 with peers: the id of the one
    /// peer whose host's first DNS label is this host's name, as a StatefulSet's pods
    /// (`tern-metadata-1` in `tern-metadata-1.tern-metadata:9060`) and hosts named in their
    /// peers' lists are.
    pub node_id: u64,
    /// A replicated server snapshots its state every this many Raft entries and keeps a fifth
    /// of that behind the snapshot; a replica further behind catches up by the snapshot.
    pub raft_snapshot_entries: u64,
}

/// Most replicas of one metadata cluster.
pub const MAX_PEERS: usize = 7;

impl Config {
    /// The peers as (id, address), checked: ids unique and non-zero, this node among them.
    pub fn peer_map(&self) -> anyhow::Result<BTreeMap<u64, String>> {
        let mut peers = BTreeMap::new();
        if self.peers.len() > MAX_PEERS {
            bail!("peers lists {} replicas; at most {MAX_PEERS}", self.peers.len());
        }
        for peer in &self.peers {
            let Some((id, addr)) = peer.split_once('=') else {
                bail!("peers entry {peer:?} is not ID=HOST:PORT");
            };
            let id: u64 =
                id.trim().parse().map_err(|_| anyhow::anyhow!("peers entry {peer:?}: {id:?} is not an id"))?;
            if id == 0 || addr.trim().is_empty() {
                bail!("peers entry {peer:?}: ids start at 1 and the address may not be empty");
            }
            if peers.insert(id, addr.trim().to_string()).is_some() {
                bail!("peers lists id {id} twice");
            }
        }
        if !peers.is_empty() && self.node_id != 0 && !peers.contains_key(&self.node_id) {
            bail!("node_id = {} is not among peers ({})", self.node_id, self.peers.join(", "));
        }
        Ok(peers)
    }

    /// This server's id among `peers` (its `peer_map`): `node_id`, or with `node_id = 0` the peer named by this
    /// host's name (read from the kernel: a container's own); 0 without peers.
    pub fn node_id(&self, peers: &BTreeMap<u64, String>) -> anyhow::Result<u64> {
        if peers.is_empty() || self.node_id != 0 {
            return Ok(self.node_id);
        }
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("node_id = 0 with peers: reading this host's name from /proc/sys/kernel/hostname")?;
        node_id_of_host(peers, hostname.trim())
    }
}

/// The id of the one peer whose host's first DNS label is `hostname`.
fn node_id_of_host(peers: &BTreeMap<u64, String>, hostname: &str) -> anyhow::Result<u64> {
    let first_label = |addr: &str| {
        let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
        host.split('.').next().unwrap_or_default().to_string()
    };
    let matching: Vec<u64> =
        peers.iter().filter(|(_, addr)| first_label(addr) == hostname).map(|(&id, _)| id).collect();
    match matching[..] {
        [id] => Ok(id),
        [] => bail!(
            "node_id is not set and no peer's host is named {hostname:?}, this host's name: set node_id \
             to this server's id among peers ({})",
            peers.iter().map(|(id, addr)| format!("{id}={addr}")).collect::<Vec<_>>().join(", ")
        ),
        _ => bail!("node_id is not set and peers {matching:?} are all on host {hostname:?}: set node_id"),
    }
}

/// One tenant's quotas; 0 (the default of each) means unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantQuota {
    /// Most jobs of the tenant registered at once.
    pub max_jobs: u64,
    /// Most bytes of DRAM held by the tenant's jobs: their files' blocks (whole blocks allocated)
    /// and their shuffles' bytes.
    pub dram_bytes: ByteSize,
    /// Most bytes of NVMe held by the tenant's jobs' files and shuffles.
    pub nvme_bytes: ByteSize,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            serve: Serve::on_loopback(tern_common::ports::METADATA, tern_common::ports::METADATA_ADMIN),
            dir: PathBuf::from("tern-data/metadata"),
            block_size: ByteSize(u64::from(tern_proto::DEFAULT_BLOCK_SIZE)),
            heartbeat_interval_ms: 1000,
            server_timeout_ms: 5000,
            default_lease_ms: 30_000,
            max_lease_ms: 3_600_000,
            writer_lease_ms: 60_000,
            drain_timeout_ms: 600_000,
            copy_rate: ByteSize(1 << 30),
            durable_files: false,
            max_list_entries: 10_000,
            max_jobs: 10_000,
            max_entries: 10_000_000,
            fsync: true,
            snapshot_interval_ms: 60_000,
            snapshot_log_size: ByteSize(64 << 20),
            max_connections: 4096,
            max_concurrent_streams: 1024,
            max_message_size: ByteSize(tern_proto::MAX_GRPC_MESSAGE_BYTES as u64),
            cluster_secret_file: None,
            tenants: BTreeMap::new(),
            peers: Vec::new(),
            node_id: 0,
            raft_snapshot_entries: 5000,
        }
    }
}

impl Config {
    /// Refuses values the server cannot run with, naming the key and the accepted range.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.peer_map()?;
        if !(10..=10_000_000).contains(&self.raft_snapshot_entries) {
            bail!("raft_snapshot_entries = {} is not from 10 to 10000000", self.raft_snapshot_entries);
        }
        let block_size = self.block_size.bytes();
        let (min, max) = (u64::from(tern_proto::MIN_BLOCK_SIZE), u64::from(tern_proto::MAX_BLOCK_SIZE));
        if !block_size.is_power_of_two() || !(min..=max).contains(&block_size) {
            bail!("block_size = {} is not a power of two from {} to {}", self.block_size, ByteSize(min), ByteSize(max));
        }
        if self.heartbeat_interval_ms == 0 || self.heartbeat_interval_ms >= self.server_timeout_ms {
            bail!(
                "heartbeat_interval_ms = {} must be above 0 and below server_timeout_ms = {}, \
                 or live servers would be declared dead",
                self.heartbeat_interval_ms,
                self.server_timeout_ms
            );
        }
        // Writers renew at a third of the lease: shorter ones would be lost to an RPC's latency.
        if self.writer_lease_ms < 1000 || self.drain_timeout_ms == 0 {
            bail!(
                "writer_lease_ms = {} must be at least 1000, and drain_timeout_ms = {} above 0",
                self.writer_lease_ms,
                self.drain_timeout_ms
            );
        }
        if self.default_lease_ms == 0 || self.default_lease_ms > self.max_lease_ms {
            bail!(
                "default_lease_ms = {} must be above 0 and at most max_lease_ms = {}",
                self.default_lease_ms,
                self.max_lease_ms
            );
        }
        for (key, value) in [
            ("max_list_entries", u64::from(self.max_list_entries)),
            ("max_jobs", u64::from(self.max_jobs)),
            ("max_entries", self.max_entries),
        ] {
            if value == 0 {
                bail!("{key} must be at least 1");
            }
        }
        if self.max_connections == 0 || self.max_concurrent_streams == 0 {
            bail!("max_connections and max_concurrent_streams must be at least 1");
        }
        let message = self.max_message_size.bytes();
        if !(64 << 10..=tern_proto::MAX_GRPC_MESSAGE_BYTES as u64).contains(&message) {
            bail!(
                "max_message_size = {} must be from 64KiB to {} (the clients' limit)",
                self.max_message_size,
                ByteSize(tern_proto::MAX_GRPC_MESSAGE_BYTES as u64)
            );
        }
        if self.snapshot_interval_ms == 0 || self.snapshot_log_size.bytes() == 0 {
            bail!("snapshot_interval_ms and snapshot_log_size must be above 0");
        }
        for name in self.tenants.keys() {
            crate::jobs::validate_tenant(name).map_err(|r| anyhow::anyhow!("[tenants.{name}]: {}", r.reason))?;
        }
        self.serve.check("gRPC", true)
    }

    /// The block size in bytes; fits in u32 once validated.
    pub fn block_size_bytes(&self) -> u32 {
        u32::try_from(self.block_size.bytes()).unwrap_or(tern_proto::MAX_BLOCK_SIZE)
    }

    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }

    pub fn server_timeout(&self) -> Duration {
        Duration::from_millis(self.server_timeout_ms)
    }

    pub fn writer_lease(&self) -> Duration {
        Duration::from_millis(self.writer_lease_ms)
    }

    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }

    pub fn snapshot_interval(&self) -> Duration {
        Duration::from_millis(self.snapshot_interval_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tern_common::config::from_toml;

    #[test]
    fn an_unset_node_id_is_the_peer_named_by_this_hosts_name() {
        let peers: BTreeMap<u64, String> = [(1, "meta-0.meta.tern.svc:9060"), (2, "meta-1.meta.tern.svc:9060")]
            .into_iter()
            .map(|(id, addr)| (id, addr.to_string()))
            .collect();
        assert_eq!(node_id_of_host(&peers, "meta-1").unwrap(), 2);
        let none = node_id_of_host(&peers, "meta").unwrap_err().to_string();
        assert!(none.contains("no peer's host is named \"meta\"") && none.contains("1=meta-0"), "{none}");
        let twice: BTreeMap<u64, String> = [(1, "h:1".to_string()), (2, "h:2".to_string())].into_iter().collect();
        assert!(node_id_of_host(&twice, "h").unwrap_err().to_string().contains("all on host"));
        // An id given wins, and must be among the peers.
        let config = Config { peers: vec!["1=a:1".into(), "2=b:2".into()], node_id: 2, ..Config::default() };
        assert_eq!(config.node_id(&config.peer_map().unwrap()).unwrap(), 2);
        let config = Config { node_id: 3, ..config };
        assert!(config.validate().unwrap_err().to_string().contains("node_id = 3 is not among peers"));
    }

    #[test]
    fn defaults_are_valid_and_print_back() {
        let config = Config::default();
        config.validate().unwrap();
        let text = toml::to_string(&config).unwrap();
        assert!(text.contains("block_size = \"1MiB\""), "{text}");
        let parsed: Config = toml::from_str(&text).unwrap();
        assert_eq!(parsed, config);
        let partial: Config = from_toml("block_size = \"4MiB\"").unwrap();
        assert_eq!(partial.block_size, ByteSize::mib(4));
        assert!(from_toml::<Config>("blok_size = 1").is_err());
        let quotas: Config = from_toml("[tenants.etl]\nmax_jobs = 2\ndram_bytes = \"1GiB\"").unwrap();
        let etl = quotas.tenants["etl"];
        assert_eq!((etl.max_jobs, etl.dram_bytes, etl.nvme_bytes), (2, ByteSize::gib(1), ByteSize(0)));
        quotas.validate().unwrap();
        assert!(from_toml::<Config>("[tenants.etl]\nmax_job = 2").is_err());
    }

    #[test]
    fn refuses_bad_values() {
        type Case = (fn(&mut Config), &'static str);
        let cases: [Case; 11] = [
            (|c| c.serve.listen = "0.0.0.0:9060".parse().unwrap(), "tern cert init --dir DIR"),
            (|c| c.block_size = ByteSize(3 << 20), "power of two"),
            (|c| c.block_size = ByteSize::kib(2), "power of two"),
            (|c| c.block_size = ByteSize::mib(128), "power of two"),
            (|c| c.heartbeat_interval_ms = 6000, "server_timeout_ms"),
            (|c| c.default_lease_ms = 0, "default_lease_ms"),
            (|c| c.max_jobs = 0, "max_jobs"),
            (|c| c.max_connections = 0, "max_connections"),
            (|c| c.max_message_size = ByteSize::kib(1), "max_message_size"),
            (|c| c.max_message_size = ByteSize::mib(17), "max_message_size"),
            (|c| c.serve.admin_listen = "0.0.0.0:9061".parse().unwrap(), "admin endpoint"),
        ];
        for (break_it, expected) in cases {
            let mut config = Config::default();
            break_it(&mut config);
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(expected), "{err}");
        }
    }
}
