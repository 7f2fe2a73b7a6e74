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

//!
//! Where each decision lives (each file adds an `impl Policy` block for its concern):
//! - `ids`: the ids the policy mints: job keys, executor slots, assignment ids.
//! - `executors`: the executor registry: executors join with their capacity, leave or are lost.
//! - `queues`: which queue, job and stage an executor's next task comes from (fair share,
//!   priority, submission), and the ready lists that keep that cheap.
//! - `locality`: which ready task of a stage an executor takes (its host first, the locality wait).
//! - `fit`: whether a task fits an executor's free resources, and on which GPU devices.
//! - `gangs`: gang stages placed all at once or not at all, and why a gang waits.
//! - `assignments`: a task's assignment from launch to its executor's report; what an outcome
//!   does is decided by the file that owns its rule; cancelled assignments become Cancel events.
//! - `jobs`: jobs, stages and tasks as the policy keeps them; adding, cancelling, forgetting jobs.
//! - `dag`: stages start when the stages they wait for succeed; a stage ends at `min_success`.
//! - `retry`: failed tasks: backoff, the attempt limit, OOM memory doubling.
//! - `elastic`: elastic stages their owner grows and shrinks (ScaleStage, AddStage), and leases.
//! - `lineage`: recomputing a producer's lost output, reopening its stage.
//! - `status`: job and stage status, why tasks wait, counts and shares for metrics.
//!
//! Each file's unit tests sit beside its rules; `testkit` holds the helpers they share.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use tern_proto::sched as pb;

use assignments::Running;
use executors::Executor;
use ids::JobKey;
pub use ids::{AssignmentId, ExecutorSlot};
use jobs::Job;
use queues::Queue;

mod assignments;
mod dag;
mod elastic;
mod executors;
mod fit;
mod gangs;
mod ids;
mod jobs;
mod lineage;
mod locality;
mod queues;
mod retry;
mod status;
#[cfg(test)]
mod testkit;

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
    /// A client credential of the job's tenant (its queue), handed to its tasks.
    pub tenant_credential: String,
    /// Copies of what its built-ins write (at least 1).
    pub copies: u32,
    pub submitted_unix_ms: u64,
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
    Cancel { executor: ExecutorSlot, assignments: Vec<AssignmentId> },
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
    free_slots: Vec<ExecutorSlot>,
    live_executors: u32,
    hosts: HashMap<String, Vec<ExecutorSlot>>,
    total_cpu: u64,
    total_gpu: u64,
    queues: Vec<Queue>,
    queue_index: HashMap<String, usize>,
    jobs: HashMap<JobKey, Job>,
    job_keys: HashMap<String, JobKey>,
    next_job: JobKey,
    running: HashMap<AssignmentId, Running>,
    next_assignment: AssignmentId,
    /// (due ms, job, stage, task) of tasks in backoff.
    backoff: BinaryHeap<Reverse<(u64, JobKey, usize, u32)>>,
    backlog: u64,
    backoff_count: u64,
    events: Vec<Event>,
    /// Executors a gang placed tasks on since the last [`Policy::take_gang_wakes`].
    gang_wakes: Vec<ExecutorSlot>,
    /// Unfinished jobs whose elastic stage has a lease: job key -> (lease ms, deadline ms).
    leases: BTreeMap<JobKey, (u64, u64)>,
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
            next_job: JobKey::FIRST,
            running: HashMap::new(),
            next_assignment: AssignmentId::FIRST,
            backoff: BinaryHeap::new(),
            backlog: 0,
            backoff_count: 0,
            events: Vec::new(),
            gang_wakes: Vec::new(),
            leases: BTreeMap::new(),
        }
    }

    /// Tasks ready to run and not placed.
    pub fn backlog(&self) -> u64 {
        self.backlog
    }

    /// Events since the last call.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }
}
