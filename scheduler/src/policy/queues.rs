//! Which queue, job and stage an executor's next task comes from: queues share the cluster by
//! weight with dominant-resource fairness, and within a queue jobs run by priority, then by
//! submission. The ready lists (a queue's jobs with ready tasks, a job's stages with ready tasks,
//! a stage's ready tasks) keep a decision from scanning all jobs or tasks.

use std::cmp::Reverse;
use std::collections::BTreeMap;

use tern_proto::sched as pb;

use super::ids::JobKey;
use super::jobs::Stage;
use super::{ExecutorSlot, Policy, TaskState};

/// Candidates a decision looks at in one queue before moving on (tasks that do not fit).
pub(super) const MAX_CANDIDATES: usize = 16;

#[derive(Debug)]
pub(super) struct Queue {
    pub(super) name: String,
    pub(super) weight: u32,
    /// Resources held by its running tasks.
    pub(super) used_cpu: u64,
    pub(super) used_gpu: u64,
    /// Jobs with ready tasks, by (higher priority first, then submission).
    pub(super) ready_jobs: BTreeMap<(Reverse<i32>, JobKey), JobKey>,
    pub(super) dispatched: u64,
}

impl Policy {
    pub(super) fn queue_of(&mut self, name: &str) -> usize {
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

    /// Dominant share of a queue divided by its weight (lower goes first).
    pub(super) fn weighted_share(&self, q: usize) -> f64 {
        let queue = &self.queues[q];
        let cpu = if self.total_cpu == 0 { 0.0 } else { queue.used_cpu as f64 / self.total_cpu as f64 };
        let gpu = if self.total_gpu == 0 { 0.0 } else { queue.used_gpu as f64 / self.total_gpu as f64 };
        cpu.max(gpu) / f64::from(queue.weight)
    }

    /// Up to `max` assignments for executor `slot`: its outbox first (gang placements), then
    /// tasks chosen by fair share.
    pub fn assign(&mut self, slot: ExecutorSlot, max: usize, now_ms: u64) -> Vec<pb::Assignment> {
        let mut out = Vec::new();
        let Some(executor) = self.executors.get_mut(slot.index()).and_then(Option::as_mut) else {
            return out;
        };
        let take = executor.outbox.len().min(max);
        out.extend(executor.outbox.drain(..take));
        // Queues that had nothing placeable this call are skipped for the rest of it.
        let mut exhausted = vec![false; self.queues.len()];
        while out.len() < max {
            let executor = self.executors[slot.index()].as_ref().expect("live executor");
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
    fn place_from_queue(&mut self, q: usize, slot: ExecutorSlot, now_ms: u64, out: &mut Vec<pb::Assignment>) -> bool {
        let mut looked = 0;
        let jobs: Vec<JobKey> = self.queues[q].ready_jobs.values().take(MAX_CANDIDATES).copied().collect();
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

    /// Puts the stage in its job's ready list and the job in its queue's.
    pub(super) fn mark_ready(&mut self, key: JobKey, s: usize) {
        let job = self.jobs.get_mut(&key).expect("job exists");
        if !job.ready_stages.contains(&s) {
            job.ready_stages.push_back(s);
        }
        let sort = (Reverse(job.info.priority), job.seq);
        self.queues[job.queue].ready_jobs.insert(sort, key);
    }

    /// Takes the stage out of its job's ready list (and the job out of its queue's) once it has
    /// no queued task left.
    pub(super) fn unready_if_empty(&mut self, key: JobKey, s: usize) {
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
}

/// Puts task `t` in its stage's ready lists (state and time; the caller keeps the counts).
pub(super) fn enqueue(stage: &mut Stage, t: u32, now_ms: u64) {
    let task = &mut stage.tasks[t as usize];
    task.state = TaskState::Queued;
    task.queued_at_ms = now_ms;
    stage.ready.push_back(t);
    if let Some(host) = stage.info.hosts.get(t as usize).filter(|h| !h.is_empty()) {
        stage.local.entry(host.clone()).or_default().push_back(t);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, VecDeque};

    use crate::policy::testkit::*;

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
}
