//! A job's stages in DAG order: a stage starts (its tasks queued) once the stages it waits for have
//! succeeded; it succeeds once `min_success` tasks did (the rest are cancelled), and a failed
//! stage fails its job.

use std::cmp::Reverse;

use tern_proto::sched as pb;

use super::assignments::Running;
use super::ids::JobKey;
use super::jobs::cancel_unfinished;
use super::queues::enqueue;
use super::{Policy, TaskState};

impl Policy {
    pub(super) fn start_stage(&mut self, key: JobKey, s: usize, now_ms: u64) {
        let job = self.jobs.get_mut(&key).expect("job exists");
        job.state = pb::JobState::Running;
        let stage = &mut job.stages[s];
        stage.state = pb::StageState::Running;
        stage.started_ms = now_ms.max(1);
        let n = stage.tasks.len() as u32;
        for t in 0..n {
            enqueue(stage, t, now_ms);
        }
        stage.counts.waiting -= n;
        stage.counts.queued += n;
        self.backlog += u64::from(n);
        // An elastic stage may start with no tasks: nothing to offer yet.
        if n > 0 {
            self.mark_ready(key, s);
        }
    }

    pub(super) fn finish_stage(
        &mut self,
        key: JobKey,
        s: usize,
        succeeded: bool,
        error: String,
        now_ms: u64,
        now_unix_ms: u64,
    ) {
        let job = self.jobs.get_mut(&key).expect("job");
        let stage = &mut job.stages[s];
        if stage.state != pb::StageState::Running {
            return;
        }
        stage.state = if succeeded { pb::StageState::Succeeded } else { pb::StageState::Failed };
        stage.finished_ms = now_ms.max(1);
        // min_success met: the rest are cancelled.
        let mut running = Vec::new();
        cancel_unfinished(stage, &mut running, &mut self.backlog, &mut self.backoff_count);
        stage.ready.clear();
        stage.local.clear();
        job.ready_stages.retain(|&x| x != s);
        if job.ready_stages.is_empty() {
            let sort = (Reverse(job.info.priority), job.seq);
            self.queues[job.queue].ready_jobs.remove(&sort);
        }
        job.unfinished_stages -= 1;
        self.cancel_assignments(running);
        if !succeeded {
            self.finish_job(key, pb::JobState::Failed, error, now_ms, now_unix_ms);
            return;
        }
        if std::mem::take(&mut self.jobs.get_mut(&key).expect("job").stages[s].recomputing) {
            // A recompute round: the stages after it started long ago.
            self.resume_consumers(key, s, now_ms);
        } else {
            let next = self.jobs[&key].stages[s].next.clone();
            for n in next {
                let stage = &mut self.jobs.get_mut(&key).expect("job").stages[n];
                stage.pending_deps -= 1;
                if stage.pending_deps == 0 && stage.state == pb::StageState::Waiting {
                    self.start_stage(key, n, now_ms);
                }
            }
        }
        if self.jobs[&key].unfinished_stages == 0 {
            self.finish_job(key, pb::JobState::Succeeded, String::new(), now_ms, now_unix_ms);
        }
    }

    /// A task succeeded: its stage ends once `min_success` tasks did (or, in a recompute round,
    /// once every task the round queued again is done).
    pub(super) fn task_succeeded(&mut self, run: &Running, now_ms: u64, now_unix_ms: u64) {
        let stage = &mut self.jobs.get_mut(&run.job).expect("job of a running task").stages[run.stage];
        stage.tasks[run.task as usize].state = TaskState::Succeeded;
        stage.counts.succeeded += 1;
        let c = stage.counts;
        // A recompute round ends when every task it queued again is done.
        let done =
            if stage.recomputing { c.queued + c.backoff + c.running == 0 } else { c.succeeded >= stage.min_success };
        if done {
            self.finish_stage(run.job, run.stage, true, String::new(), now_ms, now_unix_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::policy::testkit::*;

    #[test]
    fn stages_run_in_dag_order() {
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 8, 0);
        let mut second = stage("b", 2, MILLI, 0);
        second.after = vec!["a".into()];
        add(&mut p, "j", "q", 0, vec![stage("a", 2, MILLI, 0), second]);
        let first = p.assign(e, 10, 0);
        assert!(first.iter().all(|a| a.stage == "a") && first.len() == 2);
        p.report(e, &result(&first[0], pb::TaskOutcome::Succeeded), 0, 1);
        assert!(p.assign(e, 10, 0).is_empty(), "b waits for all of a");
        p.report(e, &result(&first[1], pb::TaskOutcome::Succeeded), 0, 1);
        let next = p.assign(e, 10, 0);
        assert!(next.iter().all(|a| a.stage == "b") && next.len() == 2);
    }

    #[test]
    fn min_success_ends_the_stage_and_cancels_the_rest() {
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 8, 0);
        let mut s = stage("s", 5, MILLI, 0);
        s.min_success = 3;
        add(&mut p, "j", "q", 0, vec![s]);
        let got = p.assign(e, 10, 0);
        assert_eq!(got.len(), 5);
        for a in &got[..2] {
            p.report(e, &result(a, pb::TaskOutcome::Succeeded), 0, 1);
        }
        assert_eq!(p.job_state("j"), Some(pb::JobState::Running));
        p.report(e, &result(&got[2], pb::TaskOutcome::Succeeded), 0, 1);
        assert_eq!(p.job_state("j"), Some(pb::JobState::Succeeded));
        let events = p.take_events();
        assert!(events.contains(&Event::Cancel {
            executor: e,
            assignments: vec![
                AssignmentId::from_wire(got[3].assignment_id),
                AssignmentId::from_wire(got[4].assignment_id)
            ]
        }));
        assert!(events.contains(&Event::JobFinished { job_id: "j".into(), state: pb::JobState::Succeeded }));
        assert_eq!(p.executor_running(e), 0, "cancelled tasks free their resources");
        assert!(!p.report(e, &result(&got[3], pb::TaskOutcome::Succeeded), 0, 1), "late results are ignored");
    }
}
