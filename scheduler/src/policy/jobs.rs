//! Jobs, stages and tasks as the policy keeps them, and a job's life: added (its first stages
//! start), cancelled, finished (its unfinished tasks cancelled, the server told), forgotten.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, VecDeque};

use tern_proto::sched as pb;
use tern_scheduler_api::Operator;

use super::ids::JobKey;
use super::{AssignmentId, Event, JobInfo, Policy, Res, StageInfo, TaskState};
use crate::spec::Dag;

/// Task errors kept per stage.
pub(super) const MAX_STAGE_ERRORS: usize = 8;

#[derive(Debug)]
pub(super) struct Job {
    pub(super) info: JobInfo,
    /// Its place in submission order (its key), the tie-break within a priority.
    pub(super) seq: JobKey,
    pub(super) queue: usize,
    pub(super) state: pb::JobState,
    pub(super) error: String,
    pub(super) stages: Vec<Stage>,
    /// Stages with ready tasks, in stage order (a stage appears at most once).
    pub(super) ready_stages: VecDeque<usize>,
    pub(super) unfinished_stages: usize,
    pub(super) finished_unix_ms: u64,
}

#[derive(Debug)]
pub(super) struct Stage {
    pub(super) info: StageInfo,
    /// The stage's operator, parsed once (a validated spec always names one).
    pub(super) operator: Option<Operator>,
    pub(super) state: pb::StageState,
    pub(super) needs: Res,
    pub(super) max_attempts: u32,
    pub(super) backoff_ms: u64,
    pub(super) min_success: u32,
    pub(super) tasks: Vec<Task>,
    pub(super) ready: VecDeque<u32>,
    /// Ready tasks preferring a host, by host (entries may be stale: checked when taken).
    pub(super) local: HashMap<String, VecDeque<u32>>,
    /// Stages waiting on this one.
    pub(super) next: Vec<usize>,
    /// Unfinished stages it waits for.
    pub(super) pending_deps: usize,
    pub(super) counts: Counts,
    pub(super) attempts: u32,
    pub(super) oom_retries: u32,
    pub(super) lost: u32,
    pub(super) paths: BTreeMap<String, u32>,
    pub(super) errors: VecDeque<String>,
    pub(super) started_ms: u64,
    pub(super) finished_ms: u64,
    /// Gang stages: whether its gang was placed (then it behaves like any stage).
    pub(super) gang_placed: bool,
    /// Elastic stages: tasks that ended, in order (bounded by the stage's task limit).
    pub(super) ended: Vec<pb::ElasticTaskEnd>,
    /// The stage that writes this one's input (see [`Dag::producer`]).
    pub(super) producer: Option<usize>,
    /// Succeeded tasks queued again because a later stage found their output lost.
    pub(super) recomputed: u32,
    /// Times this stage was reopened after finishing, to recompute lost output.
    pub(super) recompute_rounds: u32,
    /// Reopened and not finished again: its consumers' waiting tasks resume when it does.
    pub(super) recomputing: bool,
}

#[derive(Debug, Clone)]
pub(super) struct Task {
    pub(super) state: TaskState,
    /// Attempt numbers handed out (the next run's attempt number).
    pub(super) runs: u32,
    /// Failures counted against max_attempts (OOM included, executor loss not).
    pub(super) failures: u32,
    pub(super) memory_bytes: u64,
    /// When it last became queued (for the locality wait).
    pub(super) queued_at_ms: u64,
    /// Its running assignment, if running (set at launch; read only while it runs).
    pub(super) assignment: Option<AssignmentId>,
}

#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Counts {
    pub(super) waiting: u32,
    pub(super) queued: u32,
    pub(super) backoff: u32,
    pub(super) running: u32,
    pub(super) succeeded: u32,
    pub(super) failed: u32,
    pub(super) cancelled: u32,
}

impl Counts {
    pub(super) fn get(&mut self, state: TaskState) -> &mut u32 {
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

impl Policy {
    /// Adds a validated job; its first stages' tasks are queued at once.
    pub fn add_job(&mut self, info: JobInfo, stages: Vec<StageInfo>, dag: &Dag, now_ms: u64) {
        let queue_name =
            if info.queue.is_empty() { crate::spec::DEFAULT_QUEUE.to_string() } else { info.queue.clone() };
        let queue = self.queue_of(&queue_name);
        let key = self.next_job;
        self.next_job = key.next();
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
    pub(super) fn new_stage(&self, info: StageInfo) -> Stage {
        let needs: Res = info.spec.needs.unwrap_or_default().into();
        let n = info.spec.tasks;
        let min_success = if info.spec.min_success == 0 { n } else { info.spec.min_success };
        let max_attempts =
            if info.spec.max_attempts == 0 { self.config.default_max_attempts } else { info.spec.max_attempts };
        let backoff_ms = if info.spec.backoff_ms == 0 { self.config.default_backoff_ms } else { info.spec.backoff_ms };
        Stage {
            operator: info.spec.operator.as_ref().and_then(|o| o.name.parse().ok()),
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
                    assignment: None
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

    pub(super) fn finish_job(
        &mut self,
        key: JobKey,
        state: pb::JobState,
        error: String,
        now_ms: u64,
        now_unix_ms: u64,
    ) {
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
}

/// Queued and backoff tasks become cancelled; running ones are collected to be told to stop.
pub(super) fn cancel_unfinished(
    stage: &mut Stage,
    running: &mut Vec<AssignmentId>,
    backlog: &mut u64,
    backoff: &mut u64,
) {
    for task in &mut stage.tasks {
        match task.state {
            TaskState::Queued => *backlog -= 1,
            TaskState::Backoff => *backoff -= 1,
            TaskState::Running => running.extend(task.assignment),
            TaskState::Waiting => {}
            TaskState::Succeeded | TaskState::Failed | TaskState::Cancelled => continue,
        }
        *stage.counts.get(task.state) -= 1;
        task.state = TaskState::Cancelled;
        stage.counts.cancelled += 1;
    }
}
