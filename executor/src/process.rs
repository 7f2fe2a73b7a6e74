//! `tern executor`: a process that registers its CPUs, memory and GPUs with the scheduler,
//! pulls batches of tasks by long poll, runs them concurrently within its resources, and
//! reports their results in its next poll.
//!
//! One loop drives the executor: it polls (carrying the results of tasks finished since the last
//! poll), starts what it is given, and repeats; tasks run as their own tokio tasks and hand their
//! reports back over a channel. A poll waits long only when nothing runs here; while tasks run it
//! waits at most [`RESULT_DELAY`], so a finished task is reported within that. A separate task
//! heartbeats. Nothing heavy happens before the executor registers (GPU detection is a library
//! probe; the Tern client connects on the first task that needs it), so a new executor is running
//! its first task within milliseconds of its start.
//!
//! Leaving: on SIGTERM (or after `idle_exit` with nothing to do) the executor stops its tasks
//! and tells the scheduler, reporting every task it had as lost, so they run again elsewhere.
//! A killed executor (SIGKILL) says nothing; the scheduler notices the missing heartbeats.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tern_client::{ClientOptions, ErrorKind};
use tern_proto::sched as pb;
use tern_scheduler_api::SchedulerClient;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use crate::operators::{self, Report, Services};

/// Longest a finished task's result waits for the next poll while other tasks run.
pub const RESULT_DELAY: Duration = Duration::from_millis(20);
/// How long the executor keeps trying a scheduler it cannot reach before it gives up.
const SCHEDULER_PATIENCE: Duration = Duration::from_secs(60);
/// First pause after a failed call, doubled up to [`MAX_RETRY_PAUSE`].
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(50);
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(2);

/// Pauses between calls to the scheduler that failed; bounded by [`SCHEDULER_PATIENCE`] at the
/// call sites.
fn retry_backoff() -> tern_common::Backoff {
    tern_common::Backoff::new(FIRST_RETRY_PAUSE, MAX_RETRY_PAUSE)
}

/// How `tern executor` runs.
#[derive(Debug, Clone)]
pub struct ExecutorConfig {
    /// The scheduler's address.
    pub scheduler: String,
    /// The metadata server tasks use; `None` = the one the scheduler names.
    pub metadata: Option<String>,
    /// TLS material towards the scheduler and the metadata server.
    pub tls_dir: Option<PathBuf>,
    /// Its `executor` credential (`tern_proto::identity`): the scheduler hands tasks to its
    /// holders only.
    pub credential: String,
    /// Name in the scheduler's logs ("" = its executor id).
    pub name: String,
    /// Host it runs on, for locality (as storage servers name theirs).
    pub host: String,
    /// CPUs offered, in milli-CPUs.
    pub cpu_milli: u64,
    /// Memory offered to tasks.
    pub memory_bytes: u64,
    /// GPUs offered.
    pub gpus: tern_gpu::Inventory,
    /// Leave after this long with nothing to run (the pool's elastic executors); `None` = stay.
    pub idle_exit: Option<Duration>,
    /// Spark executor JVMs kept parked, at most (see `operators::spark_warm`; 0 = none).
    pub warm_spark_executors: usize,
}

/// Why [`run`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Asked to stop (SIGTERM, Ctrl-C).
    Shutdown,
    /// Nothing to run for `idle_exit`.
    Idle,
}

/// A task this executor has: waiting for room here, or running.
struct Held {
    assignment: Arc<pb::Assignment>,
    abort: Option<AbortHandle>,
}

/// Resources in use or free on this executor.
#[derive(Debug, Clone, Default)]
struct Room {
    cpu_milli: u64,
    memory_bytes: u64,
    /// Milli-GPUs per address.
    gpus: HashMap<String, u64>,
}

/// A finished task's report, from its tokio task to the loop.
struct Finished {
    assignment_id: u64,
    report: Report,
    duration: Duration,
}

/// The executor's state between polls.
struct Executor {
    client: SchedulerClient,
    services: Arc<Services>,
    executor_id: String,
    max_batch: u32,
    max_poll_wait: Duration,
    capacity: Room,
    used: Room,
    held: HashMap<u64, Held>,
    /// Assignments waiting for room here, in the order given.
    waiting: VecDeque<u64>,
    results: Vec<pb::TaskResult>,
    finished_tx: mpsc::UnboundedSender<Finished>,
    finished_rx: mpsc::UnboundedReceiver<Finished>,
    first_task_logged: bool,
    started: Instant,
}

/// Runs an executor until `shutdown` resolves (then it leaves cleanly) or it has been idle for
/// `idle_exit`.
pub async fn run(config: ExecutorConfig, shutdown: impl Future<Output = ()>) -> anyhow::Result<Exit> {
    let started = Instant::now();
    tokio::pin!(shutdown);
    if config.cpu_milli == 0 {
        bail!("an executor needs some CPU to offer (--cpus above 0)");
    }
    let client = tokio::select! {
        connected = connect(&config.scheduler, config.tls_dir.as_deref(), &config.credential) => connected?,
        _ = &mut shutdown => return Ok(Exit::Shutdown),
    };
    let registration = tokio::select! {
        registered = register(&client, &config) => registered?,
        _ = &mut shutdown => return Ok(Exit::Shutdown),
    };
    let metadata = config.metadata.clone().unwrap_or_else(|| registration.metadata.clone());
    let options = ClientOptions { tls_dir: config.tls_dir.clone(), ..ClientOptions::default() };
    let (finished_tx, finished_rx) = mpsc::unbounded_channel();
    let capacity = Room {
        cpu_milli: config.cpu_milli,
        memory_bytes: config.memory_bytes,
        gpus: config.gpus.devices.iter().map(|d| (d.address.clone(), 1000)).collect(),
    };
    let mut executor = Executor {
        client,
        services: Arc::new(
            Services::new(metadata, options)
                .with_host(&config.host)
                .with_warm_spark_executors(config.warm_spark_executors),
        ),
        executor_id: registration.executor_id.clone(),
        max_batch: registration.max_batch.max(1),
        max_poll_wait: Duration::from_millis(registration.max_poll_wait_ms.max(1)),
        capacity,
        used: Room::default(),
        held: HashMap::new(),
        waiting: VecDeque::new(),
        results: Vec::new(),
        finished_tx,
        finished_rx,
        first_task_logged: false,
        started,
    };
    tracing::info!(
        executor = %executor.executor_id, scheduler = %config.scheduler, cpus = config.cpu_milli as f64 / 1000.0,
        memory_bytes = config.memory_bytes, gpus = ?config.gpus.addresses(), gpu_source = ?config.gpus.source,
        gpu_note = config.gpus.note.as_deref().unwrap_or(""), metadata = %executor.services.metadata(),
        startup_ms = started.elapsed().as_secs_f64() * 1e3, "executor registered"
    );
    let heartbeat_interval = Duration::from_millis(registration.heartbeat_interval_ms.max(10));
    let (cancel_tx, mut cancel_rx) = mpsc::unbounded_channel::<HeartbeatNews>();
    let mut heartbeat = tokio::spawn(heartbeats(
        executor.client.clone(),
        executor.executor_id.clone(),
        heartbeat_interval,
        cancel_tx.clone(),
    ));

    let mut idle_since = Instant::now();
    let mut failing_since: Option<Instant> = None;
    let mut backoff = retry_backoff();
    let mut news_queue = Vec::new();
    let exit = loop {
        executor.collect_finished();
        while let Ok(news) = cancel_rx.try_recv() {
            news_queue.push(news);
        }
        for news in std::mem::take(&mut news_queue) {
            match news {
                HeartbeatNews::Cancel(ids) => executor.cancel(&ids),
                HeartbeatNews::Forgotten => {
                    executor.reregister(&config).await?;
                    heartbeat.abort();
                    heartbeat = tokio::spawn(heartbeats(
                        executor.client.clone(),
                        executor.executor_id.clone(),
                        heartbeat_interval,
                        cancel_tx.clone(),
                    ));
                }
            }
        }
        if !executor.held.is_empty() {
            idle_since = Instant::now();
        }
        let idle_left = config.idle_exit.map(|idle| idle.saturating_sub(idle_since.elapsed()));
        if idle_left == Some(Duration::ZERO) && executor.results.is_empty() {
            break Exit::Idle;
        }
        let want = if executor.waiting.is_empty() && executor.has_room() { executor.max_batch } else { 0 };
        if want == 0 && executor.results.is_empty() {
            // Full, with nothing to report: wait for a task to finish.
            tokio::select! {
                finished = executor.finished_rx.recv() => {
                    if let Some(finished) = finished {
                        executor.finish(finished);
                    }
                }
                news = cancel_rx.recv() => news_queue.extend(news),
                _ = &mut shutdown => break Exit::Shutdown,
            }
            continue;
        }
        let batch = executor.results.len().min(executor.max_batch as usize);
        let results: Vec<pb::TaskResult> = executor.results.drain(..batch).collect();
        // Results that did not fit this poll go with the next one at once: a long poll here would
        // hold them back for up to max_poll_wait, and the job's end with them.
        let wait = if want == 0 || !executor.results.is_empty() {
            Duration::ZERO
        } else if executor.held.is_empty() {
            idle_left.map_or(executor.max_poll_wait, |left| left.min(executor.max_poll_wait))
        } else {
            RESULT_DELAY
        };
        let poll = executor.client.poll(&executor.executor_id, results.clone(), want, wait);
        let reply = tokio::select! {
            reply = poll => reply,
            _ = &mut shutdown => {
                // The results may or may not have reached the scheduler; leaving repeats them
                // (the scheduler takes a repeated result once).
                executor.results.splice(0..0, results);
                break Exit::Shutdown;
            }
        };
        match reply {
            Ok(reply) => {
                failing_since = None;
                backoff.reset();
                executor.cancel(&reply.cancel);
                if !reply.assignments.is_empty() {
                    idle_since = Instant::now();
                }
                for assignment in reply.assignments {
                    executor.accept(assignment);
                }
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                tracing::warn!(executor = %executor.executor_id, "the scheduler forgot this executor ({e})");
                news_queue.push(HeartbeatNews::Forgotten);
            }
            Err(e) => {
                // Keep the results for the next try.
                executor.results.splice(0..0, results);
                let since = *failing_since.get_or_insert_with(Instant::now);
                if since.elapsed() > SCHEDULER_PATIENCE {
                    heartbeat.abort();
                    executor.stop_all();
                    bail!("the scheduler at {} has not answered for {SCHEDULER_PATIENCE:?}: {e}", config.scheduler);
                }
                let pause = backoff.next().expect("an unbounded backoff always has a next delay");
                tracing::warn!(executor = %executor.executor_id, "poll failed ({e}); retrying in {pause:?}");
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = &mut shutdown => break Exit::Shutdown,
                }
            }
        }
    };
    heartbeat.abort();
    executor.leave(exit).await;
    Ok(exit)
}

/// What the heartbeat task tells the loop.
enum HeartbeatNews {
    Cancel(Vec<u64>),
    /// The scheduler no longer knows this executor (it was declared lost): register again.
    Forgotten,
}

async fn heartbeats(
    client: SchedulerClient,
    executor_id: String,
    interval: Duration,
    news: mpsc::UnboundedSender<HeartbeatNews>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        match client.heartbeat(&executor_id).await {
            Ok(cancel) if !cancel.is_empty() => {
                let _ = news.send(HeartbeatNews::Cancel(cancel));
            }
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {
                let _ = news.send(HeartbeatNews::Forgotten);
                return;
            }
            Err(e) => tracing::warn!(executor = %executor_id, "heartbeat failed: {e}"),
        }
    }
}

async fn connect(addr: &str, tls_dir: Option<&std::path::Path>, credential: &str) -> anyhow::Result<SchedulerClient> {
    let started = Instant::now();
    let mut backoff = retry_backoff();
    loop {
        match SchedulerClient::connect(addr, tls_dir, Some(credential)).await {
            Ok(client) => return Ok(client),
            Err(e) if e.kind() == ErrorKind::Unavailable && started.elapsed() < SCHEDULER_PATIENCE => {
                let pause = backoff.next().expect("an unbounded backoff always has a next delay");
                tracing::warn!("cannot reach the scheduler yet ({e}); retrying in {pause:?}");
                tokio::time::sleep(pause).await;
            }
            Err(e) => return Err(e).with_context(|| format!("connecting to the scheduler at {addr}")),
        }
    }
}

async fn register(client: &SchedulerClient, config: &ExecutorConfig) -> anyhow::Result<pb::RegisterExecutorResponse> {
    let request = pb::RegisterExecutorRequest {
        name: config.name.clone(),
        host: config.host.clone(),
        capacity: Some(pb::Resources { cpu_milli: config.cpu_milli, memory_bytes: config.memory_bytes, gpu_milli: 0 }),
        gpu_addresses: config.gpus.addresses(),
        operators: tern_scheduler_api::Operator::ALL.iter().map(|o| o.name().to_string()).collect(),
    };
    client
        .register_executor(request)
        .await
        .with_context(|| format!("registering with the scheduler at {}", client.addr()))
}

impl Executor {
    fn has_room(&self) -> bool {
        self.used.cpu_milli < self.capacity.cpu_milli
    }

    /// Takes an assignment: starts it now if it fits, else queues it until something finishes.
    fn accept(&mut self, assignment: pb::Assignment) {
        let id = assignment.assignment_id;
        if self.held.contains_key(&id) {
            tracing::warn!(assignment = id, "the scheduler sent an assignment twice; ignored");
            return;
        }
        self.held.insert(id, Held { assignment: Arc::new(assignment), abort: None });
        self.waiting.push_back(id);
        self.start_waiting();
    }

    /// Starts waiting tasks, in order, while they fit. The first one always starts when
    /// nothing runs, so a task larger than this executor (the scheduler's mistake) cannot stall it.
    fn start_waiting(&mut self) {
        while let Some(&id) = self.waiting.front() {
            let needs = needs(&self.held[&id].assignment);
            let running = self.held.len() - self.waiting.len();
            if running > 0 && !self.fits(&needs) {
                break;
            }
            self.waiting.pop_front();
            self.take(&needs);
            self.start(id);
        }
    }

    fn fits(&self, needs: &Room) -> bool {
        self.used.cpu_milli + needs.cpu_milli <= self.capacity.cpu_milli
            && self.used.memory_bytes + needs.memory_bytes <= self.capacity.memory_bytes
            && needs.gpus.iter().all(|(address, milli)| {
                self.used.gpus.get(address).copied().unwrap_or(0) + milli
                    <= self.capacity.gpus.get(address).copied().unwrap_or(0)
            })
    }

    fn take(&mut self, needs: &Room) {
        self.used.cpu_milli += needs.cpu_milli;
        self.used.memory_bytes += needs.memory_bytes;
        for (address, milli) in &needs.gpus {
            *self.used.gpus.entry(address.clone()).or_default() += milli;
        }
    }

    fn give_back(&mut self, needs: &Room) {
        self.used.cpu_milli = self.used.cpu_milli.saturating_sub(needs.cpu_milli);
        self.used.memory_bytes = self.used.memory_bytes.saturating_sub(needs.memory_bytes);
        for (address, milli) in &needs.gpus {
            if let Some(used) = self.used.gpus.get_mut(address) {
                *used = used.saturating_sub(*milli);
            }
        }
    }

    fn start(&mut self, id: u64) {
        let held = self.held.get_mut(&id).expect("a started task is held");
        let assignment = held.assignment.clone();
        let (services, finished) = (self.services.clone(), self.finished_tx.clone());
        if !self.first_task_logged {
            self.first_task_logged = true;
            tracing::info!(
                executor = %self.executor_id, since_start_ms = self.started.elapsed().as_secs_f64() * 1e3,
                "first task running"
            );
        }
        tracing::debug!(
            assignment = id, job = %assignment.job_id, stage = %assignment.stage, task = assignment.task_index,
            attempt = assignment.attempt, operator = assignment.operator.as_ref().map(|o| o.name.as_str()).unwrap_or(""),
            "task started"
        );
        let handle = tokio::spawn(async move {
            let started = Instant::now();
            let report = operators::run(&assignment, &services).await;
            let _ = finished.send(Finished { assignment_id: id, report, duration: started.elapsed() });
        });
        held.abort = Some(handle.abort_handle());
    }

    /// Moves every report that has arrived into the results of the next poll.
    fn collect_finished(&mut self) {
        while let Ok(finished) = self.finished_rx.try_recv() {
            self.finish(finished);
        }
    }

    fn finish(&mut self, finished: Finished) {
        let Some(held) = self.held.remove(&finished.assignment_id) else {
            return; // Cancelled meanwhile: already reported.
        };
        let report = finished.report;
        if report.outcome != pb::TaskOutcome::Succeeded {
            tracing::warn!(
                assignment = finished.assignment_id, job = %held.assignment.job_id, stage = %held.assignment.stage,
                task = held.assignment.task_index, attempt = held.assignment.attempt, outcome = ?report.outcome,
                "task did not succeed: {}", report.message
            );
        }
        self.give_back(&needs(&held.assignment));
        self.results.push(pb::TaskResult {
            assignment_id: finished.assignment_id,
            outcome: report.outcome as i32,
            message: truncate(report.message),
            path: report.path,
            duration_us: finished.duration.as_micros() as u64,
            lost_inputs: report.lost_inputs,
        });
        self.start_waiting();
    }

    /// Stops the named tasks (their job was cancelled, or their stage no longer needs them) and
    /// reports them lost.
    fn cancel(&mut self, ids: &[u64]) {
        for id in ids {
            let Some(held) = self.held.remove(id) else { continue };
            match held.abort {
                Some(abort) => {
                    abort.abort();
                    self.give_back(&needs(&held.assignment));
                }
                None => self.waiting.retain(|w| w != id),
            }
            self.results.push(lost(*id, "cancelled by the scheduler"));
        }
        self.start_waiting();
    }

    /// Aborts every task; returns their ids.
    fn stop_all(&mut self) -> Vec<u64> {
        let ids: Vec<u64> = self.held.keys().copied().collect();
        for held in self.held.values() {
            if let Some(abort) = &held.abort {
                abort.abort();
            }
        }
        self.held.clear();
        self.waiting.clear();
        self.used = Room::default();
        ids
    }

    /// The scheduler forgot this executor (it missed heartbeats) and has queued its tasks again:
    /// drop them and register anew.
    async fn reregister(&mut self, config: &ExecutorConfig) -> anyhow::Result<()> {
        let dropped = self.stop_all();
        self.results.clear();
        let registration = register(&self.client, config).await?;
        tracing::warn!(
            old = %self.executor_id, new = %registration.executor_id, dropped = dropped.len(),
            "registered again; tasks of the old registration were dropped (the scheduler runs them again)"
        );
        self.executor_id = registration.executor_id;
        Ok(())
    }

    /// Tells the scheduler this executor is leaving, with every result not yet reported and every
    /// task it still had as lost.
    async fn leave(&mut self, why: Exit) {
        self.collect_finished();
        let mut results = std::mem::take(&mut self.results);
        let stopped = self.stop_all();
        results.extend(stopped.iter().map(|&id| lost(id, "the executor is leaving")));
        let count = results.len();
        match tokio::time::timeout(Duration::from_secs(5), self.client.leave(&self.executor_id, results)).await {
            Ok(Ok(requeued)) => tracing::info!(
                executor = %self.executor_id, reason = ?why, results = count, stopped = stopped.len(), requeued,
                "executor left"
            ),
            Ok(Err(e)) => tracing::warn!(executor = %self.executor_id, "leaving: {e}; the scheduler will find it lost"),
            Err(_) => {
                tracing::warn!(executor = %self.executor_id, "leaving timed out; the scheduler will find it lost")
            }
        }
    }
}

/// What a task holds while it runs here.
fn needs(assignment: &pb::Assignment) -> Room {
    let granted = assignment.granted.unwrap_or_default();
    Room {
        cpu_milli: granted.cpu_milli,
        memory_bytes: granted.memory_bytes,
        gpus: assignment.gpus.iter().map(|g| (g.address.clone(), u64::from(g.gpu_milli))).collect(),
    }
}

fn lost(assignment_id: u64, why: &str) -> pb::TaskResult {
    pb::TaskResult {
        assignment_id,
        outcome: pb::TaskOutcome::Lost as i32,
        message: why.to_string(),
        ..Default::default()
    }
}

/// Results carry at most 4 KiB of message (the scheduler keeps no more).
fn truncate(message: String) -> String {
    const MAX: usize = 4096;
    match tern_proto::cut_message(&message, MAX) {
        cut if cut.len() == message.len() => message,
        cut => cut.to_owned(),
    }
}

/// Memory this machine has (MemTotal), for an executor's default `--memory`.
pub fn machine_memory_bytes() -> anyhow::Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .context("no MemTotal in /proc/meminfo")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        let cut = truncate("é".repeat(3000));
        assert!(cut.len() <= 4096 && cut.chars().all(|c| c == 'é'));
    }

    #[test]
    fn machine_memory_is_known() {
        assert!(machine_memory_bytes().unwrap() > 64 << 20);
    }
}
