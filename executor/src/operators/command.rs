//! `command`: any executable, run with the task's environment (see [`super::task_env`]).
//!
//! The program runs in its own process group, stdin closed; the last few KiB of its stdout and
//! stderr are kept for the failure message. Exit status 0 is success.
//!
//! Memory: the task's granted memory is enforced by watching the resident set (RSS) of the
//! program and every process it started, every [`MEMORY_CHECK_INTERVAL`]; past the grant the
//! whole group is killed (SIGKILL) and the task reported OOM, so the scheduler retries it with
//! twice the memory. RSS rather than `setrlimit(RLIMIT_AS)`: an address-space limit breaks
//! programs that reserve far more than they touch (JVMs, Go, CUDA), and a failed `malloc` does
//! not tell the executor it was memory. The cost: a program may overshoot between two checks.
//! A program killed by a signal from elsewhere is reported failed, naming the signal: only the
//! executor's own enforcement says OOM (a SIGKILL may be `kill -9`, a cancelled Spark executor, or
//! the kernel's OOM killer; the message says whether the kernel counted an OOM kill meanwhile).

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tern_proto::sched as pb;
use tokio::io::AsyncReadExt;
use tokio::process::Command;

use super::{task_env, Report, Services};

/// How often a command's memory is checked.
pub const MEMORY_CHECK_INTERVAL: Duration = Duration::from_millis(20);
/// Bytes of each of stdout and stderr kept for the report.
const OUTPUT_TAIL_BYTES: usize = 2048;
/// Most processes of one task walked when summing its memory.
const MAX_PROCESSES: usize = 1024;
/// How long the output readers get to finish after the program exits.
const OUTPUT_DRAIN: Duration = Duration::from_millis(200);

pub async fn run(task: &pb::Assignment, services: &Services) -> Report {
    let operator = task.operator.clone().unwrap_or_default();
    let Some((program, args)) = operator.argv.split_first() else {
        return Report::failed("command: the stage's operator has no argv (the program to run)");
    };
    let env: Vec<(String, String)> = operator.env.into_iter().collect();
    run_program(task, services, program, args, &env, None).await
}

/// Runs `program` with `args` as task `task` (its environment, `env` added; in `cwd` when given,
/// else the executor's own directory), watching its memory as the module says; the report is the
/// program's.
pub(super) async fn run_program(
    task: &pb::Assignment,
    services: &Services,
    program: &str,
    args: &[String],
    env: &[(String, String)],
    cwd: Option<&std::path::Path>,
) -> Report {
    let mut command = Command::new(program);
    if let Some(cwd) = cwd {
        command.current_dir(cwd);
    }
    command
        .args(args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .envs(task_env(task, services.metadata()))
        .stdin(Stdio::null());
    match Started::spawn(command) {
        Ok(started) => watch(task, program, started).await,
        Err(e) => Report::failed(format!("command: cannot start {program:?}: {e}")),
    }
}

/// A program started by [`Started::spawn`], its output being gathered.
pub(super) struct Started {
    pub child: tokio::process::Child,
    pub pid: u32,
    stdout: Arc<Mutex<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
    readers: [tokio::task::JoinHandle<()>; 2],
}

impl Started {
    /// Starts `command` in a process group of its own (so the group can be killed with everything
    /// it started), killed if dropped, its stdout and stderr tails kept.
    pub fn spawn(mut command: Command) -> std::io::Result<Started> {
        command.stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0).kill_on_drop(true);
        let mut child = command.spawn()?;
        let pid = child.id().ok_or_else(|| std::io::Error::other("it exited before it could be watched"))?;
        let (stdout, stdout_done) = tail(child.stdout.take());
        let (stderr, stderr_done) = tail(child.stderr.take());
        Ok(Started { child, pid, stdout, stderr, readers: [stdout_done, stderr_done] })
    }

    /// What it wrote so far (stdout, stderr tails), forgotten: for a program whose first output
    /// belongs to no task (a parked JVM's warm-up).
    pub fn take_output(&self) -> (Vec<u8>, Vec<u8>) {
        (std::mem::take(&mut *self.stdout.lock()), std::mem::take(&mut *self.stderr.lock()))
    }
}

/// Waits for `started` to end as task `task` (the task's memory enforced, its group killed when
/// this returns or is dropped); the report is the program's.
pub(super) async fn watch(task: &pb::Assignment, program: &str, started: Started) -> Report {
    let Started { mut child, pid, stdout, stderr, readers } = started;
    let began = Instant::now();
    let oom_kills_before = kernel_oom_kills();
    // Dropped (the task cancelled, the executor leaving) or done: the group goes with it.
    let _group = GroupGuard(pid as libc::pid_t);
    let limit = task.granted.as_ref().map(|g| g.memory_bytes).unwrap_or(0);
    let mut tick = tokio::time::interval(MEMORY_CHECK_INTERVAL);
    let mut peak = 0u64;
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            _ = tick.tick(), if limit > 0 => {
                let rss = process_tree_rss_bytes(pid);
                peak = peak.max(rss);
                if rss > limit {
                    kill_group(pid as libc::pid_t);
                    let _ = child.wait().await;
                    return Report::oom(format!(
                        "command {program:?} used {rss} bytes of memory (resident), more than the {limit} granted; killed"
                    ));
                }
            }
        }
    };
    let status = match status {
        Ok(status) => status,
        Err(e) => return Report::failed(format!("command {program:?}: waiting for it: {e}")),
    };
    // Let the readers drain what the program wrote last (bounded: a process it left behind may
    // hold the pipes open until the group is killed).
    for reader in readers {
        let _ = tokio::time::timeout(OUTPUT_DRAIN, reader).await;
    }
    let output = describe_output(&stdout.lock(), &stderr.lock());
    let seconds = began.elapsed().as_secs_f64();
    if status.success() {
        return Report::succeeded(format!("exit 0 after {seconds:.3} s"));
    }
    if let Some(signal) = status.signal() {
        let kernel = match (oom_kills_before, kernel_oom_kills()) {
            (Some(before), Some(after)) if after > before => "; the kernel's OOM killer killed a process meanwhile",
            _ => "",
        };
        return Report::failed(format!(
            "command {program:?} was killed by signal {signal} ({}) from outside the executor after {seconds:.3} s \
             (not by Tern's memory enforcement: peak resident memory seen {peak} of {limit} bytes granted{kernel}){output}",
            signal_name(signal)
        ));
    }
    Report::failed(format!("command {program:?} failed ({status}) after {seconds:.3} s{output}"))
}

/// The kernel's count of OOM kills since boot (`oom_kill` in /proc/vmstat, Linux 4.13 on).
fn kernel_oom_kills() -> Option<u64> {
    let vmstat = std::fs::read_to_string("/proc/vmstat").ok()?;
    vmstat.lines().find_map(|line| line.strip_prefix("oom_kill ")?.trim().parse().ok())
}

/// A signal's name, as `kill -l` gives it, for the common ones.
fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGHUP => "SIGHUP",
        _ => "another signal",
    }
}

/// Kills the task's process group when dropped.
struct GroupGuard(libc::pid_t);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        kill_group(self.0);
    }
}

fn kill_group(pgid: libc::pid_t) {
    // SAFETY: kill(2) on a process group this executor made; harmless if it is already gone.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}

/// The last [`OUTPUT_TAIL_BYTES`] a pipe carried, gathered in the background.
fn tail(
    pipe: Option<impl tokio::io::AsyncRead + Unpin + Send + 'static>,
) -> (Arc<Mutex<Vec<u8>>>, tokio::task::JoinHandle<()>) {
    let kept = Arc::new(Mutex::new(Vec::new()));
    let done = {
        let kept = kept.clone();
        tokio::spawn(async move {
            let Some(mut pipe) = pipe else { return };
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                let mut kept = kept.lock();
                kept.extend_from_slice(&buf[..n]);
                if kept.len() > OUTPUT_TAIL_BYTES {
                    let cut = kept.len() - OUTPUT_TAIL_BYTES;
                    kept.drain(..cut);
                }
            }
        })
    };
    (kept, done)
}

fn describe_output(stdout: &[u8], stderr: &[u8]) -> String {
    let mut text = String::new();
    for (name, bytes) in [("stdout", stdout), ("stderr", stderr)] {
        let shown = String::from_utf8_lossy(bytes);
        let shown = shown.trim();
        if !shown.is_empty() {
            text.push_str(&format!("; {name} ends: {shown}"));
        }
    }
    text
}

/// Resident bytes of process `pid` and all its descendants (from /proc; 0 once it is gone).
pub fn process_tree_rss_bytes(pid: u32) -> u64 {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let mut total = 0;
    let mut stack = vec![pid];
    let mut seen = 0;
    while let Some(pid) = stack.pop() {
        seen += 1;
        if seen > MAX_PROCESSES {
            break;
        }
        if let Ok(statm) = std::fs::read_to_string(format!("/proc/{pid}/statm")) {
            let resident: u64 = statm.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
            total += resident * page;
        }
        // Children of every thread (any thread may have forked).
        let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else { continue };
        for thread in threads.flatten() {
            if let Ok(children) = std::fs::read_to_string(thread.path().join("children")) {
                stack.extend(children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()));
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use tern_client::ClientOptions;

    use super::*;

    fn command(argv: &[&str], memory_bytes: u64) -> pb::Assignment {
        pb::Assignment {
            job_id: "job-7".into(),
            stage: "cmd".into(),
            task_index: 2,
            task_count: 5,
            attempt: 0,
            operator: Some(pb::Operator {
                name: "command".into(),
                argv: argv.iter().map(|s| s.to_string()).collect(),
                env: HashMap::from([("EXTRA".to_string(), "yes".to_string())]),
                ..Default::default()
            }),
            granted: Some(pb::Resources { cpu_milli: 1000, memory_bytes, gpu_milli: 0 }),
            output_path: "/out/x".into(),
            ..Default::default()
        }
    }

    fn services() -> Services {
        Services::new("127.0.0.1:9".into(), ClientOptions::default())
    }

    #[tokio::test]
    async fn a_command_sees_its_environment() {
        let script = r#"test "$TERN_JOB_ID/$TERN_STAGE/$TERN_TASK_INDEX/$TERN_TASK_COUNT/$TERN_ATTEMPT/$TERN_METADATA/$TERN_OUTPUT/$EXTRA" = "job-7/cmd/2/5/0/127.0.0.1:9//out/x/yes""#;
        let report = run(&command(&["sh", "-c", script], 0), &services()).await;
        assert_eq!(report.outcome, pb::TaskOutcome::Succeeded, "{}", report.message);
    }

    #[tokio::test]
    async fn a_failing_command_reports_its_status_and_output() {
        let report = run(&command(&["sh", "-c", "echo broken pipe dream >&2; exit 3"], 0), &services()).await;
        assert_eq!(report.outcome, pb::TaskOutcome::Failed);
        assert!(report.message.contains("exit status: 3"), "{}", report.message);
        assert!(report.message.contains("broken pipe dream"), "{}", report.message);
        let report = run(&command(&["/no/such/program"], 0), &services()).await;
        assert_eq!(report.outcome, pb::TaskOutcome::Failed);
        assert!(report.message.contains("cannot start"), "{}", report.message);
    }

    #[tokio::test]
    async fn a_command_past_its_memory_is_killed_as_oom() {
        // Holds about 64 MiB in a shell variable (through a child pipeline) for a while.
        let hog = "x=$(head -c 67108864 /dev/zero | tr '\\0' a); sleep 5";
        let started = Instant::now();
        let report = run(&command(&["sh", "-c", hog], 32 << 20), &services()).await;
        assert_eq!(report.outcome, pb::TaskOutcome::Oom, "{}", report.message);
        assert!(started.elapsed() < Duration::from_secs(4), "killed late: {:?}", started.elapsed());
        // With room it runs to the end.
        let fits = "x=$(head -c 1048576 /dev/zero | tr '\\0' a)";
        let report = run(&command(&["sh", "-c", fits], 256 << 20), &services()).await;
        assert_eq!(report.outcome, pb::TaskOutcome::Succeeded, "{}", report.message);
    }

    #[tokio::test]
    async fn a_command_killed_from_outside_is_failed_naming_the_signal_not_oom() {
        let report = run(&command(&["sh", "-c", "kill -9 $$"], 256 << 20), &services()).await;
        assert_eq!(report.outcome, pb::TaskOutcome::Failed, "{}", report.message);
        assert!(report.message.contains("killed by signal 9 (SIGKILL)"), "{}", report.message);
        assert!(report.message.contains("not by Tern's memory enforcement"), "{}", report.message);
        let report = run(&command(&["sh", "-c", "kill -TERM $$"], 0), &services()).await;
        assert_eq!(report.outcome, pb::TaskOutcome::Failed, "{}", report.message);
        assert!(report.message.contains("signal 15 (SIGTERM)"), "{}", report.message);
        assert!(kernel_oom_kills().is_some(), "/proc/vmstat has no oom_kill counter");
    }

    #[test]
    fn rss_of_this_process_is_counted() {
        let rss = process_tree_rss_bytes(std::process::id());
        assert!(rss > 1 << 20, "{rss}");
        assert_eq!(process_tree_rss_bytes(u32::MAX), 0);
    }
}
