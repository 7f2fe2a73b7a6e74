//! A real cluster for black-box tests: the `tern` binary started as separate processes (one
//! metadata server, N storage servers) on loopback ports, state and logs in a temp dir; and
//! [`multihost`], the same on several hosts (network namespaces) with TLS between them.

pub mod multihost;
pub mod table;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use tern_client::{Client, ClientOptions, TransportKind};
use tern_local::{Daemon, DaemonSpec, Deadline, Host};

pub const TERN: &str = env!("CARGO_BIN_EXE_tern");
/// Heartbeats are fast in tests so that deaths and frees show within a second or two.
pub const HEARTBEAT_MS: u64 = 200;
pub const SERVER_TIMEOUT_MS: u64 = 1500;
/// How long a cluster may take to come up.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

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
    /// The metadata server, then storage server `i` at `1 + i`; each keeps how it was started,
    /// to start it again on the same --dir and addresses.
    daemons: Vec<Daemon>,
}

/// A loopback port that was free a moment ago, never the same one twice in this test.
pub fn free_port() -> u16 {
    tern_local::free_port().unwrap()
}

/// Makes the daemons' secret and the shell's credentials in `dir` (`tern cert secret`, as `tern up`
/// does); returns the `--set` every daemon of the cluster takes to read it.
pub fn cluster_secret(dir: &Path) -> String {
    let out = Command::new(TERN).args(["cert", "secret", "--dir"]).arg(dir).output().unwrap();
    assert!(out.status.success(), "tern cert secret: {}", String::from_utf8_lossy(&out.stderr));
    format!("cluster_secret_file={}", dir.join("cluster.secret").display())
}

/// A raw gRPC client of the Metadata service at `addr` (plain), presenting `token` (a job's
/// token, text form) on every call when given, as the client library does.
pub async fn raw_metadata(
    addr: &str,
    token: Option<&str>,
) -> tern_proto::v1::metadata_client::MetadataClient<tern_proto::identity::Presenting<tonic::transport::Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let presents = match token {
        Some(token) => tern_proto::identity::Presents::job_token(token).unwrap(),
        None => tern_proto::identity::Presents::default(),
    };
    tern_proto::v1::metadata_client::MetadataClient::with_interceptor(channel, presents)
}

/// Starts `tern ARGS`, its output in `DIR/NAME.log`.
pub fn spawn_logged(dir: &Path, name: &str, args: &[&str]) -> Daemon {
    let spec = DaemonSpec::new(name, TERN, dir.join(format!("{name}.log"))).args(args);
    spec.spawn().unwrap_or_else(|e| panic!("{e:#}"))
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

    /// [`Cluster::start_with_nvme`] with the metadata server reading `toml` as its config file.
    pub async fn start_with_nvme_and_metadata_config(
        servers: usize,
        dram: &str,
        nvme: Nvme<'_>,
        toml: &str,
    ) -> Cluster {
        Cluster::start_full(servers, dram, Tls::Off, Some(nvme), Some(toml)).await
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
        let metadata_addr = Host::local().addr(free_port());
        let tls_dir = (tls != Tls::Off).then(|| dir.path().join("tls"));
        if let Some(tls_dir) = &tls_dir {
            let out = Command::new(TERN).args(["cert", "init", "--dir"]).arg(tls_dir).output().unwrap();
            assert!(out.status.success(), "tern cert init: {}", String::from_utf8_lossy(&out.stderr));
        }
        let secret_set = cluster_secret(dir.path());
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
            Tls::Off => metadata_addr.to_string(),
            Tls::Quic => format!("http://{metadata_addr}"),
            Tls::Full => format!("https://{metadata_addr}"),
        };
        let host = Host::local();
        let metadata_dir = dir.path().join("metadata").to_string_lossy().into_owned();
        let metadata = DaemonSpec::new("metadata", TERN, dir.path().join("metadata.log"))
            .on(host.clone())
            .serving(metadata_addr)
            .args(["metadata-server", "--listen", &metadata_addr.to_string(), "--dir", &metadata_dir])
            .args(["--admin", "127.0.0.1:0"])
            .args(["--set", &format!("heartbeat_interval_ms={HEARTBEAT_MS}")])
            .args(["--set", &format!("server_timeout_ms={SERVER_TIMEOUT_MS}")])
            .args(["--set", &secret_set])
            .args(&metadata_tls);
        let mut daemons = vec![metadata.spawn().unwrap_or_else(|e| panic!("{e:#}"))];
        let mut storage = Vec::new();
        for i in 0..servers {
            let addr = host.addr(free_port());
            let nvme_path = dir.path().join(format!("storage-{i}.nvme")).to_string_lossy().into_owned();
            let mut args = vec![
                "storage-server",
                "--metadata",
                &metadata_url,
                "--listen",
                &addr.to_string(),
                "--admin",
                "127.0.0.1:0",
                "--dram",
                dram,
                "--set",
                &secret_set,
            ]
            .into_iter()
            .map(String::from)
            .collect::<Vec<_>>();
            args.extend(storage_tls.iter().map(|a| a.to_string()));
            if let Some(nvme) = &nvme {
                args.extend(
                    ["--nvme", &nvme_path, "--nvme-size", nvme.size, "--io-engine", nvme.engine].map(String::from),
                );
            }
            let name = format!("storage-{i}");
            let spec = DaemonSpec::new(&name, TERN, dir.path().join(format!("{name}.log"))).on(host.clone());
            daemons.push(spec.serving(addr).args(args).spawn().unwrap_or_else(|e| panic!("{e:#}")));
            storage.push((daemons.len() - 1, addr));
        }
        let mut cluster = Cluster {
            dir,
            metadata_addr: metadata_addr.to_string(),
            storage_addrs: storage.iter().map(|(_, addr)| addr.to_string()).collect(),
            tls_dir,
            tls,
            daemons,
        };
        let (url, options) = (cluster.metadata_url(), cluster.options(TransportKind::Tcp));
        let deadline = Deadline::after(STARTUP_TIMEOUT);
        if let Err(e) = tern_local::cluster_ready(&mut cluster.daemons, 0, &url, &options, &storage, &deadline).await {
            panic!("{e:#}\n{}", cluster.logs());
        }
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
        let deadline = Deadline::after(Duration::from_secs(20));
        let url = self.metadata_url();
        let connect = || Client::connect_with(&url, self.options(transport));
        match tern_local::poll_until(&deadline, connect).await {
            Ok(client) => client,
            Err(e) => panic!("metadata server never answered: {e}\n{}", self.logs()),
        }
    }

    /// The daemons' `--set` of the cluster secret (`cluster_secret_file=...`), for daemons a test
    /// starts beside the cluster (a scheduler).
    pub fn secret_setting(&self) -> String {
        format!("cluster_secret_file={}", self.dir.path().join("cluster.secret").display())
    }

    /// A client of tenant `tenant`, holding that tenant's credential (made from the secret).
    pub async fn tenant_client(&self, tenant: &str) -> Client {
        let secret = tern_proto::identity::ClusterSecret::load(&self.dir.path().join("cluster.secret")).unwrap();
        let identity = tern_proto::identity::Identity::new(tern_proto::identity::Role::Client, tenant, "");
        let options =
            ClientOptions { credential: Some(secret.credential(&identity)), ..self.options(TransportKind::Tcp) };
        let (deadline, url) = (Deadline::after(Duration::from_secs(20)), self.metadata_url());
        match tern_local::poll_until(&deadline, || Client::connect_with(&url, options.clone())).await {
            Ok(client) => client,
            Err(e) => panic!("metadata server never answered: {e}\n{}", self.logs()),
        }
    }

    /// The executors' credential file (`tern cert secret` made it, as `tern up` does).
    pub fn executor_credential(&self) -> PathBuf {
        self.dir.path().join("credentials").join("executor")
    }

    /// The operator's credential file (`tern cert secret` made it, as `tern up` does).
    pub fn admin_credential(&self) -> PathBuf {
        self.dir.path().join("credentials").join("admin")
    }

    /// A client acting as the operator (cordon, drain, end any job).
    pub async fn admin_client(&self) -> Client {
        let credential = tern_proto::identity::load_credential(&self.admin_credential()).unwrap();
        let options = ClientOptions { credential: Some(credential), ..self.options(TransportKind::Tcp) };
        Client::connect_with(&self.metadata_url(), options).await.unwrap()
    }

    /// Runs `tern` as the operator (`--as` the admin credential) and returns its output.
    pub fn tern_admin(&self, args: &[&str]) -> Output {
        let admin = self.admin_credential().to_string_lossy().into_owned();
        let with: Vec<&str> = args.iter().copied().chain(["--as", &admin]).collect();
        self.tern(&with)
    }

    /// [`Cluster::tern_admin`], failing the test if it fails; its stdout.
    pub fn tern_admin_ok(&self, args: &[&str]) -> String {
        let out = self.tern_admin(args);
        assert!(out.status.success(), "tern {args:?} as admin failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    /// Runs the `tern` command line against this cluster (as a client of the default tenant).
    pub fn tern(&self, args: &[&str]) -> Output {
        let mut command = Command::new(TERN);
        command.args(args).env("TERN_METADATA", self.metadata_url()).env_remove("TERN_TRANSPORT").env_remove("TERN_AS");
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
        let log = self.dir.path().join(format!("metadata-{n}.log"));
        self.respawn(0, log);
    }

    /// Kills storage server `i` with SIGKILL (unless it is dead already) and starts it again with
    /// the same flags (same address, same NVMe path); its log is `storage-<i>-again.log`.
    pub fn restart_storage(&mut self, i: usize) {
        let log = self.dir.path().join(format!("storage-{i}-again.log"));
        self.respawn(1 + i, log);
    }

    /// Waits until storage server `i`, started again, takes new blocks: registered and reconciled.
    /// A write proves it (status alone may still list the killed process as alive); it leaves a
    /// one-byte file at `/probe-storage-<i>`.
    pub async fn wait_storage_back(&self, i: usize, client: &Client) {
        let address = self.storage_addrs[i].clone();
        let probe = format!("/probe-storage-{i}");
        self.wait_for("the storage server to register again", Duration::from_secs(20), || async {
            let status = client.status().await.ok()?;
            let server = status.servers.iter().find(|s| s.address == address)?;
            (server.alive && client.put(&probe, bytes::Bytes::from_static(b"x")).await.is_ok()).then_some(())
        })
        .await;
    }

    /// SIGKILLs daemon `d` (unless it is dead already) and starts it again as it was, logging to `log`.
    fn respawn(&mut self, d: usize, log: PathBuf) {
        let daemon = &mut self.daemons[d];
        let _ = daemon.kill();
        let _ = daemon.wait();
        let spec = daemon.spec().clone().log_to(log);
        *daemon = spec.spawn().unwrap_or_else(|e| panic!("{e:#}"));
    }

    /// SIGKILLs storage server `i`.
    pub fn kill_storage(&mut self, i: usize) {
        let daemon = &mut self.daemons[1 + i];
        assert!(daemon.try_wait().unwrap().is_none(), "storage server already killed");
        daemon.kill().unwrap();
        daemon.wait().unwrap();
    }

    /// SIGTERMs storage server `i` (it drains itself, then exits).
    pub fn terminate_storage(&mut self, i: usize) {
        self.daemons[1 + i].terminate().unwrap();
    }

    /// How storage server `i` exited, or `None` while it runs.
    pub fn storage_exit(&mut self, i: usize) -> Option<std::process::ExitStatus> {
        self.daemons[1 + i].try_wait().unwrap()
    }

    /// The metadata server's admin (HTTP) address, from the line its log opens with.
    pub fn metadata_admin_addr(&self) -> String {
        self.admin_addr("metadata")
    }

    /// Storage server `i`'s admin (HTTP) address, from the line its log opens with.
    pub fn storage_admin_addr(&self, i: usize) -> String {
        self.admin_addr(&format!("storage-{i}"))
    }

    fn admin_addr(&self, daemon: &str) -> String {
        let log = std::fs::read_to_string(self.dir.path().join(format!("{daemon}.log"))).unwrap_or_default();
        let found =
            log.lines().find_map(|line| line.split("admin ").nth(1)?.split([')', ',']).next().map(str::to_string));
        found.unwrap_or_else(|| panic!("the {daemon} log names no admin address:\n{log}"))
    }

    /// Polls `check` until it yields a value, or fails the test after `timeout`.
    pub async fn wait_for<T, F, Fut>(&self, what: &str, timeout: Duration, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = Deadline::after(timeout);
        let found = tern_local::poll_until(&deadline, || {
            let check = check();
            async move { check.await.ok_or(()) }
        })
        .await;
        found.unwrap_or_else(|()| panic!("timed out after {timeout:?} waiting for {what}\n{}", self.logs()))
    }

    /// Every daemon's log, to print when a test fails.
    pub fn logs(&self) -> String {
        logs_in(self.dir.path())
    }
}

/// A client credential file of `tenant` for the cluster in `dir` (made from `dir/cluster.secret`
/// as `tern cert credential` makes one, at `dir/credentials/<tenant>`; kept if there).
pub fn tenant_credential(dir: &Path, tenant: &str) -> PathBuf {
    use tern_proto::identity::{ClusterSecret, Identity, Role};
    let path = dir.join("credentials").join(tenant);
    if !path.exists() {
        let secret = ClusterSecret::load(&dir.join("cluster.secret")).unwrap();
        tern_proto::identity::write_credential(&path, &secret.credential(&Identity::new(Role::Client, tenant, "")))
            .unwrap();
    }
    path
}

/// The end of every `*.log` file in `dir`, each under its name: what a failing test prints.
pub fn logs_in(dir: &Path) -> String {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "log")).collect()
        })
        .unwrap_or_default();
    names.sort();
    names.iter().map(|p| log_tail(p)).collect()
}

/// Lines of each log a failing test prints: the end of every daemon's log, so one chatty log
/// cannot push the others out of what a CI summary keeps of the output.
const LOG_TAIL_LINES: usize = 60;

fn log_tail(path: &Path) -> String {
    let log = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    let shown = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
    let of = match shown.len() < lines.len() {
        true => format!(" (last {} of {} lines)", shown.len(), lines.len()),
        false => String::new(),
    };
    format!("--- {}{of} ---\n{}\n", path.display(), shown.join("\n"))
}

/// `n` random bytes.
pub fn random_bytes(n: usize) -> Vec<u8> {
    use rand::RngCore;
    let mut data = vec![0u8; n];
    rand::rng().fill_bytes(&mut data);
    data
}
