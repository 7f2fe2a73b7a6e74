//! Tern's Spark shuffle plugin on real Spark, across hosts with TLS (Spark on a client host, the
//! daemons on others; see [`MultiHost`]): spark-shuffle/tests/spark_suite.py runs RDD, JVM
//! and SQL shuffles (AQE coalescing and skew splitting forced) on Spark's built-in shuffle and on
//! Tern and fails on any difference; then a TeraSort validated as `tern teravalidate` does; Spark's
//! shuffle cleanup and the application's end leaving no bytes in Tern; a storage server cut off
//! between a shuffle's map and reduce stages, recovered by one map-stage retry that reruns exactly
//! the lost maps; and a second driver with dynamic allocation (executors released between two
//! reads of one shuffle), its job in the tenant and with the copies its conf names, that is
//! SIGKILLed, its data freed when its job lease lapses.
//! spark-shuffle/tests/spark_space.py runs long applications on a cluster whose DRAM holds about
//! two of their shuffles: without the plugin's cleanup a later query fails out-of-space; with it
//! (past a threshold, or when pushes wait for space) every query is right, and a shuffle larger
//! than the cluster fails within the wait with a message saying what is full and what to do.
//!
//! Both on Spark 3.5.3 and 4.3.0 (the jar of each line: spark-shuffle/build.sh builds both).
//!
//! Needs python3 and a JDK (javac, jar); installs pyspark==3.5.3 with pip if it is missing, and
//! pyspark 4.3.0 in its venv under ~/.cache/tern/pyspark (spark-shuffle/pyspark-venv.sh).

use crate::common;

use std::path::Path;
use std::process::Command;

use common::multihost::{storage_host, Layout, MultiHost, CLIENT_HOST};
use common::{Cluster, TERN};
use tern_common::spark::SparkLine;

fn ensure_pyspark() {
    let has = |version: &str| {
        Command::new("python3")
            .args(["-c", &format!("import pyspark, sys; sys.exit(pyspark.__version__ != '{version}')")])
            .status()
            .is_ok_and(|s| s.success())
    };
    if has("3.5.3") {
        return;
    }
    let status = Command::new("python3")
        .args(["-m", "pip", "install", "--user", "--quiet", "pyspark==3.5.3", "py4j==0.10.9.7"])
        .status()
        .expect("running pip");
    assert!(status.success() && has("3.5.3"), "installing pyspark==3.5.3 failed");
}

/// The Python of a venv holding pyspark `version` (spark-shuffle/pyspark-venv.sh installs it there
/// once per machine).
fn pyspark_venv(root: &Path, version: &str) -> std::path::PathBuf {
    let out = Command::new(root.join("spark-shuffle/pyspark-venv.sh"))
        .arg(version)
        .output()
        .expect("running spark-shuffle/pyspark-venv.sh");
    assert!(
        out.status.success(),
        "installing pyspark {version} into its venv failed (spark-shuffle/pyspark-venv.sh {version}):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Path::new(String::from_utf8(out.stdout).unwrap().trim()).join("bin/python")
}

/// Builds the plugin's jars; the Spark 3.5 one's path, and what build.sh said on stderr.
fn build_plugin(root: &Path) -> (String, String) {
    build_plugin_for(root, SparkLine::V3_5)
}

/// Builds the plugin's jars; the path of `line`'s, and what build.sh said on stderr.
fn build_plugin_for(root: &Path, line: SparkLine) -> (String, String) {
    // --tests: the x86_64 library is this test build's own (scripts/test.sh builds the same jars).
    let out = Command::new(root.join("spark-shuffle/build.sh"))
        .arg("--tests")
        .output()
        .expect("running spark-shuffle/build.sh --tests");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "spark-shuffle/build.sh --tests failed:\n{stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let jar = stdout.lines().find(|l| l.ends_with(&format!("/{}", line.jar())));
    (jar.unwrap_or_else(|| panic!("build.sh printed no {}:\n{stdout}", line.jar())).to_string(), stderr)
}

/// The suite with Spark (driver and local-cluster executors) on a client host of its own and the
/// metadata and storage servers on three others, everything TLS: the suite's main application
/// gives the TLS material as PEM text in its Spark conf and moves blocks over QUIC; its second
/// driver names the TLS directory and takes the default transport (TLS over TCP).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spark_jobs_across_hosts_over_tls_and_quic_match_the_builtin_shuffle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ensure_pyspark();
    suite_across_hosts(root, Path::new("python3"), SparkLine::V3_5).await;
}

/// The same suite on pyspark 4.3.0 (its own venv) with the Spark 4 jar and Spark 4.3's manager
/// class (`TernBlockingShuffleManager`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spark_4_3_jobs_across_hosts_over_tls_and_quic_match_the_builtin_shuffle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = pyspark_venv(root, "4.3.0");
    suite_across_hosts(root, &python, SparkLine::V4_3).await;
}

/// spark_suite.py run by `python` (whose pyspark is of `line`) on a client host, against daemons
/// on three others.
async fn suite_across_hosts(root: &Path, python: &Path, line: SparkLine) {
    let (jar, _) = build_plugin_for(root, line);
    let layout = Layout { storage_servers: 3, dram: "512MiB", metadata_sets: &[] };
    let cluster = MultiHost::start(layout).await;
    let work = tempfile::tempdir().unwrap();
    let client = cluster.network().host(CLIENT_HOST);
    let cut = cluster.network().host(&storage_host(0)).link().unwrap();
    let mut python = tokio::process::Command::from(client.command(python));
    python
        .env("TERN_SPARK_SHUFFLE_MANAGER", line.shuffle_manager_class())
        .env("TERN_METADATA", &cluster.metadata_url)
        .env("TERN_TLS_DIR", &cluster.tls_dir)
        .env("TERN_CLUSTER_SECRET", cluster.tls_dir.join("cluster.secret"))
        // Storage server 0's link cut: the veth's bridge end lives in this test's namespace.
        .env("TERN_STORAGE_FAULT", format!("nsenter --net=/proc/{}/ns/net ip link set {cut} down", std::process::id()))
        .env("TERN_WORK", work.path())
        // Spark's driver and its local-cluster master and workers bind this address: the client
        // host's own, which the namespace has (the machine's hostname resolves to one it lacks).
        .env("SPARK_LOCAL_IP", client.ip().to_string());
    let script = root.join("spark-shuffle/tests/spark_suite.py");
    run_script(python, &jar, &script, "all Spark cases agree", &|| cluster.logs()).await;
    // Server 0 was cut off by the suite; the others served the QUIC application and the TLS one.
    for i in 1..3 {
        let metrics = cluster.storage_metrics(i);
        for transport in ["quic", "tcp+tls"] {
            let accepted = format!("tern_storage_connections_accepted_total{{transport=\"{transport}\"}}");
            assert!(metrics.contains(&accepted), "storage server {i} accepted no {transport} connection:\n{metrics}");
        }
    }
}

/// Spark on Tern's scheduler: spark_suite.py with master `local-cluster-tern://` against `tern up`
/// whose pool starts at 0 executors (at most 2, 2 CPUs each, 1.5 GiB: one 1-core Spark executor of
/// 700 MiB heap fits in each, by memory; GPUs "0" and "1" from a discovery script). Every Tern case
/// agrees with the built-in shuffle while the executors are Tern tasks (the suite checks the
/// application's Tern job); an executor JVM SIGKILLed mid-stage costs nothing but a rerun; a stage
/// with a TaskResourceProfile runs on the default profile's executors (no dynamic allocation); the
/// dynamic-allocation child releases all its executors and gets new ones, then runs a stage with a
/// resource profile of its own (2-core executors of one GPU, one GPU a task) on executors of that
/// profile, which Tern ran as a stage of its own with that profile's resources. Here: the pool went
/// up to 2 executors for Spark and back to 0 once the applications ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spark_applications_run_on_terns_scheduler_and_pool() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ensure_pyspark();
    let (jar, _) = build_plugin(root);
    let dir = tempfile::tempdir().unwrap();
    let (_up, metadata, scheduler) = up_with_spark_pool(dir.path());
    let client = tern_scheduler_api::SchedulerClient::connect(&scheduler, None, None).await.unwrap();
    // Samples the pool while Spark runs: its most executors.
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let sampler = {
        let (client, peak) = (client.clone(), peak.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(pool) = client.pool_status().await {
                    peak.fetch_max(pool.executors, std::sync::atomic::Ordering::Relaxed);
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        })
    };
    assert_eq!(client.pool_status().await.unwrap().executors, 0, "the pool starts empty");
    let work = tempfile::tempdir().unwrap();
    let mut python = tokio::process::Command::new("python3");
    python
        .env("TERN_METADATA", &metadata)
        .env("TERN_WORK", work.path())
        .env("TERN_CLUSTER_SECRET", dir.path().join("cluster.secret"))
        .env("TERN_SPARK_MASTER", tern_scheduler_api::spark_master_url(&scheduler));
    let script = root.join("spark-shuffle/tests/spark_suite.py");
    let logs = || crate::common::logs_in(&dir.path().join("logs"));
    run_script(python, &jar, &script, "all Spark cases agree", &logs).await;
    sampler.abort();
    assert_eq!(peak.load(std::sync::atomic::Ordering::Relaxed), 2, "the pool never ran 2 executors for Spark");
    // Executors above the pool's min leave after --executor-idle-timeout (30 s by default).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let pool = client.pool_status().await.unwrap();
        if pool.executors == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the pool did not go back to 0 executors: {pool:?}");
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// The Spark lines tested less often, 4.0.5, 4.1.4 and 4.2.1 (each pyspark in its own venv), with
/// the Spark 4 jar on Tern's scheduler as the suite above runs it, less its JVM cases, TeraSort
/// and the child's stage of its own resource profile (TERN_SPARK_SMOKE; the 4.3 suite runs those):
/// RDD and SQL shuffles against the built-in shuffle (AQE coalescing and a skew split), Spark's
/// order-independent checksums equal to the built-in shuffle's (4.1 on), an executor SIGKILLed
/// mid-stage, a TaskResourceProfile's stage, and the dynamic-allocation child (executors released
/// and new ones reading the shuffle, a SIGKILLed driver's data freed). One `tern up` serves the
/// three in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spark_4_0_to_4_2_smoke_on_terns_scheduler() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let versions = ["4.0.5", "4.1.4", "4.2.1"];
    let pythons: Vec<_> = versions.iter().map(|version| pyspark_venv(root, version)).collect();
    let (jar, _) = build_plugin_for(root, SparkLine::V4_2);
    let dir = tempfile::tempdir().unwrap();
    let (_up, metadata, scheduler) = up_with_spark_pool(dir.path());
    let script = root.join("spark-shuffle/tests/spark_suite.py");
    let logs = || crate::common::logs_in(&dir.path().join("logs"));
    for (version, python) in versions.iter().zip(&pythons) {
        let line = SparkLine::of_version(version).unwrap();
        println!("Spark {version}:");
        let work = tempfile::tempdir().unwrap();
        let mut command = tokio::process::Command::new(python);
        command
            .env("TERN_METADATA", &metadata)
            .env("TERN_WORK", work.path())
            .env("TERN_CLUSTER_SECRET", dir.path().join("cluster.secret"))
            .env("TERN_SPARK_MASTER", tern_scheduler_api::spark_master_url(&scheduler))
            .env("TERN_SPARK_SHUFFLE_MANAGER", line.shuffle_manager_class())
            .env("TERN_SPARK_SMOKE", "1");
        run_script(command, &jar, &script, "all Spark cases agree", &logs).await;
    }
}

/// A jar on a Spark it was not built for fails as the SparkContext starts, with one line naming
/// the Spark found and the jar (or, on 4.3, the manager class) to use: the 3.5 jar on 4.3.0, the 4
/// jar on 3.5.3, and 4.3 given the manager class of 3.5 to 4.2.
#[test]
fn a_plugin_jar_on_the_wrong_spark_fails_at_start_naming_the_one_to_use() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ensure_pyspark();
    let spark43 = pyspark_venv(root, "4.3.0");
    let (jar35, _) = build_plugin_for(root, SparkLine::V3_5);
    let jar4 = jar35.replace(SparkLine::V3_5.jar(), SparkLine::V4_3.jar());
    let start = r#"
import sys
from pyspark import SparkConf, SparkContext
jar, manager = sys.argv[1:]
conf = (SparkConf().setMaster("local[1]").set("spark.ui.enabled", "false")
        .set("spark.driver.extraClassPath", jar).set("spark.shuffle.manager", manager)
        .set("spark.tern.metadata", "127.0.0.1:1"))
try:
    SparkContext(conf=conf).stop()
    print("STARTED")
except Exception as e:
    print("FAILED", e)
"#;
    let manager = tern_common::spark::SHUFFLE_MANAGER_CLASS;
    for (python, jar, said) in [
        (
            spark43.as_path(),
            &jar35,
            "Tern's Spark plugin tern-spark-3.5.jar is built for Spark 3.5 (Scala 2.12) but this is Spark 4.3.0: \
             use tern-spark-4.jar instead",
        ),
        (
            Path::new("python3"),
            &jar4,
            "Tern's Spark plugin tern-spark-4.jar is built for Spark 4.0 to 4.3 (Scala 2.13) but this is Spark \
             3.5.3: use tern-spark-3.5.jar instead",
        ),
        (
            spark43.as_path(),
            &jar4,
            "Spark 4.3.0 needs a BlockingShuffleManager: set \
             spark.shuffle.manager=io.tern.spark.TernBlockingShuffleManager (io.tern.spark.TernShuffleManager \
             serves Spark 3.5 to 4.2)",
        ),
    ] {
        let out = Command::new(python).args(["-c", start, jar, manager]).output().expect("running python");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("FAILED") && stdout.contains(said),
            "{jar} with {manager} under {}: wanted a failure saying {said:?}, got:\n{stdout}\n{}",
            python.display(),
            tail(&String::from_utf8_lossy(&out.stderr), 40)
        );
    }
}

/// GPUs for Spark on Tern's scheduler (spark-shuffle/tests/spark_gpus.py): `tern up`'s pool, empty
/// at first, starts one executor whose GPU discovery script names GPUs 0 and 1 (this machine has
/// none) for the application's backlog of two one-GPU executors; each Spark task sees its executor's granted device in
/// `TaskContext.resources()` and `CUDA_VISIBLE_DEVICES`, the two executors hold different devices;
/// `tern job list` shows the application, a shuffle lands in the application job's own Tern job, and
/// `tern job cancel` stops the application and frees that Tern job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spark_gpu_executors_get_distinct_granted_devices() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ensure_pyspark();
    let (jar, _) = build_plugin(root);
    let dir = tempfile::tempdir().unwrap();
    let port = tern_local::free_port_range(14).unwrap();
    let ports = tern_local::PortLayout::new(port, 2).unwrap();
    let script = dir.path().join("gpus.sh");
    std::fs::write(&script, "#!/bin/sh\necho '{\"name\": \"gpu\", \"addresses\": [\"0\", \"1\"]}'\n").unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let _up = TernUp::start(
        dir.path(),
        port,
        &[
            "--executor-gpu-discovery-script",
            script.to_str().unwrap(),
            "--min-executors",
            "0",
            "--max-executors",
            "1",
            "--executor-cpus",
            "2",
            "--executor-memory",
            "3GiB",
        ],
    );
    let mut python = tokio::process::Command::new("python3");
    python
        .env("TERN_METADATA", format!("127.0.0.1:{}", ports.metadata()))
        .env("TERN_SPARK_MASTER", tern_scheduler_api::spark_master_url(&format!("127.0.0.1:{}", ports.scheduler())))
        .env("TERN_CREDENTIAL_FILE", crate::common::tenant_credential(dir.path(), "gpu-team"));
    let script = root.join("spark-shuffle/tests/spark_gpus.py");
    let logs = || crate::common::logs_in(&dir.path().join("logs"));
    run_script(python, &jar, &script, "GPU executors right", &logs).await;
}

/// Two Spark applications at once in queues of weight 2 (`gold`) and 1 (`bronze`), each wanting 6
/// one-core executors, on 6 executor slots (two `tern executor`s of 3 CPUs, started once both
/// applications have submitted, so that neither holds the pool before the other asks). Executor
/// time measured from Tern's side (each application's running executor tasks, sampled every
/// 100 ms over 12 s while both still have executors queued) is 2:1 within 15%, and each driver
/// saw as many executors register as Tern ran for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_spark_applications_share_executors_by_queue_weight() {
    use std::time::{Duration, Instant};
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ensure_pyspark();
    let (jar, _) = build_plugin(root);
    let dir = tempfile::tempdir().unwrap();
    let port = tern_local::free_port_range(14).unwrap();
    let ports = tern_local::PortLayout::new(port, 2).unwrap();
    // The pool starts nothing (max 0): the test starts the executors itself, at the moment it picks.
    let _up = TernUp::start(dir.path(), port, &["--queue", "gold=2", "--queue", "bronze=1", "--max-executors", "0"]);
    let scheduler = format!("127.0.0.1:{}", ports.scheduler());
    // The test watches both queues as an operator; each application acts as its queue's tenant.
    let admin = tern_proto::identity::load_credential(&dir.path().join("credentials/admin")).unwrap();
    let client = tern_scheduler_api::SchedulerClient::connect(&scheduler, None, Some(&admin)).await.unwrap();
    let stop = dir.path().join("stop");
    let logs = || crate::common::logs_in(&dir.path().join("logs"));
    let script = root.join("spark-shuffle/tests/spark_share.py");
    let apps: Vec<_> = ["gold", "bronze"]
        .into_iter()
        .map(|queue| {
            tokio::process::Command::new("python3")
                .arg(&script)
                .env("TERN_METADATA", format!("127.0.0.1:{}", ports.metadata()))
                .env("TERN_SPARK_JAR", &jar)
                .env("TERN_SPARK_MASTER", tern_scheduler_api::spark_master_url(&scheduler))
                .env("TERN_QUEUE", queue)
                .env("TERN_CREDENTIAL_FILE", crate::common::tenant_credential(dir.path(), queue))
                .env("TERN_EXECUTORS", "6")
                .env("TERN_STOP", &stop)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .unwrap()
        })
        .collect();
    // Both applications' jobs, by queue.
    let deadline = Instant::now() + Duration::from_secs(90);
    let jobs = loop {
        let jobs = client.list_jobs(true).await.unwrap();
        let find = |queue: &str| jobs.iter().find(|j| j.queue == queue).map(|j| j.job_id.clone());
        if let (Some(gold), Some(bronze)) = (find("gold"), find("bronze")) {
            break [gold, bronze];
        }
        assert!(
            Instant::now() < deadline,
            "both applications did not submit within 90 s: {jobs:?}\n{}",
            tail(&logs(), 40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let executors: Vec<_> = (0..2)
        .map(|i| {
            tokio::process::Command::new(TERN)
                .args(["executor", "--scheduler", &scheduler, "--cpus", "3", "--memory", "3GiB"])
                .arg("--credential-file")
                .arg(dir.path().join("credentials/executor"))
                .args(["--name", &format!("share-{i}")])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .unwrap()
        })
        .collect();
    // Running and queued executor tasks of each application now.
    let counts = || async {
        let mut out = [(0u32, 0u32); 2];
        for (i, job) in jobs.iter().enumerate() {
            let status = client.job(job).await.unwrap();
            let stage = &status.stages[0];
            out[i] = (stage.running, stage.queued);
        }
        out
    };
    // Every slot taken (each Tern task is an executor JVM starting or running)...
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = counts().await;
        if now[0].0 + now[1].0 == 6 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "6 executor tasks did not start within 30 s: {now:?}\n{}",
            tail(&logs(), 40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // ...then executor time over a window in which both applications want more than they hold.
    const WINDOW: Duration = Duration::from_secs(12);
    let (mut time, start) = ([0f64; 2], Instant::now());
    let mut last = start;
    while start.elapsed() < WINDOW {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = counts().await;
        let dt = last.elapsed().as_secs_f64();
        last = Instant::now();
        for i in 0..2 {
            assert!(now[i].1 > 0, "application {i} stopped being backlogged: {now:?}");
            time[i] += f64::from(now[i].0) * dt;
        }
    }
    let ratio = time[0] / time[1];
    println!("executor seconds over {WINDOW:?}: gold {:.1}, bronze {:.1}, ratio {ratio:.2}", time[0], time[1]);
    assert!((ratio - 2.0).abs() <= 0.3, "gold:bronze executor time {ratio:.2}, not 2:1 within 15% ({time:?})");
    std::fs::write(&stop, "").unwrap();
    for (app, (queue, executors)) in apps.into_iter().zip([("gold", 4), ("bronze", 2)]) {
        let out = tokio::time::timeout(Duration::from_secs(60), app.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("the {queue} application did not end within 60 s of its stop file"))
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("share app done"),
            "the {queue} application failed:\n{stdout}\n{}",
            tail(&String::from_utf8_lossy(&out.stderr), 60)
        );
        let said = format!("queue {queue}: {executors} executors registered");
        assert!(stdout.contains(&said), "wanted {said:?}:\n{stdout}");
    }
    drop(executors);
}

/// A gang on real Spark, run as a user would after `tern up` (spark-shuffle/tests/spark_gang.py): a
/// bare `spark-submit` with SPARK_CONF_DIR set to the directory `tern up` wrote (its master and
/// Tern's shuffle, no --master or shuffle settings given) asks for 3 executors that start together
/// (`spark.tern.gang.minExecutors=3`) from a pool of at most 2 one-CPU executors. While the pool
/// holds 2, none of the 3 runs (the Tern job shows 0 running, its status says why, and so does the
/// driver's log, naming the key); once a third `tern executor` joins, all 3 start in one step, all
/// register with the driver after it joined and close together, and a shuffle through Tern counts
/// right. About 40 s (38 s on the 2-core machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spark_gang_starts_together_with_tern_ups_spark_defaults() {
    use std::time::{Duration, Instant};
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ensure_pyspark();
    let (jar, _) = build_plugin(root);
    let dir = tempfile::tempdir().unwrap();
    let port = tern_local::free_port_range(14).unwrap();
    let ports = tern_local::PortLayout::new(port, 2).unwrap();
    let executor_flags = ["--executor-cpus", "1", "--executor-memory", "1536MiB"];
    let _up = TernUp::start(
        dir.path(),
        port,
        &[&["--min-executors", "0", "--max-executors", "2", "--executor-idle-timeout", "120s"][..], &executor_flags]
            .concat(),
    );
    let scheduler = format!("127.0.0.1:{}", ports.scheduler());
    let master = tern_scheduler_api::spark_master_url(&scheduler);
    // `tern up` found the jar build.sh made beside its binary and wrote it into Spark's defaults.
    let conf_dir = dir.path().join("spark");
    let defaults = std::fs::read_to_string(conf_dir.join("spark-defaults.conf")).unwrap();
    for wanted in [&master, &jar, "io.tern.spark.TernShuffleManager"] {
        assert!(defaults.contains(wanted), "spark-defaults.conf lacks {wanted}:\n{defaults}");
    }
    let client = tern_scheduler_api::SchedulerClient::connect(&scheduler, None, None).await.unwrap();
    let logs = || crate::common::logs_in(&dir.path().join("logs"));
    let pyspark = Command::new("python3")
        .args(["-c", "import os, pyspark; print(os.path.dirname(pyspark.__file__))"])
        .output()
        .unwrap();
    let spark_submit = Path::new(String::from_utf8(pyspark.stdout).unwrap().trim()).join("bin/spark-submit");
    let start_file = dir.path().join("gang-start");
    let metrics: Vec<String> = (0..2).map(|i| format!("http://127.0.0.1:{}/metrics", ports.storage_admin(i))).collect();
    let app = tokio::process::Command::new(&spark_submit)
        .args(["--conf", "spark.tern.gang.minExecutors=3", "--conf", "spark.executor.instances=3"])
        .args(["--conf", "spark.executor.cores=1", "--conf", "spark.executor.memory=512m"])
        .args(["--conf", "spark.driver.memory=512m", "--conf", "spark.ui.enabled=false"])
        .arg(root.join("spark-shuffle/tests/spark_gang.py"))
        .env("SPARK_CONF_DIR", &conf_dir)
        .env_remove("SPARK_HOME")
        .env_remove("LD_LIBRARY_PATH")
        .env("TERN_SPARK_MASTER", &master)
        .env("TERN_GANG_START", &start_file)
        .env("TERN_STORAGE_METRICS", metrics.join(","))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // The application's job (`tern job list` shows it as spark-<app name>)...
    let deadline = Instant::now() + Duration::from_secs(60);
    let job = loop {
        let jobs = client.list_jobs(true).await.unwrap();
        if let Some(job) = jobs.iter().find(|j| j.name == "spark-gang") {
            break job.job_id.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the application did not submit within 60 s: {jobs:?}\n{}",
            tail(&logs(), 40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // ...waits on a pool that started its 2 executors for it, with nothing running, and says why.
    let deadline = Instant::now() + Duration::from_secs(20);
    while client.pool_status().await.unwrap().executors < 2 {
        assert!(Instant::now() < deadline, "the pool did not start 2 executors within 20 s\n{}", tail(&logs(), 40));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let waited = Instant::now();
    let mut blocked = String::new();
    while waited.elapsed() < Duration::from_secs(6) {
        let stage = client.job(&job).await.unwrap().stages.remove(0);
        assert_eq!((stage.running, stage.queued), (0, 3), "the gang must wait whole: {stage:?}");
        blocked = stage.blocked;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        blocked.contains("a gang of 3 tasks") && blocked.contains("the 2 live executors hold at most 2 of them"),
        "tern job status does not say why the gang waits: {blocked:?}"
    );
    // Capacity for all 3: another executor joins. The Tern side sees 0 running, then 3 at once.
    let unix_ms = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
    let joined_ms = unix_ms();
    let _extra = tokio::process::Command::new(TERN)
        .args(["executor", "--scheduler", &scheduler, "--name", "gang-extra", "--cpus", "1", "--memory", "1536MiB"])
        .arg("--credential-file")
        .arg(dir.path().join("credentials/executor"))
        .env_remove("LD_LIBRARY_PATH")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    std::fs::write(&start_file, joined_ms.to_string()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let stage = client.job(&job).await.unwrap().stages.remove(0);
        if stage.running > 0 {
            assert_eq!((stage.running, stage.queued), (3, 0), "the gang started in part: {stage:?}");
            break;
        }
        assert!(Instant::now() < deadline, "the gang did not start within 20 s: {stage:?}\n{}", tail(&logs(), 40));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = tokio::time::timeout(Duration::from_secs(120), app.wait_with_output())
        .await
        .expect("the application did not end within 120 s")
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("gang done"),
        "spark_gang.py failed:\n{stdout}\n--- stderr (tail) ---\n{}\n{}",
        tail(&stderr, 150),
        tail(&logs(), 60)
    );
    // The driver said why it waited, naming the key.
    let warned = |l: &&str| l.contains("spark.tern.gang.minExecutors = 3") && l.contains("hold at most 2 of them");
    let said: Vec<&str> =
        stderr.lines().filter(|l| l.contains("WARN") || l.contains("tern-executors")).take(40).collect();
    let warning = stderr.lines().find(warned);
    assert!(warning.is_some(), "no warning in the driver's log; its warnings:\n{}", said.join("\n"));
    println!("the driver said: {}", warning.unwrap_or_default());
}

/// `tern up` under test, started with `extra` flags; interrupted (Ctrl-C) when dropped.
/// `tern up` in `dir` with the pool the Spark suite runs on: 0 to 2 executors of 2 CPUs and
/// 1.5 GiB, each with GPUs "0" and "1" from a discovery script (this machine has none: for the
/// dynamic-allocation child's profile); the cluster, and its metadata and scheduler addresses.
fn up_with_spark_pool(dir: &Path) -> (TernUp, String, String) {
    let port = tern_local::free_port_range(14).unwrap();
    let ports = tern_local::PortLayout::new(port, 2).unwrap();
    let gpus = dir.join("gpus.sh");
    std::fs::write(&gpus, "#!/bin/sh\necho '{\"name\": \"gpu\", \"addresses\": [\"0\", \"1\"]}'\n").unwrap();
    std::fs::set_permissions(&gpus, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let flags = [
        ["--min-executors", "0"],
        ["--max-executors", "2"],
        ["--executor-cpus", "2"],
        ["--executor-memory", "1536MiB"],
        ["--executor-gpu-discovery-script", gpus.to_str().unwrap()],
    ];
    let up = TernUp::start(dir, port, flags.as_flattened());
    (up, format!("127.0.0.1:{}", ports.metadata()), format!("127.0.0.1:{}", ports.scheduler()))
}

struct TernUp(std::process::Child);

impl TernUp {
    fn start(dir: &Path, port: u16, extra: &[&str]) -> TernUp {
        use std::io::BufRead;
        let mut up = Command::new(TERN)
            .args(["up", "--dir", dir.to_str().unwrap(), "--port", &port.to_string(), "--dram", "512MiB"])
            .args(["--nvme-size", "0"])
            .args(extra)
            // Cargo's test runner points LD_LIBRARY_PATH at target/debug, which may hold a
            // libtern_spark.so older than the jar's; Spark's JVMs (the pool's executors start
            // them) must load the jar's, as a user's do.
            .env_remove("LD_LIBRARY_PATH")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let stdout = std::io::BufReader::new(up.stdout.take().unwrap());
        let mut lines = stdout.lines();
        // Ready once its banner says how to stop it (the pool and scheduler are up by then).
        loop {
            match lines.next() {
                Some(Ok(line)) if line.contains("Ctrl-C stops the cluster") => break,
                Some(Ok(_)) => {}
                _ => panic!("tern up exited before printing its banner"),
            }
        }
        // Keep draining its stdout so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        TernUp(up)
    }
}

impl Drop for TernUp {
    #[allow(unsafe_code)] // kill(2): Ctrl-C to our own child
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child process.
        unsafe {
            libc::kill(self.0.id() as libc::pid_t, libc::SIGINT);
        }
        let _ = self.0.wait();
    }
}

/// Long applications under storage pressure (see spark-shuffle/tests/spark_space.py): 2 storage
/// servers of 56 MiB DRAM each and no NVMe tier; each query shuffles ~30 MiB (~40 of the 112 blocks:
/// batches of three 256 KiB chunks fill three quarters of a 1 MiB block).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_applications_free_finished_queries_shuffles_under_storage_pressure() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ensure_pyspark();
    let (jar, _) = build_plugin(root);
    let cluster = Cluster::start(2, "56MiB").await;
    let mut python = tokio::process::Command::new("python3");
    python.env("TERN_METADATA", &cluster.metadata_addr);
    let script = root.join("spark-shuffle/tests/spark_space.py");
    run_script(python, &jar, &script, "storage pressure handled", &|| cluster.logs()).await;
}

/// Runs one of the plugin's Python test scripts with `python` (its cluster's environment set),
/// TERN_SPARK_JAR and TERN_BIN, printing its output; fails unless it exits 0 having printed
/// `done`, showing the tails of its stderr and of the cluster's `logs`.
async fn run_script(
    mut python: tokio::process::Command,
    jar: &str,
    script: &Path,
    done: &str,
    logs: &(dyn Fn() -> String + Sync),
) {
    let out = python
        .arg(script)
        .env("TERN_SPARK_JAR", jar)
        .env("TERN_BIN", TERN)
        .output()
        .await
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    let name = script.file_name().unwrap_or_default().to_string_lossy();
    assert!(
        out.status.success(),
        "{name} failed:\n{stdout}\n--- stderr (tail) ---\n{}\n{}",
        tail(&String::from_utf8_lossy(&out.stderr), 200),
        tail(&logs(), 60)
    );
    assert!(stdout.contains(done), "{stdout}");
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Unmounts a test mount when dropped.
struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// The jar carries a library per platform and unpacks it where it may run: with java.io.tmpdir on
/// a noexec mount it loads from the directory it is given (`spark.tern.nativeDir`, or Spark's
/// local dir), and where that directory is noexec too the error names it and the setting.
#[test]
fn the_native_library_is_per_platform_and_never_assumes_tmp_is_executable() {
    #[allow(unsafe_code)] // geteuid(2): std has no safe wrapper
    // SAFETY: geteuid only reads the process's credentials.
    let root_user = unsafe { libc::geteuid() } == 0;
    assert!(root_user, "this test needs root: it mounts a noexec tmpfs (CI runs as root)");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ensure_pyspark();
    let (jar, said) = build_plugin(root);

    let listing = Command::new("jar").args(["tf", &jar]).output().expect("running jar tf");
    let listing = String::from_utf8_lossy(&listing.stdout);
    let has = |platform: &str| listing.contains(&format!("native/{platform}/libtern_spark.so"));
    assert!(has("linux-x86_64"), "no linux-x86_64 library:\n{listing}");
    // aarch64 needs rustup to fetch the target; build.sh says loudly when it could not.
    if said.contains("WARNING: rustup cannot install the aarch64-unknown-linux-gnu target") {
        println!("not checked: the jar's linux-aarch64 library (build.sh could not install the Rust target)");
    } else {
        assert!(has("linux-aarch64"), "no linux-aarch64 library:\n{listing}");
    }

    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let noexec = dir.path().join("noexec");
    let exec = dir.path().join("exec");
    std::fs::create_dir_all(&noexec).unwrap();
    let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", "noexec,size=256m", "tmpfs"]).arg(&noexec).status();
    assert!(mounted.is_ok_and(|s| s.success()), "mounting a noexec tmpfs at {} failed", noexec.display());
    let _mount = Mount(noexec.clone());
    let load = |dir: Option<&Path>| {
        let mut java = Command::new("java");
        // Nothing on the library path: the jar's copy is the one loaded.
        java.arg("-Djava.library.path=/nonexistent").arg(format!("-Djava.io.tmpdir={}", noexec.display()));
        java.args(["-cp", &jar, "io.tern.spark.NativeLibrary"]).args(dir);
        let out = java.env_remove("TERN_SPARK_NATIVE_DIR").output().expect("running java");
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    };

    let (ok, said) = load(Some(&exec));
    assert!(ok, "{said}");
    assert!(
        said.contains(&format!("loaded libtern_spark from {}/tern-native/libtern_spark-", exec.display())),
        "{said}"
    );
    // A second JVM finds the same file (named by its hash) and loads it without writing again.
    let unpacked: Vec<_> = std::fs::read_dir(exec.join("tern-native")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(unpacked.len(), 1, "{unpacked:?}");
    let (ok, again) = load(Some(&exec));
    assert!(ok && again == said, "{again}");

    // Left to java.io.tmpdir, which is noexec: a clear error, not a bare link error.
    let (ok, said) = load(None);
    assert!(!ok, "loaded from a noexec directory?\n{said}");
    assert!(
        said.contains(&noexec.join("tern-native").display().to_string())
            && said.contains("does not allow executing files")
            && said.contains("spark.tern.nativeDir"),
        "{said}"
    );
}

/// `tern bench spark-small` on a few of its jobs: both backends run, every job's result is the
/// same on both (the bench fails otherwise), and the report has a ratio per pair.
#[test]
fn the_small_jobs_bench_compares_results_and_times() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ensure_pyspark();
    let (jar, _) = build_plugin(root);
    let jobs = "group_count,join,window_top3,except";
    let out = Command::new(TERN)
        .args(["bench", "spark-small", "--pairs", "1", "--rows", "20000", "--jobs", jobs, "--json", "--jar", &jar])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", tail(&String::from_utf8_lossy(&out.stderr), 80));
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let names: Vec<&str> = report["jobs"].as_array().unwrap().iter().map(|j| j[0].as_str().unwrap()).collect();
    assert_eq!(names.join(","), jobs);
    assert_eq!(report["ratio"]["runs"], 1);
    assert!(report["ratio"]["median"].as_f64().is_some_and(|r| r > 0.0), "{stdout}");
    // `except` removes some rows and keeps others: a digest of something, not of nothing.
    let except = &report["tern_runs"][0]["jobs"][3];
    assert!(except["rows"].as_u64().is_some_and(|rows| rows > 0), "{stdout}");
}

/// `tern bench spark-pool` with one executor and two runs of each kind (pool, local-cluster,
/// local-cluster, pool): every TeraSort validates on both; the first pool application's executor
/// starts cold and teaches its Tern executor the kind, the second is a parked JVM handed off
/// (`tern executor --warm-spark-executors`, 1 by default). How much sooner is the bench's to say,
/// not this test's.
#[test]
fn the_spark_pool_bench_hands_the_second_application_a_parked_executor_jvm() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ensure_pyspark();
    let (jar, _) = build_plugin(root);
    let scratch = tempfile::tempdir().unwrap();
    let out = Command::new(TERN)
        .args(["bench", "spark-pool", "--size", "8MiB", "--executors", "1", "--runs", "2", "--json", "--jar", &jar])
        .arg("--scratch")
        .arg(scratch.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", tail(&String::from_utf8_lossy(&out.stderr), 80));
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(report["all_valid"], true, "{stdout}");
    let pool: Vec<&serde_json::Value> = report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["executors_from"] == "tern-pool")
        .flat_map(|r| r["result"]["executors"].as_array().unwrap())
        .collect();
    assert_eq!(pool.len(), 2, "{stdout}");
    assert_eq!((&pool[0]["warm"], &pool[1]["warm"]), (&false.into(), &true.into()), "{stdout}");
    let warm = &report["pool_acquisition"]["warm_request_to_registered_s"];
    assert_eq!(warm["runs"], 1, "{stdout}");
}

/// `tern bench tpcds` at scale factor 0.01 (tpcgen-cli takes fractions) on four shuffle-heavy
/// queries: the packages are pip-installed and the data generated into a fresh cache, both
/// systems run every query, each result is the same on both (the bench fails otherwise), and the
/// report has the per-query and total figures.
#[test]
fn the_tpcds_bench_compares_every_query_on_both_shuffles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ensure_pyspark();
    let (jar, _) = build_plugin(root);
    let cache = tempfile::tempdir().unwrap();
    let queries = "q24a,q25,q27,q39a";
    let out = Command::new(TERN)
        .args(["bench", "tpcds", "--scale", "0.01", "--queries", queries, "--pairs", "1", "--json", "--jar", &jar])
        .arg("--cache")
        .arg(cache.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", tail(&String::from_utf8_lossy(&out.stderr), 80));
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let names: Vec<&str> = report["queries"].as_array().unwrap().iter().map(|q| q["name"].as_str().unwrap()).collect();
    assert_eq!(names.join(","), queries);
    assert!(report["queries"].as_array().unwrap().iter().all(|q| q["outcome"] == "same"), "{stdout}");
    assert_eq!((report["compared"].as_u64(), report["same"].as_u64()), (Some(4), Some(4)), "{stdout}");
    assert_eq!(report["all_same"], true);
    assert_eq!(report["ratio"]["runs"], 1);
    assert!(report["ratio"]["median"].as_f64().is_some_and(|r| r > 0.0), "{stdout}");
    assert!(report["tern_total_seconds"]["median"].as_f64().is_some_and(|s| s > 0.0), "{stdout}");
    // q27 (a rollup over store sales) returns 100 rows at this scale: a comparison of something.
    assert_eq!(report["queries"][2]["rows"], 100, "{stdout}");
}
