//! A real cluster for black-box tests: the `tern` binary started as separate processes (one
//! metadata server, N storage servers) on loopback ports, state and logs in a temp dir.

#![allow(dead_code)] // each test binary uses a different part of the harness

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tern_client::{Client, ClientOptions, TransportKind};

pub const TERN: &str = env!("CARGO_BIN_EXE_tern");
/// Heartbeats are fast in tests so that deaths and frees show within a second or two.
pub const HEARTBEAT_MS: u64 = 200;
pub const SERVER_TIMEOUT_MS: u64 = 1500;

/// How a test cluster uses TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tls {
    /// Plain TCP everywhere, as `tern up` without TLS material.
    Off,
    /// TLS material in DIR/tls: storage servers also serve QUIC; gRPC stays plain (as `tern up`).
    Quic,
    /// As `Quic`, and the metadata server serves gRPC over mutual TLS (as `tern up --tls`).
    Full,
}

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub metadata_addr: String,
    pub storage_addrs: Vec<String>,
    /// The cluster's TLS material (`tern cert init`), unless started with `Tls::Off`.
    pub tls_dir: Option<PathBuf>,
    pub tls: Tls,
    metadata: Child,
    /// How the metadata server was started, to start it again on the same --dir and port.
    metadata_args: Vec<String>,
    storage: Vec<Option<Child>>,
    /// How each storage server was started, to start it again.
    storage_args: Vec<Vec<String>>,
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    // A port is only probed here, not held, so until its daemon binds it the kernel may offer
    // it again: never hand out the same port twice in one test process.
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if GIVEN.lock().unwrap().insert(port) {
            return port;
        }
    }
}

pub fn spawn_logged(dir: &Path, name: &str, args: &[&str]) -> Child {
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    Command::new(TERN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"))
}

/// An NVMe tier for each storage server: a file of `size` in the cluster's directory (on the
/// real disk, under the target dir), served by `engine` ("uring", "psync" or "auto").
#[derive(Debug, Clone, Copy)]
pub struct Nvme<'a> {
    pub size: &'a str,
    pub engine: &'a str,
}

impl Cluster {
    /// Starts a metadata server and `servers` storage servers of `dram` each, and waits until
    /// every storage server has registered.
    pub async fn start(servers: usize, dram: &str) -> Cluster {
        Cluster::start_full(servers, dram, Tls::Off, None, None).await
    }

    /// [`Cluster::start`] with the metadata server reading `toml` as its config file.
    pub async fn start_with_metadata_config(servers: usize, dram: &str, toml: &str) -> Cluster {
        Cluster::start_full(servers, dram, Tls::Off, None, Some(toml)).await
    }

    /// [`Cluster::start`] with TLS material made by `tern cert init` as `tls` says.
    pub async fn start_with(servers: usize, dram: &str, tls: Tls) -> Cluster {
        Cluster::start_full(servers, dram, tls, None, None).await
    }

    /// [`Cluster::start`], each storage server with an NVMe tier.
    pub async fn start_with_nvme(servers: usize, dram: &str, nvme: Nvme<'_>) -> Cluster {
        Cluster::start_full(servers, dram, Tls::Off, Some(nvme), None).await
    }

    async fn start_full(
        servers: usize,
        dram: &str,
        tls: Tls,
        nvme: Option<Nvme<'_>>,
        metadata_config: Option<&str>,
    ) -> Cluster {
        // O_DIRECT needs a disk filesystem: the target dir is on the real disk, /tmp may be tmpfs.
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let metadata_addr = format!("127.0.0.1:{}", free_port());
        let tls_dir = (tls != Tls::Off).then(|| dir.path().join("tls"));
        if let Some(tls_dir) = &tls_dir {
            let out = Command::new(TERN).args(["cert", "init", "--dir"]).arg(tls_dir).output().unwrap();
            assert!(out.status.success(), "tern cert init: {}", String::from_utf8_lossy(&out.stderr));
        }
        let tls_arg = tls_dir.as_ref().map(|d| d.to_string_lossy().to_string()).unwrap_or_default();
        let storage_tls: Vec<&str> = if tls == Tls::Off { Vec::new() } else { vec!["--tls-dir", &tls_arg] };
        let mut metadata_tls: Vec<&str> = Vec::new();
        if tls == Tls::Full {
            metadata_tls.extend(["--tls-dir", &tls_arg]);
        }
        let config_path = dir.path().join("metadata.toml").to_string_lossy().into_owned();
        if let Some(toml) = metadata_config {
            std::fs::write(&config_path, toml).unwrap();
            metadata_tls.extend(["--config", &config_path]);
        }
        // Storage servers are told by the scheme whether the control plane is TLS.
        let metadata_url = match tls {
            Tls::Off => metadata_addr.clone(),
            Tls::Quic => format!("http://{metadata_addr}"),
            Tls::Full => format!("https://{metadata_addr}"),
        };
        let metadata_args: Vec<String> = [
            &[
                "metadata-server",
                "--listen",
                &metadata_addr,
                "--dir",
                &dir.path().join("metadata").to_string_lossy(),
                "--admin",
                "127.0.0.1:0",
                "--set",
                &format!("heartbeat_interval_ms={HEARTBEAT_MS}"),
                "--set",
                &format!("server_timeout_ms={SERVER_TIMEOUT_MS}"),
            ][..],
            &metadata_tls,
        ]
        .concat()
        .into_iter()
        .map(String::from)
        .collect();
        let args: Vec<&str> = metadata_args.iter().map(String::as_str).collect();
        let metadata = spawn_logged(dir.path(), "metadata", &args);
        let mut cluster = Cluster {
            dir,
            metadata_addr,
            storage_addrs: Vec::new(),
            tls_dir,
            tls,
            metadata,
            metadata_args,
            storage: Vec::new(),
            storage_args: Vec::new(),
        };
        for i in 0..servers {
            let addr = format!("127.0.0.1:{}", free_port());
            let nvme_path = cluster.dir.path().join(format!("storage-{i}.nvme")).to_string_lossy().into_owned();
            let mut args = vec![
                "storage-server",
                "--metadata",
                &metadata_url,
                "--listen",
                &addr,
                "--admin",
                "127.0.0.1:0",
                "--dram",
                dram,
            ];
            args.extend(&storage_tls);
            if let Some(nvme) = &nvme {
                args.extend(["--nvme", &nvme_path, "--nvme-size", nvme.size, "--io-engine", nvme.engine]);
            }
            let child = spawn_logged(cluster.dir.path(), &format!("storage-{i}"), &args);
            cluster.storage.push(Some(child));
            cluster.storage_args.push(args.iter().map(|a| a.to_string()).collect());
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
        self.client_over(TransportKind::Tcp).await
    }

    /// The metadata address as a client of this cluster gives it: `http://` when the cluster's
    /// gRPC is plain but the client has TLS material (for QUIC).
    pub fn metadata_url(&self) -> String {
        match self.tls {
            Tls::Off | Tls::Full => self.metadata_addr.clone(),
            Tls::Quic => format!("http://{}", self.metadata_addr),
        }
    }

    /// Client options with this cluster's TLS material and `transport`.
    pub fn options(&self, transport: TransportKind) -> ClientOptions {
        ClientOptions { transport, tls_dir: self.tls_dir.clone(), ..ClientOptions::default() }
    }

    /// A client whose block traffic goes over `transport`.
    pub async fn client_over(&self, transport: TransportKind) -> Client {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match Client::connect_with(&self.metadata_url(), self.options(transport)).await {
                Ok(client) => return client,
                Err(e) if Instant::now() > deadline => panic!("metadata server never answered: {e}\n{}", self.logs()),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// Runs the `tern` command line against this cluster.
    pub fn tern(&self, args: &[&str]) -> Output {
        let mut command = Command::new(TERN);
        command.args(args).env("TERN_METADATA", self.metadata_url()).env_remove("TERN_TRANSPORT");
        match &self.tls_dir {
            Some(dir) => command.env("TERN_TLS_DIR", dir),
            None => command.env_remove("TERN_TLS_DIR"),
        };
        command.output().unwrap()
    }

    /// Runs `tern` and returns its stdout, failing the test if it fails.
    pub fn tern_ok(&self, args: &[&str]) -> String {
        let out = self.tern(args);
        assert!(out.status.success(), "tern {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    /// Kills the metadata server with SIGKILL and starts it again on the same --dir and port;
    /// `n` names its log file (`metadata-<n>.log`).
    pub fn restart_metadata(&mut self, n: usize) {
        let _ = self.metadata.kill();
        let _ = self.metadata.wait();
        let args: Vec<&str> = self.metadata_args.iter().map(String::as_str).collect();
        self.metadata = spawn_logged(self.dir.path(), &format!("metadata-{n}"), &args);
    }

    /// Kills storage server `i` with SIGKILL (unless it is dead already) and starts it again with
    /// the same flags (same address, same NVMe path); its log is `storage-<i>-again.log`.
    pub fn restart_storage(&mut self, i: usize) {
        if let Some(mut child) = self.storage[i].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let args: Vec<&str> = self.storage_args[i].iter().map(String::as_str).collect();
        self.storage[i] = Some(spawn_logged(self.dir.path(), &format!("storage-{i}-again"), &args));
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
