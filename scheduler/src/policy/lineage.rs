//! Lineage recovery: a task that finds its input lost names the tasks of its producer stage that
//! wrote it; those run again (the producer reopens if it had finished) and the task waits for
//! them, with no attempt counted. A stage reopens at most `MAX_RECOMPUTE_ROUNDS` times.

use tern_proto::sched as pb;

use super::assignments::Running;
use super::ids::JobKey;
use super::queues::enqueue;
use super::{Policy, TaskState};

/// Times a finished stage is reopened to recompute lost output before its job fails (a storage
/// cluster losing the same data over and over will not converge).
pub(super) const MAX_RECOMPUTE_ROUNDS: u32 = 4;

impl Policy {
    /// Lineage recovery for `run`, whose task found the output of tasks `lost` of its stage's
    /// producer lost: those tasks are queued again (the producer reopens if it had finished) and
    /// the task waits for them. `Err` says why that cannot be, and the task then fails.
    pub(super) fn recompute_lost_input(&mut self, run: &Running, lost: &[u32], now_ms: u64) -> Result<(), String> {
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
    pub(super) fn resume_consumers(&mut self, key: JobKey, p: usize, now_ms: u64) {
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
}

#[cfg(test)]
mod tests {
    use super::MAX_RECOMPUTE_ROUNDS;
    use crate::policy::testkit::*;

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
    fn run_until(p: &mut Policy, e: ExecutorSlot, stage: &str, now: u64) -> Vec<pb::Assignment> {
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
}
