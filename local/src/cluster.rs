//! A throwaway cluster for benchmarks and `tern terasort`: `tern up` started as a child process in a temp dir, on a
//! free port range laid out as `tern up` lays it out.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{Daemon, DaemonSpec, Deadline, Host, PortLayout};
use anyhow::Context;

/// How long `tern up` may take to bring the cluster up.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

pub struct EmbeddedCluster {
    up: Daemon,
    dir: tempfile::TempDir,
    host: Host,
    ports: PortLayout,
    /// The metadata server's address; with replicas, their comma-separated list.
    pub metadata_addr: String,
}

impl EmbeddedCluster {
    /// Starts `tern up` with `servers` storage servers of `dram` each on a free port range, and
    /// waits until all have registered.
    pub async fn start(tern: &Path, servers: u16, dram: &str) -> anyhow::Result<EmbeddedCluster> {
        EmbeddedCluster::start_with(tern, servers, dram, "1MiB", None, &std::env::temp_dir(), &[]).await
    }

    /// As [`EmbeddedCluster::start`], with the cluster block size `block_size` (e.g. "4MiB"), an
    /// NVMe tier of `nvme` per storage server (`off`, a size, or `tern up`'s default `auto` when
    /// not given), the cluster's directory in `parent`
    /// (where the NVMe files go: it must be on a disk that takes O_DIRECT), and more `tern up`
    /// flags `extra` (e.g. `--executors 4`: then the task scheduler is at
    /// [`EmbeddedCluster::scheduler_addr`]).
    pub async fn start_with(
        tern: &Path,
        servers: u16,
        dram: &str,
        block_size: &str,
        nvme: Option<&str>,
        parent: &Path,
        extra: &[String],
    ) -> anyhow::Result<EmbeddedCluster> {
        let ports = PortLayout::free(servers)?;
        let args: Vec<String> = ["--storage-servers", &servers.to_string(), "--dram", dram, "--block-size", block_size]
            .into_iter()
            .map(String::from)
            // A measurement or a sort must fail with the daemon that died, not go on against a
            // restarted one that lost its DRAM tier.
            .chain(["--exit-on-failure".to_string()])
            .chain(nvme.map(|size| ["--nvme-size".to_string(), size.to_string()]).into_iter().flatten())
            .chain(extra.iter().cloned())
            .collect();
        EmbeddedCluster::launch(tern, ports, parent, &args).await
    }

    /// `tern up --metadata-replicas replicas` with one storage server and no NVMe tier, supervised
    /// as an operator's is (a daemon that dies is restarted; nothing else stops), everything else
    /// at its defaults: what `tern bench failover` kills replicas of. `metadata_addr` is then the
    /// replicas' list.
    pub async fn start_replicated(tern: &Path, replicas: u16) -> anyhow::Result<EmbeddedCluster> {
        let ports = PortLayout::free_with_replicas(1, replicas)?;
        let args = ["--storage-servers", "1", "--nvme-size", "off", "--metadata-replicas", &replicas.to_string()]
            .map(String::from);
        EmbeddedCluster::launch(tern, ports, &std::env::temp_dir(), &args).await
    }

    /// Starts `tern up` on `ports` in a temp dir in `parent` with `args`, and waits until every
    /// storage server has registered.
    async fn launch(tern: &Path, ports: PortLayout, parent: &Path, args: &[String]) -> anyhow::Result<EmbeddedCluster> {
        let dir = tempfile::Builder::new()
            .prefix("tern-up-")
            .tempdir_in(parent)
            .with_context(|| format!("making a temp dir in {}", parent.display()))?;
        let host = Host::local();
        let metadata = host.addr(ports.metadata());
        let mut up = [DaemonSpec::new("tern up", tern, dir.path().join("up.log"))
            .on(host.clone())
            .serving(metadata)
            .args(["up", "--dir", &dir.path().to_string_lossy(), "--port", &ports.metadata().to_string()])
            .args(args)
            .spawn()?];
        // `tern up` runs every daemon, so it is the one to blame for any of them.
        let storage: Vec<_> = (0..ports.storage_servers()).map(|i| (0, host.addr(ports.storage(i)))).collect();
        let metadata_addr: Vec<String> =
            (0..ports.metadata_replicas()).map(|k| host.addr(ports.metadata_replica(k)).to_string()).collect();
        let metadata_addr = metadata_addr.join(",");
        let options = tern_client::ClientOptions::default();
        let deadline = Deadline::after(STARTUP_TIMEOUT);
        crate::cluster_ready(&mut up, 0, &metadata_addr, &options, &storage, &deadline).await?;
        let [up] = up;
        Ok(EmbeddedCluster { up, dir, host, ports, metadata_addr })
    }

    /// `tern up`'s directory (its `daemons.json`, logs and state).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// How many metadata replicas it runs.
    pub fn metadata_replicas(&self) -> u16 {
        self.ports.metadata_replicas()
    }

    /// Metadata replica `k`'s gRPC address (`k` from 0).
    pub fn metadata_replica_addr(&self, k: u16) -> String {
        self.host.addr(self.ports.metadata_replica(k)).to_string()
    }

    /// Metadata replica `k`'s admin (metrics) address (`k` from 0).
    pub fn metadata_replica_admin(&self, k: u16) -> std::net::SocketAddr {
        self.host.addr(self.ports.metadata_replica_admin(k))
    }

    /// `tern up`'s process id.
    pub fn up_pid(&self) -> u32 {
        self.up.id()
    }

    /// Whether `tern up` is still running (it stops only when asked, or with `--exit-on-failure`).
    pub fn up_running(&mut self) -> bool {
        matches!(self.up.try_wait(), Ok(None))
    }

    /// The cluster's own TLS material (`tern up` makes it): what QUIC clients need.
    pub fn tls_dir(&self) -> PathBuf {
        self.dir.path().join("tls")
    }

    /// The credential file `tern up` wrote for `name` (`admin`, `default`, `executor`).
    pub fn credential_file(&self, name: &str) -> PathBuf {
        self.dir.path().join("credentials").join(name)
    }

    /// The task scheduler's address, when `tern up` was given executor flags.
    pub fn scheduler_addr(&self) -> String {
        self.host.addr(self.ports.scheduler()).to_string()
    }

    /// Storage server `i`'s block-service address.
    pub fn storage_addr(&self, i: u16) -> String {
        self.host.addr(self.ports.storage(i)).to_string()
    }
}

impl Drop for EmbeddedCluster {
    fn drop(&mut self) {
        // SIGTERM lets `tern up` stop its daemons (they would die with it anyway: PDEATHSIG);
        // waiting for it keeps the temp dir until they have.
        let _ = self.up.terminate();
        let _ = self.up.wait();
    }
}
