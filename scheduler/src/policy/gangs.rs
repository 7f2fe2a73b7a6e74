//! Gang stages: `min_available` tasks (default all) are placed at once across the cluster, or none,
//! decided on trial copies of the executors' free resources. Tasks placed on executors other than
//! the polling one wait in their outboxes, and those executors are woken. Also why a gang the live
//! executors cannot hold keeps waiting.

use std::collections::HashMap;

use tern_proto::sched as pb;
use tern_scheduler_api::Operator;

use super::executors::Executor;
use super::fit::{fit_on, idle_copy, take, GpuPicks};
use super::ids::JobKey;
use super::jobs::Stage;
use super::{ExecutorSlot, Policy, Res, TaskState};

impl Policy {
    /// Executors that have gang tasks waiting for them in their outboxes, since the last call.
    pub fn take_gang_wakes(&mut self) -> Vec<ExecutorSlot> {
        std::mem::take(&mut self.gang_wakes)
    }

    /// All-or-nothing: places `min_available` (or all) queued tasks of a gang stage across the
    /// cluster on a trial copy of free resources; commits only if enough fit.
    pub(super) fn place_gang(
        &mut self,
        key: JobKey,
        s: usize,
        slot: ExecutorSlot,
        out: &mut Vec<pb::Assignment>,
    ) -> bool {
        let stage = &self.jobs[&key].stages[s];
        let queued: Vec<u32> =
            (0..stage.tasks.len() as u32).filter(|&t| stage.tasks[t as usize].state == TaskState::Queued).collect();
        let want =
            if stage.info.spec.min_available == 0 { stage.tasks.len() } else { stage.info.spec.min_available as usize };
        let want = want.saturating_sub(stage.counts.running as usize + stage.counts.succeeded as usize);
        let op = stage.operator;
        let gpu_optional = stage.info.spec.gpu_optional;
        // Trial copies of the executors' free resources, the polling executor first.
        let mut order: Vec<ExecutorSlot> = vec![slot];
        order.extend(
            (0..self.executors.len())
                .map(ExecutorSlot::at_index)
                .filter(|&e| e != slot && self.executors[e.index()].is_some()),
        );
        let mut trial: HashMap<ExecutorSlot, Executor> = HashMap::new();
        let mut plan: Vec<(u32, ExecutorSlot, Res, GpuPicks)> = Vec::new();
        for &t in &queued {
            let res = Res { memory_bytes: stage.tasks[t as usize].memory_bytes, ..stage.needs };
            let mut placed = false;
            for &e in &order {
                let real = self.executors[e.index()].as_ref().expect("live");
                if !real.runs(op) {
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
                self.executors[e.index()].as_mut().expect("live").outbox.push(a);
                if !self.gang_wakes.contains(&e) {
                    self.gang_wakes.push(e);
                }
            }
        }
        true
    }

    /// For a gang stage not yet placed: why the live executors cannot hold its gang even when
    /// all are idle (they hold fewer of its tasks than the gang needs), or "" when they could.
    /// Like Volcano's "Unschedulable" podgroup condition: the gang keeps waiting (executors may
    /// still join) but its job's status says why.
    pub(super) fn why_gang_blocked(&self, stage: &Stage, need: Res, op: Option<Operator>, wants: &str) -> String {
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
}

#[cfg(test)]
mod tests {
    use crate::policy::testkit::*;

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
}
