//! `tern admin` against a real cluster: cordon keeps new placements off a server (and survives a
//! metadata restart), a drain copies sealed files off, waits for a running job's shuffle and then
//! the server exits, SIGTERM drains a storage server the same way, a drain ends at its deadline, end-job frees the job's blocks, and
//! unregister-shuffle frees a shuffle.

use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use serde_json::Value;
use tern_client::{ErrorKind, ShuffleOptions};

use crate::common::{random_bytes, Cluster, TERN};

const BLOCK: usize = 1 << 20;

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The servers holding `path`'s blocks, by id (as JSON strings).
fn block_servers(cluster: &Cluster, path: &str) -> Vec<String> {
    let stat = json(&cluster.tern_ok(&["fs", "stat", "--json", path]));
    stat["blocks"].as_array().unwrap().iter().map(|b| b["server_id"].as_str().unwrap().to_string()).collect()
}

/// Storage server `i`'s id, as `tern admin servers` shows it.
fn server_id(cluster: &Cluster, i: usize) -> String {
    let servers = json(&cluster.tern_admin_ok(&["admin", "servers", "--json"]));
    let server = servers.as_array().unwrap().iter().find(|s| s["address"] == cluster.storage_addrs[i].as_str());
    server.unwrap_or_else(|| panic!("storage server {i} not listed: {servers}"))["server_id"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn wait_exit(cluster: &mut Cluster, i: usize, within: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(status) = cluster.storage_exit(i) {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "storage server {i} still runs after {within:?}\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn cordon_keeps_new_placements_off_a_server_until_uncordoned() {
    let mut cluster = Cluster::start(2, "64MiB").await;
    let client = cluster.client().await;
    let (cordoned, open) = (server_id(&cluster, 0), server_id(&cluster, 1));
    let out = json(&cluster.tern_admin_ok(&["admin", "cordon", &cluster.storage_addrs[0], "--json"]));
    assert_eq!((out["state"].as_str(), out["server_id"].as_str()), (Some("cordoned"), Some(cordoned.as_str())));
    assert!(cluster.tern_ok(&["status"]).contains("cordoned"));

    for i in 0..4 {
        client.put(&format!("/c/f{i}"), Bytes::from(random_bytes(3 * BLOCK))).await.unwrap();
        assert!(
            block_servers(&cluster, &format!("/c/f{i}")).iter().all(|s| *s == open),
            "a block on the cordoned server"
        );
    }
    let job = client.start_job(None, Duration::from_secs(30)).await.unwrap();
    let shuffle = client.register_shuffle(job.id(), 16, ShuffleOptions::default()).await.unwrap();
    assert!(
        shuffle.segment_addresses().iter().all(|a| *a == cluster.storage_addrs[1]),
        "a segment on the cordoned server"
    );
    // The cordon is logged: it survives the metadata server's restart.
    cluster.restart_metadata(1);
    let status = cluster
        .wait_for("the cordoned server back", Duration::from_secs(20), || async {
            let out = cluster.tern_admin(&["admin", "server", &cordoned, "--json"]);
            out.status.success().then(|| json(&String::from_utf8_lossy(&out.stdout)))
        })
        .await;
    assert_eq!(status["state"], "cordoned", "{status}");

    cluster.tern_admin_ok(&["admin", "uncordon", &cordoned]);
    let client = cluster.client().await;
    cluster
        .wait_for("both servers back", Duration::from_secs(20), || async {
            let servers = json(&cluster.tern_admin_ok(&["admin", "servers", "--json"]));
            servers.as_array().unwrap().iter().all(|s| s["state"] == "alive").then_some(())
        })
        .await;
    // Two copies need two servers taking placements: the uncordoned one takes one again.
    let two = tern_client::CreateOptions { replicas: 2, ..Default::default() };
    client.put_with_options("/c/two", Bytes::from(random_bytes(BLOCK)), two).await.unwrap();
    let servers = block_servers(&cluster, "/c/two");
    assert!(servers.contains(&cordoned) && servers.contains(&open), "{servers:?}");
    let unknown = cluster.tern_admin(&["admin", "cordon", "10.9.9.9:1"]);
    assert!(!unknown.status.success());
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no storage server \"10.9.9.9:1\""));
}

#[tokio::test]
async fn a_drain_copies_files_off_waits_for_a_running_jobs_shuffle_then_the_server_exits() {
    let mut cluster = Cluster::start(2, "64MiB").await;
    let client = cluster.client().await;
    let job = client.start_job(None, Duration::from_secs(30)).await.unwrap();
    // Only server 0 takes placements: a sealed file and the job's shuffle segment go there.
    let other = cluster.storage_addrs[1].clone();
    cluster.tern_admin_ok(&["admin", "cordon", &other]);
    let moved = random_bytes(3 * BLOCK + 5);
    client.put("/moved", Bytes::from(moved.clone())).await.unwrap();
    let _shuffle = client.register_shuffle(job.id(), 1, ShuffleOptions::default()).await.unwrap();
    cluster.tern_admin_ok(&["admin", "uncordon", &other]);
    // A sealed file with a second copy elsewhere is neither copied nor waited for.
    client
        .put_with_options(
            "/two",
            Bytes::from(random_bytes(BLOCK)),
            tern_client::CreateOptions { replicas: 2, ..Default::default() },
        )
        .await
        .unwrap();

    let address = cluster.storage_addrs[0].clone();
    let mut wait = Command::new(TERN)
        .args(["admin", "drain", &address, "--wait", "--timeout", "60s", "--json"])
        .arg("--as")
        .arg(cluster.admin_credential())
        .env("TERN_METADATA", &cluster.metadata_addr)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The file's blocks are copied to server 1 and re-pointed; the shuffle's segment keeps the
    // server (a job still pushes and fetches there).
    let on_other = server_id(&cluster, 1);
    let draining = cluster
        .wait_for("the file copied off the draining server", Duration::from_secs(10), || async {
            let server = json(&cluster.tern_admin_ok(&["admin", "server", &address, "--json"]));
            let copied = block_servers(&cluster, "/moved").iter().all(|s| *s == on_other);
            (server["state"] == "draining" && copied && server["sole_copy_blocks"] == 0).then_some(server)
        })
        .await;
    assert_eq!(draining["drain_waiting_for"], "1 segments of registered shuffles", "{draining}");
    let status = cluster.tern_ok(&["status"]);
    assert!(status.contains(&format!("draining {}", draining["server_id"].as_str().unwrap())), "{status}");
    assert!(status.contains("0 blocks (0B) pending") && status.contains("copied, 0 failed"), "{status}");
    let copies = json(&cluster.tern_ok(&["status", "--json"]))["copies"].clone();
    assert_eq!((copies["copied_blocks"].as_u64(), copies["pending_blocks"].as_u64()), (Some(4), Some(0)), "{copies}");
    // New data goes elsewhere while the job still holds the server.
    client.put("/after", Bytes::from(random_bytes(2 * BLOCK))).await.unwrap();
    assert!(block_servers(&cluster, "/after").iter().all(|s| *s == on_other));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(cluster.storage_exit(0).is_none(), "the server left while a live job needed it");
    assert!(wait.try_wait().unwrap().is_none(), "drain --wait returned while the job ran");

    job.end().await.unwrap();
    let status = wait_exit(&mut cluster, 0, Duration::from_secs(15)).await;
    assert!(status.success(), "a drained server exits 0, not {status}");
    let waited = wait.wait_with_output().unwrap();
    assert!(waited.status.success(), "drain --wait: {}", String::from_utf8_lossy(&waited.stderr));
    let told = json(&String::from_utf8_lossy(&waited.stdout));
    assert_eq!((told["drained"].as_bool(), told["drain_waiting_for"].as_str()), (Some(true), Some("")), "{told}");
    // Every file still reads, the moved one exactly, with the drained server gone.
    assert!(client.open("/moved").await.unwrap().read_to_end().await.unwrap() == moved);
    for path in ["/two", "/after"] {
        client.open(path).await.unwrap().read_to_end().await.unwrap();
    }
    let metrics = crate::monitoring::http_get(cluster.metadata_admin_addr().parse().unwrap(), "/metrics").unwrap();
    assert!(metrics.contains("tern_metadata_copied_blocks 4"), "{metrics}");
}

#[tokio::test]
async fn sigterm_drains_a_storage_server_copying_its_files_off_before_it_exits() {
    let mut cluster = Cluster::start(2, "64MiB").await;
    let client = cluster.client().await;
    let other = cluster.storage_addrs[1].clone();
    cluster.tern_admin_ok(&["admin", "cordon", &other]);
    let data = random_bytes(2 * BLOCK);
    client.put("/held", Bytes::from(data.clone())).await.unwrap();
    cluster.tern_admin_ok(&["admin", "uncordon", &other]);
    cluster.terminate_storage(0);
    let status = wait_exit(&mut cluster, 0, Duration::from_secs(15)).await;
    assert!(status.success(), "a drained server exits 0 on SIGTERM, not {status}");
    assert!(block_servers(&cluster, "/held").iter().all(|s| *s == server_id(&cluster, 1)));
    assert!(client.open("/held").await.unwrap().read_to_end().await.unwrap() == data);
}

#[tokio::test]
async fn a_drain_ends_at_its_deadline() {
    let mut cluster = Cluster::start(2, "64MiB").await;
    let client = cluster.client().await;
    // A sealed single-copy file outside any job: nothing frees it, so only the deadline ends the drain.
    cluster.tern_admin_ok(&["admin", "cordon", &cluster.storage_addrs[1]]);
    client.put("/only-here", Bytes::from(random_bytes(BLOCK))).await.unwrap();
    let out = json(&cluster.tern_admin_ok(&["admin", "drain", &cluster.storage_addrs[0], "--timeout", "2s", "--json"]));
    assert_eq!((out["state"].as_str(), out["drained"].as_bool()), (Some("draining"), Some(false)), "{out}");
    assert_eq!(out["sole_copy_blocks"], 1, "{out}");
    let started = std::time::Instant::now();
    let status = wait_exit(&mut cluster, 0, Duration::from_secs(15)).await;
    assert!(status.success(), "{status}");
    assert!(started.elapsed() >= Duration::from_millis(1500), "left before its deadline: {:?}", started.elapsed());
}

#[tokio::test]
async fn end_job_and_unregister_shuffle_free_what_they_held() {
    let cluster = Cluster::start(2, "64MiB").await;
    let client = cluster.client().await;
    let job = client.start_job(None, Duration::from_secs(60)).await.unwrap();
    client.put(&format!("{}/out", job.root()), Bytes::from(random_bytes(3 * BLOCK))).await.unwrap();
    let shuffle = client.register_shuffle(job.id(), 4, ShuffleOptions::default()).await.unwrap();
    let jobs = json(&cluster.tern_admin_ok(&["admin", "jobs", "--json"]));
    let listed = jobs.as_array().unwrap().iter().find(|j| j["job_id"] == job.id()).unwrap_or_else(|| panic!("{jobs}"));
    assert_eq!(listed["files"], 1, "{listed}");
    assert!(listed["expires_in_ms"].as_u64().unwrap() > 0);

    let freed =
        json(&cluster.tern_admin_ok(&["admin", "unregister-shuffle", &shuffle.id().get().to_string(), "--json"]));
    assert_eq!(freed["shuffle_id"], shuffle.id().get().to_string(), "ids are strings: {freed}");
    let gone = client.open_shuffle(shuffle.id()).await.map(drop).unwrap_err();
    assert_eq!(gone.kind(), ErrorKind::NotFound, "{gone}");

    let ended = json(&cluster.tern_admin_ok(&["admin", "end-job", job.id(), "--json"]));
    assert_eq!((ended["files_deleted"].as_u64(), ended["blocks_freed"].as_u64()), (Some(1), Some(3)), "{ended}");
    let jobs = json(&cluster.tern_admin_ok(&["admin", "jobs", "--json"]));
    assert!(jobs.as_array().unwrap().is_empty(), "{jobs}");
    // The servers hear of the frees in their heartbeats, and hold nothing after.
    cluster
        .wait_for("the job's blocks freed on the servers", Duration::from_secs(10), || async {
            let servers = json(&cluster.tern_admin_ok(&["admin", "servers", "--json"]));
            let used: u64 = servers
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|s| s["tiers"].as_array().unwrap().iter().map(|t| t["used_blocks"].as_u64().unwrap()))
                .sum();
            let placed: u64 = servers.as_array().unwrap().iter().map(|s| s["allocated_blocks"].as_u64().unwrap()).sum();
            (used == 0 && placed == 0).then_some(())
        })
        .await;
    let again = cluster.tern_admin(&["admin", "end-job", job.id()]);
    assert!(String::from_utf8_lossy(&again.stderr).contains("not registered"), "{again:?}");
}

#[tokio::test]
async fn admin_commands_take_the_control_planes_authentication() {
    let cluster = Cluster::start_with(1, "16MiB", crate::common::Tls::Full).await;
    // The harness hands the cluster's TLS material to the command line (TERN_TLS_DIR).
    let servers = json(&cluster.tern_admin_ok(&["admin", "servers", "--json"]));
    assert_eq!(servers.as_array().unwrap().len(), 1, "{servers}");
    cluster.tern_admin_ok(&["admin", "cordon", &cluster.storage_addrs[0]]);
    // Without it, the metadata server's mutual TLS lets nothing through.
    let out = Command::new(TERN)
        .args(["admin", "uncordon", &cluster.storage_addrs[0]])
        .arg("--as")
        .arg(cluster.admin_credential())
        .env("TERN_METADATA", &cluster.metadata_addr)
        .env_remove("TERN_TLS_DIR")
        .output()
        .unwrap();
    assert!(!out.status.success(), "an admin call without TLS material went through");
    let servers = json(&cluster.tern_admin_ok(&["admin", "servers", "--json"]));
    assert_eq!(servers[0]["state"], "cordoned", "{servers}");
}
