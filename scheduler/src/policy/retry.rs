//! Failed tasks: retried after a backoff that doubles per failure, up to `max_attempts`; an OOM
//! retry doubles the task's memory up to its stage's `max_memory`. Time is an argument: `tick`
//! moves tasks whose backoff is over back to the queues.

use std::cmp::Reverse;

use super::assignments::Running;
use super::jobs::MAX_STAGE_ERRORS;
use super::{Policy, TaskState};

impl Policy {
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

    /// When the next backoff ends, if any.
    pub fn next_due_ms(&self) -> Option<u64> {
        self.backoff.peek().map(|Reverse((due, ..))| *due)
    }

    /// A task failed (`oom`: ran out of memory): counted against `max_attempts`; below the limit
    /// it runs again after a backoff that doubles per failure (capped at `max_backoff_ms`), and an
    /// OOM doubles its memory up to the stage's `max_memory`. At the limit the task fails, and its
    /// stage (so its job) fails once too few tasks remain to reach `min_success`.
    pub(super) fn task_failed(&mut self, run: &Running, oom: bool, message: &str, now_ms: u64, now_unix_ms: u64) {
        let config_max_backoff = self.config.max_backoff_ms;
        let key = run.job;
        let t = run.task;
        let stage = &mut self.jobs.get_mut(&key).expect("job of a running task").stages[run.stage];
        let task = &mut stage.tasks[t as usize];
        task.failures += 1;
        let what = if oom { "out of memory" } else { "failed" };
        let note = format!(
            "task {t} attempt {}: {what}{}{message}",
            task.runs - 1,
            if message.is_empty() { "" } else { ": " }
        );
        if stage.errors.len() == MAX_STAGE_ERRORS {
            stage.errors.pop_front();
        }
        stage.errors.push_back(note.clone());
        if oom {
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
                let error =
                    format!("stage {:?}: {note} (attempt limit {} reached)", stage.info.spec.name, stage.max_attempts);
                self.finish_stage(key, run.stage, false, error, now_ms, now_unix_ms);
            }
        } else {
            let backoff = stage.backoff_ms.saturating_mul(1u64 << (task.failures - 1).min(20)).min(config_max_backoff);
            task.state = TaskState::Backoff;
            stage.counts.backoff += 1;
            self.backoff_count += 1;
            self.backoff.push(Reverse((now_ms + backoff, key, run.stage, t)));
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::policy::testkit::*;

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
}
