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
        let dir = tempfile::Builder::new()
            .prefix("tern-up-")
            .tempdir_in(parent)
            .with_context(|| format!("making a temp dir in {}", parent.display()))?;
        let ports = PortLayout::free(servers)?;
        let host = Host::local();
        let metadata = host.addr(ports.metadata());
        let mut up = [DaemonSpec::new("tern up", tern, dir.path().join("up.log"))
            .on(host.clone())
            .serving(metadata)
            .args(["up", "--dir", &dir.path().to_string_lossy(), "--port", &ports.metadata().to_string()])
            .args(["--storage-servers", &servers.to_string(), "--dram", dram, "--block-size", block_size])
            // A measurement or a sort must fail with the daemon that died, not go on against a
            // restarted one that lost its DRAM tier.
            .args(["--exit-on-failure"])
            .args(nvme.map(|size| ["--nvme-size", size]).into_iter().flatten())
            .args(extra)
            .spawn()?];
        // `tern up` runs every daemon, so it is the one to blame for any of them.
        let storage: Vec<_> = (0..servers).map(|i| (0, host.addr(ports.storage(i)))).collect();
        let options = tern_client::ClientOptions::default();
        let deadline = Deadline::after(STARTUP_TIMEOUT);
        crate::cluster_ready(&mut up, 0, &metadata.to_string(), &options, &storage, &deadline).await?;
        let [up] = up;
        Ok(EmbeddedCluster { up, dir, host, ports, metadata_addr: metadata.to_string() })
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
