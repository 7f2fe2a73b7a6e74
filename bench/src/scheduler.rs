//! `tern bench scheduler`: how fast the scheduler hands out tasks, and how fast a new executor
//! starts running one.
//!
//! - Dispatch: `tern up --executors E` (the real scheduler and E real executor processes of
//!   8 CPUs each), then jobs of `noop` tasks; tasks/s = tasks over the time from submission until
//!   the job has succeeded (every task assigned, run and reported). Two kinds, each measured
//!   `runs` times in rotating order after a small warm-up job, reported as median and range:
//!   - tiny tasks (0.001 CPU each): one executor holds thousands at once, so assignments are
//!     batched; this is the scheduler's bookkeeping rate, not its placement rate;
//!   - whole-CPU tasks (1 CPU each): an executor of 8 CPUs runs 8 at once, so the scheduler
//!     places every task into a slot a finished one freed: the placement rate.
//! - Cold start: a job of `noop` tasks that sleep keeps a backlog; then, one at a time, an
//!   executor process is started and timed from just before spawn to the moment it logs
//!   "first task running" (it has registered, polled, been given a task and started it); it is
//!   then stopped (it leaves, and its task goes back to the backlog for the next one).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use tern_common::{percentile, percentile_if_supported, rotation, Spread};
use tern_proto::sched as pb;
use tern_scheduler_api::{spec, SchedulerClient};
use tern_terasort::{driver, tasks};
use tokio::io::AsyncBufReadExt;

use tern_local::cluster::EmbeddedCluster;

/// How to run the benchmark.
#[derive(Debug, Clone)]
pub struct SchedulerBenchOptions {
    /// The `tern` binary.
    pub tern: PathBuf,
    /// Tiny (0.001 CPU) noop tasks dispatched in each measured job.
    pub tasks: u32,
    /// Whole-CPU noop tasks dispatched in each measured job.
    pub whole_cpu_tasks: u32,
    /// Measurements of each dispatch kind.
    pub runs: u32,
    /// Executors they are dispatched to.
    pub executors: u32,
    /// Executor starts timed.
    pub cold_starts: u32,
    /// Show progress on stderr.
    pub progress: bool,
}

/// What `tern bench scheduler --json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct SchedulerBenchReport {
    /// Median of `tiny_tasks_per_s` (the figure this benchmark has always printed).
    pub tasks_per_s: f64,
    /// Tiny (0.001 CPU, batched) noop tasks per second over `runs` jobs of `tasks` each.
    pub tiny_tasks_per_s: Spread,
    /// Whole-CPU noop tasks per second over `runs` jobs of `whole_cpu_tasks` each: every task
    /// placed into a freed CPU.
    pub whole_cpu_tasks_per_s: Spread,
    pub executors: u32,
    /// CPUs each executor offers: whole-CPU tasks running at once per executor.
    pub executor_cpus: u32,
    pub tasks: u32,
    pub whole_cpu_tasks: u32,
    pub runs: u32,
    /// Median seconds of a tiny-task job.
    pub dispatch_seconds: f64,
    pub cold_starts: u32,
    pub cold_start_ms_p50: f64,
    /// None where `cold_starts` is too few to support it (p90 needs 10, p99 100).
    pub cold_start_ms_p90: Option<f64>,
    pub cold_start_ms_p99: Option<f64>,
    pub cold_start_ms_min: f64,
    pub cold_start_ms_max: f64,
}

/// CPUs a tiny noop task asks for: small, so one executor holds thousands at once.
const NOOP_CPU_MILLI: u64 = 1;
/// CPUs a whole-CPU noop task asks for.
const WHOLE_CPU_MILLI: u64 = 1000;
const NOOP_MEMORY_BYTES: u64 = 1 << 10;
/// What each benchmark executor offers.
const EXECUTOR_CPUS: u32 = 8;
const EXECUTOR_MEMORY: &str = "64GiB";
/// How long any one phase may take before the benchmark gives up.
const PHASE_TIMEOUT: Duration = Duration::from_secs(300);

pub async fn run(options: &SchedulerBenchOptions) -> anyhow::Result<SchedulerBenchReport> {
    if options.tasks == 0
        || options.whole_cpu_tasks == 0
        || options.runs == 0
        || options.executors == 0
        || options.cold_starts == 0
    {
        bail!("--tasks, --whole-cpu-tasks, --runs, --executors and --cold-starts must each be at least 1");
    }
    let say = |text: String| {
        if options.progress {
            eprintln!("{text}");
        }
    };

    // Dispatch.
    let pool = [
        "--executors".to_string(),
        options.executors.to_string(),
        "--executor-cpus".into(),
        EXECUTOR_CPUS.to_string(),
        "--executor-memory".into(),
        EXECUTOR_MEMORY.into(),
        "--executor-gpus".into(),
        "0".into(),
    ];
    say(format!("starting a cluster with {} executors...", options.executors));
    let cluster = start_cluster(&options.tern, &pool).await?;
    let scheduler = connect(&cluster).await?;
    wait_for_executors(&scheduler, options.executors).await?;
    say("warm-up job...".into());
    run_noop_job(&scheduler, "warm-up", options.tasks.min(2000), NOOP_CPU_MILLI).await?;
    let (mut tiny, mut whole) = (Vec::new(), Vec::new());
    for run in 0..options.runs {
        for kind in rotation(&[Dispatch::Tiny, Dispatch::WholeCpu], run as usize) {
            let (tasks, cpu_milli, runs) = match kind {
                Dispatch::Tiny => (options.tasks, NOOP_CPU_MILLI, &mut tiny),
                Dispatch::WholeCpu => (options.whole_cpu_tasks, WHOLE_CPU_MILLI, &mut whole),
            };
            let took = run_noop_job(&scheduler, &format!("dispatch-{kind:?}-{run}"), tasks, cpu_milli).await?;
            let rate = f64::from(tasks) / took.as_secs_f64();
            say(format!("  run {}: {tasks} {kind:?} tasks: {rate:.0} tasks/s ({:.3} s)", run + 1, took.as_secs_f64()));
            runs.push(rate);
        }
    }
    drop(cluster);

    // Cold start.
    say(format!("timing {} executor starts...", options.cold_starts));
    let no_executors = ["--executors".to_string(), "0".into()];
    let cluster = start_cluster(&options.tern, &no_executors).await?;
    let scheduler = connect(&cluster).await?;
    let hold = noop_job("cold-start", options.cold_starts.max(2), 600_000, 1000);
    let hold_id = scheduler.submit(hold).await?;
    let mut starts_ms = Vec::with_capacity(options.cold_starts as usize);
    for run in 0..options.cold_starts {
        let ms = time_executor_start(&options.tern, &cluster).await?;
        say(format!("  start {}: {ms:.1} ms", run + 1));
        starts_ms.push(ms);
    }
    scheduler.cancel(&hold_id).await?;
    drop(cluster);

    Ok(shape_report(options, tiny, whole, starts_ms))
}

/// The two kinds of dispatch measured.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Dispatch {
    Tiny,
    WholeCpu,
}

/// The report from the measured rates (tasks/s per run) and cold starts (ms).
fn shape_report(
    options: &SchedulerBenchOptions,
    tiny: Vec<f64>,
    whole: Vec<f64>,
    mut starts_ms: Vec<f64>,
) -> SchedulerBenchReport {
    starts_ms.sort_by(f64::total_cmp);
    let tiny_tasks_per_s = Spread::of(tiny);
    SchedulerBenchReport {
        tasks_per_s: tiny_tasks_per_s.median,
        dispatch_seconds: f64::from(options.tasks) / tiny_tasks_per_s.median,
        tiny_tasks_per_s,
        whole_cpu_tasks_per_s: Spread::of(whole),
        executors: options.executors,
        executor_cpus: EXECUTOR_CPUS,
        tasks: options.tasks,
        whole_cpu_tasks: options.whole_cpu_tasks,
        runs: options.runs,
        cold_starts: starts_ms.len() as u32,
        cold_start_ms_p50: percentile(&starts_ms, 50.0),
        cold_start_ms_p90: percentile_if_supported(&starts_ms, 90.0),
        cold_start_ms_p99: percentile_if_supported(&starts_ms, 99.0),
        cold_start_ms_min: starts_ms.first().copied().unwrap_or(f64::NAN),
        cold_start_ms_max: starts_ms.last().copied().unwrap_or(f64::NAN),
    }
}

/// A percentile in ms, or "n/a" where the samples do not support it.
fn ms_or_na(value: Option<f64>) -> String {
    value.map_or_else(|| "n/a".to_string(), |ms| format!("{ms:.1} ms"))
}

pub fn print_table(report: &SchedulerBenchReport) {
    println!(
        "scheduler dispatch to {} executors of {} CPUs, tasks/s, median [min-max] of {} runs:",
        report.executors, report.executor_cpus, report.runs
    );
    println!(
        "  tiny tasks (0.001 CPU, batched)  {:.0}   ({} tasks a job; target >= 10000 tasks/s)",
        report.tiny_tasks_per_s, report.tasks
    );
    println!(
        "  whole-CPU tasks (1 CPU, placed)  {:.0}   ({} tasks a job; {} run at once)",
        report.whole_cpu_tasks_per_s,
        report.whole_cpu_tasks,
        report.executors * report.executor_cpus
    );
    println!("executor cold start (process start to first task running), {} starts:", report.cold_starts);
    println!(
        "  p50 {:.1} ms   p90 {}   p99 {}   min {:.1} ms   max {:.1} ms   (target p50 <= 50 ms; \
         p90 needs 10 samples, p99 100)",
        report.cold_start_ms_p50,
        ms_or_na(report.cold_start_ms_p90),
        ms_or_na(report.cold_start_ms_p99),
        report.cold_start_ms_min,
        report.cold_start_ms_max
    );
}

async fn start_cluster(tern: &std::path::Path, extra: &[String]) -> anyhow::Result<EmbeddedCluster> {
    EmbeddedCluster::start_with(tern, 1, "256MiB", "1MiB", None, &std::env::temp_dir(), extra).await
}

/// The cluster's scheduler, once it answers.
async fn connect(cluster: &EmbeddedCluster) -> anyhow::Result<SchedulerClient> {
    let started = Instant::now();
    loop {
        if let Ok(client) = SchedulerClient::connect(&cluster.scheduler_addr(), None, None).await {
            if client.pool_status().await.is_ok() {
                return Ok(client);
            }
        }
        if started.elapsed() > Duration::from_secs(30) {
            bail!("the scheduler at {} did not answer within 30 s", cluster.scheduler_addr());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_for_executors(scheduler: &SchedulerClient, executors: u32) -> anyhow::Result<()> {
    let started = Instant::now();
    while scheduler.pool_status().await?.executors < executors {
        if started.elapsed() > Duration::from_secs(30) {
            bail!("{executors} executors did not register within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// A job of one stage of `tasks` noop tasks.
fn noop_job(name: &str, tasks: u32, sleep_ms: u64, cpu_milli: u64) -> pb::JobSpec {
    let params =
        if sleep_ms > 0 { [("sleep_ms".to_string(), sleep_ms.to_string())].into() } else { Default::default() };
    pb::JobSpec {
        name: name.into(),
        stages: vec![pb::StageSpec {
            name: "noop".into(),
            operator: Some(pb::Operator { name: "noop".into(), params, ..Default::default() }),
            tasks,
            needs: Some(pb::Resources { cpu_milli, memory_bytes: NOOP_MEMORY_BYTES, gpu_milli: 0 }),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Submits a job of `tasks` noop tasks of `cpu_milli` each and waits until it succeeds; returns
/// the time taken.
async fn run_noop_job(scheduler: &SchedulerClient, name: &str, tasks: u32, cpu_milli: u64) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let job_id = scheduler.submit(noop_job(name, tasks, 0, cpu_milli)).await?;
    loop {
        let status = scheduler.job(&job_id).await?;
        match status.state() {
            pb::JobState::Succeeded => return Ok(started.elapsed()),
            pb::JobState::Failed | pb::JobState::Cancelled => {
                bail!("the {name} job ended {:?}: {}", status.state(), status.error)
            }
            _ => {}
        }
        if started.elapsed() > PHASE_TIMEOUT {
            bail!("the {name} job did not finish within {PHASE_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Starts one executor and times it to its "first task running" log line; then stops it.
async fn time_executor_start(tern: &std::path::Path, cluster: &EmbeddedCluster) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut child = tokio::process::Command::new(tern)
        .args(["executor", "--scheduler", &cluster.scheduler_addr(), "--cpus", "1", "--memory", "1GiB", "--gpus", "0"])
        .arg("--credential-file")
        .arg(cluster.credential_file("executor"))
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting an executor")?;
    let stderr = child.stderr.take().context("the executor's stderr")?;
    let mut lines = tokio::io::BufReader::new(stderr).lines();
    let mut seen = Vec::new();
    let found = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await? {
            if line.contains("first task running") {
                return Ok::<bool, std::io::Error>(true);
            }
            if seen.len() < 20 {
                seen.push(line);
            }
        }
        Ok(false)
    })
    .await;
    let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
    match found {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => bail!("the executor exited before running a task:\n{}", seen.join("\n")),
        Ok(Err(e)) => bail!("reading the executor's log: {e}"),
        Err(_) => bail!("the executor ran no task within 30 s:\n{}", seen.join("\n")),
    }
    if let Some(pid) = child.id() {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGTERM);
        }
    }
    // Drain its log so it never blocks on a full pipe while leaving.
    let drain = async { while let Ok(Some(_)) = lines.next_line().await {} };
    let _ = tokio::time::timeout(Duration::from_secs(10), async { tokio::join!(drain, child.wait()) }).await;
    Ok(elapsed_ms)
}

/// How to run `tern bench job-terasort`.
#[derive(Debug, Clone)]
pub struct JobTerasortOptions {
    pub tern: PathBuf,
    pub size_bytes: u64,
    /// Tasks per stage, for both sorts.
    pub tasks: u32,
    /// Executors (one CPU each), and the concurrency `tern terasort` gets alike.
    pub executors: u32,
    /// Runs of each sort (alternating); medians are reported.
    pub runs: u32,
    pub progress: bool,
}

/// `tern job terasort` beside `tern terasort` of the same size on the same cluster.
#[derive(Debug, Clone, Serialize)]
pub struct JobTerasortReport {
    pub bytes: u64,
    pub tasks: u32,
    pub executors: u32,
    /// Submission to success of the scheduler job (teragen, map, reduce stages), median.
    pub job_seconds: f64,
    /// `tern terasort`'s teragen + map + reduce phases (its validation is left out, as the job
    /// has none), median.
    pub terasort_seconds: f64,
    /// job / terasort: at most 1.2 is the target.
    pub ratio: f64,
    /// Runs of each; the seconds are medians.
    pub runs: u32,
    /// Seconds of each of the job's stages in the last run (first task started to last finished).
    pub job_stage_seconds: std::collections::BTreeMap<String, f64>,
    /// `tern terasort`'s phases in the last run.
    pub terasort_phases: driver::Phases,
    pub job_valid: bool,
    pub terasort_valid: bool,
    /// The same records sorted in this process's memory (bounded; see `sampled`).
    pub in_memory_sort: tern_terasort::in_memory::InMemorySort,
    /// `tern terasort`'s sort rate (bytes over its map and reduce phases, median run) over the
    /// in-memory sort's.
    pub terasort_of_in_memory: f64,
}

/// Runs the TeraSort job through the scheduler and `tern terasort`'s in-process sort on one
/// cluster (`tern up --executors E`, two storage servers), the same size and task count;
/// validates both outputs.
pub async fn job_terasort(options: &JobTerasortOptions) -> anyhow::Result<JobTerasortReport> {
    if options.runs == 0 || options.tasks == 0 || options.executors == 0 {
        bail!("--runs, --tasks and --executors must each be at least 1");
    }
    let say = |text: String| {
        if options.progress {
            eprintln!("{text}");
        }
    };
    // Room for the job's input, shuffle and output at once (it keeps its input to the end).
    let dram_per_server = format!("{}MiB", (options.size_bytes * 2).max(256 << 20).div_ceil(1 << 20));
    let executor_memory = format!("{}MiB", (options.size_bytes * 2).max(1 << 30).div_ceil(1 << 20));
    let extra = [
        "--executors".to_string(),
        options.executors.to_string(),
        "--executor-cpus".into(),
        "1".into(),
        "--executor-memory".into(),
        executor_memory,
        "--executor-gpus".into(),
        "0".into(),
    ];
    say(format!("starting a cluster with {} executors...", options.executors));
    let cluster =
        EmbeddedCluster::start_with(&options.tern, 2, &dram_per_server, "1MiB", None, &std::env::temp_dir(), &extra)
            .await?;
    let scheduler = connect(&cluster).await?;
    wait_for_executors(&scheduler, options.executors).await?;

    let client = tern_client::Client::connect(&cluster.metadata_addr).await?;
    let (mut job_runs, mut terasort_runs, mut sort_seconds) = (Vec::new(), Vec::new(), Vec::new());
    let (mut job_valid, mut terasort_valid) = (true, true);
    let mut stage_seconds = std::collections::BTreeMap::new();
    let mut phases = None;
    for run in 1..=options.runs {
        say(format!("run {run}: tern terasort..."));
        let report = driver::terasort(&driver::TerasortOptions {
            size_bytes: options.size_bytes,
            metadata: cluster.metadata_addr.clone(),
            client: tern_client::ClientOptions::default(),
            maps: options.tasks as usize,
            reduces: options.tasks as usize,
            started: Instant::now(),
            progress: false,
            replicas: 1,
            shuffle_class: tern_client::StorageClass::Any,
            reduce_memory: None,
        })
        .await?;
        let seconds = report.phases.teragen + report.phases.map + report.phases.reduce;
        sort_seconds.push(report.phases.map + report.phases.reduce);
        say(format!("  {seconds:.2} s (valid: {}); {:?}", report.valid(), report.phases));
        terasort_valid &= report.valid();
        terasort_runs.push(seconds);
        phases = Some(report.phases.clone());

        say(format!("run {run}: tern job terasort..."));
        let out = format!("/bench-job-terasort-{}-{run}", std::process::id());
        let spec = spec::terasort_job(&spec::TerasortJob {
            size_bytes: options.size_bytes,
            tasks: options.tasks,
            gpu: false,
            out: out.clone(),
            validate: None,
            copies: 1,
        })?;
        let started = Instant::now();
        let job_id = scheduler.submit(spec).await?;
        let status = scheduler.wait(&job_id, Duration::from_millis(10), |_| {}).await?;
        let seconds = started.elapsed().as_secs_f64();
        if status.state() != pb::JobState::Succeeded {
            bail!("the terasort job ended {:?}: {}", status.state(), status.error);
        }
        stage_seconds = status
            .stages
            .iter()
            .map(|s| (s.name.clone(), s.finished_unix_ms.saturating_sub(s.started_unix_ms) as f64 / 1e3))
            .collect();
        say(format!("  {seconds:.2} s; stages: {stage_seconds:?}"));
        job_runs.push(seconds);
        let hidden = indicatif::MultiProgress::with_draw_target(indicatif::ProgressDrawTarget::hidden());
        let output = tasks::Location::Store(format!("{out}/output"));
        let summary = tasks::teravalidate(Some(&client), &output, &hidden).await?;
        job_valid &= summary.sorted()
            && summary.records == options.size_bytes / 100
            && format!("{:x}", summary.checksum) == report.input_checksum;
        let _ = client.delete(&out, true).await;
    }
    job_runs.sort_by(f64::total_cmp);
    terasort_runs.sort_by(f64::total_cmp);
    let (job_seconds, terasort_seconds) = (percentile(&job_runs, 50.0), percentile(&terasort_runs, 50.0));
    let sort_rates: Vec<f64> = sort_seconds.iter().map(|s| options.size_bytes as f64 / s).collect();
    drop(cluster);
    say("in-memory sort of the same records...".into());
    let records = options.size_bytes / tern_terasort::RECORD_LEN as u64;
    let in_memory_sort = tokio::task::spawn_blocking(move || tern_terasort::in_memory::sort(records)).await??;
    let terasort_of_in_memory = tern_common::median(sort_rates) / 1e9 / in_memory_sort.gb_per_s;
    Ok(JobTerasortReport {
        bytes: options.size_bytes,
        tasks: options.tasks,
        executors: options.executors,
        job_seconds,
        terasort_seconds,
        ratio: job_seconds / terasort_seconds,
        job_stage_seconds: stage_seconds,
        terasort_phases: phases.context("no runs")?,
        runs: options.runs,
        job_valid,
        terasort_valid,
        in_memory_sort,
        terasort_of_in_memory,
    })
}

pub fn print_job_terasort(report: &JobTerasortReport) {
    println!(
        "terasort of {} MB, {} tasks per stage, {} executors of one CPU",
        report.bytes / 1_000_000,
        report.tasks,
        report.executors
    );
    println!(
        "  tern terasort (teragen+map+reduce) {:>8.2} s   valid: {}",
        report.terasort_seconds, report.terasort_valid
    );
    println!("  tern job terasort                  {:>8.2} s   valid: {}", report.job_seconds, report.job_valid);
    println!("  ratio job / terasort               {:>8.2}     (target <= 1.2)", report.ratio);
    println!("  {}", report.in_memory_sort.describe(report.bytes / tern_terasort::RECORD_LEN as u64));
    println!("  tern terasort's sort rate (map+reduce) is {:.3} of the in-memory sort's", report.terasort_of_in_memory);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noop_jobs_are_valid_jobs() {
        let limits = spec::SpecLimits::default();
        spec::validate(&noop_job("x", 10, 0, NOOP_CPU_MILLI), &limits).unwrap();
        spec::validate(&noop_job("y", 10, 1000, 1000), &limits).unwrap();
        spec::validate(&noop_job("z", 10, 0, WHOLE_CPU_MILLI), &limits).unwrap();
    }

    #[test]
    fn reports_spreads_and_only_supported_percentiles() {
        let options = SchedulerBenchOptions {
            tern: "tern".into(),
            tasks: 1000,
            whole_cpu_tasks: 100,
            runs: 3,
            executors: 4,
            cold_starts: 20,
            progress: false,
        };
        let starts: Vec<f64> = (1..=20).map(f64::from).collect();
        let report = shape_report(&options, vec![3000.0, 1000.0, 2000.0], vec![50.0, 70.0, 60.0], starts);
        assert_eq!(report.tasks_per_s, 2000.0);
        assert_eq!((report.tiny_tasks_per_s.min, report.tiny_tasks_per_s.max), (1000.0, 3000.0));
        assert_eq!(report.whole_cpu_tasks_per_s.median, 60.0);
        assert_eq!(report.dispatch_seconds, 0.5);
        assert_eq!(report.cold_start_ms_p50, 10.0);
        assert_eq!(report.cold_start_ms_p90, Some(18.0));
        assert_eq!(report.cold_start_ms_p99, None, "20 starts have no 99th percentile");
        assert_eq!((report.cold_start_ms_min, report.cold_start_ms_max), (1.0, 20.0));
        assert_eq!(ms_or_na(report.cold_start_ms_p99), "n/a");
        let json = serde_json::to_value(&report).unwrap();
        assert!(json["cold_start_ms_p99"].is_null());
        assert_eq!(json["whole_cpu_tasks_per_s"]["runs"], 3);
    }

    #[test]
    fn dispatch_kinds_take_turns_going_first() {
        let kinds = [Dispatch::Tiny, Dispatch::WholeCpu];
        assert_eq!(rotation(&kinds, 0)[0], Dispatch::Tiny);
        assert_eq!(rotation(&kinds, 1)[0], Dispatch::WholeCpu);
        assert_eq!(rotation(&kinds, 2)[0], Dispatch::Tiny);
    }
}
