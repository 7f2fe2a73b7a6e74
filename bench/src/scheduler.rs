//! `tern bench scheduler`: how fast the scheduler hands out tasks, and how fast a new executor
//! starts running one.
//!
//! - Dispatch: `tern up --executors E` (the real scheduler and E real executor processes), then
//!   one job of N `noop` tasks; tasks/s = N over the time from submission until the job has
//!   succeeded (every task assigned, run and reported). A small warm-up job runs first.
//! - Cold start: a job of `noop` tasks that sleep keeps a backlog; then, one at a time, an
//!   executor process is started and timed from just before spawn to the moment it logs
//!   "first task running" (it has registered, polled, been given a task and started it); it is
//!   then stopped (it leaves, and its task goes back to the backlog for the next one).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use tern_common::percentile;
use tern_proto::sched as pb;
use tern_scheduler::{spec, SchedulerClient};
use tern_terasort::{driver, tasks};
use tokio::io::AsyncBufReadExt;

use tern_local::cluster::EmbeddedCluster;

/// How to run the benchmark.
#[derive(Debug, Clone)]
pub struct SchedulerBenchOptions {
    /// The `tern` binary.
    pub tern: PathBuf,
    /// Noop tasks dispatched in the measured job.
    pub tasks: u32,
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
    pub tasks_per_s: f64,
    pub executors: u32,
    pub cold_start_ms_p50: f64,
    pub cold_start_ms_p99: f64,
    pub tasks: u32,
    pub dispatch_seconds: f64,
    pub cold_starts: u32,
    pub cold_start_ms_min: f64,
    pub cold_start_ms_max: f64,
}

/// CPUs a noop task asks for: small, so one executor holds thousands at once.
const NOOP_CPU_MILLI: u64 = 1;
const NOOP_MEMORY_BYTES: u64 = 1 << 10;
/// What each benchmark executor offers.
const EXECUTOR_CPUS: &str = "8";
const EXECUTOR_MEMORY: &str = "64GiB";
/// How long any one phase may take before the benchmark gives up.
const PHASE_TIMEOUT: Duration = Duration::from_secs(300);

pub async fn run(options: &SchedulerBenchOptions) -> anyhow::Result<SchedulerBenchReport> {
    if options.tasks == 0 || options.executors == 0 || options.cold_starts == 0 {
        bail!("--tasks, --executors and --cold-starts must each be at least 1");
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
        EXECUTOR_CPUS.into(),
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
    run_noop_job(&scheduler, "warm-up", options.tasks.min(2000)).await?;
    say(format!("dispatching {} noop tasks...", options.tasks));
    let dispatch = run_noop_job(&scheduler, "dispatch", options.tasks).await?;
    let tasks_per_s = f64::from(options.tasks) / dispatch.as_secs_f64();
    say(format!("  {:.0} tasks/s ({:.3} s)", tasks_per_s, dispatch.as_secs_f64()));
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
        let ms = time_executor_start(&options.tern, &cluster.scheduler_addr()).await?;
        say(format!("  start {}: {ms:.1} ms", run + 1));
        starts_ms.push(ms);
    }
    scheduler.cancel(&hold_id).await?;
    drop(cluster);

    starts_ms.sort_by(f64::total_cmp);
    Ok(SchedulerBenchReport {
        tasks_per_s,
        executors: options.executors,
        cold_start_ms_p50: percentile(&starts_ms, 50.0),
        cold_start_ms_p99: percentile(&starts_ms, 99.0),
        tasks: options.tasks,
        dispatch_seconds: dispatch.as_secs_f64(),
        cold_starts: options.cold_starts,
        cold_start_ms_min: starts_ms.first().copied().unwrap_or(0.0),
        cold_start_ms_max: starts_ms.last().copied().unwrap_or(0.0),
    })
}

pub fn print_table(report: &SchedulerBenchReport) {
    println!("scheduler dispatch: {} noop tasks to {} executors", report.tasks, report.executors);
    println!(
        "  {:>10.0} tasks/s   ({:.3} s; target >= 10000 tasks/s to 4 executors)",
        report.tasks_per_s, report.dispatch_seconds
    );
    println!("executor cold start (process start to first task running), {} starts:", report.cold_starts);
    println!(
        "  p50 {:.1} ms   p99 {:.1} ms   min {:.1} ms   max {:.1} ms   (target p50 <= 50 ms)",
        report.cold_start_ms_p50, report.cold_start_ms_p99, report.cold_start_ms_min, report.cold_start_ms_max
    );
}

async fn start_cluster(tern: &std::path::Path, extra: &[String]) -> anyhow::Result<EmbeddedCluster> {
    EmbeddedCluster::start_with(tern, 1, "256MiB", "1MiB", None, &std::env::temp_dir(), extra).await
}

/// The cluster's scheduler, once it answers.
async fn connect(cluster: &EmbeddedCluster) -> anyhow::Result<SchedulerClient> {
    let started = Instant::now();
    loop {
        if let Ok(client) = SchedulerClient::connect(&cluster.scheduler_addr(), None).await {
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

/// Submits a job of `tasks` noop tasks and waits until it succeeds; returns the time taken.
async fn run_noop_job(scheduler: &SchedulerClient, name: &str, tasks: u32) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let job_id = scheduler.submit(noop_job(name, tasks, 0, NOOP_CPU_MILLI)).await?;
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
async fn time_executor_start(tern: &std::path::Path, scheduler: &str) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut child = tokio::process::Command::new(tern)
        .args(["executor", "--scheduler", scheduler, "--cpus", "1", "--memory", "1GiB", "--gpus", "0"])
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
    let (mut job_runs, mut terasort_runs) = (Vec::new(), Vec::new());
    let (mut job_valid, mut terasort_valid) = (true, true);
    let mut stage_seconds = std::collections::BTreeMap::new();
    let mut phases = None;
    for run in 1..=options.runs {
        say(format!("run {run}: tern terasort..."));
        let report = driver::terasort(&driver::TerasortOptions {
            size_bytes: options.size_bytes,
            metadata: cluster.metadata_addr.clone(),
            maps: options.tasks as usize,
            reduces: options.tasks as usize,
            started: Instant::now(),
            progress: false,
            replicas: 1,
        })
        .await?;
        let seconds = report.phases.teragen + report.phases.map + report.phases.reduce;
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
    drop(cluster);
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noop_jobs_are_valid_jobs() {
        let limits = spec::SpecLimits::default();
        spec::validate(&noop_job("x", 10, 0, NOOP_CPU_MILLI), &limits).unwrap();
        spec::validate(&noop_job("y", 10, 1000, 1000), &limits).unwrap();
    }
}
