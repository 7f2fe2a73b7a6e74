//! Which ready task of a stage an executor takes: one whose input lives on its host first; a task
//! preferring another host is left to that host for `locality_wait_ms` when an executor there has
//! room, then any executor takes it.

use super::ids::JobKey;
use super::queues::MAX_CANDIDATES;
use super::{ExecutorSlot, Policy, TaskState};

impl Policy {
    /// Takes a ready task of the stage for the executor: one preferring its host first, then the
    /// head of the list, unless that one prefers another host where an executor has room and its
    /// wait is not over. Lists are cleaned lazily: entries of tasks no longer queued are dropped
    /// when met (a task queued again may sit in a list twice; the second entry is then stale).
    pub(super) fn pick_task(&mut self, key: JobKey, s: usize, slot: ExecutorSlot, now_ms: u64) -> Option<u32> {
        let host = self.executors[slot.index()].as_ref().expect("live").host.clone();
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
                    list.iter().any(|&e| self.executors[e.index()].as_ref().is_some_and(|x| x.free_cpu >= cpu))
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
}

#[cfg(test)]
mod tests {
    use crate::policy::testkit::*;

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
}
