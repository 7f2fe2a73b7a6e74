//! The scheduler's gRPC service on loopback, with a real metadata server and storage server
//! in-process, and test code playing the executors (poll, report). Real executor processes are
//! the black-box tests' business (tests/ at the root).

#![expect(clippy::disallowed_methods, reason = "a black-box test times real waits on a real server")]
#![allow(clippy::unwrap_used, reason = "test support: helpers outside #[test] fns unwrap as the tests do")]

use std::time::{Duration, Instant};

use tern_common::config::Serve;
use tern_proto::identity::{ClusterSecret, Identity, Role};
use tern_proto::sched as pb;
use tern_scheduler::{server, Config};
use tern_scheduler_api::{spec, SchedulerClient};

struct Cluster {
    _dir: tempfile::TempDir,
    _metadata: tern_metadata::MetadataServer,
    _storage: tern_storage::StorageServer,
    metadata_addr: String,
    scheduler: server::SchedulerServer,
    /// A client of the default tenant (no credential): submits and watches jobs.
    client: SchedulerClient,
    /// The test's executors: an executor credential.
    pool: SchedulerClient,
}

async fn cluster(tune: impl FnOnce(&mut Config)) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let metadata = tern_metadata::start(tern_metadata::Config {
        serve: Serve::on_loopback(0, 0),
        dir: dir.path().join("metadata"),
        heartbeat_interval_ms: 100,
        server_timeout_ms: 2000,
        ..Default::default()
    })
    .await
    .unwrap();
    let metadata_addr = metadata.addr().to_string();
    let storage = tern_storage::start(tern_storage::Config {
        metadata: metadata_addr.clone(),
        // The secret the metadata server made in its directory, as a storage server must hold.
        cluster_secret_file: Some(dir.path().join("metadata").join("cluster.secret")),
        serve: Serve::on_loopback(0, 0),
        dram: tern_common::ByteSize::mib(64),
        huge_pages: false,
        prefault: false,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut config = Config {
        serve: Serve::on_loopback(0, 0),
        metadata: metadata_addr.clone(),
        cluster_secret_file: Some(dir.path().join("metadata").join("cluster.secret")),
        ..Config::default()
    };
    tune(&mut config);
    let scheduler = server::start(config).await.unwrap();
    let addr = scheduler.addr().to_string();
    let client = SchedulerClient::connect(&addr, None, None).await.unwrap();
    let secret = ClusterSecret::load(&dir.path().join("metadata").join("cluster.secret")).unwrap();
    let executor = secret.credential(&Identity::new(Role::Executor, "", ""));
    let pool = SchedulerClient::connect(&addr, None, Some(&executor)).await.unwrap();
    Cluster { _dir: dir, _metadata: metadata, _storage: storage, metadata_addr, scheduler, client, pool }
}

async fn executor(client: &SchedulerClient, host: &str, cpus: u64) -> String {
    let reply = client
        .register_executor(pb::RegisterExecutorRequest {
            name: format!("test-{host}"),
            host: host.into(),
            capacity: Some(pb::Resources { cpu_milli: cpus * 1000, memory_bytes: 64 << 30, gpu_milli: 0 }),
            gpu_addresses: vec![],
            operators: vec![],
        })
        .await
        .unwrap();
    assert!(reply.max_batch > 0 && reply.heartbeat_interval_ms > 0);
    reply.executor_id
}

fn ok(a: &pb::Assignment) -> pb::TaskResult {
    pb::TaskResult {
        assignment_id: a.assignment_id,
        outcome: pb::TaskOutcome::Succeeded as i32,
        path: "cpu".into(),
        ..Default::default()
    }
}

const SORT: &str = r#"
name = "sort"
[[shuffles]]
name = "data"
partitions = 3
[[stages]]
name = "map"
operator = "terasort-map"
tasks = 2
output = "data"
needs = { cpus = 1, memory = "64MiB" }
[[stages]]
name = "reduce"
operator = "terasort-reduce"
tasks = 3
after = ["map"]
input = "data"
output = "/out/sorted"
needs = { cpus = 1, memory = "64MiB" }
"#;

/// Polls (reporting `results`) until at least `want` assignments came, or panics after 10 s.
async fn take(
    client: &SchedulerClient,
    executor: &str,
    want: usize,
    mut results: Vec<pb::TaskResult>,
) -> Vec<pb::Assignment> {
    let started = Instant::now();
    let mut got = Vec::new();
    while got.len() < want {
        assert!(started.elapsed() < Duration::from_secs(10), "only {} of {want} assignments came", got.len());
        let reply = client.poll(executor, std::mem::take(&mut results), 64, Duration::from_millis(200)).await.unwrap();
        got.extend(reply.assignments);
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_its_stages_over_its_own_tern_job_and_shuffles() {
    let c = cluster(|_| {}).await;
    let job_id = c.client.submit(spec::parse(SORT, false).unwrap()).await.unwrap();
    let e = executor(&c.pool, "127.0.0.1", 8).await;
    let maps = take(&c.pool, &e, 2, vec![]).await;
    assert!(maps.iter().all(|a| a.stage == "map" && a.operator.as_ref().unwrap().name == "terasort-map"));
    let shuffle = maps[0].output_shuffle_id;
    assert!(shuffle != 0 && maps[0].output_partitions == 3 && !maps[0].tern_job_id.is_empty());
    assert!(maps[0].tern_job_root.starts_with("/jobs/"));
    let status = c.client.job(&job_id).await.unwrap();
    assert_eq!(status.state(), pb::JobState::Running);
    assert_eq!((status.stages[0].running, status.stages[1].waiting), (2, 3));

    // The shuffle exists on the metadata server while the job runs.
    // Its tasks hold the Tern job's token; no one else may look at the shuffle.
    let tern = tern_client::Client::connect(&c.metadata_addr).await.unwrap();
    let refused = tern.open_shuffle(tern_client::ShuffleId::from_wire(shuffle)).await.err().unwrap();
    assert_eq!(refused.kind(), tern_client::ErrorKind::PermissionDenied, "{refused}");
    tern.add_job_token(&maps[0].tern_job_token).unwrap();
    tern.open_shuffle(tern_client::ShuffleId::from_wire(shuffle)).await.unwrap();

    // Results ride on the next poll, which also hands out the reduce tasks (the map stage is done).
    let reduces = take(&c.pool, &e, 3, maps.iter().map(ok).collect()).await;
    assert!(reduces.iter().all(|a| a.stage == "reduce" && a.input_shuffle_id == shuffle && a.input_maps == 2));
    assert_eq!(reduces[0].output_path, "/out/sorted");
    let mut indexes: Vec<u32> = reduces.iter().map(|a| a.task_index).collect();
    indexes.sort();
    assert_eq!(indexes, [0, 1, 2]);
    c.pool.poll(&e, reduces.iter().map(ok).collect(), 0, Duration::ZERO).await.unwrap();
    let status = c.client.job(&job_id).await.unwrap();
    assert_eq!(status.state(), pb::JobState::Succeeded, "{status:?}");
    assert_eq!(status.stages[1].paths.get("cpu"), Some(&3));

    // Its Tern job was ended: the shuffle is gone.
    let started = Instant::now();
    while tern.open_shuffle(tern_client::ShuffleId::from_wire(shuffle)).await.is_ok() {
        assert!(started.elapsed() < Duration::from_secs(5), "the job's shuffle outlived it");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pool = c.client.pool_status().await.unwrap();
    assert_eq!((pool.backlog_tasks, pool.running_tasks, pool.executors, pool.idle_executors), (0, 0, 1, 1));
    c.scheduler.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_executors_tasks_run_elsewhere_and_metrics_say_so() {
    let c = cluster(|config| {
        config.heartbeat_interval_ms = 50;
        config.executor_timeout_ms = 300;
    })
    .await;
    let job = "name = \"n\"\n[[stages]]\nname = \"s\"\noperator = \"noop\"\ntasks = 4\nmax_attempts = 1\n";
    let job_id = c.client.submit(spec::parse(job, false).unwrap()).await.unwrap();
    let doomed = executor(&c.pool, "a", 4).await;
    let first = take(&c.pool, &doomed, 4, vec![]).await;
    // It goes silent; another executor joins and gets the same tasks, as new attempts.
    let survivor = executor(&c.pool, "b", 4).await;
    let again = take(&c.pool, &survivor, 4, vec![]).await;
    assert!(again.iter().all(|a| a.attempt == 1));
    let mut a: Vec<u32> = first.iter().map(|a| a.task_index).collect();
    let mut b: Vec<u32> = again.iter().map(|a| a.task_index).collect();
    a.sort();
    b.sort();
    assert_eq!(a, b);
    // The lost executor is told so when it comes back.
    let err = c.pool.heartbeat(&doomed).await.unwrap_err();
    assert_eq!(err.kind(), tern_client::ErrorKind::NotFound);
    c.pool.poll(&survivor, again.iter().map(ok).collect(), 0, Duration::ZERO).await.unwrap();
    let status = c.client.job(&job_id).await.unwrap();
    assert_eq!(status.state(), pb::JobState::Succeeded, "max_attempts = 1 not used up by the loss");
    assert_eq!(status.stages[0].lost, 4);

    // Past a gauge refresh, the survivor heartbeating meanwhile.
    for _ in 0..7 {
        c.pool.heartbeat(&survivor).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let url = format!("http://{}/metrics", c.scheduler.admin_addr());
    let text = http_get(&url).await;
    for want in [
        "tern_scheduler_executors_lost_total 1",
        "tern_scheduler_executors 1",
        "tern_scheduler_backlog_tasks 0",
        "tern_scheduler_running_tasks 0",
        "tern_scheduler_dispatched_tasks_total 8",
        "tern_scheduler_task_results_total{outcome=\"succeeded\"} 4",
        "tern_scheduler_queue_share{queue=\"default\"}",
    ] {
        assert!(text.contains(want), "metrics lack {want:?}:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_poll_wakes_when_work_arrives_and_cancels_reach_executors() {
    let c = cluster(|_| {}).await;
    let e = executor(&c.pool, "h", 2).await;
    let poller = {
        let client = c.pool.clone();
        let e = e.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let reply = client.poll(&e, vec![], 16, Duration::from_secs(5)).await.unwrap();
            (reply, started.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let job = "name = \"w\"\n[[stages]]\nname = \"s\"\noperator = \"noop\"\ntasks = 3\n";
    let job_id = c.client.submit(spec::parse(job, false).unwrap()).await.unwrap();
    let (reply, waited) = poller.await.unwrap();
    assert_eq!(reply.assignments.len(), 2, "two 1-CPU tasks fit a 2-CPU executor, in one batch");
    let mut handed: Vec<u64> = reply.assignments.iter().map(|a| a.assignment_id).collect();
    handed.sort();
    assert!(waited < Duration::from_secs(4), "the poll waited {waited:?}: it was not woken");

    assert_eq!(c.client.cancel(&job_id).await.unwrap(), pb::JobState::Cancelled);
    let reply = c.pool.poll(&e, vec![], 16, Duration::from_secs(1)).await.unwrap();
    assert!(reply.assignments.is_empty());
    let mut cancelled = reply.cancel.clone();
    cancelled.sort();
    assert_eq!(cancelled, handed, "both running tasks are told to stop");
    let status = c.client.job(&job_id).await.unwrap();
    assert_eq!((status.state(), status.stages[0].cancelled), (pb::JobState::Cancelled, 3));
    let listed = c.client.list_jobs(false).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(c.client.list_jobs(true).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors_and_the_server_keeps_serving() {
    let c = cluster(|config| config.max_tasks_per_stage = 10).await;
    let mut job =
        spec::parse("name = \"b\"\n[[stages]]\nname = \"s\"\noperator = \"noop\"\ntasks = 3\n", false).unwrap();
    job.stages[0].tasks = 11;
    let err = c.client.submit(job.clone()).await.unwrap_err();
    assert_eq!(err.kind(), tern_client::ErrorKind::Invalid);
    assert!(err.message().contains("tasks = 11"), "{err}");
    job.stages[0].after = vec!["nowhere".into()];
    job.stages[0].tasks = 1;
    let err = c.client.submit(job.clone()).await.unwrap_err();
    assert!(err.message().contains("\"nowhere\""), "{err}");
    let err = c.pool.poll("e-404", vec![], 1, Duration::ZERO).await.unwrap_err();
    assert_eq!(err.kind(), tern_client::ErrorKind::NotFound);
    let err = c.client.job("nope").await.unwrap_err();
    assert_eq!(err.kind(), tern_client::ErrorKind::NotFound);
    job.stages[0].after.clear();
    c.client.submit(job).await.unwrap();
}

async fn http_get(url: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.trim_start_matches("http://");
    let (host, path) = rest.split_once('/').unwrap();
    let mut stream = tokio::net::TcpStream::connect(host).await.unwrap();
    stream
        .write_all(format!("GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).await.unwrap();
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gang_placed_during_one_poll_wakes_the_other_executors_poll() {
    let c = cluster(|_| {}).await;
    let a = executor(&c.pool, "a", 2).await;
    let b = executor(&c.pool, "b", 2).await;
    let waiting = {
        let client = c.pool.clone();
        let a = a.clone();
        tokio::spawn(async move { client.poll(&a, vec![], 16, Duration::from_secs(5)).await.unwrap() })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let job = "name = \"g\"\n[[stages]]\nname = \"s\"\noperator = \"noop\"\ntasks = 4\ngang = true\n";
    c.client.submit(spec::parse(job, false).unwrap()).await.unwrap();
    // Whichever poll places the gang, both executors get two tasks each, promptly.
    let mine = c.pool.poll(&b, vec![], 16, Duration::from_secs(2)).await.unwrap();
    let theirs = tokio::time::timeout(Duration::from_secs(3), waiting).await.unwrap().unwrap();
    assert_eq!((mine.assignments.len(), theirs.assignments.len()), (2, 2));
    let pool = c.client.pool_status().await.unwrap();
    assert_eq!((pool.running_tasks, pool.backlog_tasks, pool.idle_executors), (4, 0, 0));
}
