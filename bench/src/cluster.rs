//! A throwaway cluster for benchmarks: `tern up` started as a child process in a temp dir.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

pub struct EmbeddedCluster {
    child: Child,
    dir: tempfile::TempDir,
    pub metadata_addr: String,
    pub port: u16,
}

impl EmbeddedCluster {
    /// Starts `tern up` with `servers` storage servers of `dram` each on a free port range, and
    /// waits until all have registered.
    pub async fn start(tern: &Path, servers: u16, dram: &str) -> anyhow::Result<EmbeddedCluster> {
        EmbeddedCluster::start_with(tern, servers, dram, "1MiB", None, &std::env::temp_dir(), &[]).await
    }

    /// As [`EmbeddedCluster::start`], with the cluster block size `block_size` (e.g. "4MiB"), an
    /// NVMe tier of `nvme` per storage server if given, the cluster's directory in `parent`
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
        let port = free_port_range(12 + 2 * servers)?;
        let log = std::fs::File::create(dir.path().join("up.log"))?;
        let child = Command::new(tern)
            .args(["up", "--dir", &dir.path().to_string_lossy(), "--port", &port.to_string()])
            .args(["--storage-servers", &servers.to_string(), "--dram", dram, "--block-size", block_size])
            .args(nvme.map(|size| ["--nvme-size", size]).into_iter().flatten())
            .args(extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting tern up")?;
        let mut cluster = EmbeddedCluster { child, dir, metadata_addr: format!("127.0.0.1:{port}"), port };
        let started = Instant::now();
        loop {
            if let Some(status) = cluster.child.try_wait()? {
                bail!("tern up exited ({status}):\n{}", std::fs::read_to_string(cluster.log()).unwrap_or_default());
            }
            if let Ok(client) = tern_client::Client::connect(&cluster.metadata_addr).await {
                if let Ok(status) = client.status().await {
                    if status.servers.iter().filter(|s| s.alive).count() == servers as usize {
                        return Ok(cluster);
                    }
                }
            }
            if started.elapsed() > Duration::from_secs(60) {
                bail!("the embedded cluster did not come up in 60 s; see {}", cluster.log().display());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("up.log")
    }

    /// Storage server `i`'s block-service address (as `tern up` assigns ports).
    /// The cluster's own TLS material (`tern up` makes it): what QUIC clients need.
    pub fn tls_dir(&self) -> PathBuf {
        self.dir.path().join("tls")
    }

    /// The task scheduler's address, when `tern up` was given executor flags.
    pub fn scheduler_addr(&self) -> String {
        format!("127.0.0.1:{}", self.port + 2)
    }

    pub fn storage_addr(&self, i: u16) -> String {
        format!("127.0.0.1:{}", self.port + 10 + 2 * i)
    }
}

impl Drop for EmbeddedCluster {
    fn drop(&mut self) {
        // SIGTERM lets `tern up` stop its daemons; they also die with it (PDEATHSIG).
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

/// The first port of `len` consecutive free loopback ports. Probed below Linux's ephemeral range
/// (32768 up), so a port the kernel hands to some other socket meanwhile cannot land in it, and
/// from a random start, so clusters started at the same moment (parallel tests) rarely probe
/// the same ports: a probed port is only free until somebody binds it.
pub fn free_port_range(len: u16) -> anyhow::Result<u16> {
    const LOW: u16 = 20_000;
    const HIGH: u16 = 32_000;
    anyhow::ensure!(len > 0 && len < HIGH - LOW, "a range of {len} ports");
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().subsec_nanos()
        ^ std::process::id().rotate_left(16);
    let slots = (HIGH - LOW) / len;
    for i in 0..u32::from(slots) {
        let start = LOW + ((seed.wrapping_add(i) % u32::from(slots)) as u16) * len;
        if (start..start + len).all(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok()) {
            return Ok(start);
        }
    }
    bail!("no {len} consecutive free ports on 127.0.0.1 between {LOW} and {HIGH}")
}
