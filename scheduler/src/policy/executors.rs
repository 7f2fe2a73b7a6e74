//! The executor registry: executors join with their capacity (CPUs, memory, GPU devices, the
//! operators they run) and leave or are lost. A lost executor's running tasks are queued again
//! without counting a failure; its slot is reused by the next executor to join.

use super::assignments::Outcome;
use super::{AssignmentId, ExecutorSlot, Policy, Res};
use crate::spec::MILLI;
use tern_proto::sched as pb;
use tern_scheduler_api::Operator;

/// One GPU device of an executor.
#[derive(Debug, Clone)]
pub(super) struct Gpu {
    pub(super) address: String,
    pub(super) free_milli: u32,
}

/// An executor as the policy sees it.
#[derive(Debug)]
pub(super) struct Executor {
    pub(super) host: String,
    pub(super) capacity: Res,
    pub(super) free_cpu: u64,
    pub(super) free_memory: u64,
    pub(super) gpus: Vec<Gpu>,
    pub(super) running: u32,
    /// Assignments placed here by a gang decision made during another executor's poll.
    pub(super) outbox: Vec<pb::Assignment>,
    /// Operators it runs; empty = all.
    pub(super) operators: Vec<Operator>,
}

impl Executor {
    pub(super) fn runs(&self, operator: Option<Operator>) -> bool {
        self.operators.is_empty() || operator.is_some_and(|o| self.operators.contains(&o))
    }
}

impl Policy {
    /// Adds an executor; returns its slot (the server maps its own ids to slots).
    pub fn add_executor(
        &mut self,
        host: &str,
        capacity: Res,
        gpu_addresses: &[String],
        operators: &[Operator],
    ) -> ExecutorSlot {
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
                self.executors[slot.index()] = Some(executor);
                slot
            }
            None => {
                self.executors.push(Some(executor));
                ExecutorSlot::at_index(self.executors.len() - 1)
            }
        };
        self.hosts.entry(host.to_string()).or_default().push(slot);
        self.live_executors += 1;
        slot
    }

    /// Removes an executor (it left or was lost): its running tasks are queued again without
    /// counting a failure. Returns how many.
    pub fn remove_executor(&mut self, slot: ExecutorSlot, now_ms: u64) -> u32 {
        let Some(executor) = self.executors.get_mut(slot.index()).and_then(Option::take) else {
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
        let mine: Vec<AssignmentId> =
            self.running.iter().filter(|(_, r)| r.executor == slot).map(|(&id, _)| id).collect();
        let count = mine.len() as u32;
        let mut sorted = mine;
        sorted.sort_unstable();
        for id in sorted {
            self.finish_assignment(id, Outcome::Lost, "", "", now_ms, 0);
        }
        count
    }

    pub fn executor_running(&self, slot: ExecutorSlot) -> u32 {
        self.executors.get(slot.index()).and_then(Option::as_ref).map_or(0, |e| e.running)
    }
}

#[cfg(test)]
mod tests {
    use crate::policy::testkit::*;

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
}
