//! A cluster on several hosts: the metadata server, each storage server and the client each on a
//! host of its own (a network namespace with its own address on a bridge, see
//! [`tern_local::Network`]), talking TLS to one another with certificates for the hosts'
//! addresses, as a real deployment must (no `--trusted-network`, nothing on loopback). Faults are
//! real network faults: a host's link cut (packets vanish), healed, slowed, or a process killed.
//!
//! Hosts: `meta` (the metadata server), `s1`..`sN` (storage server `i` on `s{i+1}`), `client`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tern_client::{Client, ClientOptions, StatusResponse, TransportKind};
use tern_local::{Daemon, DaemonSpec, Deadline, Network};

use super::TERN;

/// Ports are per namespace, so every host uses the usual ones.
const METADATA_PORT: u16 = 9060;
const STORAGE_PORT: u16 = 9070;
/// Storage servers' admin endpoint (/metrics), on each one's own loopback.
const STORAGE_ADMIN_PORT: u16 = 9071;
/// The metadata server's admin endpoint (/metrics), on its host's loopback.
const METADATA_ADMIN_PORT: u16 = 9072;
/// How long the cluster may take to come up.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How often [`MultiHost::wait_status`] asks.
const STATUS_POLL: Duration = Duration::from_millis(200);
/// The host clients run on.
pub const CLIENT_HOST: &str = "client";
pub const METADATA_HOST: &str = "meta";

/// What to start.
#[derive(Debug, Clone)]
pub struct Layout<'a> {
    pub storage_servers: usize,
    /// DRAM per storage server.
    pub dram: &'a str,
    /// `key=value` settings for the metadata server (`--set`); none: its defaults.
    pub metadata_sets: &'a [&'a str],
}

pub struct MultiHost {
    pub dir: tempfile::TempDir,
    pub tls_dir: PathBuf,
    /// `https://` and the metadata server's address: the control plane is mutual TLS.
    pub metadata_url: String,
    /// Storage server `i`'s block address (TLS over TCP; QUIC on the same port over UDP).
    pub storage_addrs: Vec<String>,
    /// The metadata server, then storage server `i` at `1 + i`.
    daemons: Vec<Daemon>,
    /// Declared last: dropped after the daemons are killed, it removes the hosts.
    network: Network,
}

/// The host storage server `i` runs on.
pub fn storage_host(i: usize) -> String {
    format!("s{}", i + 1)
}

/// `tern cert init` in `DIR/tls` with certificates for every host's address; returns that dir.
pub fn cert_init(network: &Network, dir: &Path) -> PathBuf {
    let tls_dir = dir.join("tls");
    let mut cert = Command::new(TERN);
    cert.args(["cert", "init", "--dir"]).arg(&tls_dir);
    for host in network.hosts() {
        cert.args(["--host", &host.ip().to_string()]);
    }
    let out = cert.output().unwrap();
    assert!(out.status.success(), "tern cert init: {}", String::from_utf8_lossy(&out.stderr));
    tls_dir
}

impl MultiHost {
    /// Makes the hosts, the TLS material for their addresses, starts the daemons on them and waits
    /// (from the client host) until every storage server has registered. Fails the test, saying
    /// why, where namespaces cannot be made.
    pub async fn start(layout: Layout<'_>) -> MultiHost {
        let mut names = vec![METADATA_HOST.to_string()];
        names.extend((0..layout.storage_servers).map(storage_host));
        names.push(CLIENT_HOST.to_string());
        let network = Network::create(&names.iter().map(String::as_str).collect::<Vec<_>>())
            .unwrap_or_else(|e| panic!("the multi-host cluster needs network namespaces: {e:#}"));
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let tls_dir = cert_init(&network, dir.path());
        let tls = tls_dir.to_string_lossy().into_owned();

        let meta = network.host(METADATA_HOST).clone();
        let metadata_addr = meta.addr(METADATA_PORT);
        let metadata_url = format!("https://{metadata_addr}");
        let state = dir.path().join("metadata").to_string_lossy().into_owned();
        let mut metadata = daemon(dir.path(), "metadata")
            .on(meta)
            .serving(metadata_addr)
            .args(["metadata-server", "--listen", &metadata_addr.to_string(), "--dir", &state, "--tls-dir", &tls])
            .args(["--admin", &format!("127.0.0.1:{METADATA_ADMIN_PORT}")]);
        for set in layout.metadata_sets {
            metadata = metadata.args(["--set", set]);
        }
        let mut daemons = vec![metadata.spawn().unwrap_or_else(|e| panic!("{e:#}"))];
        let mut storage = Vec::new();
        for i in 0..layout.storage_servers {
            let host = network.host(&storage_host(i)).clone();
            let addr = host.addr(STORAGE_PORT);
            let spec = daemon(dir.path(), &format!("storage-{i}"))
                .on(host)
                .serving(addr)
                .args(["storage-server", "--metadata", &metadata_url, "--listen", &addr.to_string()])
                .args([
                    "--admin",
                    &format!("127.0.0.1:{STORAGE_ADMIN_PORT}"),
                    "--dram",
                    layout.dram,
                    "--tls-dir",
                    &tls,
                ]);
            daemons.push(spec.spawn().unwrap_or_else(|e| panic!("{e:#}")));
            storage.push((daemons.len() - 1, addr));
        }
        let mut cluster = MultiHost {
            dir,
            tls_dir,
            metadata_url,
            storage_addrs: storage.iter().map(|(_, addr)| addr.to_string()).collect(),
            daemons,
            network,
        };
        let options = cluster.options(TransportKind::Auto);
        let (url, daemons) = (cluster.metadata_url.clone(), &mut cluster.daemons);
        let ready = cluster.network.on_host(CLIENT_HOST, move || {
            let deadline = Deadline::after(STARTUP_TIMEOUT);
            current_thread_runtime().block_on(async {
                tern_local::cluster_ready(daemons, 0, &url, &options, &storage, &deadline).await.map(|_| ())
            })
        });
        if let Err(e) = ready.and_then(|ready| ready) {
            panic!("{e:#}\n{}", cluster.logs());
        }
        cluster
    }

    pub fn network(&self) -> &Network {
        &self.network
    }

    /// Client options with the cluster's TLS material and block transport `transport`.
    pub fn options(&self, transport: TransportKind) -> ClientOptions {
        ClientOptions { transport, tls_dir: Some(self.tls_dir.clone()), ..ClientOptions::default() }
    }

    /// Runs `f` with a client of the cluster on a thread of host `host` (its own runtime: what
    /// the client starts in the background ends with `f`): what it connects to, it reaches
    /// across the bridge as the `tern` command on that host would.
    pub fn with_client_on<T: Send>(&self, host: &str, f: impl AsyncFnOnce(Client) -> T + Send) -> T {
        self.with_client_options_on(host, self.options(TransportKind::Auto), f)
    }

    /// [`MultiHost::with_client_on`] with a client acting as the operator (`tern cert init`'s
    /// admin credential): cordon, drain.
    pub fn with_admin_on<T: Send>(&self, host: &str, f: impl AsyncFnOnce(Client) -> T + Send) -> T {
        let admin = self.tls_dir.join("credentials").join("admin");
        let credential = tern_proto::identity::load_credential(&admin).unwrap_or_else(|e| panic!("{e}"));
        let options = ClientOptions { credential: Some(credential), ..self.options(TransportKind::Auto) };
        self.with_client_options_on(host, options, f)
    }

    fn with_client_options_on<T: Send>(
        &self,
        host: &str,
        options: ClientOptions,
        f: impl AsyncFnOnce(Client) -> T + Send,
    ) -> T {
        let run = || {
            current_thread_runtime().block_on(async {
                let deadline = Deadline::after(Duration::from_secs(20));
                let connect = || Client::connect_with(&self.metadata_url, options.clone());
                let client = tern_local::poll_until(&deadline, connect).await;
                f(client.unwrap_or_else(|e| panic!("the metadata server never answered from {host}: {e}"))).await
            })
        };
        self.network.on_host(host, run).unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// Polls the metadata server's status from its own host (reachable whatever else is cut)
    /// until `check` yields a value; fails the test, with the logs, after `timeout`.
    pub fn wait_status<T: Send>(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut(&StatusResponse) -> Option<T> + Send,
    ) -> T {
        let found = self.with_client_on(METADATA_HOST, async |client| {
            let deadline = Instant::now() + timeout;
            let mut last = None;
            loop {
                if let Ok(status) = client.status().await {
                    if let Some(found) = check(&status) {
                        return Ok(found);
                    }
                    last = Some(status);
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(last);
                }
                tokio::time::sleep(STATUS_POLL.min(left)).await;
            }
        });
        found.unwrap_or_else(|last| {
            panic!("timed out after {timeout:?} waiting for {what}; last status: {last:?}\n{}", self.logs())
        })
    }

    /// `tern ARGS` on the client host, started in the background against this cluster with its
    /// block traffic over `transport`; output in `DIR/NAME.log`.
    pub fn spawn_tern(&self, name: &str, transport: TransportKind, args: &[&str]) -> Daemon {
        daemon(self.dir.path(), name)
            .on(self.network.host(CLIENT_HOST).clone())
            .env("TERN_METADATA", &self.metadata_url)
            .env("TERN_TLS_DIR", &self.tls_dir)
            .env("TERN_TRANSPORT", transport.to_string())
            .args(args)
            .spawn()
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// `tern terasort --size SIZE --json EXTRA` on the client host, started in the background.
    pub fn spawn_terasort(&self, size: &str, transport: TransportKind, extra: &[&str]) -> Daemon {
        let args = [&["terasort", "--size", size, "--metadata", &self.metadata_url, "--json"], extra].concat();
        self.spawn_tern("terasort", transport, &args)
    }

    /// Waits up to `timeout` for `run` (a [`MultiHost::spawn_tern`]) to finish and returns the
    /// JSON object its output ends with; fails the test, with the logs, if it fails or runs late.
    pub async fn json_result(&self, run: &mut Daemon, timeout: Duration) -> serde_json::Value {
        let Some(status) = run.wait_until(&Deadline::after(timeout)).await else {
            let _ = run.kill();
            panic!("{} still running after {timeout:?}\n{}", run.name(), self.logs());
        };
        let log = std::fs::read_to_string(run.log()).unwrap_or_default();
        assert!(status.success(), "{} failed ({status})\n{}", run.name(), self.logs());
        let json = log.lines().rev().find(|line| line.starts_with('{'));
        let json = json.unwrap_or_else(|| panic!("{} printed no JSON:\n{log}", run.name()));
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"))
    }

    /// Waits up to `timeout` for a terasort run to finish; fails the test unless it validated.
    /// Returns its report and when it finished.
    pub async fn validated(&self, run: &mut Daemon, timeout: Duration) -> (serde_json::Value, Instant) {
        let report = self.json_result(run, timeout).await;
        let finished = Instant::now();
        assert_eq!(report["sorted"], true, "{report}");
        assert_eq!(report["input_checksum"], report["output_checksum"], "{report}");
        (report, finished)
    }

    /// Storage server `i`'s Prometheus metrics, read on its own host.
    pub fn storage_metrics(&self, i: usize) -> String {
        let admin = std::net::SocketAddr::from(([127, 0, 0, 1], STORAGE_ADMIN_PORT));
        let read = self.network.on_host(&storage_host(i), || crate::monitoring::http_get(admin, "/metrics"));
        read.and_then(|metrics| metrics).unwrap_or_else(|e| panic!("metrics of storage server {i}: {e:#}"))
    }

    /// The metadata server's Prometheus metrics, read on its own host.
    pub fn metadata_metrics(&self) -> String {
        let admin = std::net::SocketAddr::from(([127, 0, 0, 1], METADATA_ADMIN_PORT));
        let read = self.network.on_host(METADATA_HOST, || crate::monitoring::http_get(admin, "/metrics"));
        read.and_then(|metrics| metrics).unwrap_or_else(|e| panic!("metrics of the metadata server: {e:#}"))
    }

    /// SIGKILLs storage server `i`.
    pub fn kill_storage(&mut self, i: usize) {
        let daemon = &mut self.daemons[1 + i];
        daemon.kill().unwrap();
        daemon.wait().unwrap();
    }

    /// Storage server `i`'s exit status once it has exited.
    pub fn storage_exit(&mut self, i: usize) -> Option<std::process::ExitStatus> {
        self.daemons[1 + i].try_wait().unwrap()
    }

    /// Every daemon's and client's log, to print when a test fails.
    pub fn logs(&self) -> String {
        super::logs_in(self.dir.path())
    }
}

/// A `tern` process named `name` with its log in `dir`, configured by its flags alone.
fn daemon(dir: &Path, name: &str) -> DaemonSpec {
    DaemonSpec::new(name, TERN, dir.join(format!("{name}.log"))).without_tern_env()
}

fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}
