//! The storage server's configuration: one typed struct, loaded from TOML, printed at start-up.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::bail;
use serde::{Deserialize, Serialize};
use tern_common::config::Serve;
use tern_common::ByteSize;

pub use crate::nvme::engine::IoEngineChoice;

/// Configuration of `tern storage-server`. Read it with `tern_common::config::load`, which lays a
/// file and settings over [`Config::default`], the one place the defaults are written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `listen`: the block service over TCP; `tls_dir`: serve TLS 1.3 (mutual) on that same port
    /// beside plain frames, and QUIC (see `quic_listen`), and talk TLS to a metadata server given
    /// as `https://` or as a bare host:port. With `tls_dir`, `listen` may be any address: plain
    /// frames are taken from loopback peers only, unless `trusted_network`. Without it, a
    /// non-loopback `listen` needs `trusted_network`.
    #[serde(flatten)]
    pub serve: Serve,
    /// host:port of the metadata server's gRPC endpoint; of a replicated one, its members'
    /// (`a,b,c`): the server registers with, heartbeats to and follows whichever leads.
    pub metadata: String,
    /// The cluster secret, with which the server proves it is one (its credential, bound to its
    /// advertised address). Unset: `cluster.secret` in `tls_dir`; without either it does not start.
    pub cluster_secret_file: Option<std::path::PathBuf>,
    /// host:port registered with the metadata server for clients to reach the block service.
    /// Unset: the bound address (which must then not be a wildcard like 0.0.0.0).
    pub advertise: Option<String>,
    /// Size of the DRAM tier arena, cut into blocks of the cluster's block size.
    pub dram: ByteSize,
    /// Most open block-service connections; further ones are told so and closed.
    pub max_connections: usize,
    /// Most replies queued per connection; past it the server stops reading that connection's
    /// requests until the client reads replies (backpressure).
    pub max_in_flight_per_connection: usize,
    /// Ask for transparent huge pages on the arena (madvise MADV_HUGEPAGE).
    pub huge_pages: bool,
    /// Fault the whole arena in at start-up (MAP_POPULATE), so the first writes do not pay for
    /// page faults and a machine without the memory fails at once.
    pub prefault: bool,
    /// The NVMe tier: a file (created if missing and preallocated to `nvme_size`) or a block
    /// device, opened with O_DIRECT. It must be on a filesystem that takes O_DIRECT (not tmpfs).
    /// Unset: no NVMe tier.
    pub nvme: Option<PathBuf>,
    /// Bytes of `nvme` to use. Required for a new or empty file; unset: for an existing file its
    /// size, for a block device the device size.
    pub nvme_size: Option<ByteSize>,
    /// The NVMe tier's io engine: `uring`, `psync` or `auto` (io_uring if a probe at start-up
    /// works, else psync, logged at warn with the reason).
    pub io_engine: IoEngineChoice,
    /// Address of the QUIC (UDP) block service, used when `tls_dir` is set. Unset: the block
    /// service's host and port number (the bound one when `listen` has port 0).
    pub quic_listen: Option<SocketAddr>,
    /// On SIGTERM (or SIGINT) the server drains itself: it asks the metadata server to place
    /// nothing more here and waits until nothing it holds is still needed, at most this long,
    /// then exits 0. 0: exit at once. A second signal cuts the wait short. Below Kubernetes'
    /// default 30 s termination grace, so the pod exits before it is killed.
    pub drain_grace_ms: u64,
    /// Serve clients on this host (this network namespace) through a Unix socket as well, and
    /// share the DRAM arena with them read-only, so they read leased DRAM blocks with no request
    /// at all. The arena is then a memfd (shared memory), which gets transparent huge pages only
    /// where `/sys/kernel/mm/transparent_hugepage/shmem_enabled` allows them (`advise`); false
    /// keeps it anonymous memory.
    pub local_clients: bool,
    /// The block service over RDMA (rdma_cm on `listen`'s address and port): `auto` serves it when
    /// this host has an RDMA device and plain frames are allowed (`listen` on loopback, or
    /// `trusted_network`: RDMA frames are not encrypted), else logs why not; `on` fails start-up
    /// when it cannot; `off` never.
    pub rdma: RdmaMode,
}

/// See [`Config::rdma`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RdmaMode {
    Off,
    Auto,
    On,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            serve: Serve::on_loopback(tern_common::ports::STORAGE, tern_common::ports::STORAGE_ADMIN),
            metadata: tern_common::ports::default_metadata(),
            cluster_secret_file: None,
            advertise: None,
            dram: ByteSize::gib(1),
            max_connections: 1024,
            max_in_flight_per_connection: 64,
            huge_pages: true,
            prefault: true,
            nvme: None,
            nvme_size: None,
            io_engine: IoEngineChoice::Auto,
            quic_listen: None,
            drain_grace_ms: 25_000,
            local_clients: true,
            rdma: RdmaMode::Auto,
        }
    }
}

impl Config {
    /// Refuses settings that cannot work, before anything is mapped or bound.
    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        if let Err(why) = tern_transport::failover::metadata_addresses(&self.metadata) {
            bail!("metadata: {why} (expected host:port, or a,b,c for a replicated metadata service)");
        }
        if self.dram.bytes() == 0 {
            bail!("dram: the DRAM tier size is 0; give it at least one block (e.g. 1GiB)");
        }
        if usize::try_from(self.dram.bytes()).is_err() {
            bail!("dram: {} does not fit in this machine's address space", self.dram);
        }
        if self.max_connections == 0 {
            bail!("max_connections: must be at least 1");
        }
        if self.max_in_flight_per_connection == 0 {
            bail!("max_in_flight_per_connection: must be at least 1");
        }
        if self.nvme.is_none() && self.nvme_size.is_some() {
            bail!("nvme_size: set without `nvme`; give the NVMe file or device path too");
        }
        if self.nvme_size.is_some_and(|size| size.bytes() == 0) {
            bail!("nvme_size: 0; give the NVMe tier at least one block");
        }
        if let Some(advertise) = &self.advertise {
            if advertise.trim().is_empty() {
                bail!("advertise: empty address (expected host:port, or leave it unset)");
            }
        }
        let serve = &self.serve;
        if self.quic_listen.is_some() && serve.tls_dir.is_none() {
            bail!("quic_listen is set but tls_dir is not: QUIC needs TLS material (`tern cert init --dir DIR`, then `--tls-dir DIR`)");
        }
        // With TLS material the port speaks TLS to anyone and plain frames to loopback peers only
        // (unless the network is trusted), so any address is safe.
        serve.check("the block service over plain TCP", true)
    }

    /// Where QUIC listens once TCP is bound to `tcp`: `quic_listen`, else TCP's address and port.
    pub(crate) fn quic_listen_for(&self, tcp: SocketAddr) -> SocketAddr {
        self.quic_listen.unwrap_or(tcp)
    }

    /// The QUIC address to register: `advertise`'s host with the bound QUIC port, else the bound
    /// address when a client can dial it.
    pub(crate) fn advertised_quic_address(&self, bound: SocketAddr) -> anyhow::Result<String> {
        match &self.advertise {
            Some(advertise) => {
                let host = advertise.rsplit_once(':').map_or(advertise.as_str(), |(host, _)| host);
                Ok(format!("{host}:{}", bound.port()))
            }
            None if bound.ip().is_unspecified() => bail!(
                "the QUIC block service listens on {bound}, which clients cannot dial; \
                 set `advertise` to the host:port clients should use"
            ),
            None => Ok(bound.to_string()),
        }
    }

    /// The address to register for clients: `advertise`, else the bound address when it is one a
    /// client can dial.
    pub(crate) fn advertised_address(&self, bound: SocketAddr) -> anyhow::Result<String> {
        match &self.advertise {
            Some(advertise) => Ok(advertise.clone()),
            None if bound.ip().is_unspecified() => bail!(
                "the block service listens on {bound}, which clients cannot dial; \
                 set `advertise` to the host:port clients should use"
            ),
            None => Ok(bound.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tern_common::config::from_toml;

    #[test]
    fn defaults_round_trip_through_toml() {
        let text = toml::to_string(&Config::default()).unwrap();
        let back: Config = toml::from_str(&text).unwrap();
        assert_eq!(back, Config::default());
        let partial: Config = from_toml("dram = \"64MiB\"\nlisten = \"127.0.0.1:0\"\n").unwrap();
        assert_eq!(partial.dram, ByteSize::mib(64));
        assert_eq!(partial.max_connections, 1024);
        assert!(from_toml::<Config>("dramm = 1\n").is_err());
        let nvme: Config =
            from_toml("nvme = \"/data/tern.nvme\"\nnvme_size = \"8GiB\"\nio_engine = \"psync\"\n").unwrap();
        assert_eq!(nvme.nvme.as_deref(), Some(std::path::Path::new("/data/tern.nvme")));
        assert_eq!((nvme.nvme_size, nvme.io_engine), (Some(ByteSize::gib(8)), IoEngineChoice::Psync));
        assert!(from_toml::<Config>("io_engine = \"spdk\"\n").is_err());
    }

    #[test]
    fn wildcard_listen_needs_advertise() {
        let config = Config::default();
        let wildcard: SocketAddr = "0.0.0.0:9070".parse().unwrap();
        let err = config.advertised_address(wildcard).unwrap_err().to_string();
        assert!(err.contains("advertise"), "{err}");
        let local: SocketAddr = "127.0.0.1:9070".parse().unwrap();
        assert_eq!(config.advertised_address(local).unwrap(), "127.0.0.1:9070");
        let config = Config { advertise: Some("store-1:9070".into()), ..Config::default() };
        assert_eq!(config.advertised_address(wildcard).unwrap(), "store-1:9070");
    }

    #[test]
    fn impossible_settings_are_refused() {
        assert!(Config::default().validate().is_ok());
        assert!(Config { dram: ByteSize(0), ..Config::default() }.validate().is_err());
        assert!(Config { max_connections: 0, ..Config::default() }.validate().is_err());
        assert!(Config { max_in_flight_per_connection: 0, ..Config::default() }.validate().is_err());
        assert!(Config { metadata: String::new(), ..Config::default() }.validate().is_err());
        assert!(Config { nvme_size: Some(ByteSize::mib(1)), ..Config::default() }.validate().is_err());
        let quic = Config { quic_listen: Some("127.0.0.1:1".parse().unwrap()), ..Config::default() };
        assert!(quic.validate().unwrap_err().to_string().contains("tls_dir"));
    }

    #[test]
    fn plain_tcp_beyond_loopback_needs_a_trusted_network_or_tls() {
        let wide_serve = Serve { listen: "0.0.0.0:9070".parse().unwrap(), ..Config::default().serve };
        let wide = Config { serve: wide_serve.clone(), ..Config::default() };
        let err = wide.validate().unwrap_err().to_string();
        assert!(err.contains("tern cert init --dir DIR") && err.contains("--trusted-network"), "{err}");
        let trusted = Serve { trusted_network: true, ..wide_serve.clone() };
        assert!(Config { serve: trusted, ..Config::default() }.validate().is_ok());
        // With TLS material, remote peers get TLS on the same port (plain from loopback only).
        let tls_serve = Serve { tls_dir: Some("/etc/tern/tls".into()), ..wide_serve };
        assert!(Config { serve: tls_serve, ..Config::default() }.validate().is_ok());
    }

    #[test]
    fn quic_address_follows_advertise() {
        let bound: SocketAddr = "0.0.0.0:9170".parse().unwrap();
        assert!(Config::default().advertised_quic_address(bound).is_err());
        let config = Config { advertise: Some("store-1:9070".into()), ..Config::default() };
        assert_eq!(config.advertised_quic_address(bound).unwrap(), "store-1:9170");
        let local: SocketAddr = "127.0.0.1:9070".parse().unwrap();
        assert_eq!(Config::default().advertised_quic_address(local).unwrap(), "127.0.0.1:9070");
        assert_eq!(Config::default().quic_listen_for(local), local);
    }
}
