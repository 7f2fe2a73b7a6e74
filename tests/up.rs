//! `tern up`: a whole cluster from one command, usable at once, stopped cleanly by Ctrl-C.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_runs_a_cluster_and_ctrl_c_stops_it() {
    let dir = tempfile::tempdir().unwrap();
    let port = tern_bench::cluster::free_port_range(14).unwrap();
    let mut up = Command::new(common::TERN)
        .args(["up", "--dir", dir.path().to_str().unwrap(), "--port", &port.to_string(), "--dram", "64MiB"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr = format!("127.0.0.1:{port}");
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
    assert!(banner.contains(&format!("TERN_METADATA={addr}")), "the banner says how to use it:\n{banner}");
    let client = tern_client::Client::connect(&addr).await.unwrap();
    assert_eq!(client.status().await.unwrap().servers.iter().filter(|s| s.alive).count(), 2);
    client.put("/hello", Bytes::from_static(b"from tern up")).await.unwrap();
    assert_eq!(client.open("/hello").await.unwrap().read_to_end().await.unwrap(), b"from tern up");
    assert!(dir.path().join("logs/metadata.log").exists() && dir.path().join("logs/storage-1.log").exists());

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
