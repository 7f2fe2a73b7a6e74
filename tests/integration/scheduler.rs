//! The task scheduler end to end, as real processes on loopback: `tern scheduler`, `tern
//! executor`s and `tern up`'s executor pool, with jobs submitted by `tern job`.
//! - a TeraSort job on two executors validates;
//! - kill -9 of one executor mid-job: the job still completes and validates;
//! - the pool goes from 0 executors to N and back to 0;
//! - a command task sees its environment; a command task killed for memory is retried with twice
//!   the memory.

// kill(2): signals to the `tern up` under test.
#![allow(unsafe_code)]

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, spawn_logged, Cluster, TERN};
use tern_local::Daemon;
use tern_proto::sched as pb;
use tern_scheduler_api::SchedulerClient;

/// Executors are declared lost fast here, so a killed one's tasks rerun within a second or two.
const HEARTBEAT_MS: u64 = 200;
const EXECUTOR_TIMEOUT_MS: u64 = 1500;

/// A scheduler beside a test cluster, and executors started one by one (dropped, hence killed,
/// before the scheduler).
pub(crate) struct Scheduler {
    pub(crate) addr: String,
    /// Its admin (metrics) address.
    pub(crate) admin_addr: String,
    executors: Vec<Option<Daemon>>,
    /// Held so that dropping the struct stops the scheduler.
    _scheduler: Daemon,
}

impl Scheduler {
    pub(crate) fn start(cluster: &Cluster) -> Scheduler {
        Scheduler::start_with(cluster, "")
    }

    /// A scheduler whose config file ends with `extra` (TOML lines).
    /// With a cluster serving mutual TLS, the scheduler does too, with the cluster's material.
    fn start_with(cluster: &Cluster, extra: &str) -> Scheduler {
        let addr = format!("127.0.0.1:{}", free_port());
        let admin_addr = format!("127.0.0.1:{}", free_port());
        let config = cluster.dir.path().join("scheduler.toml");
        let tls = match (&cluster.tls, &cluster.tls_dir) {
            (common::Tls::Full, Some(dir)) => format!("tls_dir = \"{}\"\n", dir.display()),
            _ => String::new(),
        };
        std::fs::write(
            &config,
            format!(
                "listen = \"{addr}\"\nadmin_listen = \"{admin_addr}\"\nmetadata = \"{}\"\n\
                 heartbeat_interval_ms = {HEARTBEAT_MS}\nexecutor_timeout_ms = {EXECUTOR_TIMEOUT_MS}\n\
                 default_backoff_ms = 50\n{tls}{extra}",
                cluster.metadata_url()
            ),
        )
        .unwrap();
        let secret = cluster.secret_setting();
        let child = spawn_logged(
            cluster.dir.path(),
            "scheduler",
            &["scheduler", "--config", &config.to_string_lossy(), "--set", &secret],
        );
        Scheduler { addr, admin_addr, executors: Vec::new(), _scheduler: child }
    }

    /// Starts an executor offering `cpus` and `memory`; returns its index.
    pub(crate) fn executor(&mut self, cluster: &Cluster, cpus: &str, memory: &str) -> usize {
        self.executor_with_gpus(cluster, cpus, memory, "0")
    }

    /// An executor declaring `gpus` GPUs (`--gpus`, whether or not the machine has them).
    fn executor_with_gpus(&mut self, cluster: &Cluster, cpus: &str, memory: &str, gpus: &str) -> usize {
        let i = self.executors.len();
        let child = spawn_logged(
            cluster.dir.path(),
            &format!("executor-{i}"),
            &[
                "executor",
                "--scheduler",
                &self.addr,
                "--cpus",
                cpus,
                "--memory",
                memory,
                "--gpus",
                gpus,
                "--credential-file",
                &cluster.executor_credential().to_string_lossy(),
            ],
        );
        self.executors.push(Some(child));
        i
    }

    fn kill_9(&mut self, i: usize) {
        let mut child = self.executors[i].take().expect("executor already killed");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    async fn client(&self, cluster: &Cluster) -> SchedulerClient {
        let client = cluster
            .wait_for("the scheduler to answer", Duration::from_secs(20), || async {
                let client = SchedulerClient::connect(&self.addr, None, None).await.ok()?;
                client.pool_status().await.ok().map(|_| client)
            })
            .await;
        client
    }

    /// Runs `tern job ARGS` against this scheduler; stdout, failing the test on an error.
    fn job(&self, cluster: &Cluster, args: &[&str]) -> String {
        let out = Command::new(TERN)
            .arg("job")
            .args(["--scheduler", &self.addr])
            .args(args)
            .env_remove("TERN_SCHEDULER")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "tern job {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            cluster.logs()
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

/// Submits the job file `text` (TOML) with `tern job submit`; returns the job id.
fn submit(cluster: &Cluster, scheduler: &Scheduler, name: &str, text: &str) -> String {
    let path = cluster.dir.path().join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    let out = scheduler.job(cluster, &["submit", "--json", &path.to_string_lossy()]);
    let reply: serde_json::Value =
        serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("tern job submit --json printed {out:?}: {e}"));
    reply["job_id"].as_str().unwrap_or_else(|| panic!("no job_id in {reply}")).to_string()
}

/// Waits until the job finishes; returns its last status.
async fn finish(cluster: &Cluster, client: &SchedulerClient, job_id: &str, timeout: Duration) -> pb::JobStatus {
    cluster
        .wait_for(&format!("job {job_id} to finish"), timeout, || async {
            let status = client.job(job_id).await.ok()?;
            tern_scheduler_api::client::is_finished(status.state()).then_some(status)
        })
        .await
}

fn stage<'a>(status: &'a pb::JobStatus, name: &str) -> &'a pb::StageStatus {
    status.stages.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no stage {name} in {status:?}"))
}

/// A TeraSort job of `bytes` with `tasks` tasks per stage, sorted into `output`.
fn terasort_job(name: &str, bytes: u64, tasks: u32, output: &str) -> String {
    terasort_job_reducing(name, bytes, tasks, output, "operator = \"terasort-reduce\"")
}

/// [`terasort_job`] whose reduce stage says `reduce` (its operator and any GPU needs).
fn terasort_job_reducing(name: &str, bytes: u64, tasks: u32, output: &str, reduce: &str) -> String {
    format!(
        r#"
name = "{name}"

[[shuffles]]
name = "sorting"
partitions = {tasks}

[[stages]]
name = "teragen"
operator = "teragen"
params = {{ size = {bytes} }}
tasks = {tasks}
output = "./input"
needs = {{ cpus = 1, memory = "64MiB" }}

[[stages]]
name = "map"
operator = "terasort-map"
tasks = {tasks}
after = ["teragen"]
input = "./input"
output = "sorting"
needs = {{ cpus = 1, memory = "128MiB" }}

[[stages]]
name = "reduce"
{reduce}
tasks = {tasks}
after = ["map"]
input = "sorting"
output = "{output}"
needs = {{ cpus = 1, memory = "256MiB", gpus = {gpus} }}
"#,
        gpus = if reduce.contains("gpu") { "0.5" } else { "0" }
    )
}

/// `tern teravalidate --json` of a store directory.
fn validate(cluster: &Cluster, dir: &str) -> serde_json::Value {
    let out = cluster.tern(&["teravalidate", "--json", dir]);
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("teravalidate {dir}: {e}: {}\n{}", String::from_utf8_lossy(&out.stderr), cluster.logs())
    })
}

/// The checksum valsort gives `bytes` of teragen records (generation is deterministic).
fn expected_checksum(cluster: &Cluster, bytes: u64) -> String {
    let dir = cluster.dir.path().join(format!("expected-{bytes}"));
    let dir = dir.to_string_lossy();
    cluster.tern_ok(&["teragen", "--local", "--size", &bytes.to_string(), "--parts", "1", "--out", &dir]);
    let out = cluster.tern(&["teravalidate", "--local", "--json", &dir]);
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    summary["checksum"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terasort_job_on_two_executors_validates() {
    let cluster = Cluster::start(2, "256MiB").await;
    let mut scheduler = Scheduler::start(&cluster);
    scheduler.executor(&cluster, "1", "1GiB");
    scheduler.executor(&cluster, "1", "1GiB");
    let client = scheduler.client(&cluster).await;
    let bytes = 20_000_000;
    let job_id = submit(&cluster, &scheduler, "sort", &terasort_job("sort", bytes, 4, "/sorted/two"));
    let status = finish(&cluster, &client, &job_id, Duration::from_secs(120)).await;
    assert_eq!(status.state(), pb::JobState::Succeeded, "{status:?}\n{}", cluster.logs());
    assert_eq!(stage(&status, "reduce").succeeded, 4);
    assert_eq!(stage(&status, "reduce").paths.get("cpu"), Some(&4), "{status:?}");

    let summary = validate(&cluster, "/sorted/two");
    assert_eq!(summary["sorted"], true, "{summary}");
    assert_eq!(summary["records"], bytes / 100);
    assert_eq!(summary["checksum"], expected_checksum(&cluster, bytes).as_str());
    // The job's own data (its input, the shuffle) went with it; the output outside stays.
    let listing = cluster.tern_ok(&["fs", "ls", "/jobs"]);
    assert!(!listing.contains(&status.tern_job_id) || status.tern_job_id.is_empty(), "{listing}");
    // The same output again is refused at submission: the old parts would stand in for new ones.
    let path = cluster.dir.path().join("again.toml");
    std::fs::write(&path, terasort_job("again", bytes, 4, "/sorted/two")).unwrap();
    let out = Command::new(TERN).args(["job", "--scheduler", &scheduler.addr, "submit"]).arg(&path).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("/sorted/two already holds /sorted/two/part-"), "{stderr}");
}

/// The GPU reduce on an executor that declares a GPU it cannot open (no driver here; on a GPU
/// machine the declared "0" is real and the path says so): a gpu_optional stage still sorts, and
/// the results say which path ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gpu_reduce_says_which_path_ran_and_falls_back_to_the_cpu() {
    let cluster = Cluster::start(2, "256MiB").await;
    let mut scheduler = Scheduler::start(&cluster);
    scheduler.executor_with_gpus(&cluster, "2", "1GiB", "1");
    let client = scheduler.client(&cluster).await;
    let bytes = 10_000_000;
    let reduce = "operator = \"terasort-reduce-gpu\"\ngpu_optional = true";
    let job = terasort_job_reducing("gpu", bytes, 2, "/sorted/gpu", reduce);
    let job_id = submit(&cluster, &scheduler, "gpu", &job);
    let status = finish(&cluster, &client, &job_id, Duration::from_secs(120)).await;
    assert_eq!(status.state(), pb::JobState::Succeeded, "{status:?}\n{}", cluster.logs());
    let paths = &stage(&status, "reduce").paths;
    assert_eq!(paths.values().sum::<u32>(), 2, "{status:?}");
    let gpu_here = tern_gpu::detect().devices.iter().any(|d| d.address == "0");
    let expected = if gpu_here { "gpu:0" } else { "cpu" };
    assert_eq!(paths.get(expected), Some(&2), "{status:?}");
    let summary = validate(&cluster, "/sorted/gpu");
    assert_eq!(summary["sorted"], true, "{summary}");
    assert_eq!(summary["checksum"], expected_checksum(&cluster, bytes).as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_survives_kill_9_of_an_executor_mid_job() {
    let cluster = Cluster::start(2, "512MiB").await;
    let mut scheduler = Scheduler::start(&cluster);
    let doomed = scheduler.executor(&cluster, "1", "1GiB");
    scheduler.executor(&cluster, "1", "1GiB");
    let client = scheduler.client(&cluster).await;
    let bytes = 60_000_000;
    let job_id = submit(&cluster, &scheduler, "survivor", &terasort_job("survivor", bytes, 6, "/sorted/survivor"));
    // Both executors busy (one CPU each, one CPU per task): each holds a running task.
    let busy_stage = cluster
        .wait_for("both executors to run a task", Duration::from_secs(60), || async {
            let status = client.job(&job_id).await.ok()?;
            status.stages.iter().find(|s| s.running >= 2).map(|s| s.name.clone())
        })
        .await;
    scheduler.kill_9(doomed);

    let status = finish(&cluster, &client, &job_id, Duration::from_secs(180)).await;
    assert_eq!(status.state(), pb::JobState::Succeeded, "{status:?}\n{}", cluster.logs());
    assert!(stage(&status, &busy_stage).lost >= 1, "the killed executor's task was not rerun: {status:?}");
    let summary = validate(&cluster, "/sorted/survivor");
    assert_eq!(summary["sorted"], true, "{summary}");
    assert_eq!(summary["records"], bytes / 100);
    assert_eq!(summary["checksum"], expected_checksum(&cluster, bytes).as_str());
}

/// More results than one poll may carry (max_batch) go with the next poll at once, not after a
/// long poll: 40 tasks finish together on an executor that may report 8 per poll, with nothing
/// left to run, so a long poll (30 s here) would hold 32 results and the job's end back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_beyond_one_poll_are_reported_without_a_long_poll() {
    let cluster = Cluster::start(1, "64MiB").await;
    let mut scheduler = Scheduler::start_with(&cluster, "max_batch = 8\nmax_poll_wait_ms = 30000\n");
    scheduler.executor(&cluster, "4", "1GiB");
    let client = scheduler.client(&cluster).await;
    let job = r#"
name = "together"
[[stages]]
name = "sleep"
operator = "noop"
params = { sleep_ms = "300" }
tasks = 40
needs = { cpus = 0.01, memory = "1MiB" }
"#;
    let job_id = submit(&cluster, &scheduler, "together", job);
    let status = finish(&cluster, &client, &job_id, Duration::from_secs(60)).await;
    assert_eq!(status.state(), pb::JobState::Succeeded, "{status:?}\n{}", cluster.logs());
    let took = status.finished_unix_ms.saturating_sub(status.submitted_unix_ms);
    assert!(took < 10_000, "the job took {took} ms: results waited for a 30 s long poll\n{}", cluster.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_task_sees_its_environment() {
    let cluster = Cluster::start(1, "64MiB").await;
    let mut scheduler = Scheduler::start(&cluster);
    scheduler.executor(&cluster, "2", "1GiB");
    let client = scheduler.client(&cluster).await;
    let out = cluster.dir.path().join("env");
    std::fs::create_dir(&out).unwrap();
    let script = format!(
        "echo \"$TERN_JOB_ID|$TERN_STAGE|$TERN_TASK_INDEX|$TERN_TASK_COUNT|$TERN_ATTEMPT|$TERN_METADATA|$TERN_OUTPUT|$GREETING\" > {}/task-$TERN_TASK_INDEX",
        out.display()
    );
    let job = format!(
        r#"
name = "env"
[[stages]]
name = "show"
command = ["sh", "-c", {script:?}]
env = {{ GREETING = "hello" }}
tasks = 3
output = "/out/env"
needs = {{ cpus = 0.5, memory = "64MiB" }}
"#
    );
    let job_id = submit(&cluster, &scheduler, "env", &job);
    let status = finish(&cluster, &client, &job_id, Duration::from_secs(60)).await;
    assert_eq!(status.state(), pb::JobState::Succeeded, "{status:?}\n{}", cluster.logs());
    for task in 0..3 {
        let seen = std::fs::read_to_string(out.join(format!("task-{task}"))).unwrap();
        let expected = format!("{job_id}|show|{task}|3|0|{}|/out/env|hello", cluster.metadata_addr);
        assert_eq!(seen.trim(), expected);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_killed_for_memory_is_retried_with_twice_the_memory() {
    let cluster = Cluster::start(1, "64MiB").await;
    let mut scheduler = Scheduler::start(&cluster);
    scheduler.executor(&cluster, "2", "2GiB");
    let client = scheduler.client(&cluster).await;
    let out = cluster.dir.path().join("attempts");
    std::fs::create_dir(&out).unwrap();
    // Records each attempt's memory, then holds a 48 MiB buffer (dd's block) for a while.
    let script = format!(
        "echo $TERN_MEMORY_BYTES > {}/attempt-$TERN_ATTEMPT; dd if=/dev/zero of=/dev/null bs=48M count=40 2>/dev/null",
        out.display()
    );
    let job = format!(
        r#"
name = "hog"
[[stages]]
name = "hog"
command = ["sh", "-c", {script:?}]
tasks = 1
max_memory = "256MiB"
needs = {{ cpus = 1, memory = "32MiB" }}
"#
    );
    let job_id = submit(&cluster, &scheduler, "hog", &job);
    let status = finish(&cluster, &client, &job_id, Duration::from_secs(60)).await;
    assert_eq!(status.state(), pb::JobState::Succeeded, "{status:?}\n{}", cluster.logs());
    assert_eq!(stage(&status, "hog").oom_retries, 1, "{status:?}");
    let memory = |attempt: u32| -> u64 {
        std::fs::read_to_string(out.join(format!("attempt-{attempt}"))).unwrap().trim().parse().unwrap()
    };
    assert_eq!(memory(0), 32 << 20);
    assert_eq!(memory(1), 64 << 20);
    assert!(!out.join("attempt-2").exists());
}

/// `tern up` with a pool that scales to zero: no executors, then N while a backlog waits, then
/// none again once they have been idle for the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_scales_from_zero_to_n_and_back_to_zero() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let port = free_port_range(80);
    let mut up = Command::new(TERN)
        .args(["up", "--dir", &dir.path().to_string_lossy(), "--port", &port.to_string(), "--storage-servers", "1"])
        .args(["--dram", "64MiB", "--min-executors", "0", "--max-executors", "3"])
        .args(["--executor-cpus", "1", "--executor-memory", "1GiB", "--executor-gpus", "0"])
        .args(["--executor-idle-timeout", "1s"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("up.log")).unwrap())
        .spawn()
        .unwrap();
    let logs = || {
        let mut text = std::fs::read_to_string(dir.path().join("up.log")).unwrap_or_default();
        for entry in std::fs::read_dir(dir.path().join("logs")).into_iter().flatten().flatten() {
            text.push_str(&format!("--- {} ---\n", entry.path().display()));
            text.push_str(&std::fs::read_to_string(entry.path()).unwrap_or_default());
        }
        text
    };
    let scheduler_addr = format!("127.0.0.1:{}", port + 2);
    let wait = |what: &'static str, timeout: Duration| {
        let deadline = Instant::now() + timeout;
        move || assert!(Instant::now() < deadline, "timed out waiting for {what}")
    };
    let check = wait("the scheduler", Duration::from_secs(60));
    let client = loop {
        if let Ok(client) = SchedulerClient::connect(&scheduler_addr, None, None).await {
            if client.pool_status().await.is_ok() {
                break client;
            }
        }
        check();
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(client.pool_status().await.unwrap().executors, 0, "the pool started executors with no work");

    // Six one-CPU tasks of 2 s each: three executors of one CPU take them in two rounds.
    let job = pb::JobSpec {
        name: "scale".into(),
        stages: vec![pb::StageSpec {
            name: "wait".into(),
            operator: Some(pb::Operator {
                name: "noop".into(),
                params: [("sleep_ms".to_string(), "2000".to_string())].into(),
                ..Default::default()
            }),
            tasks: 6,
            needs: Some(pb::Resources { cpu_milli: 1000, memory_bytes: 64 << 20, gpu_milli: 0 }),
            ..Default::default()
        }],
        ..Default::default()
    };
    let job_id = client.submit(job).await.unwrap();
    let check = wait("three executors", Duration::from_secs(30));
    let mut most = 0;
    loop {
        let status = client.pool_status().await.unwrap();
        most = most.max(status.executors);
        if most == 3 {
            break;
        }
        if check_done(&client, &job_id).await {
            panic!("the job finished with at most {most} executors\n{}", logs());
        }
        check();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let check = wait("the job", Duration::from_secs(60));
    while !check_done(&client, &job_id).await {
        check();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(client.job(&job_id).await.unwrap().state(), pb::JobState::Succeeded, "{}", logs());
    // Idle for 1 s, they leave: back to zero.
    let check = wait("the pool to scale back to zero", Duration::from_secs(30));
    while client.pool_status().await.unwrap().executors > 0 {
        check();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(std::fs::read_to_string(dir.path().join("logs/executor-0.log")).unwrap().contains("executor left"));

    // SAFETY: plain kill(2) on our own child's pid.
    unsafe {
        libc::kill(up.id() as libc::pid_t, libc::SIGTERM);
    }
    let status = up.wait().unwrap();
    assert!(status.success(), "tern up exited {status}\n{}", logs());
}

async fn check_done(client: &SchedulerClient, job_id: &str) -> bool {
    tern_scheduler_api::client::is_finished(client.job(job_id).await.unwrap().state())
}

/// The first of `len` consecutive free loopback ports.
fn free_port_range(len: u16) -> u16 {
    tern_local::free_port_range(len).unwrap()
}
