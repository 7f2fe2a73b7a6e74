//! `tern bench spark-pool`: Spark executors from Tern's pool (master `local-cluster-tern://`, Tern's
//! scheduler and a warm `tern up` pool) against Spark's own local-cluster executors, the same
//! cores and memory, the same Tern shuffle, in one run: how long executors take to come, and a
//! TeraSort on them (the plugin jar's `PoolRun`, which runs `TeraSort`), in `--runs` runs whose
//! order rotates; every output validated.
//!
//! Acquisition of an executor on the pool: from the backend asking Tern's scheduler for its task
//! (`TernSchedulerBackend.requestedAtMs`) to its registration with the driver (Spark's
//! `SparkListenerExecutorAdded`), split at the executor's start: its JVM's start (its
//! RuntimeMXBean), or for a parked JVM (`tern executor --warm-spark-executors`) its hand-off.
//! Before it is Tern's part (scheduling, the pool executor's poll, the launch or hand-off), after
//! it the JVM's start and Spark's registration, which local-cluster executors pay whole. The first
//! pool run's executors start cold (each Tern executor learns the kind from them); later runs'
//! come from parked JVMs, and the report gives both. All on one machine's clock.

use std::path::PathBuf;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressDrawTarget};
use serde::{Deserialize, Serialize};
use tern_common::Spread;
use tern_local::cluster::EmbeddedCluster;
use tern_terasort::tasks::{self, Location};
use tern_terasort::RECORD_LEN;

use crate::spark::{plugin_confs, submit_for_result, SparkRun, SparkSetup};

pub struct SparkPoolOptions {
    pub tern: PathBuf,
    pub size_bytes: u64,
    /// Executors of each application (and the pool's warm executors).
    pub executors: u32,
    /// Runs of each kind (the order rotates).
    pub runs: usize,
    /// Executor memory (heap) in MiB; each executor has 1 core.
    pub executor_memory_mib: u64,
    pub spark: SparkSetup,
    pub scratch: PathBuf,
    pub quiet: bool,
}

/// Where the executors came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Executors {
    TernPool,
    LocalCluster,
}

/// One executor's times as `PoolRun` reports them (ms since the epoch; -1: not known).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecutorTimes {
    pub id: String,
    pub requested_ms: i64,
    pub jvm_start_ms: i64,
    pub registered_ms: i64,
    /// A parked JVM became this executor: `jvm_start_ms` is the hand-off.
    #[serde(default)]
    pub warm: bool,
}

/// What `PoolRun` prints.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolRunResult {
    pub application_start_ms: i64,
    pub executors: Vec<ExecutorTimes>,
    pub terasort: SparkRun,
}

#[derive(Debug, Serialize)]
pub struct Run {
    pub executors_from: Executors,
    pub result: PoolRunResult,
    pub valid: bool,
}

/// Seconds, as medians and ranges over every executor of every run.
#[derive(Debug, Serialize)]
pub struct Acquisition {
    /// Request to registration (pool only: local-cluster has no per-executor request time).
    pub request_to_registered_s: Option<Spread>,
    /// Its 50th percentile.
    pub p50_s: Option<f64>,
    /// Request to registration of the executors that were parked JVMs, and of those started cold
    /// (pool only).
    pub warm_request_to_registered_s: Option<Spread>,
    pub cold_request_to_registered_s: Option<Spread>,
    /// Request to the executor JVM's start: Tern's part (pool only).
    pub request_to_jvm_s: Option<Spread>,
    /// JVM start to registration: the JVM's and Spark's part.
    pub jvm_to_registered_s: Spread,
    /// Application start (after the cluster manager started) to registration.
    pub app_start_to_registered_s: Spread,
}

#[derive(Debug, Serialize)]
pub struct SparkPoolReport {
    pub size_bytes: u64,
    pub partitions: usize,
    pub executors: u32,
    pub executor_cores: u32,
    pub executor_memory_mib: u64,
    pub runs: Vec<Run>,
    pub pool_acquisition: Acquisition,
    pub local_cluster_acquisition: Acquisition,
    pub pool_terasort_s: Spread,
    pub local_cluster_terasort_s: Spread,
    /// Of the per-run ratios pool / local-cluster (run i of each; the target: at most 1.1).
    pub terasort_ratio: Spread,
    pub all_valid: bool,
}

/// The two kinds in run `run`'s order.
pub fn run_order(run: usize) -> Vec<Executors> {
    tern_common::rotation(&[Executors::TernPool, Executors::LocalCluster], run)
}

fn seconds(from: i64, to: i64) -> Option<f64> {
    (from > 0 && to > 0).then(|| (to - from) as f64 / 1000.0)
}

/// Sums up the acquisition times of `runs` (all of one kind).
fn acquisition(runs: &[&Run]) -> Acquisition {
    let all = |f: &dyn Fn(i64, &ExecutorTimes) -> Option<f64>| -> Vec<f64> {
        runs.iter()
            .flat_map(|r| r.result.executors.iter().filter_map(|e| f(r.result.application_start_ms, e)))
            .collect()
    };
    let requested = all(&|_, e| seconds(e.requested_ms, e.registered_ms));
    let warm = all(&|_, e| seconds(e.requested_ms, e.registered_ms).filter(|_| e.warm));
    let cold = all(&|_, e| seconds(e.requested_ms, e.registered_ms).filter(|_| !e.warm));
    let to_jvm = all(&|_, e| seconds(e.requested_ms, e.jvm_start_ms));
    let some = |v: Vec<f64>| (!v.is_empty()).then(|| Spread::of(v));
    let request_to_registered_s = some(requested);
    Acquisition {
        p50_s: request_to_registered_s.as_ref().map(|s| s.median),
        request_to_registered_s,
        warm_request_to_registered_s: some(warm),
        cold_request_to_registered_s: some(cold),
        request_to_jvm_s: some(to_jvm),
        jvm_to_registered_s: Spread::of(all(&|_, e| seconds(e.jvm_start_ms, e.registered_ms))),
        app_start_to_registered_s: Spread::of(all(&|start, e| seconds(start, e.registered_ms))),
    }
}

pub async fn run(options: &SparkPoolOptions) -> anyhow::Result<SparkPoolReport> {
    anyhow::ensure!(options.runs >= 1, "--runs must be at least 1");
    anyhow::ensure!((1..=16).contains(&options.executors), "--executors must be 1 to 16");
    let (plugin, home, submit) = options.spark.resolve()?;
    std::fs::create_dir_all(&options.scratch)?;
    // Absolute: spark-submit runs in the work directory (Spark copies the application's jar into
    // its working directory).
    let scratch = std::fs::canonicalize(&options.scratch)?;
    let work = tempfile::tempdir_in(&scratch)?;
    let progress = MultiProgress::with_draw_target(if options.quiet {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    });
    let input = work.path().join("input");
    let records = options.size_bytes / RECORD_LEN as u64;
    let generated = tasks::teragen(
        None,
        records,
        tasks::default_tasks(options.size_bytes),
        &Location::Local(input.clone()),
        tern_client::CreateOptions::default(),
        &progress,
    )
    .await?;
    let partitions = ((options.size_bytes >> 26) as usize).max(4);
    // Each pool executor holds one Spark executor: 1 CPU, the heap plus Spark's overhead (at
    // least 384 MiB) and some room.
    let grant_mib = options.executor_memory_mib + options.executor_memory_mib.div_ceil(10).max(384);
    let n = options.executors.to_string();
    let pool = [
        "--min-executors".to_string(),
        n.clone(),
        "--max-executors".into(),
        n.clone(),
        "--executor-cpus".into(),
        "1".into(),
        "--executor-memory".into(),
        format!("{}MiB", grant_mib + 128),
    ];
    let room = format!("{}MiB", ((options.size_bytes >> 20) + 256).max(512));
    let cluster = EmbeddedCluster::start_with(&options.tern, 2, &room, "1MiB", Some("off"), work.path(), &pool).await?;
    wait_for_pool(&cluster.scheduler_addr(), options.executors).await?;
    let local_cluster = format!("local-cluster[{n},1,{}]", options.executor_memory_mib + 124);
    let tern_master = tern_scheduler_api::spark_master_url(&cluster.scheduler_addr());
    let mut runs = Vec::new();
    for run in 0..options.runs {
        for kind in run_order(run) {
            let master = match kind {
                Executors::TernPool => &tern_master,
                Executors::LocalCluster => &local_cluster,
            };
            // The same start for both: a pool run leaves its Tern executors parking JVMs (seconds
            // of CPU), which must not land on the next run, whichever kind it is.
            let busy = wait_for_quiet().await;
            if !options.quiet {
                eprintln!(
                    "spark-pool: run {} on {kind:?} ({master}; CPU {:.0}% busy before) ...",
                    run + 1,
                    busy * 100.0
                );
            }
            let out = work.path().join(format!("out-{run}-{kind:?}"));
            let mut command = tokio::process::Command::new(&submit);
            command
                .current_dir(work.path())
                .env("SPARK_HOME", &home)
                .args(["--master", master, "--class", "io.tern.spark.tools.PoolRun"])
                .args(["--driver-memory", &options.spark.driver_memory])
                .args(["--executor-memory", &format!("{}m", options.executor_memory_mib)])
                .args(["--conf", "spark.executor.cores=1", "--conf", &format!("spark.executor.instances={n}")])
                .args(["--conf", "spark.extraListeners=io.tern.spark.tools.PoolRun$Times"])
                .args(["--conf", "spark.serializer=org.apache.spark.serializer.KryoSerializer"]);
            for conf in plugin_confs(&plugin, Some(&cluster.metadata_addr)) {
                command.args(["--conf", &conf]);
            }
            command.arg(&plugin.jar).arg(&n).arg(&input).arg(&out).arg(partitions.to_string());
            let result: PoolRunResult =
                submit_for_result(command, "POOLRUN ", &format!("{kind:?}"), Duration::from_secs(1800)).await?;
            anyhow::ensure!(
                result.executors.len() == options.executors as usize,
                "{kind:?} run {}: {} executors reported, wanted {}",
                run + 1,
                result.executors.len(),
                options.executors
            );
            let summary = tasks::teravalidate(None, &Location::Local(out.clone()), &progress).await?;
            let valid =
                summary.sorted() && summary.checksum == generated.checksum && summary.records == generated.records;
            std::fs::remove_dir_all(&out).ok();
            if !options.quiet {
                eprintln!("spark-pool: {kind:?}: terasort {:.2} s, output valid: {valid}", result.terasort.seconds);
            }
            runs.push(Run { executors_from: kind, result, valid });
        }
    }
    drop(cluster);
    let of = |kind: Executors| runs.iter().filter(|r| r.executors_from == kind).collect::<Vec<_>>();
    let (pool_runs, local_runs) = (of(Executors::TernPool), of(Executors::LocalCluster));
    let terasort = |runs: &[&Run]| Spread::of(runs.iter().map(|r| r.result.terasort.seconds).collect());
    let ratios =
        pool_runs.iter().zip(&local_runs).map(|(p, l)| p.result.terasort.seconds / l.result.terasort.seconds).collect();
    Ok(SparkPoolReport {
        size_bytes: records * RECORD_LEN as u64,
        partitions,
        executors: options.executors,
        executor_cores: 1,
        executor_memory_mib: options.executor_memory_mib,
        pool_acquisition: acquisition(&pool_runs),
        local_cluster_acquisition: acquisition(&local_runs),
        pool_terasort_s: terasort(&pool_runs),
        local_cluster_terasort_s: terasort(&local_runs),
        terasort_ratio: Spread::of(ratios),
        all_valid: runs.iter().all(|r| r.valid),
        runs,
    })
}

/// Waits (up to [`QUIET_WAIT`]) until the machine's CPUs are less than [`QUIET_BUSY`] busy over
/// half a second; returns the last busy fraction.
async fn wait_for_quiet() -> f64 {
    let deadline = std::time::Instant::now() + QUIET_WAIT;
    let mut busy = 1.0;
    while std::time::Instant::now() < deadline {
        let before = cpu_jiffies();
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let (Some((total0, idle0)), Some((total1, idle1))) = (before, cpu_jiffies()) {
            busy = 1.0 - (idle1 - idle0) as f64 / (total1 - total0).max(1) as f64;
            if busy < QUIET_BUSY {
                break;
            }
        } else {
            break;
        }
    }
    busy
}

/// Below this busy fraction the machine counts as quiet.
const QUIET_BUSY: f64 = 0.25;
/// Longest wait for a quiet machine before a run.
const QUIET_WAIT: Duration = Duration::from_secs(30);

/// All CPUs' (total, idle + iowait) jiffies from /proc/stat.
fn cpu_jiffies() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat.lines().next()?.split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    (fields.len() >= 5).then(|| (fields.iter().sum(), fields[3] + fields[4]))
}

/// Waits until the pool's warm executors have registered with the scheduler.
async fn wait_for_pool(scheduler: &str, executors: u32) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(client) = tern_scheduler_api::SchedulerClient::connect(scheduler, None, None).await {
            if client.pool_status().await.is_ok_and(|p| p.executors >= executors) {
                return Ok(());
            }
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the pool's {executors} executors did not register within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn print_table(r: &SparkPoolReport) {
    println!(
        "Spark executors from Tern's warm pool vs Spark's local-cluster: {} executors of {} core and {} MiB, \
         TeraSort of {} bytes in {} partitions, {} runs each (order rotates); median [min-max]:",
        r.executors, r.executor_cores, r.executor_memory_mib, r.size_bytes, r.partitions, r.pool_terasort_s.runs
    );
    let opt = |s: &Option<Spread>| s.as_ref().map_or("n/a".to_string(), |s| s.to_string());
    for (name, a) in [("pool", &r.pool_acquisition), ("local-cluster", &r.local_cluster_acquisition)] {
        println!("  {name} executor acquisition, s (every executor of every run):");
        println!(
            "    request -> registered with the driver  {}   (target p50 <= 1.5)",
            opt(&a.request_to_registered_s)
        );
        println!("      from a parked JVM  {}", opt(&a.warm_request_to_registered_s));
        println!("      from a JVM started cold  {}", opt(&a.cold_request_to_registered_s));
        println!(
            "    request -> executor started (Tern's part: a JVM start or a hand-off)  {}",
            opt(&a.request_to_jvm_s)
        );
        println!("    executor started -> registered (the JVM and Spark)  {}", a.jvm_to_registered_s);
        println!("    application start -> registered  {}", a.app_start_to_registered_s);
    }
    println!("  TeraSort on the pool           {} s", r.pool_terasort_s);
    println!("  TeraSort on local-cluster      {} s", r.local_cluster_terasort_s);
    println!("  ratio pool / local-cluster, per run  {}   (target <= 1.1)", r.terasort_ratio);
    println!("  every output valid: {}", r.all_valid);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_rotate_and_acquisition_splits_at_the_jvm_start() {
        assert_eq!(run_order(0), [Executors::TernPool, Executors::LocalCluster]);
        assert_eq!(run_order(1), [Executors::LocalCluster, Executors::TernPool]);
        let times = |requested_ms, jvm_start_ms, registered_ms| ExecutorTimes {
            id: "0".into(),
            requested_ms,
            jvm_start_ms,
            registered_ms,
            warm: requested_ms > 0 && registered_ms - requested_ms < 1500,
        };
        let run = |executors| Run {
            executors_from: Executors::TernPool,
            result: PoolRunResult { application_start_ms: 900, executors, terasort: SparkRun::default() },
            valid: true,
        };
        let (a, b) = (run(vec![times(1000, 1100, 3000), times(1000, 1300, 2000)]), run(vec![times(-1, 1100, 1600)]));
        let acq = acquisition(&[&a, &b]);
        let req = acq.request_to_registered_s.unwrap();
        assert_eq!((req.min, req.max, req.runs), (1.0, 2.0, 2));
        assert_eq!(acq.warm_request_to_registered_s.unwrap().max, 1.0);
        assert_eq!(acq.cold_request_to_registered_s.unwrap().runs, 1);
        assert_eq!(acq.request_to_jvm_s.unwrap().max, 0.3);
        assert_eq!((acq.jvm_to_registered_s.min, acq.jvm_to_registered_s.runs), (0.5, 3));
        assert_eq!(acq.app_start_to_registered_s.max, 2.1);
        let json = serde_json::to_value(&a).unwrap();
        assert_eq!(json["executors_from"], "tern-pool");
    }
}
