//! An assignment's life: a placed task is launched (its id, the resources it takes, the message
//! its executor runs), its executor reports how it ended, and the outcome goes to the rule that
//! owns it (`dag` for success, `retry` for failure, `lineage` for lost input, `elastic` for
//! elastic stages; a lost executor's task is queued again here). Cancelled assignments free their
//! resources and become Cancel events for their executors.

use std::cmp::Reverse;
use std::collections::BTreeMap;

use tern_proto::cut_message;
use tern_proto::sched as pb;

use super::fit::take;
use super::ids::JobKey;
use super::{AssignmentId, Event, ExecutorSlot, Policy, Res, TaskState};

/// Bytes of one task error kept.
const MAX_ERROR_BYTES: usize = 4096;

/// A running assignment.
#[derive(Debug, Clone)]
pub(super) struct Running {
    pub(super) executor: ExecutorSlot,
    pub(super) job: JobKey,
    pub(super) stage: usize,
    pub(super) task: u32,
    pub(super) res: Res,
    pub(super) gpus: Vec<(usize, u32)>,
    pub(super) queue: usize,
}

/// How an assignment ended, as the policy acts on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Outcome {
    Succeeded,
    Failed,
    Oom,
    Lost,
    /// The task's input is lost: these tasks of its producer stage must run again.
    InputLost(Vec<u32>),
}

impl Policy {
    /// Records task `t` as running on `slot` and builds its assignment.
    pub(super) fn launch(
        &mut self,
        key: JobKey,
        s: usize,
        t: u32,
        slot: ExecutorSlot,
        res: Res,
        gpus: Vec<(usize, u32)>,
    ) -> pb::Assignment {
        let id = self.next_assignment;
        self.next_assignment = id.next();
        let executor = self.executors[slot.index()].as_mut().expect("live");
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
        task.assignment = Some(id);
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
            assignment_id: id.to_wire(),
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
            tenant_credential: job.info.tenant_credential.clone(),
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

    /// Applies an executor's report of one assignment. Unknown ids (a cancelled or re-queued
    /// attempt reporting late) are ignored; returns false for them.
    pub fn report(&mut self, slot: ExecutorSlot, result: &pb::TaskResult, now_ms: u64, now_unix_ms: u64) -> bool {
        let id = AssignmentId::from_wire(result.assignment_id);
        let Some(run) = self.running.get(&id) else {
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
        self.finish_assignment(id, outcome, &message, &result.path, now_ms, now_unix_ms);
        true
    }

    /// Ends assignment `id` with `outcome`: its resources are released, then the outcome's rule
    /// decides what becomes of its task (the stage may finish, the task may run again).
    pub(super) fn finish_assignment(
        &mut self,
        id: AssignmentId,
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
        let key = run.job;
        let job = self.jobs.get_mut(&key).expect("job of a running task");
        let stage = &mut job.stages[run.stage];
        debug_assert_eq!(stage.tasks[run.task as usize].state, TaskState::Running);
        stage.counts.running -= 1;
        if !path.is_empty() {
            *stage.paths.entry(cut_message(path, 64).to_string()).or_default() += 1;
        }
        if stage.info.spec.elastic {
            self.end_elastic_task(&run, outcome, message);
            return;
        }
        match outcome {
            Outcome::Succeeded => self.task_succeeded(&run, now_ms, now_unix_ms),
            Outcome::Lost => {
                // Its executor is gone, not its fault: first in line again, no failure counted.
                let t = run.task;
                let task = &mut stage.tasks[t as usize];
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
                self.task_failed(&run, outcome == Outcome::Oom, message, now_ms, now_unix_ms)
            }
        }
    }

    /// Sends Cancel events for running assignments (by executor) and frees their resources.
    pub(super) fn cancel_assignments(&mut self, mut ids: Vec<AssignmentId>) {
        ids.sort_unstable();
        let mut by_executor: BTreeMap<ExecutorSlot, Vec<AssignmentId>> = BTreeMap::new();
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
        if let Some(executor) = self.executors.get_mut(run.executor.index()).and_then(Option::as_mut) {
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
}
