//! `tern up`: a whole cluster from one command, usable at once, stopped cleanly by Ctrl-C.

// kill(2): Ctrl-C to the `tern up` under test.
#![allow(unsafe_code)]

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;

/// Starts `tern up` with `extra` flags and waits for its banner.
fn start_up(dir: &std::path::Path, port: u16, extra: &[&str]) -> (std::process::Child, String) {
    let mut up = Command::new(common::TERN)
        .args(["up", "--dir", dir.to_str().unwrap(), "--port", &port.to_string(), "--dram", "64MiB"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
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
