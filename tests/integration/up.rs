//! `tern up`: a whole cluster from one command, usable at once, stopped cleanly by Ctrl-C.

// kill(2): Ctrl-C to the `tern up` under test.
#![allow(unsafe_code)]

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;

/// Starts `tern up` with `extra` flags and waits for its banner.
fn start_up(dir: &std::path::Path, port: u16, extra: &[&str]) -> (std::process::Child, String) {
    start_up_with_stderr(dir, port, extra, Stdio::null())
}

/// [`start_up`], its stderr (where it says what happens to its daemons) going to `stderr`.
fn start_up_with_stderr(
    dir: &std::path::Path,
    port: u16,
    extra: &[&str],
    stderr: impl Into<Stdio>,
) -> (std::process::Child, String) {
    let mut up = Command::new(common::TERN)
        .args(["up", "--dir", dir.to_str().unwrap(), "--port", &port.to_string(), "--dram", "64MiB"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    // Ready is when `tern up` says so: its banner ends with how to stop it.
    let stdout = up.stdout.take().unwrap();
    let (lines_tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let mut banner = String::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !banner.contains("Ctrl-C stops the cluster") {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines.recv_timeout(left).expect("tern up prints its banner once the cluster is up");
        banner.push_str(&line);
        banner.push('\n');
    }
    (up, banner)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_runs_a_cluster_and_ctrl_c_stops_it() {
    let dir = tempfile::tempdir().unwrap();
    let port = tern_local::free_port_range(14).unwrap();
    let (mut up, banner) = start_up(dir.path(), port, &[]);
    let addr = format!("127.0.0.1:{port}");
    assert!(banner.contains(&format!("TERN_METADATA={addr}")), "the banner says how to use it:\n{banner}");
    let client = tern_client::Client::connect(&addr).await.unwrap();
    assert_eq!(client.status().await.unwrap().servers.iter().filter(|s| s.alive).count(), 2);
    client.put("/hello", Bytes::from_static(b"from tern up")).await.unwrap();
    assert_eq!(client.open("/hello").await.unwrap().read_to_end().await.unwrap(), b"from tern up");
    assert!(dir.path().join("logs/metadata.log").exists() && dir.path().join("logs/storage-1.log").exists());
    // Its storage servers serve QUIC with the CA `tern up` made in DIR/tls.
    let quic = tern_client::ClientOptions {
        transport: tern_client::TransportKind::Quic,
        tls_dir: Some(dir.path().join("tls")),
        ..Default::default()
    };
    let over_quic = tern_client::Client::connect_with(&format!("http://{addr}"), quic).await.unwrap();
    assert_eq!(over_quic.open("/hello").await.unwrap().read_to_end().await.unwrap(), b"from tern up");

    // Ctrl-C: SIGINT to `tern up`, which stops its daemons and exits 0.
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(up.id() as libc::pid_t, libc::SIGINT);
    }
    let status = up.wait().unwrap();
    assert!(status.success(), "tern up exited with {status}");
    assert!(std::net::TcpStream::connect(&addr).is_err(), "the metadata server is gone once tern up has exited");
    assert!(std::net::TcpStream::connect(("127.0.0.1", port + 10)).is_err(), "storage server 0 is gone too");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_tls_serves_the_control_plane_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let port = tern_local::free_port_range(14).unwrap();
    let (mut up, banner) = start_up(dir.path(), port, &["--tls"]);
    let tls_dir = dir.path().join("tls");
    assert!(banner.contains(&format!("TERN_TLS_DIR={}", tls_dir.display())), "the banner names the TLS dir:\n{banner}");
    // Spark's defaults name the TLS dir too, and no master (no scheduler runs).
    let spark = dir.path().join("spark");
    assert!(banner.contains(&format!("export SPARK_CONF_DIR={}", spark.display())), "{banner}");
    let defaults = std::fs::read_to_string(spark.join("spark-defaults.conf")).unwrap();
    let tls_key = format!("spark.tern.tlsDir {}", tls_dir.display());
    let keys: Vec<String> = defaults.lines().map(|l| l.split_whitespace().collect::<Vec<_>>().join(" ")).collect();
    assert!(keys.contains(&tls_key) && !defaults.contains("spark.master"), "{defaults}");
    let addr = format!("127.0.0.1:{port}");
    let options = tern_client::ClientOptions {
        transport: tern_client::TransportKind::Quic,
        tls_dir: Some(tls_dir.clone()),
        ..Default::default()
    };
    let client = tern_client::Client::connect_with(&addr, options).await.unwrap();
    client.put("/tls", Bytes::from_static(b"over TLS and QUIC")).await.unwrap();
    assert_eq!(client.open("/tls").await.unwrap().read_to_end().await.unwrap(), b"over TLS and QUIC");
    let plain = tern_client::ClientOptions { connect_timeout: Duration::from_secs(3), ..Default::default() };
    let plain = tern_client::Client::connect_with(&addr, plain).await;
    assert!(plain.is_err() || plain.unwrap().status().await.is_err(), "a plain client was served");
    let ca = std::fs::read(tls_dir.join("ca.pem")).unwrap();
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(up.id() as libc::pid_t, libc::SIGINT);
    }
    assert!(up.wait().unwrap().success());

    // A second start reuses the CA.
    let (mut again, _) = start_up(dir.path(), port, &["--tls"]);
    assert_eq!(std::fs::read(tls_dir.join("ca.pem")).unwrap(), ca, "tern up made a new CA on its second start");
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(again.id() as libc::pid_t, libc::SIGINT);
    }
    assert!(again.wait().unwrap().success());
}

/// Each live storage server's NVMe tier capacity, as `tern status` has it (None: no tier).
async fn nvme_tiers(addr: &str) -> Vec<Option<u64>> {
    let client = tern_client::Client::connect(addr).await.unwrap();
    let status = client.status().await.unwrap();
    let live = status.servers.iter().filter(|s| s.alive);
    live.map(|s| s.tiers.iter().find(|t| t.tier == "nvme").map(|t| t.capacity_bytes)).collect()
}

/// `tern up` under test: interrupted (Ctrl-C) when dropped, so a failed assertion leaves no
/// cluster behind.
struct Up(Option<std::process::Child>);

impl Up {
    /// Ctrl-C, and `tern up` exits 0.
    fn interrupt(mut self) {
        let status = stop(self.0.take().expect("running"));
        assert!(status.success(), "tern up exited with {status}");
    }
}

fn stop(mut up: std::process::Child) -> std::process::ExitStatus {
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(up.id() as libc::pid_t, libc::SIGINT);
    }
    up.wait().unwrap()
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Some(up) = self.0.take() {
            stop(up);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_gives_storage_servers_an_nvme_tier_unless_told_not_to() {
    // On the real disk: `auto` leaves the tier out on tmpfs, which takes no O_DIRECT.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let port = tern_local::free_port_range(14).unwrap();
    let (up, banner) = start_up(dir.path(), port, &[]);
    let up = Up(Some(up));
    let tiers = nvme_tiers(&format!("127.0.0.1:{port}")).await;
    assert_eq!(tiers.len(), 2, "{banner}");
    let size = tiers[0].expect("an NVMe tier by default");
    assert!((64 << 20..=2 << 30).contains(&size) && size % (1 << 20) == 0, "{size} bytes");
    assert_eq!(tiers, vec![Some(size); 2]);
    up.interrupt();
    // Started again on the same directory, the tiers keep their files and size.
    let port = tern_local::free_port_range(14).unwrap();
    let up = Up(Some(start_up(dir.path(), port, &[]).0));
    assert_eq!(nvme_tiers(&format!("127.0.0.1:{port}")).await, vec![Some(size); 2]);
    up.interrupt();

    let other = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let port = tern_local::free_port_range(14).unwrap();
    let up = Up(Some(start_up(other.path(), port, &["--nvme-size", "off"]).0));
    assert_eq!(nvme_tiers(&format!("127.0.0.1:{port}")).await, vec![None, None]);
    up.interrupt();
    let out = Command::new(common::TERN).args(["up", "--nvme-size", "lots"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("auto, or off"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `tern up`'s `DIR/daemons.json`: how each of its daemons stands.
fn daemons_file(dir: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("daemons.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Daemon `name`'s entry in `DIR/daemons.json`.
fn daemon_entry(dir: &std::path::Path, name: &str) -> serde_json::Value {
    let file = daemons_file(dir);
    let found = file["daemons"].as_array().unwrap().iter().find(|d| d["name"] == name).cloned();
    found.unwrap_or_else(|| panic!("no {name} in {file:#}"))
}

/// Polls `check` every 100 ms until it holds, for at most `timeout`.
async fn wait_until(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every file under `dir` but the lock, with its length and modification time: what a refused
/// `tern up` must leave as it was.
fn snapshot(dir: &std::path::Path) -> Vec<(std::path::PathBuf, u64, std::time::SystemTime)> {
    let mut files = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(at) = todo.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let entry = entry.unwrap();
            let meta = entry.metadata().unwrap();
            if meta.is_dir() {
                todo.push(entry.path());
            } else if entry.file_name() != "LOCK" {
                files.push((entry.path(), meta.len(), meta.modified().unwrap()));
            }
        }
    }
    files.sort();
    files
}

/// `tern up` run to its end with `args`, killed if it runs past `timeout`; its output and how
/// long it ran.
fn up_refused(args: &[&str], timeout: Duration) -> (std::process::Output, Duration) {
    let started = Instant::now();
    let mut child = Command::new(common::TERN)
        .arg("up")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > timeout {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("tern up {args:?} still ran after {timeout:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    (child.wait_with_output().unwrap(), started.elapsed())
}

const TWO_COPIES: tern_client::CreateOptions =
    tern_client::CreateOptions { class: tern_client::StorageClass::Any, replicas: 2 };

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_restarts_a_killed_storage_server_and_a_two_copy_file_stays_readable() {
    let (dir, out) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let port = tern_local::free_port_range(14).unwrap();
    let stderr_path = out.path().join("up.stderr");
    let stderr = std::fs::File::create(&stderr_path).unwrap();
    let (up, banner) = start_up_with_stderr(dir.path(), port, &[], stderr);
    let mut up = Up(Some(up));
    assert!(banner.contains("restarted") && banner.contains("daemons.json"), "the banner says so:\n{banner}");
    let client = tern_client::Client::connect(&format!("127.0.0.1:{port}")).await.unwrap();
    let data = Bytes::from(common::random_bytes((3 << 20) + 123));
    client.put_with_options("/two", data.clone(), TWO_COPIES).await.unwrap();
    let before = daemon_entry(dir.path(), "storage-0");
    assert_eq!((before["state"].as_str(), before["restarts"].as_u64()), (Some("running"), Some(0)), "{before}");
    let pid = before["pid"].as_u64().unwrap();

    // SAFETY: kill(2) on a daemon of our own `tern up`, by the pid it reported.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
    // Readable from the other copy while the victim is down or just back.
    assert_eq!(client.open("/two").await.unwrap().read_to_end().await.unwrap(), data);
    let dir_path = dir.path().to_path_buf();
    wait_until("storage-0 to be restarted", Duration::from_secs(30), || {
        let now = daemon_entry(&dir_path, "storage-0");
        now["state"] == "running" && now["restarts"] == 1 && now["pid"].as_u64() != Some(pid)
    })
    .await;
    wait_until("both storage servers to be alive", Duration::from_secs(30), || live_storage_servers(port) == 2).await;
    // The cluster still serves: the old file, and a new two-copy one, which needs both servers
    // (tried again, under a new name each time, until the metadata server has seen the restarted
    // one register).
    assert_eq!(client.open("/two").await.unwrap().read_to_end().await.unwrap(), data);
    let more = Bytes::from(common::random_bytes((2 << 20) + 7));
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut attempt = 0;
    let path = loop {
        let path = format!("/two-after-{attempt}");
        match client.put_with_options(&path, more.clone(), TWO_COPIES).await {
            Ok(_) => break path,
            Err(e) if Instant::now() < deadline => println!("put {path}: {e}; trying again"),
            Err(e) => panic!("no two-copy put within 30 s of the restart: {e}"),
        }
        attempt += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(client.open(&path).await.unwrap().read_to_end().await.unwrap(), more);
    assert!(up.0.as_mut().unwrap().try_wait().unwrap().is_none(), "tern up stopped the cluster");
    for other in ["metadata", "storage-1"] {
        assert_eq!(daemon_entry(dir.path(), other)["restarts"], 0, "{other} was restarted too");
    }
    let said = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(said.contains("storage-0 exited unexpectedly (signal: 9 (SIGKILL)); restart 1 in 500ms"), "{said}");
    assert!(said.contains("storage-0 restarted (restart 1, pid"), "{said}");
    assert!(!said.contains("stopping the cluster"), "{said}");
    up.interrupt();
    assert!(!dir.path().join("daemons.json").exists(), "nothing runs: the daemons file goes");
}

/// `tern up --metadata-replicas 3 --tls`: three metadata servers replicating over Raft on mutual
/// TLS, which the storage servers and clients are given as one list. The leader is SIGKILLed: the
/// cluster keeps serving (the file written before reads back, a new one is written), and `tern
/// up` restarts the killed replica while the others keep running. (The replicated tests in
/// `replicated_metadata` run plain gRPC.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_three_metadata_replicas_serves_through_the_leaders_death() {
    let dir = tempfile::tempdir().unwrap();
    let port = tern_local::free_port_range(20).unwrap();
    let (up, banner) = start_up(dir.path(), port, &["--metadata-replicas", "3", "--tls"]);
    let mut up = Up(Some(up));
    assert!(banner.contains("3 metadata replicas (Raft)"), "{banner}");
    let list = banner
        .lines()
        .find_map(|line| line.trim().strip_prefix("export TERN_METADATA="))
        .unwrap_or_else(|| panic!("the banner exports the replicas' list:\n{banner}"))
        .to_string();
    let addrs: Vec<&str> = list.split(',').collect();
    assert_eq!(addrs.len(), 3, "{list}");
    assert_eq!(addrs[0], format!("127.0.0.1:{port}"), "replica 1 is on --port");
    let tls_dir = dir.path().join("tls");
    let options = tern_client::ClientOptions { tls_dir: Some(tls_dir.clone()), ..Default::default() };
    let client = tern_client::Client::connect_with(&list, options).await.unwrap();
    let data = Bytes::from(common::random_bytes((3 << 20) + 5));
    client.put("/kept", data.clone()).await.unwrap();

    let addrs: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
    let tls = tern_transport::tls::TlsMaterial::load(&tls_dir).unwrap();
    let leader = crate::replicated_metadata::leader(&addrs, &[0, 1, 2], Some(&tls)).await;
    let name = format!("metadata-{}", leader + 1);
    let pid = daemon_entry(dir.path(), &name)["pid"].as_u64().unwrap();
    // SAFETY: kill(2) on a daemon of our own `tern up`, by the pid it reported.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let back = loop {
        match async { client.open("/kept").await?.read_to_end().await }.await {
            Ok(back) => break back,
            Err(e) if Instant::now() < deadline => println!("reading /kept after the leader's death: {e}"),
            Err(e) => panic!("/kept unreadable 30 s after the leader's death: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(back, data);
    let more = Bytes::from(common::random_bytes((1 << 20) + 9));
    let mut attempt = 0;
    let path = loop {
        let path = format!("/after-{attempt}");
        match client.put(&path, more.clone()).await {
            Ok(_) => break path,
            Err(e) if Instant::now() < deadline => println!("put {path}: {e}; trying again"),
            Err(e) => panic!("no put within 30 s of the leader's death: {e}"),
        }
        attempt += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(client.open(&path).await.unwrap().read_to_end().await.unwrap(), more);
    let dir_path = dir.path().to_path_buf();
    wait_until("the killed replica to be restarted", Duration::from_secs(30), || {
        let now = daemon_entry(&dir_path, &name);
        now["state"] == "running" && now["restarts"] == 1
    })
    .await;
    for other in (1..=3).map(|k| format!("metadata-{k}")).filter(|other| *other != name) {
        assert_eq!(daemon_entry(dir.path(), &other)["restarts"], 0, "{other} was restarted too");
    }
    assert!(up.0.as_mut().unwrap().try_wait().unwrap().is_none(), "tern up stopped the cluster");
    up.interrupt();
}

/// `--metadata-replicas` is 1, 3 or 5, and not on a directory that holds
/// the state of another count: each refused in one line before anything is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_refuses_metadata_replicas_it_cannot_start() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let (out, _) = up_refused(&["--dir", d, "--metadata-replicas", "2"], Duration::from_secs(10));
    assert!(String::from_utf8_lossy(&out.stderr).contains("give 1, 3 or 5"), "{out:?}");
    std::fs::create_dir(dir.path().join("metadata")).unwrap();
    let before = snapshot(dir.path());
    let port = tern_local::free_port_range(20).unwrap().to_string();
    let (out, _) = up_refused(&["--dir", d, "--port", &port, "--metadata-replicas", "3"], Duration::from_secs(10));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains("holds the state of a single metadata server"), "{said}");
    assert_eq!(snapshot(dir.path()), before, "a refused start writes nothing");
    // Three replicas' state, and five asked for: the membership cannot change yet.
    std::fs::remove_dir(dir.path().join("metadata")).unwrap();
    for k in 1..=3 {
        std::fs::create_dir(dir.path().join(format!("metadata-{k}"))).unwrap();
    }
    let (out, _) = up_refused(&["--dir", d, "--port", &port, "--metadata-replicas", "5"], Duration::from_secs(10));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("holds the state of 3 metadata replicas") && said.contains("give --metadata-replicas 3"),
        "{said}"
    );
}

/// Live storage servers, as `tern status` counts them (a blocking call, for `wait_until`).
fn live_storage_servers(port: u16) -> usize {
    let out = Command::new(common::TERN)
        .args(["status", "--json", "--metadata", &format!("127.0.0.1:{port}")])
        .output()
        .unwrap();
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    status["servers"].as_array().map_or(0, |servers| servers.iter().filter(|s| s["alive"] == true).count())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_exit_on_failure_stops_the_cluster_when_a_daemon_dies() {
    let dir = tempfile::tempdir().unwrap();
    let port = tern_local::free_port_range(14).unwrap();
    let (up, banner) = start_up(dir.path(), port, &["--exit-on-failure"]);
    let mut up = Up(Some(up));
    assert!(banner.contains("--exit-on-failure"), "{banner}");
    let pid = daemon_entry(dir.path(), "storage-1")["pid"].as_u64().unwrap();
    // SAFETY: kill(2) on a daemon of our own `tern up`, by the pid it reported.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
    let mut child = up.0.take().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "tern up --exit-on-failure kept running after a daemon died");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(!status.success(), "tern up exited with {status}");
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "the metadata server was stopped too");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_storage_server_is_not_restarted_and_the_rest_keep_running() {
    let (dir, out) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let port = tern_local::free_port_range(14).unwrap();
    let stderr_path = out.path().join("up.stderr");
    let (up, _) = start_up_with_stderr(dir.path(), port, &[], std::fs::File::create(&stderr_path).unwrap());
    let mut up = Up(Some(up));
    let metadata = format!("127.0.0.1:{port}");
    let storage_1 = format!("127.0.0.1:{}", port + 12);
    let drained = Command::new(common::TERN)
        .args(["admin", "drain", &storage_1, "--wait", "--timeout", "30s", "--metadata", &metadata])
        .arg("--as")
        .arg(dir.path().join("credentials/admin"))
        .output()
        .unwrap();
    assert!(drained.status.success(), "drain --wait: {}", String::from_utf8_lossy(&drained.stderr));
    let dir_path = dir.path().to_path_buf();
    wait_until("storage-1 to exit", Duration::from_secs(30), || {
        daemon_entry(&dir_path, "storage-1")["state"] == "stopped"
    })
    .await;
    // Longer than the first restart's pause: it stays stopped.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let entry = daemon_entry(dir.path(), "storage-1");
    assert_eq!((entry["state"].as_str(), entry["restarts"].as_u64()), (Some("stopped"), Some(0)), "{entry}");
    assert!(up.0.as_mut().unwrap().try_wait().unwrap().is_none(), "tern up stopped the cluster");
    let client = tern_client::Client::connect(&metadata).await.unwrap();
    client.put("/after-drain", Bytes::from_static(b"still served")).await.unwrap();
    assert_eq!(client.open("/after-drain").await.unwrap().read_to_end().await.unwrap(), b"still served");
    let said = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(said.contains("storage-1 exited cleanly") && said.contains("not restarted"), "{said}");
    assert!(!said.contains("storage-1 restarted"), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_up_on_a_live_dir_touches_none_of_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let port = tern_local::free_port_range(14).unwrap();
    let up = Up(Some(start_up(dir.path(), port, &[]).0));
    let log = dir.path().join("logs/metadata.log");
    let spark = dir.path().join("spark/spark-defaults.conf");
    let (log_before, spark_before) = (std::fs::read(&log).unwrap(), std::fs::read_to_string(&spark).unwrap());
    assert!(!log_before.is_empty() && spark_before.contains(&port.to_string()), "{spark_before}");

    let other = tern_local::free_port_range(14).unwrap();
    let (out, _) = up_refused(
        &["--dir", dir.path().to_str().unwrap(), "--port", &other.to_string(), "--dram", "64MiB"],
        Duration::from_secs(30),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a second tern up ran on a live dir");
    assert!(stderr.contains("in use by another tern up") && stderr.trim().lines().count() == 1, "{stderr}");
    // The running cluster's log goes on from where it was (not cut, not zeroed), and its Spark
    // configuration still names its own port.
    let log_after = std::fs::read(&log).unwrap();
    assert!(log_after.starts_with(&log_before), "metadata.log was rewritten");
    assert_eq!(std::fs::read_to_string(&spark).unwrap(), spark_before);
    let client = tern_client::Client::connect(&format!("127.0.0.1:{port}")).await.unwrap();
    client.put("/still", Bytes::from_static(b"up")).await.unwrap();
    up.interrupt();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_refuses_dram_beyond_this_machines_memory_at_once_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let port = tern_local::free_port_range(14).unwrap();
    let (out, took) = up_refused(
        &["--dir", dir.path().to_str().unwrap(), "--port", &port.to_string(), "--dram", "64TiB"],
        Duration::from_secs(30),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "tern up started 64 TiB of DRAM tiers");
    assert!(took < Duration::from_secs(10), "it took {took:?} to refuse");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(stderr.contains("--dram 64TiB") && stderr.contains("pass --dram"), "{stderr}");
    assert!(!dir.path().join("logs").exists() && !dir.path().join("spark").exists(), "it wrote before refusing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_gives_new_storage_servers_tiers_and_refuses_fewer_or_resized_without_writing() {
    // On the real disk, for NVMe tiers (auto).
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let port = tern_local::free_port_range(14).unwrap();
    let addr = format!("127.0.0.1:{port}");
    let up = Up(Some(start_up(dir.path(), port, &["--storage-servers", "1"]).0));
    let tiers = nvme_tiers(&addr).await;
    let size = tiers[0].expect("an NVMe tier by default");
    up.interrupt();
    // Two servers on a directory one server made: the new one gets a tier of the same size.
    let up = Up(Some(start_up(dir.path(), port, &[]).0));
    assert_eq!(nvme_tiers(&addr).await, vec![Some(size); 2]);
    up.interrupt();

    let before = snapshot(dir.path());
    let (dir_arg, port_arg) = (dir.path().to_str().unwrap(), port.to_string());
    let other = if size == 128 << 20 { "256MiB" } else { "128MiB" };
    for (flags, fix) in [
        (vec!["--storage-servers", "1"], "pass --storage-servers 2"),
        (vec!["--nvme-size", other], "pass --nvme-size auto"),
        (vec!["--nvme-size", "off"], "leave out --nvme-size"),
    ] {
        let mut args = vec!["--dir", dir_arg, "--port", &port_arg, "--dram", "64MiB"];
        args.extend(flags.iter().copied());
        let (out, _) = up_refused(&args, Duration::from_secs(30));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} started");
        assert!(stderr.contains(fix) && stderr.trim().lines().count() == 1, "{flags:?}: {stderr}");
        assert_eq!(snapshot(dir.path()), before, "{flags:?} wrote in the directory before refusing");
    }
}

/// `tern fs stat --json PATH` against the cluster on `port`.
fn stat_json(port: u16, path: &str) -> serde_json::Value {
    let out = Command::new(common::TERN)
        .args(["fs", "stat", "--json", path, "--metadata", &format!("127.0.0.1:{port}")])
        .output()
        .unwrap();
    assert!(out.status.success(), "tern fs stat {path}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_loses_dram_files_and_says_so_and_durable_keeps_every_file() {
    // On the real disk, for NVMe tiers (auto).
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let port = tern_local::free_port_range(14).unwrap();
    let addr = format!("127.0.0.1:{port}");
    let (up, banner) = start_up(dir.path(), port, &[]);
    let up = Up(Some(up));
    assert!(banner.contains("`tern up --durable` every file"), "the banner says how to keep files:\n{banner}");
    let client = tern_client::Client::connect(&addr).await.unwrap();
    let (plain, kept) = (Bytes::from(common::random_bytes(3 << 20)), Bytes::from(common::random_bytes(5000)));
    client.put("/plain", plain).await.unwrap();
    let nvme = tern_client::CreateOptions { class: tern_client::StorageClass::Nvme, replicas: 1 };
    client.put_with_options("/kept", kept.clone(), nvme).await.unwrap();
    up.interrupt();

    // Restarted with --durable: the DRAM file is lost and listed so; the NVMe one reads; a new
    // file of the default class is created as `nvme`.
    let (up, banner) = start_up(dir.path(), port, &["--durable"]);
    let up = Up(Some(up));
    assert!(banner.contains("Restarts: --durable"), "{banner}");
    let client = tern_client::Client::connect(&addr).await.unwrap();
    assert_eq!(stat_json(port, "/plain")["lost_blocks"], 3);
    assert_eq!(stat_json(port, "/kept")["lost_blocks"], 0);
    assert_eq!(client.open("/kept").await.unwrap().read_to_end().await.unwrap(), kept);
    let durable = Bytes::from(common::random_bytes((2 << 20) + 11));
    client.put("/durable", durable.clone()).await.unwrap();
    assert_eq!(stat_json(port, "/durable")["storage_class"], "nvme");
    up.interrupt();

    // Restarted without --durable: the file written under it survives; new files are `any` again.
    let (up, banner) = start_up(dir.path(), port, &[]);
    let up = Up(Some(up));
    assert!(!banner.contains("Restarts: --durable"), "{banner}");
    let client = tern_client::Client::connect(&addr).await.unwrap();
    assert_eq!(client.open("/durable").await.unwrap().read_to_end().await.unwrap(), durable);
    client.put("/after", Bytes::from_static(b"dram first")).await.unwrap();
    assert_eq!(stat_json(port, "/after")["storage_class"], "any");
    let out = Command::new(common::TERN).args(["status", "--json", "--metadata", &addr]).output().unwrap();
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["lost_files"], 1, "only /plain is lost: {status}");
    up.interrupt();

    // --durable with no NVMe tiers is refused at once, before anything is written.
    let other = tempfile::tempdir().unwrap();
    let (out, _) = up_refused(
        &["--dir", other.path().to_str().unwrap(), "--port", &port.to_string(), "--durable", "--nvme-size", "off"],
        Duration::from_secs(30),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.trim().lines().count() == 1, "{stderr}");
    assert!(stderr.contains("--durable keeps files on NVMe tiers") && stderr.contains("--nvme-size auto"), "{stderr}");
    assert_eq!(snapshot(other.path()), vec![], "it wrote before refusing");
}
