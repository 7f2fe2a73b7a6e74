//! Placement decisions: pure and deterministic (no I/O, no clock; time is an argument), so every
//! rule is unit-tested alone. The server wraps one [`Policy`] in a mutex.
//!
//! - Queues share the cluster by weight with dominant-resource fairness: the next task comes
//!   from the queue with the lowest `max(cpu share, gpu share) / weight` among those with work.
//! - Within a queue, jobs run by priority (higher first), then by submission.
//! - Gang stages place `min_available` tasks (default all) at once across the cluster, or none.
//! - A failed task is retried after a backoff that doubles per failure, up to `max_attempts`;
//!   an OOM retry doubles its memory up to the stage's `max_memory`. A task whose executor is
//!   lost runs again without counting a failure.
//! - A stage succeeds once `min_success` tasks succeeded; the rest are cancelled.
//! - Lineage: a task that finds its input lost names the tasks of the stage that wrote it; those
//!   run again (the stage reopens if it had finished), and the task waits for them, no attempt
//!   counted. A stage's output may be lost `MAX_RECOMPUTE_ROUNDS` times before the job fails.
//! - GPUs are accounted exactly in milli-units per device: a fraction goes to the device with
//!   the least room that still fits it (best fit), whole GPUs take free devices.
//! - A task may name a host (where its input lives): executors on that host take it first; other
//!   executors leave it for a short while (`locality_wait_ms`) when one on its host has room.
//!
//! Cost: a decision looks at the queues (few), the head of a job's ready list, and a bounded number
//! of candidates; nothing scans all tasks or all executors.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};

use tern_proto::cut_message;
use tern_proto::sched as pb;

use crate::spec::{Dag, MILLI};

/// Candidates a decision looks at in one queue before moving on (tasks that do not fit).
const MAX_CANDIDATES: usize = 16;
/// Task errors kept per stage.
const MAX_STAGE_ERRORS: usize = 8;
/// Ended tasks of an elastic stage reported by one ScaleStage call.
const MAX_ENDED_REPORTED: usize = 1024;
/// Bytes of one task error kept.
const MAX_ERROR_BYTES: usize = 4096;
/// Times a finished stage is reopened to recompute lost output before its job fails (a storage
/// cluster losing the same data over and over will not converge).
const MAX_RECOMPUTE_ROUNDS: u32 = 4;

/// The policy's knobs (from the scheduler's config).
#[derive(Debug, Clone)]
pub struct PolicyConfig {
    pub default_max_attempts: u32,
    pub default_backoff_ms: u64,
    pub max_backoff_ms: u64,
    pub locality_wait_ms: u64,
    pub max_tasks_per_executor: u32,
    pub default_queue_weight: u32,
    pub queue_weights: BTreeMap<String, u32>,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            default_max_attempts: 4,
            default_backoff_ms: 200,
            max_backoff_ms: 30_000,
            locality_wait_ms: 50,
            max_tasks_per_executor: 4096,
            default_queue_weight: 1,
            queue_weights: BTreeMap::new(),
        }
    }
}

/// Resources in exact units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Res {
    pub cpu_milli: u64,
    pub memory_bytes: u64,
    pub gpu_milli: u64,
}

impl From<pb::Resources> for Res {
    fn from(r: pb::Resources) -> Res {
        Res { cpu_milli: r.cpu_milli, memory_bytes: r.memory_bytes, gpu_milli: r.gpu_milli }
    }
}

impl From<Res> for pb::Resources {
    fn from(r: Res) -> pb::Resources {
        pb::Resources { cpu_milli: r.cpu_milli, memory_bytes: r.memory_bytes, gpu_milli: r.gpu_milli }
    }
}

/// GPU devices (by index on the executor) and the milli-units taken on each.
type GpuPicks = Vec<(usize, u32)>;

/// One GPU device of an executor.
#[derive(Debug, Clone)]
struct Gpu {
    address: String,
    free_milli: u32,
}

/// An executor as the policy sees it.
#[derive(Debug)]
struct Executor {
    host: String,
    capacity: Res,
    free_cpu: u64,
    free_memory: u64,
    gpus: Vec<Gpu>,
    running: u32,
    /// Assignments placed here by a gang decision made during another executor's poll.
    outbox: Vec<pb::Assignment>,
    /// Operators it runs; empty = all.
    operators: Vec<String>,
}

impl Executor {
    fn runs(&self, operator: &str) -> bool {
        self.operators.is_empty() || self.operators.iter().any(|o| o == operator)
    }
}

/// Where a task is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskState {
    /// Its stage waits for earlier stages.
    Waiting,
    Queued,
    Backoff,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

#[derive(Debug, Clone)]
struct Task {
    state: TaskState,
    /// Attempt numbers handed out (the next run's attempt number).
    runs: u32,
    /// Failures counted against max_attempts (OOM included, executor loss not).
    failures: u32,
    memory_bytes: u64,
    /// When it last became queued (for the locality wait).
    queued_at_ms: u64,
    /// Its running assignment, if running.
    assignment: u64,
}

/// Static facts of a stage the policy needs, given when the job is added.
#[derive(Debug, Clone)]
pub struct StageInfo {
    pub spec: pb::StageSpec,
    /// Filled in by the server: ids and partition counts of its input/output shuffles.
    pub input_shuffle_id: u64,
    pub input_partitions: u32,
    pub input_maps: u32,
    pub output_shuffle_id: u64,
    pub output_partitions: u32,
    /// Host preferred by each task ("" = none); empty = no preferences.
    pub hosts: Vec<String>,
}

#[derive(Debug)]
struct Stage {
    info: StageInfo,
    state: pb::StageState,
    needs: Res,
    max_attempts: u32,
    backoff_ms: u64,
    min_success: u32,
    tasks: Vec<Task>,
    ready: VecDeque<u32>,
    /// Ready tasks preferring a host, by host (entries may be stale: checked when taken).
    local: HashMap<String, VecDeque<u32>>,
    /// Stages waiting on this one.
    next: Vec<usize>,
    /// Unfinished stages it waits for.
    pending_deps: usize,
    counts: Counts,
    attempts: u32,
    oom_retries: u32,
    lost: u32,
    paths: BTreeMap<String, u32>,
    errors: VecDeque<String>,
    started_ms: u64,
    finished_ms: u64,
    /// Gang stages: whether its gang was placed (then it behaves like any stage).
    gang_placed: bool,
    /// Elastic stages: tasks that ended, in order (bounded by the stage's task limit).
    ended: Vec<pb::ElasticTaskEnd>,
    /// The stage that writes this one's input (see [`Dag::producer`]).
    producer: Option<usize>,
    /// Succeeded tasks queued again because a later stage found their output lost.
    recomputed: u32,
    /// Times this stage was reopened after finishing, to recompute lost output.
    recompute_rounds: u32,
    /// Reopened and not finished again: its consumers' waiting tasks resume when it does.
    recomputing: bool,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    waiting: u32,
    queued: u32,
    backoff: u32,
    running: u32,
    succeeded: u32,
    failed: u32,
    cancelled: u32,
}

impl Counts {
    fn get(&mut self, state: TaskState) -> &mut u32 {
        match state {
            TaskState::Waiting => &mut self.waiting,
            TaskState::Queued => &mut self.queued,
            TaskState::Backoff => &mut self.backoff,
            TaskState::Running => &mut self.running,
            TaskState::Succeeded => &mut self.succeeded,
            TaskState::Failed => &mut self.failed,
            TaskState::Cancelled => &mut self.cancelled,
        }
    }
}

/// What the job-level facts are for a new job.
#[derive(Debug, Clone)]
pub struct JobInfo {
    pub job_id: String,
    pub name: String,
    pub queue: String,
    pub priority: i32,
    pub tern_job_id: String,
    pub tern_job_root: String,
    /// The Tern job's token, handed to its tasks.
    pub tern_job_token: String,
    /// Copies of what its built-ins write (at least 1).
    pub copies: u32,
    pub submitted_unix_ms: u64,
}

#[derive(Debug)]
struct Job {
    info: JobInfo,
    seq: u64,
    queue: usize,
    state: pb::JobState,
    error: String,
    stages: Vec<Stage>,
    /// Stages with ready tasks, in stage order (a stage appears at most once).
    ready_stages: VecDeque<usize>,
    unfinished_stages: usize,
    finished_unix_ms: u64,
}

#[derive(Debug)]
struct Queue {
    name: String,
    weight: u32,
    /// Resources held by its running tasks.
    used_cpu: u64,
    used_gpu: u64,
    /// Jobs with ready tasks, by (higher priority first, then submission).
    ready_jobs: BTreeMap<(Reverse<i32>, u64), u64>,
    dispatched: u64,
}

/// A running assignment.
#[derive(Debug, Clone)]
struct Running {
    executor: usize,
    job: u64,
    stage: usize,
    task: u32,
    res: Res,
    gpus: Vec<(usize, u32)>,
    queue: usize,
}

/// What [`Policy::scale_stage`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct ScaleOutcome {
    pub added: Vec<u32>,
    pub ended: Vec<pb::ElasticTaskEnd>,
    pub ended_next: u32,
    pub state: pb::JobState,
    pub queued: u32,
    pub running: u32,
}

/// Why [`Policy::scale_stage`] refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScaleError {
    NotFound(String),
    Invalid(String),
}

/// What happened that the server must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The job finished (succeeded, failed or cancelled): end its Tern job.
    JobFinished { job_id: String, state: pb::JobState },
    /// Tell this executor to stop these assignments.
    Cancel { executor: usize, assignments: Vec<u64> },
}

/// Counts for PoolStatus and metrics.
#[derive(Debug, Clone, Default)]
pub struct PoolCounts {
    pub backlog_tasks: u64,
    pub backoff_tasks: u64,
    pub running_tasks: u64,
    pub executors: u32,
    pub idle_executors: u32,
    pub backlog_needs: Res,
    pub active_jobs: u32,
}

/// Per-queue figures for metrics.
#[derive(Debug, Clone)]
pub struct QueueShare {
    pub name: String,
    pub weight: u32,
    pub used_cpu_milli: u64,
    pub used_gpu_milli: u64,
    /// Dominant share of the cluster, 0 to 1.
    pub dominant_share: f64,
    pub dispatched: u64,
}

/// The scheduler's state and rules.
#[derive(Debug)]
pub struct Policy {
    config: PolicyConfig,
    executors: Vec<Option<Executor>>,
    free_slots: Vec<usize>,
    live_executors: u32,
    hosts: HashMap<String, Vec<usize>>,
    total_cpu: u64,
    total_gpu: u64,
    queues: Vec<Queue>,
    queue_index: HashMap<String, usize>,
    jobs: HashMap<u64, Job>,
    job_keys: HashMap<String, u64>,
    next_job: u64,
    running: HashMap<u64, Running>,
    next_assignment: u64,
    /// (due ms, job, stage, task) of tasks in backoff.
    backoff: BinaryHeap<Reverse<(u64, u64, usize, u32)>>,
    backlog: u64,
    backoff_count: u64,
    events: Vec<Event>,
    /// Executors a gang placed tasks on since the last [`Policy::take_gang_wakes`].
    gang_wakes: Vec<usize>,
    /// Unfinished jobs whose elastic stage has a lease: job key -> (lease ms, deadline ms).
    leases: BTreeMap<u64, (u64, u64)>,
}

impl Policy {
    pub fn new(config: PolicyConfig) -> Policy {
        Policy {
            config,
            executors: Vec::new(),
            free_slots: Vec::new(),
            live_executors: 0,
            hosts: HashMap::new(),
            total_cpu: 0,
            total_gpu: 0,
            queues: Vec::new(),
            queue_index: HashMap::new(),
            jobs: HashMap::new(),
            job_keys: HashMap::new(),
            next_job: 0,
            running: HashMap::new(),
            next_assignment: 1,
            backoff: BinaryHeap::new(),
            backlog: 0,
            backoff_count: 0,
            events: Vec::new(),
            gang_wakes: Vec::new(),
            leases: BTreeMap::new(),
        }
    }

    /// Executors that have gang tasks waiting for them in their outboxes, since the last call.
    pub fn take_gang_wakes(&mut self) -> Vec<usize> {
        std::mem::take(&mut self.gang_wakes)
    }

    /// Tasks ready to run and not placed.
    pub fn backlog(&self) -> u64 {
        self.backlog
    }

    /// Events since the last call.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    // ---- executors ----

    /// Adds an executor; returns its slot (the server maps its own ids to slots).
    pub fn add_executor(&mut self, host: &str, capacity: Res, gpu_addresses: &[String], operators: &[String]) -> usize {
        let executor = Executor {
            host: host.to_string(),
            capacity: Res { gpu_milli: gpu_addresses.len() as u64 * MILLI, ..capacity },
            free_cpu: capacity.cpu_milli,
            free_memory: capacity.memory_bytes,
            gpus: gpu_addresses.iter().map(|a| Gpu { address: a.clone(), free_milli: MILLI as u32 }).collect(),
            running: 0,
            outbox: Vec::new(),
            operators: operators.to_vec(),
        };
        self.total_cpu += executor.capacity.cpu_milli;
        self.total_gpu += executor.capacity.gpu_milli;
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.executors[slot] = Some(executor);
                slot
            }
            None => {
                self.executors.push(Some(executor));
                self.executors.len() - 1
            }
        };
        self.hosts.entry(host.to_string()).or_default().push(slot);
        self.live_executors += 1;
        slot
    }

    /// Removes an executor (it left or was lost): its running tasks are queued again without
    /// counting a failure. Returns how many.
    pub fn remove_executor(&mut self, slot: usize, now_ms: u64) -> u32 {
        let Some(executor) = self.executors.get_mut(slot).and_then(Option::take) else {
            return 0;
        };
        self.free_slots.push(slot);
        self.live_executors -= 1;
        self.total_cpu -= executor.capacity.cpu_milli;
        self.total_gpu -= executor.capacity.gpu_milli;
        if let Some(list) = self.hosts.get_mut(&executor.host) {
            list.retain(|&s| s != slot);
            if list.is_empty() {
                self.hosts.remove(&executor.host);
            }
        }
        // Its outbox and running tasks: collect the assignments placed there.
        let mine: Vec<u64> = self.running.iter().filter(|(_, r)| r.executor == slot).map(|(&id, _)| id).collect();
        let count = mine.len() as u32;
        let mut sorted = mine;
        sorted.sort_unstable();
        for id in sorted {
            self.finish_assignment(id, Outcome::Lost, "", "", now_ms, 0);
        }
        count
    }

    pub fn executor_running(&self, slot: usize) -> u32 {
        self.executors.get(slot).and_then(Option::as_ref).map_or(0, |e| e.running)
    }

    // ---- jobs ----

    fn queue_of(&mut self, name: &str) -> usize {
        if let Some(&q) = self.queue_index.get(name) {
            return q;
        }
        let weight = self.config.queue_weights.get(name).copied().unwrap_or(self.config.default_queue_weight).max(1);
        self.queues.push(Queue {
            name: name.to_string(),
            weight,
            used_cpu: 0,
            used_gpu: 0,
            ready_jobs: BTreeMap::new(),
            dispatched: 0,
        });
        self.queue_index.insert(name.to_string(), self.queues.len() - 1);
        self.queues.len() - 1
    }

    /// Adds a validated job; its first stages' tasks are queued at once.
    pub fn add_job(&mut self, info: JobInfo, stages: Vec<StageInfo>, dag: &Dag, now_ms: u64) {
        let queue_name =
            if info.queue.is_empty() { crate::spec::DEFAULT_QUEUE.to_string() } else { info.queue.clone() };
        let queue = self.queue_of(&queue_name);
        let key = self.next_job;
        self.next_job += 1;
        let mut built: Vec<Stage> = stages.into_iter().map(|info| self.new_stage(info)).collect();
        for (stage, &producer) in built.iter_mut().zip(&dag.producer) {
            stage.producer = producer;
        }
        for (i, deps) in dag.after.iter().enumerate() {
            built[i].pending_deps = deps.len();
            for &d in deps {
                built[d].next.push(i);
            }
        }
        let unfinished_stages = built.len();
        let job_id = info.job_id.clone();
        self.jobs.insert(
            key,
            Job {
                info,
                seq: key,
                queue,
                state: pb::JobState::Pending,
                error: String::new(),
                stages: built,
                ready_stages: VecDeque::new(),
                unfinished_stages,
                finished_unix_ms: 0,
            },
        );
        self.job_keys.insert(job_id, key);
        if let Some(lease) = self.jobs[&key].stages.iter().map(|s| s.info.spec.lease_ms).find(|&l| l > 0) {
            self.leases.insert(key, (lease, now_ms + lease));
        }
        for &s in &dag.order {
            if self.jobs[&key].stages[s].pending_deps == 0 {
                self.start_stage(key, s, now_ms);
            }
        }
    }

    /// A stage of a new job (or one added to an elastic job), its tasks waiting.
    fn new_stage(&self, info: StageInfo) -> Stage {
        let needs: Res = info.spec.needs.unwrap_or_default().into();
        let n = info.spec.tasks;
        let min_success = if info.spec.min_success == 0 { n } else { info.spec.min_success };
        let max_attempts =
            if info.spec.max_attempts == 0 { self.config.default_max_attempts } else { info.spec.max_attempts };
        let backoff_ms = if info.spec.backoff_ms == 0 { self.config.default_backoff_ms } else { info.spec.backoff_ms };
        Stage {
            state: pb::StageState::Waiting,
            needs,
            max_attempts,
            backoff_ms,
            min_success,
            tasks: vec![
                Task {
                    state: TaskState::Waiting,
                    runs: 0,
                    failures: 0,
                    memory_bytes: needs.memory_bytes,
                    queued_at_ms: 0,
                    assignment: 0
                };
                n as usize
            ],
            ready: VecDeque::new(),
            local: HashMap::new(),
            next: Vec::new(),
            pending_deps: 0,
            counts: Counts { waiting: n, ..Counts::default() },
            attempts: 0,
            oom_retries: 0,
            lost: 0,
            paths: BTreeMap::new(),
            errors: VecDeque::new(),
            started_ms: 0,
            finished_ms: 0,
            gang_placed: false,
            ended: Vec::new(),
            producer: None,
            recomputed: 0,
            recompute_rounds: 0,
            recomputing: false,
            info,
        }
    }

    fn start_stage(&mut self, key: u64, s: usize, now_ms: u64) {
        let job = self.jobs.get_mut(&key).expect("job exists");
        job.state = pb::JobState::Running;
        let stage = &mut job.stages[s];
        stage.state = pb::StageState::Running;
        stage.started_ms = now_ms.max(1);
        let n = stage.tasks.len() as u32;
        for t in 0..n {
            enqueue(stage, t, now_ms);
        }
        stage.counts.waiting -= n;
        stage.counts.queued += n;
        self.backlog += u64::from(n);
        // An elastic stage may start with no tasks: nothing to offer yet.
        if n > 0 {
            self.mark_ready(key, s);
        }
    }

    /// Takes the stage out of its job's ready list (and the job out of its queue's) once it has
    /// no queued task left.
    fn unready_if_empty(&mut self, key: u64, s: usize) {
        let job = self.jobs.get_mut(&key).expect("job exists");
        if job.stages[s].counts.queued > 0 {
            return;
        }
        job.ready_stages.retain(|&x| x != s);
        if job.ready_stages.is_empty() {
            let sort = (Reverse(job.info.priority), job.seq);
            self.queues[job.queue].ready_jobs.remove(&sort);
        }
    }

    /// An elastic job's owner adds an elastic stage (a Spark application's executors of another
    /// resource profile), running at once with no tasks. Checked as a submitted job is, with the
    /// job's stages and this one together under `limits`. Returns false, changing nothing, when
    /// the job already has a stage of that name (a retried call).
    pub fn add_stage(
        &mut self,
        job_id: &str,
        spec: pb::StageSpec,
        limits: &crate::spec::SpecLimits,
        now_ms: u64,
    ) -> Result<bool, ScaleError> {
        let key = *self.job_keys.get(job_id).ok_or_else(|| ScaleError::NotFound(format!("no job {job_id}")))?;
        let job = &self.jobs[&key];
        if job.stages.iter().any(|st| st.info.spec.name == spec.name) {
            return Ok(false);
        }
        let at = format!("adding stage {:?} to job {job_id}", spec.name);
        if !matches!(job.state, pb::JobState::Pending | pb::JobState::Running) {
            return Err(ScaleError::Invalid(format!("{at}: the job is {:?}", job.state)));
        }
        if !spec.elastic || !job.stages.iter().all(|st| st.info.spec.elastic) {
            return Err(ScaleError::Invalid(format!("{at}: only elastic stages join a job, and only an elastic one")));
        }
        if spec.tasks != 0 {
            return Err(ScaleError::Invalid(format!(
                "{at}: tasks = {}; a new stage starts with 0 (add queues)",
                spec.tasks
            )));
        }
        let whole = pb::JobSpec {
            name: job.info.name.clone(),
            queue: job.info.queue.clone(),
            stages: job.stages.iter().map(|st| st.info.spec.clone()).chain([spec.clone()]).collect(),
            ..Default::default()
        };
        crate::spec::validate(&whole, limits).map_err(|e| ScaleError::Invalid(format!("{at}: {e:#}")))?;
        let stage = self.new_stage(StageInfo {
            spec,
            input_shuffle_id: 0,
            input_partitions: 0,
            input_maps: 0,
            output_shuffle_id: 0,
            output_partitions: 0,
            hosts: Vec::new(),
        });
        let job = self.jobs.get_mut(&key).expect("job");
        job.stages.push(stage);
        job.unfinished_stages += 1;
        let s = job.stages.len() - 1;
        self.start_stage(key, s, now_ms);
        Ok(true)
    }

    /// An elastic stage's owner: adds `add` tasks (new indexes), cancels the tasks in `cancel`
    /// (queued ones dropped, running ones told to stop), ends the stage when `finish` (the job
    /// succeeds), and reports ended tasks from `ended_from` on. A finished job changes nothing
    /// and says its state. `max_tasks` bounds the stage's tasks over its whole life.
    #[allow(clippy::too_many_arguments)]
    pub fn scale_stage(
        &mut self,
        job_id: &str,
        stage_name: &str,
        add: u32,
        cancel: &[u32],
        finish: bool,
        ended_from: u32,
        max_tasks: u32,
        now_ms: u64,
        now_unix_ms: u64,
    ) -> Result<ScaleOutcome, ScaleError> {
        let key = *self.job_keys.get(job_id).ok_or_else(|| ScaleError::NotFound(format!("no job {job_id}")))?;
        let job = &self.jobs[&key];
        let s = job
            .stages
            .iter()
            .position(|st| st.info.spec.name == stage_name)
            .ok_or_else(|| ScaleError::NotFound(format!("job {job_id} has no stage {stage_name:?}")))?;
        let stage = &job.stages[s];
        if !stage.info.spec.elastic {
            return Err(ScaleError::Invalid(format!("stage {stage_name:?} of job {job_id} is not elastic")));
        }
        let total = stage.tasks.len() as u64 + u64::from(add);
        if total > u64::from(max_tasks) {
            return Err(ScaleError::Invalid(format!(
                "stage {stage_name:?} of job {job_id} would have {total} tasks in its life; at most {max_tasks}"
            )));
        }
        if let Some(&bad) = cancel.iter().find(|&&t| t as usize >= stage.tasks.len()) {
            return Err(ScaleError::Invalid(format!("stage {stage_name:?} of job {job_id} has no task {bad}")));
        }
        let mut added = Vec::new();
        if let Some((lease, deadline)) = self.leases.get_mut(&key) {
            *deadline = now_ms + *lease;
        }
        if stage.state == pb::StageState::Running {
            let stage = &mut self.jobs.get_mut(&key).expect("job").stages[s];
            for _ in 0..add {
                let t = stage.tasks.len() as u32;
                stage.tasks.push(Task {
                    state: TaskState::Queued,
                    runs: 0,
                    failures: 0,
                    memory_bytes: stage.needs.memory_bytes,
                    queued_at_ms: now_ms,
                    assignment: 0,
                });
                stage.ready.push_back(t);
                stage.counts.queued += 1;
                added.push(t);
            }
            self.backlog += u64::from(add);
            let mut stop = Vec::new();
            for &t in cancel {
                let task = &mut stage.tasks[t as usize];
                match task.state {
                    TaskState::Queued => self.backlog -= 1,
                    TaskState::Running => stop.push(task.assignment),
                    _ => continue,
                }
                *stage.counts.get(task.state) -= 1;
                task.state = TaskState::Cancelled;
                stage.counts.cancelled += 1;
                stage.ended.push(pb::ElasticTaskEnd {
                    task_index: t,
                    outcome: pb::TaskOutcome::Lost as i32,
                    message: "cancelled".into(),
                });
            }
            self.cancel_assignments(stop);
            if add > 0 {
                self.mark_ready(key, s);
            }
            self.unready_if_empty(key, s);
            if finish {
                self.finish_stage(key, s, true, String::new(), now_ms, now_unix_ms);
            }
        }
        let job = &self.jobs[&key];
        let stage = &job.stages[s];
        let from = (ended_from as usize).min(stage.ended.len());
        let ended: Vec<pb::ElasticTaskEnd> = stage.ended[from..].iter().take(MAX_ENDED_REPORTED).cloned().collect();
        Ok(ScaleOutcome {
            ended_next: (from + ended.len()) as u32,
            added,
            ended,
            state: job.state,
            queued: stage.counts.queued,
            running: stage.counts.running,
        })
    }

    /// Puts the stage in its job's ready list and the job in its queue's.
    fn mark_ready(&mut self, key: u64, s: usize) {
        let job = self.jobs.get_mut(&key).expect("job exists");
        if !job.ready_stages.contains(&s) {
            job.ready_stages.push_back(s);
        }
        let sort = (Reverse(job.info.priority), job.seq);
        self.queues[job.queue].ready_jobs.insert(sort, key);
    }

    /// Cancels a job: queued tasks dropped, running ones told to stop. Returns its state after.
    pub fn cancel_job(&mut self, job_id: &str, now_ms: u64, now_unix_ms: u64) -> Option<pb::JobState> {
        let key = *self.job_keys.get(job_id)?;
        let state = self.jobs[&key].state;
        if matches!(state, pb::JobState::Succeeded | pb::JobState::Failed | pb::JobState::Cancelled) {
            return Some(state);
        }
        self.finish_job(key, pb::JobState::Cancelled, "cancelled".into(), now_ms, now_unix_ms);
        Some(pb::JobState::Cancelled)
    }

    /// Forgets a finished job.
    pub fn forget_job(&mut self, job_id: &str) {
        if let Some(key) = self.job_keys.get(job_id).copied() {
            if self.jobs[&key].finished_unix_ms != 0 {
                self.job_keys.remove(job_id);
                self.jobs.remove(&key);
            }
        }
    }

    fn finish_job(&mut self, key: u64, state: pb::JobState, error: String, now_ms: u64, now_unix_ms: u64) {
        self.leases.remove(&key);
        let job = self.jobs.get_mut(&key).expect("job exists");
        job.state = state;
        job.error = error;
        job.finished_unix_ms = now_unix_ms.max(1);
        let queue = job.queue;
        let sort = (Reverse(job.info.priority), job.seq);
        self.queues[queue].ready_jobs.remove(&sort);
        job.ready_stages.clear();
        let mut running = Vec::new();
        for stage in &mut job.stages {
            if matches!(stage.state, pb::StageState::Waiting | pb::StageState::Running) {
                stage.state = pb::StageState::Cancelled;
                stage.finished_ms = now_ms.max(1);
            }
            cancel_unfinished(stage, &mut running, &mut self.backlog, &mut self.backoff_count);
            stage.ready.clear();
            stage.local.clear();
        }
        self.events.push(Event::JobFinished { job_id: job.info.job_id.clone(), state });
        self.cancel_assignments(running);
    }

    /// Sends Cancel events for running assignments (by executor) and frees their resources.
    fn cancel_assignments(&mut self, mut ids: Vec<u64>) {
        ids.sort_unstable();
        let mut by_executor: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
        for id in ids {
            if let Some(run) = self.running.remove(&id) {
                self.release(&run);
                by_executor.entry(run.executor).or_default().push(id);
            }
        }
        for (executor, assignments) in by_executor {
            self.events.push(Event::Cancel { executor, assignments });
        }
    }

    fn release(&mut self, run: &Running) {
        if let Some(executor) = self.executors.get_mut(run.executor).and_then(Option::as_mut) {
            executor.free_cpu += run.res.cpu_milli;
            executor.free_memory += run.res.memory_bytes;
            for &(g, milli) in &run.gpus {
                executor.gpus[g].free_milli += milli;
            }
            executor.running -= 1;
        }
        let queue = &mut self.queues[run.queue];
        queue.used_cpu -= run.res.cpu_milli;
        queue.used_gpu -= run.gpus.iter().map(|&(_, m)| u64::from(m)).sum::<u64>();
    }

    // ---- time ----

    /// Moves tasks whose backoff is over back to the queues. Returns how many.
    pub fn tick(&mut self, now_ms: u64) -> u32 {
        let mut moved = 0;
        while let Some(&Reverse((due, key, s, t))) = self.backoff.peek() {
            if due > now_ms {
                break;
            }
            self.backoff.pop();
            let Some(job) = self.jobs.get_mut(&key) else { continue };
            let stage = &mut job.stages[s];
            let task = &mut stage.tasks[t as usize];
            if task.state != TaskState::Backoff {
                continue;
            }
            task.state = TaskState::Queued;
            task.queued_at_ms = now_ms;
            stage.counts.backoff -= 1;
            stage.counts.queued += 1;
            stage.ready.push_back(t);
            self.backoff_count -= 1;
            self.backlog += 1;
            moved += 1;
            self.mark_ready(key, s);
        }
        moved
    }

    /// Cancels jobs whose elastic stage's owner stopped calling ScaleStage for its lease.
    /// Returns how many. Cost: one look per leased job (few: one per running Spark application).
    pub fn expire_leases(&mut self, now_ms: u64, now_unix_ms: u64) -> u32 {
        let expired: Vec<(u64, u64)> =
            self.leases.iter().filter(|(_, &(_, deadline))| deadline <= now_ms).map(|(&k, &(l, _))| (k, l)).collect();
        for &(key, lease) in &expired {
            let error = format!("its owner did not renew its lease for {lease} ms (the Spark driver is gone?)");
            self.finish_job(key, pb::JobState::Cancelled, error, now_ms, now_unix_ms);
        }
        expired.len() as u32
    }

    /// When the next backoff ends, if any.
    pub fn next_due_ms(&self) -> Option<u64> {
        self.backoff.peek().map(|Reverse((due, ..))| *due)
    }

    // ---- placement ----

    /// Dominant share of a queue divided by its weight (lower goes first).
    fn weighted_share(&self, q: usize) -> f64 {
        let queue = &self.queues[q];
        let cpu = if self.total_cpu == 0 { 0.0 } else { queue.used_cpu as f64 / self.total_cpu as f64 };
        let gpu = if self.total_gpu == 0 { 0.0 } else { queue.used_gpu as f64 / self.total_gpu as f64 };
        cpu.max(gpu) / f64::from(queue.weight)
    }

    /// Up to `max` assignments for executor `slot`: its outbox first (gang placements), then
    /// tasks chosen by fair share.
    pub fn assign(&mut self, slot: usize, max: usize, now_ms: u64) -> Vec<pb::Assignment> {
        let mut out = Vec::new();
        let Some(executor) = self.executors.get_mut(slot).and_then(Option::as_mut) else {
            return out;
        };
        let take = executor.outbox.len().min(max);
        out.extend(executor.outbox.drain(..take));
        // Queues that had nothing placeable this call are skipped for the rest of it.
        let mut exhausted = vec![false; self.queues.len()];
        while out.len() < max {
            let executor = self.executors[slot].as_ref().expect("live executor");
            if executor.running >= self.config.max_tasks_per_executor || executor.free_cpu == 0 {
                break;
            }
            // The queue with work and the lowest weighted dominant share (ties: lower index).
            let mut best: Option<(f64, usize)> = None;
            for (q, &done) in exhausted.iter().enumerate() {
                if done || self.queues[q].ready_jobs.is_empty() {
                    continue;
                }
                let share = self.weighted_share(q);
                if best.is_none_or(|(b, _)| share < b) {
                    best = Some((share, q));
                }
            }
            let Some((_, q)) = best else { break };
            if !self.place_from_queue(q, slot, now_ms, &mut out) {
                exhausted[q] = true;
            }
        }
        out
    }

    /// Places one task (or a whole gang) of queue `q` on executor `slot`. False if none fits.
    fn place_from_queue(&mut self, q: usize, slot: usize, now_ms: u64, out: &mut Vec<pb::Assignment>) -> bool {
        let mut looked = 0;
        let jobs: Vec<u64> = self.queues[q].ready_jobs.values().take(MAX_CANDIDATES).copied().collect();
        for key in jobs {
            let stages: Vec<usize> = self.jobs[&key].ready_stages.iter().copied().collect();
            for s in stages {
                looked += 1;
                if looked > MAX_CANDIDATES {
                    return false;
                }
                let stage = &self.jobs[&key].stages[s];
                if stage.info.spec.gang && !stage.gang_placed {
                    if self.place_gang(key, s, slot, out) {
                        return true;
                    }
                    continue;
                }
                if let Some(t) = self.pick_task(key, s, slot, now_ms) {
                    let Some((res, gpus)) = self.fit(slot, key, s, t) else {
                        // Put it back at the front: it fits elsewhere, maybe.
                        self.jobs.get_mut(&key).expect("job").stages[s].ready.push_front(t);
                        continue;
                    };
                    let a = self.launch(key, s, t, slot, res, gpus);
                    out.push(a);
                    return true;
                }
            }
        }
        false
    }

    /// Takes a ready task of the stage for the executor: one preferring its host first, then the
    /// head of the list, unless that one prefers another host where an executor has room and its
    /// wait is not over. Lists are cleaned lazily: entries of tasks no longer queued are dropped
    /// when met (a task queued again may sit in a list twice; the second entry is then stale).
    fn pick_task(&mut self, key: u64, s: usize, slot: usize, now_ms: u64) -> Option<u32> {
        let host = self.executors[slot].as_ref().expect("live").host.clone();
        let wait = self.config.locality_wait_ms;
        let stage = &mut self.jobs.get_mut(&key).expect("job").stages[s];
        if let Some(local) = stage.local.get_mut(&host) {
            while let Some(t) = local.pop_front() {
                if stage.tasks[t as usize].state == TaskState::Queued {
                    return Some(t);
                }
            }
        }
        let cpu = stage.needs.cpu_milli;
        let limit = stage.ready.len().min(MAX_CANDIDATES);
        let mut rotated = 0;
        loop {
            let stage = &mut self.jobs.get_mut(&key).expect("job").stages[s];
            let t = stage.ready.pop_front()?;
            let task = &stage.tasks[t as usize];
            if task.state != TaskState::Queued {
                continue;
            }
            let young = now_ms < task.queued_at_ms + wait;
            let other = stage.info.hosts.get(t as usize).filter(|h| young && !h.is_empty() && **h != host);
            if let Some(other) = other {
                let room = self.hosts.get(other.as_str()).is_some_and(|list| {
                    list.iter().any(|&e| self.executors[e].as_ref().is_some_and(|x| x.free_cpu >= cpu))
                });
                if room {
                    let ready = &mut self.jobs.get_mut(&key).expect("job").stages[s].ready;
                    if rotated >= limit {
                        // Every candidate prefers another host that has room: leave them.
                        ready.push_front(t);
                        return None;
                    }
                    ready.push_back(t);
                    rotated += 1;
                    continue;
                }
            }
            return Some(t);
        }
    }

    /// Resources for task `t` on executor `slot`, with GPU devices chosen; None if it does not fit.
    fn fit(&self, slot: usize, key: u64, s: usize, t: u32) -> Option<(Res, Vec<(usize, u32)>)> {
        let executor = self.executors[slot].as_ref()?;
        let stage = &self.jobs[&key].stages[s];
        let op = stage.info.spec.operator.as_ref().map_or("", |o| o.name.as_str());
        if !executor.runs(op) || executor.running >= self.config.max_tasks_per_executor {
            return None;
        }
        let task = &stage.tasks[t as usize];
        let res = Res { memory_bytes: task.memory_bytes, ..stage.needs };
        fit_on(executor, res, stage.info.spec.gpu_optional)
    }

    /// All-or-nothing: places `min_available` (or all) queued tasks of a gang stage across the
    /// cluster on a trial copy of free resources; commits only if enough fit.
    fn place_gang(&mut self, key: u64, s: usize, slot: usize, out: &mut Vec<pb::Assignment>) -> bool {
        let stage = &self.jobs[&key].stages[s];
        let queued: Vec<u32> =
            (0..stage.tasks.len() as u32).filter(|&t| stage.tasks[t as usize].state == TaskState::Queued).collect();
        let want =
            if stage.info.spec.min_available == 0 { stage.tasks.len() } else { stage.info.spec.min_available as usize };
        let want = want.saturating_sub(stage.counts.running as usize + stage.counts.succeeded as usize);
        let op = stage.info.spec.operator.as_ref().map_or("", |o| o.name.as_str()).to_string();
        let gpu_optional = stage.info.spec.gpu_optional;
        // Trial copies of the executors' free resources, the polling executor first.
        let mut order: Vec<usize> = vec![slot];
        order.extend((0..self.executors.len()).filter(|&e| e != slot && self.executors[e].is_some()));
        let mut trial: HashMap<usize, Executor> = HashMap::new();
        let mut plan: Vec<(u32, usize, Res, GpuPicks)> = Vec::new();
        for &t in &queued {
            let res = Res { memory_bytes: stage.tasks[t as usize].memory_bytes, ..stage.needs };
            let mut placed = false;
            for &e in &order {
                let real = self.executors[e].as_ref().expect("live");
                if !real.runs(&op) {
                    continue;
                }
                let ex = trial.entry(e).or_insert_with(|| Executor {
                    host: String::new(),
                    capacity: real.capacity,
                    free_cpu: real.free_cpu,
                    free_memory: real.free_memory,
                    gpus: real.gpus.clone(),
                    running: real.running,
                    outbox: Vec::new(),
                    operators: Vec::new(),
                });
                if ex.running >= self.config.max_tasks_per_executor {
                    continue;
                }
                if let Some((r, g)) = fit_on(ex, res, gpu_optional) {
                    take(ex, r, &g);
                    plan.push((t, e, r, g));
                    placed = true;
                    break;
                }
            }
            if !placed {
                break;
            }
        }
        if plan.len() < want.max(1) {
            return false;
        }
        self.jobs.get_mut(&key).expect("job").stages[s].gang_placed = true;
        for (t, e, r, g) in plan {
            let a = self.launch(key, s, t, e, r, g);
            if e == slot {
                out.push(a);
            } else {
                self.executors[e].as_mut().expect("live").outbox.push(a);
                if !self.gang_wakes.contains(&e) {
                    self.gang_wakes.push(e);
                }
            }
        }
        true
    }

    /// Records task `t` as running on `slot` and builds its assignment.
    fn launch(&mut self, key: u64, s: usize, t: u32, slot: usize, res: Res, gpus: Vec<(usize, u32)>) -> pb::Assignment {
        let id = self.next_assignment;
        self.next_assignment += 1;
        let executor = self.executors[slot].as_mut().expect("live");
        take(executor, res, &gpus);
        let grants: Vec<pb::GpuGrant> = gpus
            .iter()
            .map(|&(g, m)| pb::GpuGrant { address: executor.gpus[g].address.clone(), gpu_milli: m })
            .collect();
        let gpu_total: u64 = gpus.iter().map(|&(_, m)| u64::from(m)).sum();
        let job = self.jobs.get_mut(&key).expect("job");
        let queue = job.queue;
        let stage = &mut job.stages[s];
        let task = &mut stage.tasks[t as usize];
        let attempt = task.runs;
        task.runs += 1;
        task.state = TaskState::Running;
        task.assignment = id;
        stage.counts.queued -= 1;
        stage.counts.running += 1;
        stage.attempts += 1;
        self.backlog -= 1;
        let spec = &stage.info.spec;
        let path = |d: &Option<pb::DataRef>| match d.as_ref().and_then(|d| d.kind.as_ref()) {
            Some(pb::data_ref::Kind::Path(p)) => p.clone(),
            _ => String::new(),
        };
        let assignment = pb::Assignment {
            assignment_id: id,
            job_id: job.info.job_id.clone(),
            stage: spec.name.clone(),
            task_index: t,
            task_count: stage.tasks.len() as u32,
            attempt,
            operator: spec.operator.clone(),
            granted: Some(Res { gpu_milli: gpu_total, ..res }.into()),
            gpus: grants,
            tern_job_id: job.info.tern_job_id.clone(),
            tern_job_root: job.info.tern_job_root.clone(),
            tern_job_token: job.info.tern_job_token.clone(),
            copies: job.info.copies,
            input_shuffle_id: stage.info.input_shuffle_id,
            input_partitions: stage.info.input_partitions,
            input_path: path(&spec.input),
            output_shuffle_id: stage.info.output_shuffle_id,
            output_partitions: stage.info.output_partitions,
            output_path: path(&spec.output),
            gpu_optional: spec.gpu_optional,
            input_maps: stage.info.input_maps,
        };
        if stage.counts.queued == 0 {
            job.ready_stages.retain(|&x| x != s);
            if job.ready_stages.is_empty() {
                let sort = (Reverse(job.info.priority), job.seq);
                self.queues[queue].ready_jobs.remove(&sort);
            }
        }
        self.queues[queue].used_cpu += res.cpu_milli;
        self.queues[queue].used_gpu += gpu_total;
        self.queues[queue].dispatched += 1;
        self.running.insert(id, Running { executor: slot, job: key, stage: s, task: t, res, gpus, queue });
        assignment
    }

    // ---- results ----

    /// Applies an executor's report of one assignment. Unknown ids (a cancelled or re-queued
    /// attempt reporting late) are ignored; returns false for them.
    pub fn report(&mut self, slot: usize, result: &pb::TaskResult, now_ms: u64, now_unix_ms: u64) -> bool {
        let Some(run) = self.running.get(&result.assignment_id) else {
            return false;
        };
        if run.executor != slot {
            return false;
        }
        let outcome = match pb::TaskOutcome::try_from(result.outcome).unwrap_or(pb::TaskOutcome::Unspecified) {
            pb::TaskOutcome::Succeeded => Outcome::Succeeded,
            pb::TaskOutcome::Oom => Outcome::Oom,
            pb::TaskOutcome::Lost => Outcome::Lost,
            pb::TaskOutcome::InputLost => Outcome::InputLost(result.lost_inputs.clone()),
            pb::TaskOutcome::Failed | pb::TaskOutcome::Unspecified => Outcome::Failed,
        };
        let message = cut_message(&result.message, MAX_ERROR_BYTES).to_string();
        self.finish_assignment(result.assignment_id, outcome, &message, &result.path, now_ms, now_unix_ms);
        true
    }

    fn finish_assignment(
        &mut self,
        id: u64,
        outcome: Outcome,
        message: &str,
        path: &str,
        now_ms: u64,
        now_unix_ms: u64,
    ) {
        let Some(run) = self.running.remove(&id) else { return };
        self.release(&run);
        let refused;
        let (outcome, message) = match outcome {
            Outcome::InputLost(lost) => match self.recompute_lost_input(&run, &lost, now_ms) {
                Ok(()) => return,
                Err(why) => {
                    refused = format!("{message} (its input cannot be recomputed: {why})");
                    (Outcome::Failed, refused.as_str())
                }
            },
            other => (other, message),
        };
        let config_max_backoff = self.config.max_backoff_ms;
        let key = run.job;
        let job = self.jobs.get_mut(&key).expect("job of a running task");
        let stage = &mut job.stages[run.stage];
        let task = &mut stage.tasks[run.task as usize];
        debug_assert_eq!(task.state, TaskState::Running);
        stage.counts.running -= 1;
        if !path.is_empty() {
            *stage.paths.entry(cut_message(path, 64).to_string()).or_default() += 1;
        }
        let t = run.task;
        if stage.info.spec.elastic {
            // Never run again: the owner replaces it if it still wants one.
            let (state, code) = match outcome {
                Outcome::Succeeded => (TaskState::Succeeded, pb::TaskOutcome::Succeeded),
                Outcome::Failed => (TaskState::Failed, pb::TaskOutcome::Failed),
                Outcome::Oom => (TaskState::Failed, pb::TaskOutcome::Oom),
                Outcome::Lost => (TaskState::Cancelled, pb::TaskOutcome::Lost),
                Outcome::InputLost(_) => unreachable!("turned into a failure above"),
            };
            if outcome == Outcome::Lost {
                stage.lost += 1;
            }
            task.state = state;
            *stage.counts.get(state) += 1;
            let message =
                if message.is_empty() && outcome == Outcome::Lost { "its executor was lost" } else { message };
            stage.ended.push(pb::ElasticTaskEnd { task_index: t, outcome: code as i32, message: message.to_string() });
            if matches!(outcome, Outcome::Failed | Outcome::Oom) {
                if stage.errors.len() == MAX_STAGE_ERRORS {
                    stage.errors.pop_front();
                }
                stage.errors.push_back(format!("task {t}: {message}"));
            }
            return;
        }
        match outcome {
            Outcome::Succeeded => {
                task.state = TaskState::Succeeded;
                stage.counts.succeeded += 1;
                let c = stage.counts;
                // A recompute round ends when every task it queued again is done.
                let done = if stage.recomputing {
                    c.queued + c.backoff + c.running == 0
                } else {
                    c.succeeded >= stage.min_success
                };
                if done {
                    self.finish_stage(key, run.stage, true, String::new(), now_ms, now_unix_ms);
                }
            }
            Outcome::Lost => {
                task.state = TaskState::Queued;
                task.queued_at_ms = now_ms;
                stage.counts.queued += 1;
                stage.lost += 1;
                stage.ready.push_front(t);
                self.backlog += 1;
                self.mark_ready(key, run.stage);
            }
            Outcome::InputLost(_) => unreachable!("handled above"),
            Outcome::Failed | Outcome::Oom => {
                task.failures += 1;
                let what = if outcome == Outcome::Oom { "out of memory" } else { "failed" };
                let note = format!(
                    "task {t} attempt {}: {what}{}{message}",
                    task.runs - 1,
                    if message.is_empty() { "" } else { ": " }
                );
                if stage.errors.len() == MAX_STAGE_ERRORS {
                    stage.errors.pop_front();
                }
                stage.errors.push_back(note.clone());
                if outcome == Outcome::Oom {
                    let cap = stage.info.spec.max_memory_bytes.max(stage.needs.memory_bytes);
                    let grown = task.memory_bytes.saturating_mul(2).min(cap);
                    if grown > task.memory_bytes {
                        stage.oom_retries += 1;
                    }
                    task.memory_bytes = grown;
                }
                if task.failures >= stage.max_attempts {
                    task.state = TaskState::Failed;
                    stage.counts.failed += 1;
                    // The stage can still succeed if enough tasks remain.
                    let possible = stage.tasks.len() as u32 - stage.counts.failed - stage.counts.cancelled;
                    if possible < stage.min_success {
                        let error = format!(
                            "stage {:?}: {note} (attempt limit {} reached)",
                            stage.info.spec.name, stage.max_attempts
                        );
                        self.finish_stage(key, run.stage, false, error, now_ms, now_unix_ms);
                    }
                } else {
                    let backoff =
                        stage.backoff_ms.saturating_mul(1u64 << (task.failures - 1).min(20)).min(config_max_backoff);
                    task.state = TaskState::Backoff;
                    stage.counts.backoff += 1;
                    self.backoff_count += 1;
                    self.backoff.push(Reverse((now_ms + backoff, key, run.stage, t)));
                }
            }
        }
    }

    /// Lineage recovery for `run`, whose task found the output of tasks `lost` of its stage's
    /// producer lost: those tasks are queued again (the producer reopens if it had finished) and
    /// the task waits for them. `Err` says why that cannot be, and the task then fails.
    fn recompute_lost_input(&mut self, run: &Running, lost: &[u32], now_ms: u64) -> Result<(), String> {
        let key = run.job;
        let job = self.jobs.get_mut(&key).expect("job of a running task");
        let Some(p) = job.stages[run.stage].producer else {
            return Err("no single earlier stage of the job wrote it".into());
        };
        let producer = &mut job.stages[p];
        let name = &producer.info.spec.name;
        if lost.is_empty() || lost.iter().any(|&t| t as usize >= producer.tasks.len()) {
            return Err(format!("{lost:?} are not task indexes of stage {name:?}, which has {}", producer.tasks.len()));
        }
        let reopen = match producer.state {
            pb::StageState::Succeeded if producer.recompute_rounds >= MAX_RECOMPUTE_ROUNDS => {
                return Err(format!("stage {name:?}'s output was already recomputed {MAX_RECOMPUTE_ROUNDS} times"));
            }
            pb::StageState::Succeeded => true,
            pb::StageState::Running => false,
            other => return Err(format!("stage {name:?} is {}", other.as_str_name())),
        };
        if reopen {
            producer.state = pb::StageState::Running;
            producer.finished_ms = 0;
            producer.recompute_rounds += 1;
            producer.recomputing = true;
            job.unfinished_stages += 1;
        }
        let producer = &mut job.stages[p];
        let mut queued = 0;
        for &t in lost {
            // Tasks already queued or running again (another reader found them lost) are left be.
            if producer.tasks[t as usize].state == TaskState::Succeeded {
                enqueue(producer, t, now_ms);
                producer.counts.succeeded -= 1;
                queued += 1;
            }
        }
        producer.counts.queued += queued;
        producer.recomputed += queued;
        self.backlog += u64::from(queued);
        let stage = &mut job.stages[run.stage];
        stage.tasks[run.task as usize].state = TaskState::Waiting;
        stage.counts.running -= 1;
        stage.counts.waiting += 1;
        if queued > 0 {
            self.mark_ready(key, p);
        }
        Ok(())
    }

    /// Queues again the waiting tasks of the stages that read stage `p`'s output, now that it has
    /// recomputed what they found lost.
    fn resume_consumers(&mut self, key: u64, p: usize, now_ms: u64) {
        let job = self.jobs.get_mut(&key).expect("job");
        let mut resumed = Vec::new();
        for (s, stage) in job.stages.iter_mut().enumerate() {
            if stage.producer != Some(p) || stage.state != pb::StageState::Running || stage.counts.waiting == 0 {
                continue;
            }
            let waiting: Vec<u32> = (0..stage.tasks.len() as u32)
                .filter(|&t| stage.tasks[t as usize].state == TaskState::Waiting)
                .collect();
            for &t in &waiting {
                enqueue(stage, t, now_ms);
            }
            stage.counts.waiting -= waiting.len() as u32;
            stage.counts.queued += waiting.len() as u32;
            self.backlog += waiting.len() as u64;
            resumed.push(s);
        }
        for s in resumed {
            self.mark_ready(key, s);
        }
    }

    fn finish_stage(&mut self, key: u64, s: usize, succeeded: bool, error: String, now_ms: u64, now_unix_ms: u64) {
        let job = self.jobs.get_mut(&key).expect("job");
        let stage = &mut job.stages[s];
        if stage.state != pb::StageState::Running {
            return;
        }
        stage.state = if succeeded { pb::StageState::Succeeded } else { pb::StageState::Failed };
        stage.finished_ms = now_ms.max(1);
        // min_success met: the rest are cancelled.
        let mut running = Vec::new();
        cancel_unfinished(stage, &mut running, &mut self.backlog, &mut self.backoff_count);
        stage.ready.clear();
        stage.local.clear();
        job.ready_stages.retain(|&x| x != s);
        if job.ready_stages.is_empty() {
            let sort = (Reverse(job.info.priority), job.seq);
            self.queues[job.queue].ready_jobs.remove(&sort);
        }
        job.unfinished_stages -= 1;
        self.cancel_assignments(running);
        if !succeeded {
            self.finish_job(key, pb::JobState::Failed, error, now_ms, now_unix_ms);
            return;
        }
        if std::mem::take(&mut self.jobs.get_mut(&key).expect("job").stages[s].recomputing) {
            // A recompute round: the stages after it started long ago.
            self.resume_consumers(key, s, now_ms);
        } else {
            let next = self.jobs[&key].stages[s].next.clone();
            for n in next {
                let stage = &mut self.jobs.get_mut(&key).expect("job").stages[n];
                stage.pending_deps -= 1;
                if stage.pending_deps == 0 && stage.state == pb::StageState::Waiting {
                    self.start_stage(key, n, now_ms);
                }
            }
        }
        if self.jobs[&key].unfinished_stages == 0 {
            self.finish_job(key, pb::JobState::Succeeded, String::new(), now_ms, now_unix_ms);
        }
    }

    // ---- status ----

    pub fn job_status(&self, job_id: &str, with_stages: bool) -> Option<pb::JobStatus> {
        let job = &self.jobs[self.job_keys.get(job_id)?];
        Some(pb::JobStatus {
            job_id: job.info.job_id.clone(),
            name: job.info.name.clone(),
            queue: self.queues[job.queue].name.clone(),
            priority: job.info.priority,
            state: job.state as i32,
            error: job.error.clone(),
            stages: if with_stages {
                job.stages
                    .iter()
                    .map(|stage| pb::StageStatus { blocked: self.why_blocked(stage), ..stage_status(stage) })
                    .collect()
            } else {
                Vec::new()
            },
            tern_job_id: job.info.tern_job_id.clone(),
            submitted_unix_ms: job.info.submitted_unix_ms,
            finished_unix_ms: job.finished_unix_ms,
        })
    }

    /// Why a stage's queued tasks cannot start on any live executor even when it is idle (too
    /// few CPUs, too little memory, no such GPUs, not running the operator), or "" when one
    /// could run. Such tasks wait for an executor that fits (the pool may start one), so users
    /// are told rather than left to wonder.
    fn why_blocked(&self, stage: &Stage) -> String {
        let Some(memory_bytes) = stage
            .tasks
            .iter()
            .filter(|t| matches!(t.state, TaskState::Queued | TaskState::Backoff))
            .map(|t| t.memory_bytes)
            .min()
        else {
            return String::new();
        };
        let op = stage.info.spec.operator.as_ref().map_or("", |o| o.name.as_str());
        let need = Res { memory_bytes, ..stage.needs };
        let fits_idle = |e: &Executor| {
            let idle = idle_copy(e);
            idle.runs(op) && fit_on(&idle, need, stage.info.spec.gpu_optional).is_some()
        };
        let live: Vec<&Executor> = self.executors.iter().flatten().collect();
        let wants = format!(
            "a task needs {} CPUs, {} bytes of memory and {} GPUs{}",
            need.cpu_milli as f64 / MILLI as f64,
            need.memory_bytes,
            need.gpu_milli as f64 / MILLI as f64,
            if op.is_empty() { String::new() } else { format!(" and runs operator {op}") }
        );
        if live.iter().any(|e| fits_idle(e)) {
            return self.why_gang_blocked(stage, need, op, &wants);
        }
        match live.iter().max_by_key(|e| (e.capacity.cpu_milli, e.capacity.memory_bytes)) {
            None => format!("no live executor; {wants}"),
            Some(e) => format!(
                "no live executor can run one: {wants}; the largest of {} offers {} CPUs, {} bytes and {} GPUs",
                live.len(),
                e.capacity.cpu_milli as f64 / MILLI as f64,
                e.capacity.memory_bytes,
                e.gpus.len()
            ),
        }
    }

    /// For a gang stage not yet placed: why the live executors cannot hold its gang even when
    /// all are idle (they hold fewer of its tasks than the gang needs), or "" when they could.
    /// Like Volcano's "Unschedulable" podgroup condition: the gang keeps waiting (executors may
    /// still join) but its job's status says why.
    fn why_gang_blocked(&self, stage: &Stage, need: Res, op: &str, wants: &str) -> String {
        if !stage.info.spec.gang || stage.gang_placed {
            return String::new();
        }
        let want = match stage.info.spec.min_available {
            0 => stage.tasks.len(),
            n => n as usize,
        }
        .saturating_sub(stage.counts.running as usize + stage.counts.succeeded as usize);
        let mut live = 0;
        let mut holds = 0;
        for e in self.executors.iter().flatten() {
            live += 1;
            let mut idle = idle_copy(e);
            if !idle.runs(op) {
                continue;
            }
            // At most `want` rounds in all: each round places one task or leaves the loop.
            idle.running = 0;
            while holds < want && idle.running < self.config.max_tasks_per_executor {
                let Some((r, g)) = fit_on(&idle, need, stage.info.spec.gpu_optional) else { break };
                take(&mut idle, r, &g);
                idle.running += 1;
                holds += 1;
            }
        }
        if holds >= want {
            return String::new();
        }
        format!(
            "a gang of {want} tasks starts together or not at all, and the {live} live executors hold at most \
             {holds} of them even when idle ({wants}); it waits for more executors"
        )
    }

    /// Jobs in submission order.
    pub fn job_ids(&self) -> Vec<String> {
        let mut keys: Vec<(&u64, &Job)> = self.jobs.iter().collect();
        keys.sort_by_key(|(k, _)| **k);
        keys.into_iter().map(|(_, j)| j.info.job_id.clone()).collect()
    }

    pub fn pool_counts(&self) -> PoolCounts {
        let mut needs = Res::default();
        let mut active = 0;
        for job in self.jobs.values() {
            if job.finished_unix_ms == 0 {
                active += 1;
            }
            for stage in &job.stages {
                let n = u64::from(stage.counts.queued);
                needs.cpu_milli += stage.needs.cpu_milli * n;
                needs.memory_bytes += stage.needs.memory_bytes * n;
                needs.gpu_milli += stage.needs.gpu_milli * n;
            }
        }
        let executors = self.executors.iter().flatten();
        PoolCounts {
            backlog_tasks: self.backlog,
            backoff_tasks: self.backoff_count,
            running_tasks: self.running.len() as u64,
            executors: self.live_executors,
            idle_executors: executors.filter(|e| e.running == 0).count() as u32,
            backlog_needs: needs,
            active_jobs: active,
        }
    }

    pub fn queue_shares(&self) -> Vec<QueueShare> {
        (0..self.queues.len())
            .map(|q| {
                let queue = &self.queues[q];
                QueueShare {
                    name: queue.name.clone(),
                    weight: queue.weight,
                    used_cpu_milli: queue.used_cpu,
                    used_gpu_milli: queue.used_gpu,
                    dominant_share: self.weighted_share(q) * f64::from(queue.weight),
                    dispatched: queue.dispatched,
                }
            })
            .collect()
    }

    /// The job's stage infos (for the server's bookkeeping).
    pub fn job_state(&self, job_id: &str) -> Option<pb::JobState> {
        self.job_keys.get(job_id).map(|k| self.jobs[k].state)
    }

    pub fn job_count(&self) -> usize {
        self.jobs.len()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    Succeeded,
    Failed,
    Oom,
    Lost,
    /// The task's input is lost: these tasks of its producer stage must run again.
    InputLost(Vec<u32>),
}

/// Puts task `t` in its stage's ready lists (state and time; the caller keeps the counts).
fn enqueue(stage: &mut Stage, t: u32, now_ms: u64) {
    let task = &mut stage.tasks[t as usize];
    task.state = TaskState::Queued;
    task.queued_at_ms = now_ms;
    stage.ready.push_back(t);
    if let Some(host) = stage.info.hosts.get(t as usize).filter(|h| !h.is_empty()) {
        stage.local.entry(host.clone()).or_default().push_back(t);
    }
}

/// Queued and backoff tasks become cancelled; running ones are collected to be told to stop.
fn cancel_unfinished(stage: &mut Stage, running: &mut Vec<u64>, backlog: &mut u64, backoff: &mut u64) {
    for task in &mut stage.tasks {
        match task.state {
            TaskState::Queued => *backlog -= 1,
            TaskState::Backoff => *backoff -= 1,
            TaskState::Running => running.push(task.assignment),
            TaskState::Waiting => {}
            TaskState::Succeeded | TaskState::Failed | TaskState::Cancelled => continue,
        }
        *stage.counts.get(task.state) -= 1;
        task.state = TaskState::Cancelled;
        stage.counts.cancelled += 1;
    }
}

/// Whether `res` fits on `executor`, and on which GPUs: a fraction on the device with the least
/// room that fits it (best fit, so whole devices stay free for whole-GPU tasks), whole GPUs on
/// fully free devices. A GPU-optional task fits an executor without GPUs on the CPU path.
fn fit_on(executor: &Executor, res: Res, gpu_optional: bool) -> Option<(Res, Vec<(usize, u32)>)> {
    if executor.free_cpu < res.cpu_milli || executor.free_memory < res.memory_bytes {
        return None;
    }
    if res.gpu_milli == 0 {
        return Some((res, Vec::new()));
    }
    if executor.gpus.is_empty() && gpu_optional {
        return Some((Res { gpu_milli: 0, ..res }, Vec::new()));
    }
    if res.gpu_milli < MILLI {
        let want = res.gpu_milli as u32;
        let best = executor
            .gpus
            .iter()
            .enumerate()
            .filter(|(_, g)| g.free_milli >= want)
            .min_by_key(|(i, g)| (g.free_milli, *i))?;
        return Some((res, vec![(best.0, want)]));
    }
    let whole = (res.gpu_milli / MILLI) as usize;
    let free: Vec<(usize, u32)> = executor
        .gpus
        .iter()
        .enumerate()
        .filter(|(_, g)| u64::from(g.free_milli) == MILLI)
        .take(whole)
        .map(|(i, _)| (i, MILLI as u32))
        .collect();
    (free.len() == whole).then_some((res, free))
}

/// `e` as it would be with nothing running.
fn idle_copy(e: &Executor) -> Executor {
    Executor {
        free_cpu: e.capacity.cpu_milli,
        free_memory: e.capacity.memory_bytes,
        gpus: e.gpus.iter().map(|g| Gpu { address: g.address.clone(), free_milli: MILLI as u32 }).collect(),
        outbox: Vec::new(),
        operators: e.operators.clone(),
        host: String::new(),
        ..*e
    }
}

fn take(executor: &mut Executor, res: Res, gpus: &[(usize, u32)]) {
    executor.free_cpu -= res.cpu_milli;
    executor.free_memory -= res.memory_bytes;
    for &(g, milli) in gpus {
        executor.gpus[g].free_milli -= milli;
    }
    executor.running += 1;
}

fn stage_status(stage: &Stage) -> pb::StageStatus {
    let c = stage.counts;
    pb::StageStatus {
        name: stage.info.spec.name.clone(),
        state: stage.state as i32,
        tasks: stage.tasks.len() as u32,
        waiting: c.waiting,
        queued: c.queued + c.backoff,
        running: c.running,
        succeeded: c.succeeded,
        failed: c.failed,
        cancelled: c.cancelled,
        attempts: stage.attempts,
        oom_retries: stage.oom_retries,
        lost: stage.lost,
        recomputed: stage.recomputed,
        paths: stage.paths.iter().map(|(k, v)| (k.clone(), *v)).collect(),
        errors: stage.errors.iter().cloned().collect(),
        input_shuffle_id: stage.info.input_shuffle_id,
        output_shuffle_id: stage.info.output_shuffle_id,
        needs: stage.info.spec.needs,
        // Relative to the policy's clock; the server adds its start time.
        started_unix_ms: stage.started_ms,
        finished_unix_ms: stage.finished_ms,
        blocked: String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{validate, SpecLimits};

    const GIB: u64 = 1 << 30;

    fn stage(name: &str, tasks: u32, cpu_milli: u64, gpu_milli: u64) -> pb::StageSpec {
        pb::StageSpec {
            name: name.into(),
            operator: Some(pb::Operator { name: "noop".into(), ..Default::default() }),
            tasks,
            needs: Some(pb::Resources { cpu_milli, memory_bytes: GIB, gpu_milli }),
            ..Default::default()
        }
    }

    fn add(policy: &mut Policy, id: &str, queue: &str, priority: i32, stages: Vec<pb::StageSpec>) {
        let spec = pb::JobSpec { name: id.into(), queue: queue.into(), priority, stages, ..Default::default() };
        let dag = validate(&spec, &SpecLimits::default()).unwrap();
        let infos = spec
            .stages
            .iter()
            .map(|s| StageInfo {
                spec: s.clone(),
                input_shuffle_id: 0,
                input_partitions: 0,
                input_maps: 0,
                output_shuffle_id: 0,
                output_partitions: 0,
                hosts: s.locality.clone(),
            })
            .collect();
        let info = JobInfo {
            job_id: id.into(),
            name: id.into(),
            queue: queue.into(),
            priority,
            tern_job_id: String::new(),
            tern_job_root: String::new(),
            tern_job_token: String::new(),
            copies: 1,
            submitted_unix_ms: 1,
        };
        policy.add_job(info, infos, &dag, 0);
    }

    fn executor(policy: &mut Policy, host: &str, cpus: u64, gpus: usize) -> usize {
        let addresses: Vec<String> = (0..gpus).map(|g| g.to_string()).collect();
        policy.add_executor(
            host,
            Res { cpu_milli: cpus * MILLI, memory_bytes: 64 * GIB, gpu_milli: 0 },
            &addresses,
            &[],
        )
    }

    fn result(a: &pb::Assignment, outcome: pb::TaskOutcome) -> pb::TaskResult {
        pb::TaskResult { assignment_id: a.assignment_id, outcome: outcome as i32, ..Default::default() }
    }

    fn weights(w: &[(&str, u32)]) -> PolicyConfig {
        PolicyConfig {
            queue_weights: w.iter().map(|(q, n)| (q.to_string(), *n)).collect(),
            default_backoff_ms: 100,
            ..PolicyConfig::default()
        }
    }

    #[test]
    fn queues_share_by_weight_within_ten_percent_over_1000_decisions() {
        let mut p = Policy::new(weights(&[("a", 1), ("b", 2), ("c", 3)]));
        let e = executor(&mut p, "h", 30, 0);
        for q in ["a", "b", "c"] {
            add(&mut p, q, q, 0, vec![stage("s", 5000, MILLI, 0)]);
        }
        let mut running: VecDeque<pb::Assignment> = VecDeque::new();
        let mut counts: HashMap<String, u32> = HashMap::new();
        for _ in 0..1000 {
            let mut got = p.assign(e, 1, 0);
            if got.is_empty() {
                // Full: the oldest task finishes, then decide again.
                let done = running.pop_front().unwrap();
                assert!(p.report(e, &result(&done, pb::TaskOutcome::Succeeded), 0, 1));
                got = p.assign(e, 1, 0);
            }
            let a = got.pop().unwrap();
            *counts.entry(a.job_id.clone()).or_default() += 1;
            running.push_back(a);
        }
        for (q, w) in [("a", 1.0), ("b", 2.0), ("c", 3.0)] {
            let want = 1000.0 * w / 6.0;
            let got = f64::from(counts[q]);
            assert!((got - want).abs() <= 0.1 * want, "queue {q}: {got} decisions, want {want} ± 10% ({counts:?})");
        }
    }

    #[test]
    fn dominant_resource_fairness_over_cpus_and_gpus() {
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 16, 4);
        add(&mut p, "gpu-heavy", "a", 0, vec![stage("s", 100, MILLI, MILLI)]);
        add(&mut p, "cpu-heavy", "b", 0, vec![stage("s", 100, 4 * MILLI, 0)]);
        let got = p.assign(e, 100, 0);
        let a = got.iter().filter(|x| x.job_id == "gpu-heavy").count();
        let b = got.iter().filter(|x| x.job_id == "cpu-heavy").count();
        // Each queue's dominant share is 1/4 per task: 4 GPU tasks and 3 CPU tasks (16 CPUs).
        assert_eq!((a, b), (4, 3), "{got:?}");
        let shares = p.queue_shares();
        assert!((shares[0].dominant_share - 1.0).abs() < 1e-9 && (shares[1].dominant_share - 0.75).abs() < 1e-9);
    }

    #[test]
    fn higher_priority_first_within_a_queue() {
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 4, 0);
        add(&mut p, "low", "q", 0, vec![stage("s", 4, MILLI, 0)]);
        add(&mut p, "high", "q", 5, vec![stage("s", 3, MILLI, 0)]);
        let got: Vec<String> = p.assign(e, 10, 0).into_iter().map(|a| a.job_id).collect();
        assert_eq!(got, ["high", "high", "high", "low"]);
    }

    #[test]
    fn gang_stages_start_all_together_or_not_at_all() {
        let mut p = Policy::new(PolicyConfig::default());
        let e0 = executor(&mut p, "h0", 4, 0);
        let e1 = executor(&mut p, "h1", 4, 0);
        let mut gang = stage("g", 6, 2 * MILLI, 0);
        gang.gang = true;
        add(&mut p, "gang", "q", 0, vec![gang]);
        // 12 CPUs asked, 8 in the cluster: nothing starts.
        assert!(p.assign(e0, 100, 0).is_empty());
        assert!(p.assign(e1, 100, 0).is_empty());
        assert_eq!(p.pool_counts().running_tasks, 0);
        assert_eq!(p.pool_counts().backlog_tasks, 6);
        // A third executor: the whole gang is placed in one decision, across all three.
        let e2 = executor(&mut p, "h2", 4, 0);
        let mine = p.assign(e0, 100, 0);
        assert_eq!(mine.len(), 2);
        assert_eq!(p.pool_counts().running_tasks, 6);
        assert_eq!(p.assign(e1, 100, 0).len(), 2);
        assert_eq!(p.assign(e2, 100, 0).len(), 2);

        // min_available: 3 of 5 must fit together; 4 do.
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 8, 0);
        let mut gang = stage("g", 5, 2 * MILLI, 0);
        gang.gang = true;
        gang.min_available = 3;
        add(&mut p, "gang", "q", 0, vec![gang]);
        assert_eq!(p.assign(e, 100, 0).len(), 4);
    }

    #[test]
    fn fractional_gpus_pack_exactly_with_no_capacity_lost() {
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 64, 2);
        add(&mut p, "big", "q", 3, vec![stage("s", 2, 100, 600)]);
        add(&mut p, "small", "q", 2, vec![stage("s", 2, 100, 400)]);
        let got = p.assign(e, 100, 0);
        assert_eq!(got.len(), 4, "0.6 + 0.4 twice fills two GPUs exactly");
        let ex = p.executors[e].as_ref().unwrap();
        assert!(ex.gpus.iter().all(|g| g.free_milli == 0), "{:?}", ex.gpus);
        let grants: Vec<(String, u32)> = got.iter().map(|a| (a.gpus[0].address.clone(), a.gpus[0].gpu_milli)).collect();
        assert_eq!(grants, [("0".into(), 600), ("1".into(), 600), ("0".into(), 400), ("1".into(), 400)]);
        add(&mut p, "more", "q", 0, vec![stage("s", 1, 100, 1)]);
        assert!(p.assign(e, 100, 0).is_empty(), "no GPU room is left");
        for a in &got {
            p.report(e, &result(a, pb::TaskOutcome::Succeeded), 0, 1);
        }
        // Everything came back; a whole-GPU task and four quarters now share the two devices.
        add(&mut p, "whole", "q", 9, vec![stage("s", 1, 100, 1000)]);
        add(&mut p, "quarters", "q", 8, vec![stage("s", 4, 100, 250)]);
        let got = p.assign(e, 100, 0);
        assert_eq!(got.len(), 5, "{got:?}");
        let ex = p.executors[e].as_ref().unwrap();
        assert!(ex.gpus.iter().all(|g| g.free_milli == 0), "{:?}", ex.gpus);
        assert_eq!(p.pool_counts().backlog_tasks, 1, "the milli-GPU task still waits");
    }

    #[test]
    fn oom_retries_double_memory_up_to_the_cap() {
        let mut p = Policy::new(weights(&[]));
        let e = executor(&mut p, "h", 4, 0);
        let mut s = stage("s", 1, MILLI, 0);
        s.max_memory_bytes = 4 * GIB;
        s.max_attempts = 5;
        add(&mut p, "j", "q", 0, vec![s]);
        let mut now = 0;
        let mut granted = Vec::new();
        for _ in 0..4 {
            let a = p.assign(e, 1, now).pop().expect("the task runs again");
            granted.push(a.granted.unwrap().memory_bytes / GIB);
            p.report(e, &result(&a, pb::TaskOutcome::Oom), now, 1);
            now += 10_000;
            p.tick(now);
        }
        assert_eq!(granted, [1, 2, 4, 4]);
        let status = p.job_status("j", true).unwrap();
        assert_eq!(status.stages[0].oom_retries, 2);
        assert_eq!(status.stages[0].errors.len(), 4);
    }

    #[test]
    fn min_success_ends_the_stage_and_cancels_the_rest() {
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 8, 0);
        let mut s = stage("s", 5, MILLI, 0);
        s.min_success = 3;
        add(&mut p, "j", "q", 0, vec![s]);
        let got = p.assign(e, 10, 0);
        assert_eq!(got.len(), 5);
        for a in &got[..2] {
            p.report(e, &result(a, pb::TaskOutcome::Succeeded), 0, 1);
        }
        assert_eq!(p.job_state("j"), Some(pb::JobState::Running));
        p.report(e, &result(&got[2], pb::TaskOutcome::Succeeded), 0, 1);
        assert_eq!(p.job_state("j"), Some(pb::JobState::Succeeded));
        let events = p.take_events();
        assert!(events
            .contains(&Event::Cancel { executor: e, assignments: vec![got[3].assignment_id, got[4].assignment_id] }));
        assert!(events.contains(&Event::JobFinished { job_id: "j".into(), state: pb::JobState::Succeeded }));
        assert_eq!(p.executor_running(e), 0, "cancelled tasks free their resources");
        assert!(!p.report(e, &result(&got[3], pb::TaskOutcome::Succeeded), 0, 1), "late results are ignored");
    }

    #[test]
    fn retries_back_off_exponentially_then_fail_the_job() {
        let mut p = Policy::new(weights(&[]));
        let e = executor(&mut p, "h", 4, 0);
        let mut s = stage("s", 1, MILLI, 0);
        s.max_attempts = 3;
        add(&mut p, "j", "q", 0, vec![s]);
        let a = p.assign(e, 1, 0).pop().unwrap();
        p.report(e, &result(&a, pb::TaskOutcome::Failed), 1000, 1);
        assert_eq!(p.next_due_ms(), Some(1100));
        assert_eq!(p.tick(1099), 0);
        assert!(p.assign(e, 1, 1099).is_empty(), "still backing off");
        assert_eq!(p.tick(1100), 1);
        let a = p.assign(e, 1, 1100).pop().unwrap();
        assert_eq!(a.attempt, 1);
        p.report(e, &result(&a, pb::TaskOutcome::Failed), 2000, 1);
        assert_eq!(p.next_due_ms(), Some(2200), "the second delay is doubled");
        p.tick(2200);
        let a = p.assign(e, 1, 2200).pop().unwrap();
        p.report(
            e,
            &pb::TaskResult { message: "exit status 3".into(), ..result(&a, pb::TaskOutcome::Failed) },
            3000,
            1,
        );
        let status = p.job_status("j", true).unwrap();
        assert_eq!(status.state(), pb::JobState::Failed);
        assert!(status.error.contains("exit status 3") && status.error.contains("attempt limit 3"), "{}", status.error);
    }

    #[test]
    fn elastic_stages_grow_shrink_report_ended_tasks_and_end_when_told() {
        let mut p = Policy::new(PolicyConfig::default());
        let e0 = executor(&mut p, "h0", 2, 0);
        let mut s = stage("executors", 0, MILLI, 0);
        s.elastic = true;
        add(&mut p, "app", "q", 0, vec![s]);
        assert_eq!(p.job_state("app"), Some(pb::JobState::Running));
        assert!(p.assign(e0, 10, 0).is_empty(), "no tasks yet");
        let scale = |p: &mut Policy, add: u32, cancel: &[u32], finish: bool, from: u32| {
            p.scale_stage("app", "executors", add, cancel, finish, from, 8, 1, 1).unwrap()
        };
        let out = scale(&mut p, 3, &[], false, 0);
        assert_eq!(out.added, [0, 1, 2]);
        let placed = p.assign(e0, 10, 1);
        assert_eq!(placed.iter().map(|a| a.task_index).collect::<Vec<_>>(), [0, 1], "two fit on 2 CPUs");
        assert_eq!(placed[0].task_count, 3);
        // Task 2 is still queued: cancelling it drops it; cancelling 0 stops its run.
        let out = scale(&mut p, 0, &[2, 0], false, 0);
        assert_eq!((out.queued, out.running, out.ended.len()), (0, 1, 2));
        assert_eq!(p.pool_counts().backlog_tasks, 0);
        assert!(p.take_events().contains(&Event::Cancel { executor: e0, assignments: vec![placed[0].assignment_id] }));
        // A task that fails or whose executor is lost is never run again; the owner hears why.
        p.report(e0, &pb::TaskResult { message: "exit 137".into(), ..result(&placed[1], pb::TaskOutcome::Oom) }, 2, 1);
        let out = scale(&mut p, 1, &[], false, 2);
        assert_eq!(out.ended.len(), 1);
        assert_eq!(
            (out.ended[0].task_index, out.ended[0].outcome(), out.ended[0].message.as_str()),
            (1, pb::TaskOutcome::Oom, "exit 137")
        );
        assert_eq!((out.added.as_slice(), out.ended_next), (&[3][..], 3));
        let again = p.assign(e0, 10, 3);
        assert_eq!(again.iter().map(|a| (a.task_index, a.attempt)).collect::<Vec<_>>(), [(3, 0)]);
        p.remove_executor(e0, 4);
        let out = scale(&mut p, 0, &[], false, 3);
        assert_eq!((out.ended[0].task_index, out.ended[0].outcome()), (3, pb::TaskOutcome::Lost));
        assert_eq!(p.pool_counts().backlog_tasks, 0, "a lost elastic task is not queued again");
        // Bounded over the stage's life, and only elastic stages scale.
        assert!(matches!(
            p.scale_stage("app", "executors", 5, &[], false, 0, 8, 1, 1),
            Err(ScaleError::Invalid(m)) if m.contains("at most 8")
        ));
        assert!(matches!(p.scale_stage("app", "executors", 0, &[9], false, 0, 8, 1, 1), Err(ScaleError::Invalid(_))));
        assert!(matches!(p.scale_stage("nope", "executors", 1, &[], false, 0, 8, 1, 1), Err(ScaleError::NotFound(_))));
        let out = scale(&mut p, 0, &[], true, 4);
        assert_eq!(out.state, pb::JobState::Succeeded);
        assert_eq!(p.expire_leases(u64::MAX, 1), 0, "no lease was asked for");
        let out = scale(&mut p, 2, &[], false, 4);
        assert!(out.added.is_empty(), "a finished job takes no tasks");
    }

    #[test]
    fn an_elastic_gang_starts_its_first_executors_together_or_not_at_all() {
        let mut p = Policy::new(PolicyConfig::default());
        let e0 = executor(&mut p, "h0", 1, 0);
        let mut s = stage("executors", 2, MILLI, 0);
        s.elastic = true;
        s.gang = true;
        s.min_available = 2;
        add(&mut p, "app", "q", 0, vec![s]);
        assert!(p.assign(e0, 10, 0).is_empty(), "one CPU cannot hold the gang of two");
        let e1 = executor(&mut p, "h1", 1, 0);
        let placed = p.assign(e1, 10, 1);
        assert_eq!(placed.len(), 1, "one here, the other in e0's outbox");
        assert_eq!(p.take_gang_wakes(), [e0]);
        assert_eq!(p.assign(e0, 10, 1).len(), 1);
        // Later executors of the application need no gang.
        let e2 = executor(&mut p, "h2", 1, 0);
        p.scale_stage("app", "executors", 1, &[], false, 0, 8, 2, 1).unwrap();
        assert_eq!(p.assign(e2, 10, 2).len(), 1);
    }

    #[test]
    fn status_says_why_a_gang_the_live_executors_cannot_hold_waits() {
        let mut p = Policy::new(PolicyConfig::default());
        let blocked = |p: &Policy| p.job_status("app", true).unwrap().stages[0].blocked.clone();
        let mut s = stage("executors", 3, MILLI, 0);
        s.elastic = true;
        s.gang = true;
        s.min_available = 3;
        add(&mut p, "app", "q", 0, vec![s]);
        let e0 = executor(&mut p, "h0", 1, 0);
        executor(&mut p, "h1", 1, 0);
        let why = blocked(&p);
        assert!(
            why.contains("a gang of 3 tasks") && why.contains("the 2 live executors hold at most 2 of them"),
            "{why}"
        );
        assert!(p.assign(e0, 10, 0).is_empty());
        // A third executor: the gang fits (and is placed on the next poll); nothing to report.
        let e2 = executor(&mut p, "h2", 1, 0);
        assert_eq!(blocked(&p), "");
        assert_eq!(p.assign(e2, 10, 1).len(), 1);
        assert_eq!(blocked(&p), "", "a placed gang is never blocked");
    }

    #[test]
    fn an_elastic_job_whose_owner_stops_renewing_is_cancelled() {
        let mut p = Policy::new(PolicyConfig::default());
        let e0 = executor(&mut p, "h0", 2, 0);
        let mut s = stage("executors", 1, MILLI, 0);
        s.elastic = true;
        s.lease_ms = 1000;
        add(&mut p, "app", "q", 0, vec![s]);
        let placed = p.assign(e0, 10, 0);
        assert_eq!(placed.len(), 1);
        // Each ScaleStage call renews it.
        p.scale_stage("app", "executors", 0, &[], false, 0, 8, 900, 1).unwrap();
        assert_eq!(p.expire_leases(1800, 1), 0);
        p.take_events();
        assert_eq!(p.expire_leases(1900, 1), 1);
        let status = p.job_status("app", false).unwrap();
        assert_eq!(status.state(), pb::JobState::Cancelled);
        assert!(status.error.contains("did not renew its lease"), "{}", status.error);
        assert!(p.take_events().contains(&Event::Cancel { executor: e0, assignments: vec![placed[0].assignment_id] }));
        assert_eq!(p.expire_leases(u64::MAX, 1), 0, "expired once");
    }

    #[test]
    fn an_elastic_job_gains_stages_of_other_needs_and_ends_when_all_are_finished() {
        let mut p = Policy::new(PolicyConfig::default());
        let e0 = executor(&mut p, "h0", 4, 1);
        let mut s = stage("executors", 1, MILLI, 0);
        s.elastic = true;
        add(&mut p, "app", "q", 0, vec![s]);
        let limits = SpecLimits { max_stages: 3, ..SpecLimits::default() };
        let mut big = stage("executors-rp1", 0, 2 * MILLI, MILLI);
        big.elastic = true;
        assert_eq!(p.add_stage("app", big.clone(), &limits, 1), Ok(true));
        assert_eq!(p.add_stage("app", big.clone(), &limits, 1), Ok(false), "a retried call changes nothing");
        let out = p.scale_stage("app", "executors-rp1", 2, &[], false, 0, 8, 2, 1).unwrap();
        assert_eq!(out.added, [0, 1], "the new stage's own indexes");
        let placed = p.assign(e0, 10, 2);
        let mut granted: Vec<(String, u64, u64)> = placed
            .iter()
            .map(|a| (a.stage.clone(), a.granted.unwrap().cpu_milli, a.granted.unwrap().gpu_milli))
            .collect();
        granted.sort();
        // 4 CPUs, 1 GPU: the default stage's task and one of the profile's (2 CPUs, the GPU).
        assert_eq!(granted, [("executors".into(), MILLI, 0), ("executors-rp1".into(), 2 * MILLI, MILLI)]);
        let status = p.job_status("app", true).unwrap();
        let needs: Vec<_> = status.stages.iter().map(|st| (st.name.as_str(), st.needs.unwrap().cpu_milli)).collect();
        assert_eq!(needs, [("executors", MILLI), ("executors-rp1", 2 * MILLI)]);
        // Refused: tasks at creation, a stage past the limit, a non-elastic stage.
        let mut more = big.clone();
        more.name = "x".into();
        more.tasks = 1;
        let e = p.add_stage("app", more.clone(), &limits, 3).unwrap_err();
        assert!(matches!(&e, ScaleError::Invalid(m) if m.contains("starts with 0")), "{e:?}");
        more.tasks = 0;
        assert_eq!(p.add_stage("app", more.clone(), &limits, 3), Ok(true));
        more.name = "y".into();
        let e = p.add_stage("app", more.clone(), &limits, 3).unwrap_err();
        assert!(matches!(&e, ScaleError::Invalid(m) if m.contains("at most 3")), "{e:?}");
        more.elastic = false;
        assert!(matches!(p.add_stage("app", more, &limits, 3), Err(ScaleError::Invalid(_))));
        // The job succeeds once its owner finished every stage.
        for (i, name) in ["executors", "x", "executors-rp1"].into_iter().enumerate() {
            let out = p.scale_stage("app", name, 0, &[], true, 0, 8, 4, 1).unwrap();
            let want = if i < 2 { pb::JobState::Running } else { pb::JobState::Succeeded };
            assert_eq!(out.state, want, "after finishing {name}");
        }
        let mut late = big;
        late.name = "z".into();
        assert!(matches!(p.add_stage("app", late, &limits, 5), Err(ScaleError::Invalid(_))), "a finished job");
        let mut plain = stage("s", 1, MILLI, 0);
        add(&mut p, "batch", "q", 0, vec![plain.clone()]);
        plain.name = "t".into();
        plain.tasks = 0;
        plain.elastic = true;
        assert!(matches!(p.add_stage("batch", plain, &limits, 5), Err(ScaleError::Invalid(_))), "not an elastic job");
    }

    #[test]
    fn a_lost_executor_requeues_its_tasks_without_counting_a_failure() {
        let mut p = Policy::new(PolicyConfig::default());
        let e0 = executor(&mut p, "h0", 2, 0);
        let mut s = stage("s", 2, MILLI, 0);
        s.max_attempts = 1;
        add(&mut p, "j", "q", 0, vec![s]);
        assert_eq!(p.assign(e0, 10, 0).len(), 2);
        assert_eq!(p.remove_executor(e0, 5), 2);
        assert_eq!(p.pool_counts().backlog_tasks, 2);
        let e1 = executor(&mut p, "h1", 2, 0);
        let again = p.assign(e1, 10, 5);
        assert_eq!(again.iter().map(|a| a.attempt).collect::<Vec<_>>(), [1, 1], "new attempt numbers");
        for a in &again {
            p.report(e1, &result(a, pb::TaskOutcome::Succeeded), 6, 1);
        }
        let status = p.job_status("j", true).unwrap();
        assert_eq!(status.state(), pb::JobState::Succeeded, "max_attempts = 1 was not used up by the loss");
        assert_eq!(status.stages[0].lost, 2);
    }

    /// gen writes /in, map reads /in and writes /mid, reduce reads /mid: a lineage chain.
    fn chain(p: &mut Policy, max_attempts: u32) {
        let path = |p: &str| Some(pb::DataRef { kind: Some(pb::data_ref::Kind::Path(p.into())) });
        let mut gen = stage("gen", 2, MILLI, 0);
        gen.output = path("/in");
        let mut map = stage("map", 2, MILLI, 0);
        (map.after, map.input, map.output) = (vec!["gen".into()], path("/in"), path("/mid"));
        let mut reduce = stage("reduce", 2, MILLI, 0);
        (reduce.after, reduce.input) = (vec!["map".into()], path("/mid"));
        for s in [&mut gen, &mut map, &mut reduce] {
            s.max_attempts = max_attempts;
        }
        add(p, "j", "q", 0, vec![gen, map, reduce]);
    }

    /// Runs every assignable task to success until only `stage`'s are offered; returns those.
    fn run_until(p: &mut Policy, e: usize, stage: &str, now: u64) -> Vec<pb::Assignment> {
        loop {
            let offered = p.assign(e, 10, now);
            assert!(!offered.is_empty(), "nothing to run before stage {stage}");
            if offered.iter().all(|a| a.stage == stage) {
                return offered;
            }
            for a in offered {
                p.report(e, &result(&a, pb::TaskOutcome::Succeeded), now, 1);
            }
        }
    }

    fn input_lost(a: &pb::Assignment, lost: &[u32]) -> pb::TaskResult {
        pb::TaskResult { lost_inputs: lost.to_vec(), ..result(a, pb::TaskOutcome::InputLost) }
    }

    #[test]
    fn lost_input_reruns_exactly_the_producers_lost_tasks_through_the_chain() {
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 8, 0);
        // One attempt each: lineage recovery must not count any.
        chain(&mut p, 1);
        let reduces = run_until(&mut p, e, "reduce", 0);
        assert_eq!(reduces.len(), 2);
        // Reduce 0 finds map 1's output lost: map 1 runs again, reduce 0 waits for it.
        p.report(e, &input_lost(&reduces[0], &[1]), 1, 1);
        let again = p.assign(e, 10, 1);
        assert_eq!(
            again.iter().map(|a| (a.stage.as_str(), a.task_index, a.attempt)).collect::<Vec<_>>(),
            [("map", 1, 1)]
        );
        let status = p.job_status("j", true).unwrap();
        assert_eq!(status.stages[1].state(), pb::StageState::Running, "map reopened");
        assert_eq!((status.stages[1].recomputed, status.stages[2].waiting), (1, 1));
        // The map's rerun finds gen 0's output lost too: gen 0 runs again, then map 1, then reduce 0.
        p.report(e, &input_lost(&again[0], &[0]), 2, 1);
        let gen = p.assign(e, 10, 2);
        assert_eq!(gen.iter().map(|a| (a.stage.as_str(), a.task_index)).collect::<Vec<_>>(), [("gen", 0)]);
        p.report(e, &result(&gen[0], pb::TaskOutcome::Succeeded), 3, 1);
        let map = p.assign(e, 10, 3);
        assert_eq!(
            map.iter().map(|a| (a.stage.as_str(), a.task_index, a.attempt)).collect::<Vec<_>>(),
            [("map", 1, 2)]
        );
        p.report(e, &result(&map[0], pb::TaskOutcome::Succeeded), 4, 1);
        let reduce = p.assign(e, 10, 4);
        assert_eq!(reduce.iter().map(|a| (a.stage.as_str(), a.task_index)).collect::<Vec<_>>(), [("reduce", 0)]);
        p.report(e, &result(&reduce[0], pb::TaskOutcome::Succeeded), 5, 1);
        p.report(e, &result(&reduces[1], pb::TaskOutcome::Succeeded), 5, 1);
        let status = p.job_status("j", true).unwrap();
        assert_eq!(status.state(), pb::JobState::Succeeded, "{status:?}");
        let recomputed: Vec<u32> = status.stages.iter().map(|s| s.recomputed).collect();
        assert_eq!(recomputed, [1, 1, 0]);
        assert!(status.stages.iter().all(|s| s.failed == 0 && s.errors.is_empty()));
    }

    #[test]
    fn lost_input_that_cannot_be_recomputed_fails_the_task_and_says_why() {
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 8, 0);
        chain(&mut p, 1);
        let maps = run_until(&mut p, e, "map", 0);
        p.report(e, &input_lost(&maps[0], &[7]), 1, 1);
        let status = p.job_status("j", false).unwrap();
        assert_eq!(status.state(), pb::JobState::Failed);
        assert!(status.error.contains("[7] are not task indexes of stage \"gen\", which has 2"), "{}", status.error);

        // gen has no producer: its own lost input is a plain failure.
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 8, 0);
        chain(&mut p, 1);
        let gen = p.assign(e, 10, 0);
        p.report(e, &input_lost(&gen[0], &[0]), 1, 1);
        let status = p.job_status("j", false).unwrap();
        assert!(status.error.contains("no single earlier stage of the job wrote it"), "{}", status.error);
    }

    #[test]
    fn output_lost_again_and_again_fails_the_job_after_the_round_limit() {
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 8, 0);
        chain(&mut p, 1);
        let mut reduces = run_until(&mut p, e, "reduce", 0);
        for round in 0..=MAX_RECOMPUTE_ROUNDS {
            p.report(e, &input_lost(&reduces[0], &[0]), 1, 1);
            if round == MAX_RECOMPUTE_ROUNDS {
                break;
            }
            let map = p.assign(e, 10, 1);
            p.report(e, &result(&map[0], pb::TaskOutcome::Succeeded), 1, 1);
            reduces = p.assign(e, 10, 1);
            assert_eq!(reduces.len(), 1);
        }
        let status = p.job_status("j", true).unwrap();
        assert_eq!(status.state(), pb::JobState::Failed);
        assert!(status.error.contains("already recomputed 4 times"), "{}", status.error);
        assert_eq!(status.stages[1].recomputed, MAX_RECOMPUTE_ROUNDS);
    }

    #[test]
    fn stages_run_in_dag_order() {
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 8, 0);
        let mut second = stage("b", 2, MILLI, 0);
        second.after = vec!["a".into()];
        add(&mut p, "j", "q", 0, vec![stage("a", 2, MILLI, 0), second]);
        let first = p.assign(e, 10, 0);
        assert!(first.iter().all(|a| a.stage == "a") && first.len() == 2);
        p.report(e, &result(&first[0], pb::TaskOutcome::Succeeded), 0, 1);
        assert!(p.assign(e, 10, 0).is_empty(), "b waits for all of a");
        p.report(e, &result(&first[1], pb::TaskOutcome::Succeeded), 0, 1);
        let next = p.assign(e, 10, 0);
        assert!(next.iter().all(|a| a.stage == "b") && next.len() == 2);
    }

    #[test]
    fn locality_prefers_the_inputs_host_but_does_not_wait_long() {
        let mut p = Policy::new(PolicyConfig { locality_wait_ms: 50, ..PolicyConfig::default() });
        let here = executor(&mut p, "a", 4, 0);
        let there = executor(&mut p, "b", 4, 0);
        let mut s = stage("s", 2, MILLI, 0);
        s.locality = vec!["b".into(), "b".into()];
        add(&mut p, "j", "q", 0, vec![s]);
        assert!(p.assign(here, 10, 10).is_empty(), "host b has room: leave its tasks to it for a while");
        assert_eq!(p.assign(there, 1, 10).len(), 1);
        assert_eq!(p.assign(here, 10, 60).len(), 1, "after the wait any executor takes it");
    }

    #[test]
    fn gpu_optional_tasks_run_on_cpu_executors() {
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 4, 0);
        let mut s = stage("s", 1, MILLI, 250);
        add(&mut p, "strict", "q", 0, vec![s.clone()]);
        assert!(p.assign(e, 1, 0).is_empty(), "a GPU task needs a GPU");
        s.gpu_optional = true;
        add(&mut p, "optional", "q", 0, vec![s]);
        let a = p.assign(e, 1, 0).pop().unwrap();
        assert_eq!((a.job_id.as_str(), a.gpus.len(), a.granted.unwrap().gpu_milli), ("optional", 0, 0));
    }

    #[test]
    fn status_says_why_tasks_no_executor_can_run_wait() {
        let mut p = Policy::new(PolicyConfig::default());
        let blocked = |p: &Policy, job: &str| p.job_status(job, true).unwrap().stages[0].blocked.clone();
        add(&mut p, "gpu", "q", 0, vec![stage("s", 2, MILLI, 500)]);
        let why = blocked(&p, "gpu");
        assert!(why.starts_with("no live executor;") && why.contains("0.5 GPUs"), "{why}");
        let e = executor(&mut p, "h", 4, 0);
        let why = blocked(&p, "gpu");
        assert!(why.contains("the largest of 1 offers 4 CPUs") && why.contains("and 0 GPUs"), "{why}");
        add(&mut p, "wide", "q", 0, vec![stage("s", 1, 8 * MILLI, 0)]);
        assert!(blocked(&p, "wide").contains("needs 8 CPUs"), "{}", blocked(&p, "wide"));
        // A busy executor that could run the task when idle is not "blocked": the task just waits.
        add(&mut p, "fits", "q", 0, vec![stage("s", 8, MILLI, 0)]);
        assert_eq!(p.assign(e, 100, 0).len(), 4);
        assert_eq!(blocked(&p, "fits"), "");
        // A GPU executor joins: the GPU job can now run.
        executor(&mut p, "g", 4, 1);
        assert_eq!(blocked(&p, "gpu"), "");
    }
}
