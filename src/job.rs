//! `tern job`: submit, status, list, cancel, and the terasort job, against `tern scheduler`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use tern_common::ByteSize;
use tern_proto::sched as pb;
use tern_scheduler_api::client::is_finished;
use tern_scheduler_api::SchedulerClient;

#[derive(Args)]
pub struct JobArgs {
    #[command(subcommand)]
    command: JobCommand,
    /// Scheduler address: host:port, http:// or https://.
    #[arg(long, env = "TERN_SCHEDULER", default_value_t = tern_common::ports::default_scheduler(), global = true)]
    scheduler: String,
    /// TLS material for mutual TLS to the scheduler.
    #[arg(long = "tls-dir", env = "TERN_TLS_DIR", global = true)]
    tls_dir: Option<PathBuf>,
    /// Act with the credential in this file: a tenant's (`DIR/credentials/<tenant>` of `tern up`,
    /// `tern cert credential`), which submits to that tenant's queue and sees its jobs only, or an
    /// operator's (`DIR/credentials/admin`), which sees every queue. Without it, a client of the
    /// default tenant.
    #[arg(long = "as", env = "TERN_AS", global = true, value_name = "FILE", value_parser = crate::cli::read_credential)]
    credential: Option<crate::cli::Credential>,
}

#[derive(Subcommand)]
enum JobCommand {
    /// Submit a job file (TOML, or JSON when it ends in .json); prints the job id.
    Submit {
        /// The job file: its stages, tasks and resources (README, "Jobs and the scheduler").
        file: PathBuf,
        /// Wait until the job finishes, showing progress; fail if it does not succeed.
        #[arg(long)]
        wait: bool,
        /// Print JSON (the job id, or with --wait the final status).
        #[arg(long)]
        json: bool,
        /// The tenant (the scheduler queue, whose Tern quotas the job counts against); overrides
        /// the file's `queue`/`tenant`.
        #[arg(long, env = "TERN_TENANT")]
        tenant: Option<String>,
    },
    /// A job's stages, task counts by state, which path GPU tasks ran, errors.
    Status {
        /// The id `job submit` printed.
        job_id: String,
        /// Print the status as one JSON object (state, stages, task counts, errors).
        #[arg(long)]
        json: bool,
    },
    /// Jobs the scheduler knows (unfinished ones and recently finished ones).
    List {
        /// Only unfinished jobs.
        #[arg(long)]
        active: bool,
        /// Print one JSON array of the jobs' statuses.
        #[arg(long)]
        json: bool,
    },
    /// Cancel a job: queued tasks dropped, running ones stopped, its shuffles freed.
    Cancel {
        /// The id `job submit` printed.
        job_id: String,
        /// Print {"job_id", "state"} as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Build and submit teragen → terasort-map → terasort-reduce → validate.
    Terasort {
        /// Bytes to generate and sort, e.g. 1GiB.
        #[arg(long)]
        size: ByteSize,
        /// Tasks per stage [default: one per 256 MiB, at least 2].
        #[arg(long)]
        tasks: Option<u32>,
        /// Reduce on the GPU (a quarter GPU per task; the CPU path where no executor has one).
        #[arg(long)]
        gpu: bool,
        /// Store directory for input/ and output/ [default: /terasort-<unix seconds>].
        #[arg(long)]
        out: Option<String>,
        /// Leave out the validate stage (`tern teravalidate` run as a command task).
        #[arg(long)]
        no_validate: bool,
        /// Copies of the shuffle and of the input and output parts, each on another storage
        /// server: 1 or 2.
        #[arg(long, alias = "replicas", default_value_t = 1)]
        copies: u32,
        /// Wait until the job finishes, showing progress; fail if it does not succeed.
        #[arg(long)]
        wait: bool,
        /// Print JSON (the job id, or with --wait the final status).
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(args: JobArgs) -> anyhow::Result<()> {
    // A job file that cannot be read is said before the scheduler is asked for anything.
    let file_spec = match &args.command {
        JobCommand::Submit { file, .. } => Some(tern_scheduler_api::spec::load(file)?),
        _ => None,
    };
    let credential = args.credential.as_ref().map(|c| c.text());
    let client = SchedulerClient::connect(&args.scheduler, args.tls_dir.as_deref(), credential).await?;
    match args.command {
        JobCommand::Submit { wait, json, tenant, .. } => {
            let mut spec = file_spec.unwrap_or_default();
            if let Some(tenant) = tenant.filter(|t| !t.is_empty()) {
                spec.queue = tenant;
            }
            submit(&client, spec, wait, json).await
        }
        JobCommand::Status { job_id, json } => {
            let status = client.job(&job_id).await?;
            if json {
                outln!("{}", serde_json::to_string(&job_json(&status))?);
            } else {
                print_status(&status);
            }
            Ok(())
        }
        JobCommand::List { active, json } => {
            let jobs = client.list_jobs(active).await?;
            if json {
                outln!("{}", serde_json::to_string(&Value::Array(jobs.iter().map(job_json).collect()))?);
            } else {
                outln!("{:<32} {:<10} {:<12} {:>8}", "JOB", "STATE", "QUEUE", "PRIORITY");
                for job in &jobs {
                    outln!("{:<32} {:<10} {:<12} {:>8}", job.job_id, state_name(job.state()), job.queue, job.priority);
                }
            }
            Ok(())
        }
        JobCommand::Cancel { job_id, json } => {
            let state = client.cancel(&job_id).await?;
            if json {
                outln!("{}", json!({ "job_id": job_id, "state": state_name(state) }));
            } else {
                outln!("job {job_id}: {}", state_name(state));
            }
            Ok(())
        }
        JobCommand::Terasort { size, tasks, gpu, out, no_validate, copies, wait, json } => {
            let out = out.unwrap_or_else(|| {
                let secs =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
                format!("/terasort-{secs}")
            });
            let validate = if no_validate {
                None
            } else {
                let tern = std::env::current_exe()?.to_string_lossy().into_owned();
                Some(vec![tern, "teravalidate".into(), format!("{}/output", out.trim_end_matches('/'))])
            };
            let tasks = tasks.unwrap_or_else(|| tern_terasort::tasks::default_tasks(size.bytes()) as u32);
            let spec = tern_scheduler_api::spec::terasort_job(&tern_scheduler_api::spec::TerasortJob {
                size_bytes: size.bytes(),
                tasks,
                gpu,
                out,
                validate,
                copies,
            })?;
            submit(&client, spec, wait, json).await
        }
    }
}

async fn submit(client: &SchedulerClient, spec: pb::JobSpec, wait: bool, json: bool) -> anyhow::Result<()> {
    let job_id = client.submit(spec).await?;
    if !wait {
        if json {
            outln!("{}", json!({ "job_id": job_id }));
        } else {
            outln!("{job_id}");
        }
        return Ok(());
    }
    if !json {
        eprintln!("job {job_id} submitted; waiting");
    }
    let mut last = String::new();
    let status = client
        .wait(&job_id, Duration::from_millis(200), |status| {
            if json {
                return;
            }
            let line = progress_line(status);
            if line != last {
                eprintln!("{line}");
                last = line;
            }
        })
        .await?;
    if json {
        outln!("{}", serde_json::to_string(&job_json(&status))?);
    } else {
        print_status(&status);
    }
    if status.state() != pb::JobState::Succeeded {
        bail!("job {job_id} {}: {}", state_name(status.state()), status.error);
    }
    Ok(())
}

fn progress_line(status: &pb::JobStatus) -> String {
    let stages: Vec<String> = status
        .stages
        .iter()
        .map(|s| {
            let line = format!("{} {}/{} done, {} running", s.name, s.succeeded, s.tasks, s.running);
            if s.blocked.is_empty() {
                line
            } else {
                format!("{line} (waiting: {})", s.blocked)
            }
        })
        .collect();
    format!("{}: {}", state_name(status.state()), stages.join("; "))
}

fn state_name(state: pb::JobState) -> &'static str {
    match state {
        pb::JobState::Unspecified => "unknown",
        pb::JobState::Pending => "pending",
        pb::JobState::Running => "running",
        pb::JobState::Succeeded => "succeeded",
        pb::JobState::Failed => "failed",
        pb::JobState::Cancelled => "cancelled",
    }
}

fn stage_state_name(state: pb::StageState) -> &'static str {
    match state {
        pb::StageState::Unspecified => "unknown",
        pb::StageState::Waiting => "waiting",
        pb::StageState::Running => "running",
        pb::StageState::Succeeded => "succeeded",
        pb::StageState::Failed => "failed",
        pb::StageState::Cancelled => "cancelled",
    }
}

fn job_json(job: &pb::JobStatus) -> Value {
    json!({
        "job_id": job.job_id,
        "name": job.name,
        "queue": job.queue,
        "priority": job.priority,
        "state": state_name(job.state()),
        "finished": is_finished(job.state()),
        "error": job.error,
        "tern_job_id": job.tern_job_id,
        "submitted_unix_ms": job.submitted_unix_ms,
        "finished_unix_ms": job.finished_unix_ms,
        "stages": job.stages.iter().map(|s| json!({
            "name": s.name,
            "state": stage_state_name(s.state()),
            "tasks": s.tasks,
            "waiting": s.waiting,
            "queued": s.queued,
            "running": s.running,
            "succeeded": s.succeeded,
            "failed": s.failed,
            "cancelled": s.cancelled,
            "attempts": s.attempts,
            "oom_retries": s.oom_retries,
            "lost": s.lost,
            "recomputed": s.recomputed,
            "paths": s.paths,
            "errors": s.errors,
            "blocked": s.blocked,
            "needs": s.needs.map(|n| json!({
                "cpus": n.cpu_milli as f64 / 1000.0,
                "memory_bytes": n.memory_bytes,
                "gpus": n.gpu_milli as f64 / 1000.0,
            })),
            "input_shuffle_id": crate::show::id(s.input_shuffle_id),
            "output_shuffle_id": crate::show::id(s.output_shuffle_id),
        })).collect::<Vec<_>>(),
    })
}

fn print_status(job: &pb::JobStatus) {
    outln!(
        "job {} ({}): {}  queue {}  priority {}  tern job {}",
        job.job_id,
        job.name,
        state_name(job.state()),
        job.queue,
        job.priority,
        if job.tern_job_id.is_empty() { "-" } else { &job.tern_job_id }
    );
    if !job.error.is_empty() {
        outln!("error: {}", job.error);
    }
    outln!(
        "{:<16} {:<10} {:>6} {:>7} {:>6} {:>7} {:>9} {:>6} {:>9} {:>8}  PATHS",
        "STAGE",
        "STATE",
        "TASKS",
        "WAITING",
        "QUEUED",
        "RUNNING",
        "SUCCEEDED",
        "FAILED",
        "CANCELLED",
        "ATTEMPTS"
    );
    for s in &job.stages {
        let paths: Vec<String> = s.paths.iter().map(|(path, n)| format!("{path}={n}")).collect();
        outln!(
            "{:<16} {:<10} {:>6} {:>7} {:>6} {:>7} {:>9} {:>6} {:>9} {:>8}  {}",
            s.name,
            stage_state_name(s.state()),
            s.tasks,
            s.waiting,
            s.queued,
            s.running,
            s.succeeded,
            s.failed,
            s.cancelled,
            s.attempts,
            paths.join(" ")
        );
        if let Some(n) = s.needs {
            outln!(
                "    each task: {} CPUs, {}, {} GPUs",
                n.cpu_milli as f64 / 1000.0,
                crate::show::size(n.memory_bytes),
                n.gpu_milli as f64 / 1000.0
            );
        }
        if !s.blocked.is_empty() {
            outln!("    waiting: {}", s.blocked);
        }
        if s.recomputed > 0 {
            outln!("    recomputed: {} tasks whose output a later stage found lost", s.recomputed);
        }
        for error in &s.errors {
            outln!("    {error}");
        }
    }
}
