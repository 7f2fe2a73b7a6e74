//! A real cluster for black-box tests: the `tern` binary started as separate processes (one
//! metadata server, N storage servers) on loopback ports, state and logs in a temp dir.

#![allow(dead_code)] // each test binary uses a different part of the harness

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tern_client::Client;

pub const TERN: &str = env!("CARGO_BIN_EXE_tern");
/// Heartbeats are fast in tests so that deaths and frees show within a second or two.
pub const HEARTBEAT_MS: u64 = 200;
pub const SERVER_TIMEOUT_MS: u64 = 1500;

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub metadata_addr: String,
    pub storage_addrs: Vec<String>,
    metadata: Child,
    storage: Vec<Option<Child>>,
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn spawn_logged(dir: &Path, name: &str, args: &[&str]) -> Child {
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    Command::new(TERN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"))
}

impl Cluster {
    /// Starts a metadata server and `servers` storage servers of `dram` each, and waits until
    /// every storage server has registered.
    pub async fn start(servers: usize, dram: &str) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let metadata_addr = format!("127.0.0.1:{}", free_port());
        let metadata = spawn_logged(
            dir.path(),
            "metadata",
            &[
                "metadata-server",
                "--listen",
                &metadata_addr,
                "--dir",
                &dir.path().join("metadata").to_string_lossy(),
                "--admin",
                "127.0.0.1:0",
                "--heartbeat-interval-ms",
                &HEARTBEAT_MS.to_string(),
                "--server-timeout-ms",
                &SERVER_TIMEOUT_MS.to_string(),
            ],
        );
        let mut cluster = Cluster { dir, metadata_addr, storage_addrs: Vec::new(), metadata, storage: Vec::new() };
        for i in 0..servers {
            let addr = format!("127.0.0.1:{}", free_port());
            let child = spawn_logged(
                cluster.dir.path(),
                &format!("storage-{i}"),
                &[
                    "storage-server",
                    "--metadata",
                    &cluster.metadata_addr,
                    "--listen",
                    &addr,
                    "--admin",
                    "127.0.0.1:0",
                    "--dram",
                    dram,
                ],
            );
            cluster.storage.push(Some(child));
            cluster.storage_addrs.push(addr);
        }
        let client = cluster.client().await;
        cluster
            .wait_for("every storage server to register", Duration::from_secs(30), || async {
                let status = client.status().await.ok()?;
                (status.servers.iter().filter(|s| s.alive).count() == servers).then_some(())
            })
            .await;
        cluster
    }

    pub async fn client(&self) -> Client {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match Client::connect(&self.metadata_addr).await {
                Ok(client) => return client,
                Err(e) if Instant::now() > deadline => panic!("metadata server never answered: {e}\n{}", self.logs()),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// Runs the `tern` command line against this cluster.
    pub fn tern(&self, args: &[&str]) -> Output {
        Command::new(TERN).args(args).env("TERN_METADATA", &self.metadata_addr).output().unwrap()
    }

    /// Runs `tern` and returns its stdout, failing the test if it fails.
    pub fn tern_ok(&self, args: &[&str]) -> String {
        let out = self.tern(args);
        assert!(out.status.success(), "tern {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    /// The process id of storage server `i` (for a test that kills it from another process).
    pub fn storage_pid(&self, i: usize) -> u32 {
        self.storage[i].as_ref().expect("storage server already killed").id()
    }

    /// SIGKILLs storage server `i`.
    pub fn kill_storage(&mut self, i: usize) {
        let mut child = self.storage[i].take().expect("storage server already killed");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// Polls `check` until it yields a value, or fails the test after `timeout`.
    pub async fn wait_for<T, F, Fut>(&self, what: &str, timeout: Duration, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(value) = check().await {
                return value;
            }
            assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}\n{}", self.logs());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Every daemon's log, to print when a test fails.
    pub fn logs(&self) -> String {
        let mut names: Vec<PathBuf> = std::fs::read_dir(self.dir.path())
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "log"))
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
            .iter()
            .map(|p| format!("--- {} ---\n{}", p.display(), std::fs::read_to_string(p).unwrap_or_default()))
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in self.storage.iter_mut().flatten().chain(std::iter::once(&mut self.metadata)) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `n` random bytes.
pub fn random_bytes(n: usize) -> Vec<u8> {
    use rand::RngCore;
    let mut data = vec![0u8; n];
    rand::rng().fill_bytes(&mut data);
    data
}
