//! Replicated metadata across hosts (issue 34): three metadata replicas, each on a host of its own,
//! a storage server and a client on two more, mutual TLS between all of them (Raft included).

use std::path::Path;
use std::time::{Duration, Instant};

use tern_client::{Client, ClientOptions};
use tern_local::{Daemon, DaemonSpec, Network};

use crate::common::multihost::cert_init;
use crate::common::{logs_in, TERN};
use crate::replicated_metadata::leader;
use tern_transport::tls::grpc_endpoint;

const METADATA_PORT: u16 = 9060;
const STORAGE_PORT: u16 = 9070;
const METADATA_HOSTS: [&str; 3] = ["m1", "m2", "m3"];
const STORAGE_HOST: &str = "s1";
const CLIENT_HOST: &str = "client";
/// Three heartbeat intervals (1 s), counted by the new leader from its election (the default is
/// 5 s). A heartbeat stuck on the silent leader gives up after its own deadline (1 s here); a
/// follower that has not heard of the election yet still names the old leader, which costs a
/// heartbeat another such try, and registering again and reporting the inventory take calls of
/// their own: with 2 s the new leader once declared the server dead before it had registered
/// again (2026-12-07, beside a CI run), and registration was seen to end 2.9 s after the lease.
/// What this test proves of heartbeats is that none is lost across the cut.
const SERVER_TIMEOUT_MS: u64 = 3000;
/// The job's lease, renewed every second: a renewal's try of the silent leader once waited out
/// the client's 30 s request timeout, and the new leader, counting the lease from its election,
/// ended the job first (this test failed so before renewals had deadlines of their own).
const JOB_LEASE: Duration = Duration::from_secs(3);
/// The first Status after the cut, which has no deadline of its own: a ping unanswered for 2 s
/// (1 s after the last answered one) takes the channel off the cut-off leader, and a connection
/// attempt to it has the client's 5 s connect timeout (7.7 s was seen); anything past that was a
/// try held for the 30 s request timeout.
const FIRST_STATUS: Duration = Duration::from_secs(12);

fn daemon(dir: &Path, name: &str) -> DaemonSpec {
    DaemonSpec::new(name, TERN, dir.join(format!("{name}.log"))).without_tern_env()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// How long after the job's lease the storage server may still be registering with the new
/// leader (it is given five of its 1 s heartbeat deadlines).
const RE_REGISTERED: Duration = Duration::from_secs(5);

/// What the client host asks of the root namespace, where the hosts' links are.
enum Link {
    Cut(usize),
    Heal(usize),
    /// The replica and the other replicas drop what they send each other; everyone else
    /// reaches them all.
    Partition(usize),
    Rejoin(usize),
}

/// Longest from a leader's cut from the other replicas until its own answer says it is not the
/// leader: its lease (1.2 s) and a look at it every quarter lease, with room for a busy machine.
const CUT_OFF_REFUSED: Duration = Duration::from_secs(3);
/// Longest from that cut until the client's write succeeds: the lease, a follower's wait to
/// stand (1.2 s and up to 0.6 s), the pre-vote and the election, the client's tries 0.2 s apart,
/// with room; before, its try on the old leader waited out the 10 s commit deadline and failed.
const WRITE_AFTER_PARTITION: Duration = Duration::from_secs(7);

/// Longest a metadata write may take while a minority replica is cut off or rejoins: far above a
/// write's 2-3 ms here, below the 0.9 s a write waited for the election that a rejoining
/// follower forced on openraft's own timer (this test, before `raft::elect`'s pre-vote).
const NO_PAUSE: Duration = Duration::from_millis(750);

/// Every member a voter and caught up with the leader (its matched index at the leader's last
/// log index), within 10 s; the leader's index.
async fn all_caught_up(client: &Client, logs: &dyn Fn() -> String) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let members = client.metadata_members().await.unwrap();
        let caught_up = |m: &tern_proto::v1::MetadataMember| m.voter && m.matched_index == Some(members.last_log_index);
        if members.members.len() == 3 && members.members.iter().all(caught_up) {
            let leader = members.members.iter().find(|m| m.leader).expect("the answering replica leads");
            return (leader.id - 1) as usize;
        }
        assert!(Instant::now() < deadline, "the members did not catch up: {members:?}\n{}", logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Metadata writes (directories under `root`) one after another for `period`: the slowest one's
/// time.
async fn slowest_of_writes(client: &Client, root: &str, period: Duration) -> Duration {
    let mut slowest = Duration::ZERO;
    let end = Instant::now() + period;
    for i in 0.. {
        let started = Instant::now();
        if started > end {
            break;
        }
        client.mkdir(&format!("{root}/{i}"), true).await.unwrap();
        slowest = slowest.max(started.elapsed());
    }
    slowest
}

/// The leader's host is cut off (its packets vanish; nothing is refused). The client, renewing a
/// job's 3 s lease every second, and the storage server, heartbeating every second, give up on
/// each silent try after the call's own deadline and find the new leader through the others: the
/// job lives on, no replica that stayed connected declares the server dead, the file written
/// before the cut reads back, and a new one is written. Healed, the old leader rejoins as a
/// follower whose log matches the new leader's. Then a follower is cut off and healed while the
/// client writes: no write waits for an election, and the follower catches up. Last, the leader
/// is cut off from the other replicas only: it refuses as not the leader within its lease, the
/// client's write goes to the new leader, and rejoined, the old leader follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_and_a_storage_server_live_on_when_the_leaders_packets_vanish() {
    let mut hosts = METADATA_HOSTS.to_vec();
    hosts.extend([STORAGE_HOST, CLIENT_HOST]);
    let network =
        Network::create(&hosts).unwrap_or_else(|e| panic!("this test needs network namespaces (root): {e:#}"));
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let tls_dir = cert_init(&network, dir.path());
    let tls = tls_dir.to_string_lossy().into_owned();
    let material = tern_transport::tls::TlsMaterial::load(&tls_dir).unwrap();
    let addrs: Vec<String> = METADATA_HOSTS.iter().map(|h| network.host(h).addr(METADATA_PORT).to_string()).collect();
    let peers = format!(
        "peers=[{}]",
        addrs.iter().enumerate().map(|(i, a)| format!("\"{}={a}\"", i + 1)).collect::<Vec<_>>().join(",")
    );
    let timeout = format!("server_timeout_ms={SERVER_TIMEOUT_MS}");
    let mut daemons: Vec<Daemon> = Vec::new();
    for (i, host) in METADATA_HOSTS.iter().enumerate() {
        let data = dir.path().join(host).to_string_lossy().into_owned();
        let node = format!("node_id={}", i + 1);
        let spec = daemon(dir.path(), host)
            .on(network.host(host).clone())
            .args(["metadata-server", "--listen", &addrs[i], "--dir", &data, "--admin", "127.0.0.1:9072"])
            .args(["--tls-dir", &tls, "--set", &peers, "--set", &node, "--set", &timeout]);
        daemons.push(spec.spawn().unwrap_or_else(|e| panic!("{e:#}")));
    }
    let all = addrs.join(",");
    let block = network.host(STORAGE_HOST).addr(STORAGE_PORT).to_string();
    let storage = daemon(dir.path(), "storage")
        .on(network.host(STORAGE_HOST).clone())
        .args(["storage-server", "--metadata", &all, "--listen", &block, "--admin", "127.0.0.1:9071"])
        .args(["--dram", "64MiB", "--tls-dir", &tls]);
    daemons.push(storage.spawn().unwrap_or_else(|e| panic!("{e:#}")));
    let logs = || logs_in(dir.path());

    let data: Vec<u8> = (0..(3u32 << 20)).map(|i| (i % 251) as u8).collect();
    // The client's calls run on the client host; the cut is made from here, the root namespace
    // (where the hosts' links are), when the client asks for it.
    let (ask, asked) = std::sync::mpsc::channel::<Link>();
    let (done, when_done) = std::sync::mpsc::channel::<()>();
    let link = move |change: Link| {
        ask.send(change).unwrap();
        when_done.recv().unwrap();
    };
    let hosts = &network;
    let first = std::thread::scope(|scope| {
        scope.spawn(move || {
            for change in asked {
                let others = |replica: usize| METADATA_HOSTS.iter().enumerate().filter(move |&(i, _)| i != replica);
                match change {
                    Link::Cut(replica) => hosts.cut(METADATA_HOSTS[replica]).unwrap(),
                    Link::Heal(replica) => hosts.heal(METADATA_HOSTS[replica]).unwrap(),
                    Link::Partition(replica) => {
                        for (_, other) in others(replica) {
                            hosts.block(METADATA_HOSTS[replica], other).unwrap();
                            hosts.block(other, METADATA_HOSTS[replica]).unwrap();
                        }
                    }
                    Link::Rejoin(replica) => {
                        for (_, other) in others(replica) {
                            hosts.unblock(METADATA_HOSTS[replica], other).unwrap();
                            hosts.unblock(other, METADATA_HOSTS[replica]).unwrap();
                        }
                    }
                }
                let _ = done.send(());
            }
        });
        network.on_host(CLIENT_HOST, move || {
            runtime().block_on(async {
                let first = leader(&addrs, &[0, 1, 2], Some(&material)).await;
                let options = ClientOptions { tls_dir: Some(tls_dir.clone()), ..Default::default() };
                let client = Client::connect_with(&all, options).await.unwrap();
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    let status = client.status().await.ok();
                    if status.is_some_and(|s| s.servers.iter().any(|s| s.address == block && s.state == "alive")) {
                        break;
                    }
                    assert!(Instant::now() < deadline, "the storage server never came up\n{}", logs());
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let job = client.start_job(None, JOB_LEASE).await.unwrap();
                let before = format!("{}/before", job.root());
                let mut writer = client.create(&before, false).await.unwrap();
                writer.write(&data).await.unwrap();
                writer.close().await.unwrap();

                link(Link::Cut(first));
                let others: Vec<usize> = (0..3).filter(|&i| i != first).collect();
                leader(&addrs, &others, Some(&material)).await;
                // The new leader counts the lease and the server timeout from its election, which
                // a follower holds off until its leader's lease lapsed: wait a whole lease and
                // more after it serves. The job's lease is renewed in the background all along,
                // through the same client.
                let settled = Instant::now() + JOB_LEASE + Duration::from_secs(1);
                tokio::time::sleep_until(settled.into()).await;
                // A call with no deadline of its own: it took the client's whole 30 s request
                // timeout on the cut-off leader in about one run in two, until the failover
                // channel pinged its connections (`failover::KEEP_ALIVE_TIMEOUT`).
                let asked = Instant::now();
                let status = tokio::time::timeout(FIRST_STATUS, client.status()).await;
                let status =
                    status.unwrap_or_else(|_| panic!("Status took past {FIRST_STATUS:?}\n{}", logs())).unwrap();
                eprintln!("the first Status after the cut took {:?}", asked.elapsed());
                assert!(status.jobs.iter().any(|j| j.job_id == job.id()), "the job's lease lapsed:\n{}", logs());
                // Alive on the new leader once it has registered again and its inventory is in.
                // Usually by now; about one run in ten it was still registering here (0.1-0.4 s
                // more; not yet understood, and the replicas' logs below say none declared it
                // dead), so it is given RE_REGISTERED more and the time it took is printed.
                let deadline = Instant::now() + RE_REGISTERED;
                loop {
                    // Bounded, so a Status stuck on the cut-off leader fails here rather than
                    // waiting out the client's 30 s request timeout.
                    let status = tokio::time::timeout_at(deadline.into(), client.status()).await;
                    let status = status.unwrap_or_else(|_| panic!("Status took past {RE_REGISTERED:?}\n{}", logs()));
                    let status = status.unwrap();
                    let server =
                        status.servers.iter().find(|s| s.address == block).expect("the storage server is known");
                    if server.alive {
                        eprintln!(
                            "the storage server is alive on the new leader {:?} after the lease",
                            settled.elapsed()
                        );
                        break;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "the storage server is not alive on the new leader: {server:?}\n{}",
                        logs()
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let back = client.open(&before).await.unwrap().read_to_end().await.unwrap();
                assert!(back == data, "the file read back after the cut differs\n{}", logs());
                let after = format!("{}/after", job.root());
                let mut writer = client.create(&after, false).await.unwrap();
                writer.write(&data[..1 << 20]).await.unwrap();
                writer.close().await.unwrap();

                // Healed, the old leader follows: it catches up to the new leader's log (Raft's
                // log matching: equal at the last index, equal before it) and leads no more.
                link(Link::Heal(first));
                let leads = all_caught_up(&client, &logs).await;
                assert_ne!(leads, first, "the old leader leads again after the heal\n{}", logs());
                let mut old = tern_proto::v1::metadata_client::MetadataClient::new(
                    grpc_endpoint(&addrs[first], Some(&material)).unwrap().connect_lazy(),
                );
                let refused = old.status(tern_proto::v1::StatusRequest {}).await.unwrap_err();
                assert!(refused.message().contains("not the leader"), "the old leader: {refused:?}");

                // A follower cut off and healed while the client writes: no pause. Cut off for
                // longer than its election timeouts (1.2 s and 0-0.6 s), so it would have stood
                // for election more than once on openraft's own timer.
                let follower = (0..3).find(|&i| i != leads).unwrap();
                let term = client.metadata_members().await.unwrap().term;
                link(Link::Cut(follower));
                let cut = slowest_of_writes(&client, &format!("{}/cut", job.root()), Duration::from_secs(5)).await;
                link(Link::Heal(follower));
                let healed =
                    slowest_of_writes(&client, &format!("{}/healed", job.root()), Duration::from_secs(3)).await;
                eprintln!("slowest write with a follower cut off: {cut:?}; after it rejoined: {healed:?}");
                assert!(cut < NO_PAUSE && healed < NO_PAUSE, "a write paused: {cut:?}, {healed:?}\n{}", logs());
                assert_eq!(all_caught_up(&client, &logs).await, leads, "the leadership moved\n{}", logs());
                let now = client.metadata_members().await.unwrap().term;
                assert_eq!(now, term, "a new term began while a follower was cut off and healed\n{}", logs());

                // The leader cut off from the other replicas but not from its clients: once its
                // lease has passed it answers as not the leader (it cannot commit nor confirm a
                // read), the client's calls move to the leader the majority elects, and healed,
                // the old leader follows with the new leader's log.
                link(Link::Partition(leads));
                let cut = Instant::now();
                let mut partitioned = tern_proto::v1::metadata_client::MetadataClient::new(
                    grpc_endpoint(&addrs[leads], Some(&material)).unwrap().connect_lazy(),
                );
                let refused = partitioned.status(tern_proto::v1::StatusRequest {}).await.unwrap_err();
                let refused_after = cut.elapsed();
                assert!(
                    refused.message().contains("not the leader") && refused_after < CUT_OFF_REFUSED,
                    "the cut-off leader after {refused_after:?}: {refused:?}\n{}",
                    logs()
                );
                client.mkdir(&format!("{}/partitioned", job.root()), true).await.unwrap();
                let written_after = cut.elapsed();
                eprintln!(
                    "leader cut off from the replicas: it refused after {refused_after:?}; the client wrote after \
                     {written_after:?}"
                );
                assert!(written_after < WRITE_AFTER_PARTITION, "the write took {written_after:?}\n{}", logs());
                link(Link::Rejoin(leads));
                let new = all_caught_up(&client, &logs).await;
                assert_ne!(new, leads, "the cut-off leader leads again after it rejoined\n{}", logs());
                assert!(client.stat(&format!("{}/partitioned", job.root())).await.is_ok());
                job.end().await.unwrap();
                first
            })
        })
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs()));
    let others: Vec<usize> = (0..3).filter(|&i| i != first).collect();
    for &i in &others {
        let log = std::fs::read_to_string(dir.path().join(format!("{}.log", METADATA_HOSTS[i]))).unwrap();
        assert!(
            !log.contains("its blocks are lost"),
            "replica {} declared the storage server dead after the leader was cut off:\n{}",
            METADATA_HOSTS[i],
            logs()
        );
    }
    for daemon in &mut daemons {
        let _ = daemon.kill();
    }
}
