//! Three real `tern metadata-server` processes replicating over Raft (issue 34) on loopback
//! ports, and the Rust client given all three addresses: it follows the leader, and after the
//! leader is killed (SIGKILL) it finds the new one, which has every acknowledged write.

use std::time::{Duration, Instant};

use tern_client::{Client, ErrorKind};

use crate::common::{cluster_secret, free_port, logs_in, spawn_logged};

/// The index of the replica that answers a Status call (the serving leader), within 20 s.
async fn leader(addrs: &[String], alive: &[usize]) -> usize {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        for &i in alive {
            // Lazily: a replica still starting (or killed) refuses connections.
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", addrs[i])).unwrap();
            let mut client = tern_proto::v1::metadata_client::MetadataClient::new(channel.connect_lazy());
            if client.status(tern_proto::v1::StatusRequest {}).await.is_ok() {
                return i;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no leader among {alive:?} within 20 s");
}

/// Retries `call` for up to 20 s while it fails as Unavailable (an election under way).
async fn eventually<T, F: AsyncFnMut() -> tern_client::Result<T>>(what: &str, mut call: F) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match call().await {
            Ok(value) => return value,
            Err(e) if e.kind() == ErrorKind::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_replicas_fail_over_and_the_client_follows_the_leader() {
    let dir = tempfile::tempdir().unwrap();
    let secret = cluster_secret(dir.path());
    let addrs: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let peers = format!(
        "peers=[{}]",
        addrs.iter().enumerate().map(|(i, a)| format!("\"{}={a}\"", i + 1)).collect::<Vec<_>>().join(",")
    );
    let mut daemons = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        let data = dir.path().join(format!("metadata-{}", i + 1)).to_string_lossy().into_owned();
        let node = format!("node_id={}", i + 1);
        let args = ["metadata-server", "--listen", addr, "--dir", &data, "--admin", "127.0.0.1:0", "--set", &peers];
        let mut args: Vec<&str> = args.to_vec();
        args.extend(["--set", &node, "--set", &secret]);
        daemons.push(spawn_logged(dir.path(), &format!("metadata-{}", i + 1), &args));
    }
    let first = leader(&addrs, &[0, 1, 2]).await;
    // A client given a follower first is sent on to the leader.
    let follower = (first + 1) % 3;
    let order = [follower, first, (first + 2) % 3].map(|i| addrs[i].clone()).join(",");
    let client = Client::connect(&order).await.unwrap();
    eventually("mkdir /before", async || client.mkdir("/before", false).await).await;
    eventually("stat /before", async || client.stat("/before").await).await;

    // The leader dies; the same client finds the new one, which has the write.
    daemons[first].kill().unwrap();
    let info = eventually("stat /before after the failover", async || client.stat("/before").await).await;
    assert_eq!(info.kind(), tern_client::EntryKind::Directory, "{info:?}\n{}", logs_in(dir.path()));
    eventually("mkdir /after", async || client.mkdir("/after", false).await).await;
    let others: Vec<usize> = (0..3).filter(|&i| i != first).collect();
    let second = leader(&addrs, &others).await;
    assert_ne!(second, first);
    for daemon in &mut daemons {
        let _ = daemon.kill();
    }
}
