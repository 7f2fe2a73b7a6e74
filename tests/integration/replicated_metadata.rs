//! Three real `tern metadata-server` processes replicating over Raft (issue 34) on loopback
//! ports, and the Rust client and a storage server given all three addresses: they follow the
//! leader, and after the leader is killed (SIGKILL) they find the new one, which has every
//! acknowledged write and counts leases and the storage server's timeout from the failover.

use std::time::{Duration, Instant};

use tern_client::{Client, ErrorKind};

use tern_local::Daemon;
use tern_transport::tls::{grpc_endpoint, TlsMaterial};

use crate::common::{cluster_secret, free_port, logs_in, spawn_logged};

/// The index of the replica that answers a Status call (the serving leader), within 20 s; over
/// mutual TLS with `tls`.
pub(crate) async fn leader(addrs: &[String], alive: &[usize], tls: Option<&TlsMaterial>) -> usize {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        for &i in alive {
            // Lazily: a replica still starting (or killed) refuses connections.
            let channel = grpc_endpoint(&addrs[i], tls).unwrap();
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

/// Three metadata replicas in `dir`, each with `settings` (`key=value`); their addresses and
/// processes.
fn start_replicas(dir: &std::path::Path, secret: &str, settings: &[&str]) -> (Vec<String>, Vec<Daemon>) {
    let addrs: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let daemons = (1..=3).map(|id| start_replica(dir, secret, id, &addrs, settings)).collect();
    (addrs, daemons)
}

/// Replica `id` (1-based) of the replicas at `addrs` (its peers), with `settings`.
fn start_replica(dir: &std::path::Path, secret: &str, id: usize, addrs: &[String], settings: &[&str]) -> Daemon {
    let peers = format!(
        "peers=[{}]",
        addrs.iter().enumerate().map(|(i, a)| format!("\"{}={a}\"", i + 1)).collect::<Vec<_>>().join(",")
    );
    let data = dir.join(format!("metadata-{id}")).to_string_lossy().into_owned();
    let node = format!("node_id={id}");
    let addr = &addrs[id - 1];
    let args = ["metadata-server", "--listen", addr, "--dir", &data, "--admin", "127.0.0.1:0", "--set", &peers];
    let mut args: Vec<&str> = args.to_vec();
    args.extend(["--set", &node, "--set", secret]);
    for setting in settings {
        args.extend(["--set", setting]);
    }
    spawn_logged(dir, &format!("metadata-{id}"), &args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_replicas_fail_over_and_the_client_follows_the_leader() {
    let dir = tempfile::tempdir().unwrap();
    let secret = cluster_secret(dir.path());
    let (addrs, mut daemons) = start_replicas(dir.path(), &secret, &[]);
    let first = leader(&addrs, &[0, 1, 2], None).await;
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
    let second = leader(&addrs, &others, None).await;
    assert_ne!(second, first);
    for daemon in &mut daemons {
        let _ = daemon.kill();
    }
}

/// A storage server and a job across a failover. The storage server is given every replica's
/// address and heartbeats to the leader; a job (3 s lease, renewed in the background) writes a
/// file there. For longer than the lease and the server timeout the renewals and heartbeats go to
/// the leader only (neither is logged), then the leader is SIGKILLed. The new leader keeps the job
/// (its lease counts from the failover), asks the storage server to register again instead of
/// declaring it dead, and takes its inventory: the file reads back, and a new one is written to the
/// same server, which never exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storage_server_and_a_job_follow_the_leader_across_a_failover() {
    let dir = tempfile::tempdir().unwrap();
    let secret = cluster_secret(dir.path());
    let (addrs, mut daemons) =
        start_replicas(dir.path(), &secret, &["heartbeat_interval_ms=200", "server_timeout_ms=2000"]);
    let first = leader(&addrs, &[0, 1, 2], None).await;
    let all = addrs.join(",");
    let block = format!("127.0.0.1:{}", free_port());
    let args = ["storage-server", "--metadata", &all, "--listen", &block, "--admin", "127.0.0.1:0"];
    let mut args = args.to_vec();
    args.extend(["--dram", "64MiB", "--set", &secret]);
    let mut storage = spawn_logged(dir.path(), "storage", &args);
    let logs = || logs_in(dir.path());

    let client = Client::connect(&all).await.unwrap();
    let alive = async || {
        let status = client.status().await.ok()?;
        status.servers.iter().any(|s| s.address == block && s.state == "alive").then_some(())
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while alive().await.is_none() {
        assert!(Instant::now() < deadline, "the storage server never came up\n{}", logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let job = client.start_job(None, Duration::from_secs(3)).await.unwrap();
    let data: Vec<u8> = (0..(3u32 << 20)).map(|i| (i % 251) as u8).collect();
    let before = format!("{}/before", job.root());
    let mut writer = client.create(&before, false).await.unwrap();
    writer.write(&data).await.unwrap();
    writer.close().await.unwrap();
    // Past the lease and the server timeout, on the leader only.
    tokio::time::sleep(Duration::from_secs(4)).await;

    daemons[first].kill().unwrap();
    let back =
        eventually("reading the file after the failover", async || client.open(&before).await?.read_to_end().await)
            .await;
    assert!(back == data, "the file read back after the failover differs\n{}", logs());
    let deadline = Instant::now() + Duration::from_secs(20);
    while alive().await.is_none() {
        assert!(Instant::now() < deadline, "the storage server is not alive on the new leader\n{}", logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = format!("{}/after", job.root());
    eventually("writing a file after the failover", async || {
        let mut writer = client.create(&after, false).await?;
        writer.write(&data[..1 << 20]).await?;
        writer.close().await
    })
    .await;
    let back = client.open(&after).await.unwrap().read_to_end().await.unwrap();
    assert!(back == data[..1 << 20], "the file written after the failover reads back different");
    let status = client.status().await.unwrap();
    assert!(status.jobs.iter().any(|j| j.job_id == job.id()), "the job outlived the failover:\n{}", logs());
    let dead: Vec<_> = status.servers.iter().filter(|s| !s.alive).collect();
    assert!(dead.is_empty(), "no server declared dead: {dead:?}\n{}", logs());
    assert!(storage.try_wait().unwrap().is_none(), "the storage server exited\n{}", logs());
    let _ = job.end().await;
    let _ = storage.kill();
    for daemon in &mut daemons {
        let _ = daemon.kill();
    }
}

/// `tern admin metadata ARGS` against `addrs`, as the operator (`DIR/credentials/admin`, which
/// `tern cert secret` wrote) or as the default tenant's client.
fn admin_metadata(dir: &std::path::Path, addrs: &str, operator: bool, args: &[&str]) -> std::process::Output {
    let mut command = std::process::Command::new(crate::common::TERN);
    command.args(["admin", "--metadata", addrs]);
    if operator {
        command.arg("--as").arg(dir.join("credentials/admin"));
    }
    command.args(["metadata"]).args(args).output().unwrap()
}

/// The members `tern admin metadata members --json` lists: (id, voter, leader) each.
fn members(dir: &std::path::Path, addrs: &str) -> Vec<(u64, bool, bool)> {
    let out = admin_metadata(dir, addrs, false, &["members", "--json"]);
    assert!(out.status.success(), "members: {}", String::from_utf8_lossy(&out.stderr));
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer["replicated"], true, "{answer}");
    let members = answer["members"].as_array().unwrap().iter();
    members.map(|m| (m["id"].as_u64().unwrap(), m["voter"] == true, m["leader"] == true)).collect()
}

/// Membership, one change at a time over the control plane: anyone may list the members, only
/// the operator may change them; a fourth server added catches up and votes (the service keeps
/// its majority through two of the first three gone), and removing the leader itself moves the
/// leadership; nothing written before is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_are_added_and_removed_one_at_a_time_by_the_operator_only() {
    let dir = tempfile::tempdir().unwrap();
    let secret = cluster_secret(dir.path());
    let addrs: Vec<String> = (0..4).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let mut daemons: Vec<Daemon> = (1..=3).map(|id| start_replica(dir.path(), &secret, id, &addrs[..3], &[])).collect();
    let first = leader(&addrs[..3], &[0, 1, 2], None).await;
    let all = addrs.join(",");
    let logs = || logs_in(dir.path());
    let client = Client::connect(&all).await.unwrap();
    eventually("mkdir /before", async || client.mkdir("/before", false).await).await;
    let three = members(dir.path(), &all);
    assert_eq!(three.len(), 3, "{three:?}");
    assert!(three.iter().all(|&(_, voter, _)| voter), "{three:?}");
    assert_eq!(three.iter().filter(|&&(_, _, leads)| leads).count(), 1, "{three:?}");

    // The fourth, started with the members and itself as peers; a client may not add it.
    daemons.push(start_replica(dir.path(), &secret, 4, &addrs, &[]));
    let refused = admin_metadata(dir.path(), &all, false, &["add", "4", &addrs[3]]);
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && said.contains("operator"), "a client added a member: {said}");
    let refused = admin_metadata(dir.path(), &all, false, &["remove", "1"]);
    assert!(!refused.status.success(), "a client removed a member");
    assert_eq!(members(dir.path(), &all).len(), 3, "a refused change changed the members");
    let bad = admin_metadata(dir.path(), &all, true, &["add", "4", "nohost"]);
    let said = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && said.contains("not host:port"), "a bad address: {said}");
    let bad = admin_metadata(dir.path(), &all, true, &["remove", "9"]);
    let said = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && said.contains("9 is not a member"), "a stranger removed: {said}");

    let added = admin_metadata(dir.path(), &all, true, &["add", "4", &addrs[3]]);
    assert!(added.status.success(), "add: {}\n{}", String::from_utf8_lossy(&added.stderr), logs());
    let four = members(dir.path(), &all);
    assert_eq!(four.len(), 4, "{four:?}");
    assert!(four.iter().all(|&(_, voter, _)| voter), "the added member does not vote: {four:?}");
    // A retried add is answered, not refused.
    let again = admin_metadata(dir.path(), &all, true, &["add", "4", &addrs[3]]);
    assert!(again.status.success(), "a retried add: {}", String::from_utf8_lossy(&again.stderr));

    // Removing the leader itself: the others elect one among them, and the removed one is stopped.
    let removed = admin_metadata(dir.path(), &all, true, &["remove", &(first + 1).to_string()]);
    assert!(removed.status.success(), "remove: {}\n{}", String::from_utf8_lossy(&removed.stderr), logs());
    daemons[first].kill().unwrap();
    eventually("mkdir /after-remove", async || client.mkdir("/after-remove", false).await).await;
    let left = members(dir.path(), &all);
    assert_eq!(left.len(), 3, "{left:?}");
    assert!(!left.iter().any(|m| m.0 == first as u64 + 1), "the removed member is listed: {left:?}");

    // Of the three voters left, one of the first three is killed: the majority needs the fourth.
    let other = (0..3).find(|&i| i != first).unwrap();
    daemons[other].kill().unwrap();
    eventually("mkdir /on-the-fourth", async || client.mkdir("/on-the-fourth", false).await).await;
    let paths: Vec<String> = client.list("/").await.unwrap().iter().map(|e| e.path.clone()).collect();
    for path in ["/before", "/after-remove", "/on-the-fourth"] {
        assert!(paths.iter().any(|p| p == path), "{path} is missing: {paths:?}\n{}", logs());
    }
    for daemon in &mut daemons {
        let _ = daemon.kill();
    }
}
