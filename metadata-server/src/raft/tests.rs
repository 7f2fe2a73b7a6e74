//! Three real metadata servers in one process, on loopback ports, replicating through the Raft
//! gRPC service: failover, a token across it, the follower's refusal, a restarted replica.

use std::time::Duration;

use tern_common::config::Serve;
use tern_proto::request_id::{RequestId, REQUEST_ID_HEADER};
use tern_proto::v1::metadata_client::MetadataClient;
use tern_proto::v1::*;
use tern_proto::ErrorKind;
use tonic::transport::Channel;

use crate::config::Config;
use crate::server::{start, MetadataServer};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn configs(dir: &std::path::Path) -> Vec<Config> {
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let peers: Vec<String> = ports.iter().enumerate().map(|(i, p)| format!("{}=127.0.0.1:{p}", i + 1)).collect();
    let secret = dir.join("cluster.secret");
    tern_proto::identity::ClusterSecret::generate().write_new(&secret).unwrap();
    (0..3)
        .map(|i| Config {
            serve: Serve::on_loopback(ports[i], 0),
            dir: dir.join(format!("m{}", i + 1)),
            peers: peers.clone(),
            node_id: i as u64 + 1,
            cluster_secret_file: Some(secret.clone()),
            ..Config::default()
        })
        .collect()
}

async fn client(config: &Config) -> MetadataClient<Channel> {
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", config.serve.listen)).unwrap().connect_lazy();
    MetadataClient::new(channel)
}

/// Polls the servers `alive` (indexes into `configs`) until one answers a status call; its index.
async fn leader(configs: &[Config], alive: &[usize]) -> usize {
    for _ in 0..300 {
        for &i in alive {
            if client(&configs[i]).await.status(StatusRequest {}).await.is_ok() {
                return i;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no leader among {alive:?} within 15 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_fail_over_keep_tokens_and_catch_up() {
    let temp = tempfile::tempdir().unwrap();
    let configs = configs(temp.path());
    let mut servers: Vec<Option<MetadataServer>> = Vec::new();
    for config in &configs {
        servers.push(Some(start(config.clone()).await.unwrap()));
    }
    let first = leader(&configs, &[0, 1, 2]).await;
    let mut leader_client = client(&configs[first]).await;
    leader_client.mkdir(MkdirRequest { path: "/before".into(), parents: false, ..Default::default() }).await.unwrap();
    let job = RegisterJobRequest { name: "j".into(), lease_ms: 60_000, ..Default::default() };
    let token = leader_client.register_job(job).await.unwrap().into_inner().token;

    // A follower refuses, naming the leader's address.
    let follower = (first + 1) % 3;
    // (It learns who leads from the leader's first heartbeat: until then it says none is known.)
    let mut refused = None;
    for _ in 0..100 {
        let status = client(&configs[follower])
            .await
            .mkdir(MkdirRequest { path: "/x".into(), parents: false, ..Default::default() })
            .await
            .unwrap_err();
        let known = status.message().contains("the leader is");
        refused = Some(status);
        if known {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let refused = refused.unwrap();
    assert_eq!(ErrorKind::of_status(&refused), ErrorKind::Unavailable, "{refused:?}");
    let expected = format!("not the leader; the leader is {}", configs[first].serve.listen);
    assert!(refused.message().contains(&expected), "{}", refused.message());

    // The leader stops; the other two elect one that has the write and verifies the token.
    servers[first].take().unwrap().shutdown().await;
    let others: Vec<usize> = (0..3).filter(|&i| i != first).collect();
    let second = leader(&configs, &others).await;
    let mut second_client = client(&configs[second]).await;
    let stat = second_client.stat(StatRequest { path: "/before".into(), ..Default::default() }).await;
    assert!(stat.unwrap().into_inner().info.is_some());
    let renew = RenewJobRequest { job_id: "j".into(), token: token.clone() };
    second_client.renew_job(renew).await.expect("a token issued before the failover verifies after it");
    second_client.mkdir(MkdirRequest { path: "/during".into(), parents: false, ..Default::default() }).await.unwrap();

    // The old leader restarts; the third replica stops, so the next write commits only if the
    // restarted one has the log up to it (Raft's log matching: everything before it too).
    servers[first] = Some(start(configs[first].clone()).await.unwrap());
    let third = (0..3).find(|&i| i != first && i != second).unwrap();
    servers[third].take().unwrap().shutdown().await;
    let after = second_client.mkdir(MkdirRequest { path: "/after".into(), parents: false, ..Default::default() }).await;
    after.expect("a write with the restarted replica as the only other member of the majority");
    for path in ["/before", "/during", "/after"] {
        let stat = second_client.stat(StatRequest { path: path.into(), ..Default::default() }).await;
        assert!(stat.unwrap_or_else(|e| panic!("{path}: {e}")).into_inner().info.is_some(), "{path}");
    }
    for server in servers.into_iter().flatten() {
        server.shutdown().await;
    }
}

/// A replica that was down while the others snapshotted and purged their logs catches up by the
/// snapshot (InstallSnapshot): with it and the leader the only ones up, a write commits, and the
/// state it then serves as leader has everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_behind_the_purged_log_catches_up_by_snapshot() {
    let temp = tempfile::tempdir().unwrap();
    let mut configs = configs(temp.path());
    for config in &mut configs {
        config.raft_snapshot_entries = 10;
    }
    let mut servers: Vec<Option<MetadataServer>> = Vec::new();
    for config in &configs {
        servers.push(Some(start(config.clone()).await.unwrap()));
    }
    let first = leader(&configs, &[0, 1, 2]).await;
    let behind = (first + 1) % 3;
    let other = (first + 2) % 3;
    servers[behind].take().unwrap().shutdown().await;
    let mut leader_client = client(&configs[first]).await;
    for i in 0..60 {
        leader_client
            .mkdir(MkdirRequest { path: format!("/d{i}"), parents: false, ..Default::default() })
            .await
            .unwrap();
    }
    servers[behind] = Some(start(configs[behind].clone()).await.unwrap());
    servers[other].take().unwrap().shutdown().await;
    leader_client
        .mkdir(MkdirRequest { path: "/last".into(), parents: false, ..Default::default() })
        .await
        .expect("committed with the caught-up replica");
    assert!(
        configs[behind].dir.join("raft/snapshot").exists(),
        "the replica that was behind holds an installed snapshot"
    );
    // The leader stops and the other comes back: the caught-up replica or the other leads, and
    // either way every write is there (the other has only what it had before it stopped, so a
    // leader with everything must have got it from the snapshot's holder or be it).
    servers[first].take().unwrap().shutdown().await;
    servers[other] = Some(start(configs[other].clone()).await.unwrap());
    let next = leader(&configs, &[behind, other]).await;
    let mut next_client = client(&configs[next]).await;
    for path in ["/d0", "/d59", "/last"] {
        let stat = next_client.stat(StatRequest { path: path.into(), ..Default::default() }).await;
        assert!(stat.unwrap_or_else(|e| panic!("{path}: {e}")).into_inner().info.is_some(), "{path}");
    }
    for server in servers.into_iter().flatten() {
        server.shutdown().await;
    }
}

/// A change whose answer is lost to a failover, sent again with its request id to the next
/// leader, is answered as the first time (the id and answer were in the committed entry) and not
/// made again: one job, not two.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_change_retried_after_a_failover_is_answered_not_made_again() {
    let temp = tempfile::tempdir().unwrap();
    let configs = configs(temp.path());
    let mut servers: Vec<Option<MetadataServer>> = Vec::new();
    for config in &configs {
        servers.push(Some(start(config.clone()).await.unwrap()));
    }
    let with_id = |id: RequestId| {
        let mut request = tonic::Request::new(RegisterJobRequest::default());
        request.metadata_mut().insert(REQUEST_ID_HEADER, id.to_string().parse().unwrap());
        request
    };
    let id = RequestId::new(0x5eed, 1);
    let first = leader(&configs, &[0, 1, 2]).await;
    let job = client(&configs[first]).await.register_job(with_id(id)).await.unwrap().into_inner();

    servers[first].take().unwrap().shutdown().await;
    let others: Vec<usize> = (0..3).filter(|&i| i != first).collect();
    let second = leader(&configs, &others).await;
    let mut second_client = client(&configs[second]).await;
    let again = second_client.register_job(with_id(id)).await.unwrap().into_inner();
    assert_eq!(again, job, "the new leader answers the retry as the old one did");
    assert_eq!(second_client.status(StatusRequest {}).await.unwrap().into_inner().jobs.len(), 1);
    // Another id is another call: a second job.
    second_client.register_job(with_id(RequestId::new(0x5eed, 2))).await.unwrap();
    assert_eq!(second_client.status(StatusRequest {}).await.unwrap().into_inner().jobs.len(), 2);
    for server in servers.into_iter().flatten() {
        server.shutdown().await;
    }
}

/// Leases count from the failover: the job's renewals and the storage server's heartbeats reached
/// only the old leader (neither is logged), for longer than the lease and the server timeout after
/// the replicas applied their registrations. The new leader still has the job (its token renews
/// it) and does not declare the server dead: it asks it to register again, and once it has, the
/// server is alive there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_and_server_timeouts_count_from_the_failover() {
    use tern_proto::identity::{ClusterSecret, Identity, Presents, Role};
    use tern_proto::v1::registry_client::RegistryClient;

    let temp = tempfile::tempdir().unwrap();
    let mut configs = configs(temp.path());
    for config in &mut configs {
        config.server_timeout_ms = 1500;
        config.heartbeat_interval_ms = 100;
    }
    let mut servers: Vec<Option<MetadataServer>> = Vec::new();
    for config in &configs {
        servers.push(Some(start(config.clone()).await.unwrap()));
    }
    let secret = ClusterSecret::load(&temp.path().join("cluster.secret")).unwrap();
    let address = "127.0.0.1:9".to_string();
    let credential = secret.credential(&Identity::new(Role::Server, "", &address));
    let registry = |config: &Config| {
        let channel =
            tonic::transport::Endpoint::from_shared(format!("http://{}", config.serve.listen)).unwrap().connect_lazy();
        RegistryClient::with_interceptor(channel, Presents::credential(&credential).unwrap())
    };
    let tiers = vec![TierUsage { tier: "dram".into(), capacity_blocks: 64, ..TierUsage::default() }];
    let register = RegisterServerRequest { address: address.clone(), tiers, instance_id: 1, ..Default::default() };

    let first = leader(&configs, &[0, 1, 2]).await;
    let mut leader_client = client(&configs[first]).await;
    let job = RegisterJobRequest { name: "j".into(), lease_ms: 1500, ..Default::default() };
    let token = leader_client.register_job(job).await.unwrap().into_inner().token;
    let mut leader_registry = registry(&configs[first]);
    let server_id = leader_registry.register_server(register.clone()).await.unwrap().into_inner().server_id;
    let inventory = ReportInventoryRequest { server_id, last: true, ..Default::default() };
    leader_registry.report_inventory(inventory.clone()).await.unwrap();
    let renew = RenewJobRequest { job_id: "j".into(), token: token.clone() };
    let heartbeat = HeartbeatRequest { server_id, ..Default::default() };
    for _ in 0..30 {
        leader_client.renew_job(renew.clone()).await.unwrap();
        let beat = leader_registry.heartbeat(heartbeat.clone()).await.unwrap().into_inner();
        assert!(!beat.reregister);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    servers[first].take().unwrap().shutdown().await;
    let others: Vec<usize> = (0..3).filter(|&i| i != first).collect();
    let second = leader(&configs, &others).await;
    let mut second_client = client(&configs[second]).await;
    second_client.renew_job(renew).await.expect("the job's lease counts from the failover");
    let mut second_registry = registry(&configs[second]);
    let beat = second_registry.heartbeat(heartbeat.clone()).await.unwrap().into_inner();
    assert!(beat.reregister, "the new leader has not heard from the server: it asks it to register");
    let again = second_registry.register_server(register).await.unwrap().into_inner();
    assert_eq!(again.server_id, server_id, "the same server, by its address");
    second_registry.report_inventory(inventory).await.unwrap();
    let beat = second_registry.heartbeat(heartbeat).await.unwrap().into_inner();
    assert!(!beat.reregister);
    let status = second_client.status(StatusRequest {}).await.unwrap().into_inner();
    let listed = status.servers.iter().find(|s| s.server_id == server_id).expect("the server is listed");
    assert!(listed.alive, "the server is alive on the new leader: {listed:?}");
    assert!(status.jobs.iter().any(|j| j.job_id == "j"), "the job is live on the new leader");
    for server in servers.into_iter().flatten() {
        server.shutdown().await;
    }
}
