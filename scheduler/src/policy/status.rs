//! What the policy tells: job and stage status (with why queued tasks wait when no live executor
//! can run them), job listings, and the pool's counts and queue shares for metrics.

use tern_proto::sched as pb;

use super::executors::Executor;
use super::fit::{fit_on, idle_copy};
use super::ids::JobKey;
use super::jobs::{Job, Stage};
use super::{Policy, PoolCounts, QueueShare, Res, TaskState};
use crate::spec::MILLI;

impl Policy {
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
        let op = stage.operator;
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
            op.map(|op| format!(" and runs operator {op}")).unwrap_or_default()
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

    /// Jobs in submission order.
    pub fn job_ids(&self) -> Vec<String> {
        let mut keys: Vec<(&JobKey, &Job)> = self.jobs.iter().collect();
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

    /// The job's state, or None for a job the policy does not know (never added, or forgotten).
    pub fn job_state(&self, job_id: &str) -> Option<pb::JobState> {
        self.job_keys.get(job_id).map(|k| self.jobs[k].state)
    }

    /// The job's queue (its tenant), or None for a job the policy does not know.
    pub fn job_queue(&self, job_id: &str) -> Option<&str> {
        self.job_keys.get(job_id).map(|k| self.jobs[k].info.queue.as_str())
    }

    pub fn job_count(&self) -> usize {
        self.jobs.len()
    }
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
    use crate::policy::testkit::*;

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
