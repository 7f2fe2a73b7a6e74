//! Elastic stages, run by an owner (a Spark driver) rather than to completion: the owner adds and
//! cancels tasks and ends the stage (ScaleStage), adds elastic stages of other needs (AddStage),
//! and hears how each task ended; an ended task never runs again. A job whose owner stops
//! renewing its lease is cancelled.

use tern_proto::sched as pb;

use super::assignments::{Outcome, Running};
use super::ids::JobKey;
use super::jobs::{Task, MAX_STAGE_ERRORS};
use super::{Policy, ScaleError, ScaleOutcome, StageInfo, TaskState};

/// Ended tasks of an elastic stage reported by one ScaleStage call.
const MAX_ENDED_REPORTED: usize = 1024;

impl Policy {
    /// An elastic job's owner adds an elastic stage (a Spark application's executors of another
    /// resource profile), running at once with no tasks. Checked as a submitted job is, with the
    /// job's stages and this one together under `limits`. Returns false, changing nothing, when
    /// the job already has a stage of that name (a retried call).
    pub fn add_stage(
        &mut self,
        job_id: &str,
        spec: pb::StageSpec,
        limits: &crate::spec::SpecLimits,
        now_ms: u64,
    ) -> Result<bool, ScaleError> {
        let key = *self.job_keys.get(job_id).ok_or_else(|| ScaleError::NotFound(format!("no job {job_id}")))?;
        let job = &self.jobs[&key];
        if job.stages.iter().any(|st| st.info.spec.name == spec.name) {
            return Ok(false);
        }
        let at = format!("adding stage {:?} to job {job_id}", spec.name);
        if !matches!(job.state, pb::JobState::Pending | pb::JobState::Running) {
            return Err(ScaleError::Invalid(format!("{at}: the job is {:?}", job.state)));
        }
        if !spec.elastic || !job.stages.iter().all(|st| st.info.spec.elastic) {
            return Err(ScaleError::Invalid(format!("{at}: only elastic stages join a job, and only an elastic one")));
        }
        if spec.tasks != 0 {
            return Err(ScaleError::Invalid(format!(
                "{at}: tasks = {}; a new stage starts with 0 (add queues)",
                spec.tasks
            )));
        }
        let whole = pb::JobSpec {
            name: job.info.name.clone(),
            queue: job.info.queue.clone(),
            stages: job.stages.iter().map(|st| st.info.spec.clone()).chain([spec.clone()]).collect(),
            ..Default::default()
        };
        crate::spec::validate(&whole, limits).map_err(|e| ScaleError::Invalid(format!("{at}: {e:#}")))?;
        let stage = self.new_stage(StageInfo {
            spec,
            input_shuffle_id: 0,
            input_partitions: 0,
            input_maps: 0,
            output_shuffle_id: 0,
            output_partitions: 0,
            hosts: Vec::new(),
        });
        let job = self.jobs.get_mut(&key).expect("job");
        job.stages.push(stage);
        job.unfinished_stages += 1;
        let s = job.stages.len() - 1;
        self.start_stage(key, s, now_ms);
        Ok(true)
    }

    /// An elastic stage's owner: adds `add` tasks (new indexes), cancels the tasks in `cancel`
    /// (queued ones dropped, running ones told to stop), ends the stage when `finish` (the job
    /// succeeds), and reports ended tasks from `ended_from` on. A finished job changes nothing
    /// and says its state. `max_tasks` bounds the stage's tasks over its whole life.
    #[allow(clippy::too_many_arguments)]
    pub fn scale_stage(
        &mut self,
        job_id: &str,
        stage_name: &str,
        add: u32,
        cancel: &[u32],
        finish: bool,
        ended_from: u32,
        max_tasks: u32,
        now_ms: u64,
        now_unix_ms: u64,
    ) -> Result<ScaleOutcome, ScaleError> {
        let key = *self.job_keys.get(job_id).ok_or_else(|| ScaleError::NotFound(format!("no job {job_id}")))?;
        let job = &self.jobs[&key];
        let s = job
            .stages
            .iter()
            .position(|st| st.info.spec.name == stage_name)
            .ok_or_else(|| ScaleError::NotFound(format!("job {job_id} has no stage {stage_name:?}")))?;
        let stage = &job.stages[s];
        if !stage.info.spec.elastic {
            return Err(ScaleError::Invalid(format!("stage {stage_name:?} of job {job_id} is not elastic")));
        }
        let total = stage.tasks.len() as u64 + u64::from(add);
        if total > u64::from(max_tasks) {
            return Err(ScaleError::Invalid(format!(
                "stage {stage_name:?} of job {job_id} would have {total} tasks in its life; at most {max_tasks}"
            )));
        }
        if let Some(&bad) = cancel.iter().find(|&&t| t as usize >= stage.tasks.len()) {
            return Err(ScaleError::Invalid(format!("stage {stage_name:?} of job {job_id} has no task {bad}")));
        }
        let mut added = Vec::new();
        if let Some((lease, deadline)) = self.leases.get_mut(&key) {
            *deadline = now_ms + *lease;
        }
        if stage.state == pb::StageState::Running {
            let stage = &mut self.jobs.get_mut(&key).expect("job").stages[s];
            for _ in 0..add {
                let t = stage.tasks.len() as u32;
                stage.tasks.push(Task {
                    state: TaskState::Queued,
                    runs: 0,
                    failures: 0,
                    memory_bytes: stage.needs.memory_bytes,
                    queued_at_ms: now_ms,
                    assignment: None,
                });
                stage.ready.push_back(t);
                stage.counts.queued += 1;
                added.push(t);
            }
            self.backlog += u64::from(add);
            let mut stop = Vec::new();
            for &t in cancel {
                let task = &mut stage.tasks[t as usize];
                match task.state {
                    TaskState::Queued => self.backlog -= 1,
                    TaskState::Running => stop.extend(task.assignment),
                    _ => continue,
                }
                *stage.counts.get(task.state) -= 1;
                task.state = TaskState::Cancelled;
                stage.counts.cancelled += 1;
                stage.ended.push(pb::ElasticTaskEnd {
                    task_index: t,
                    outcome: pb::TaskOutcome::Lost as i32,
                    message: "cancelled".into(),
                });
            }
            self.cancel_assignments(stop);
            if add > 0 {
                self.mark_ready(key, s);
            }
            self.unready_if_empty(key, s);
            if finish {
                self.finish_stage(key, s, true, String::new(), now_ms, now_unix_ms);
            }
        }
        let job = &self.jobs[&key];
        let stage = &job.stages[s];
        let from = (ended_from as usize).min(stage.ended.len());
        let ended: Vec<pb::ElasticTaskEnd> = stage.ended[from..].iter().take(MAX_ENDED_REPORTED).cloned().collect();
        Ok(ScaleOutcome {
            ended_next: (from + ended.len()) as u32,
            added,
            ended,
            state: job.state,
            queued: stage.counts.queued,
            running: stage.counts.running,
        })
    }

    /// Cancels jobs whose elastic stage's owner stopped calling ScaleStage for its lease.
    /// Returns how many. Cost: one look per leased job (few: one per running Spark application).
    pub fn expire_leases(&mut self, now_ms: u64, now_unix_ms: u64) -> u32 {
        let expired: Vec<(JobKey, u64)> =
            self.leases.iter().filter(|(_, &(_, deadline))| deadline <= now_ms).map(|(&k, &(l, _))| (k, l)).collect();
        for &(key, lease) in &expired {
            let error = format!("its owner did not renew its lease for {lease} ms (the Spark driver is gone?)");
            self.finish_job(key, pb::JobState::Cancelled, error, now_ms, now_unix_ms);
        }
        expired.len() as u32
    }

    /// A task of an elastic stage ended: it never runs again (its owner replaces it if it still
    /// wants one); the owner hears how it ended at its next ScaleStage.
    pub(super) fn end_elastic_task(&mut self, run: &Running, outcome: Outcome, message: &str) {
        let t = run.task;
        let stage = &mut self.jobs.get_mut(&run.job).expect("job of a running task").stages[run.stage];
        let (state, code) = match outcome {
            Outcome::Succeeded => (TaskState::Succeeded, pb::TaskOutcome::Succeeded),
            Outcome::Failed => (TaskState::Failed, pb::TaskOutcome::Failed),
            Outcome::Oom => (TaskState::Failed, pb::TaskOutcome::Oom),
            Outcome::Lost => (TaskState::Cancelled, pb::TaskOutcome::Lost),
            Outcome::InputLost(_) => unreachable!("turned into a failure above"),
        };
        if outcome == Outcome::Lost {
            stage.lost += 1;
        }
        stage.tasks[t as usize].state = state;
        *stage.counts.get(state) += 1;
        let message = if message.is_empty() && outcome == Outcome::Lost { "its executor was lost" } else { message };
        stage.ended.push(pb::ElasticTaskEnd { task_index: t, outcome: code as i32, message: message.to_string() });
        if matches!(outcome, Outcome::Failed | Outcome::Oom) {
            if stage.errors.len() == MAX_STAGE_ERRORS {
                stage.errors.pop_front();
            }
            stage.errors.push_back(format!("task {t}: {message}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::spec::SpecLimits;

    use crate::policy::testkit::*;

    #[test]
    fn elastic_stages_grow_shrink_report_ended_tasks_and_end_when_told() {
        let mut p = Policy::new(PolicyConfig::default());
        let e0 = executor(&mut p, "h0", 2, 0);
        let mut s = stage("executors", 0, MILLI, 0);
        s.elastic = true;
        add(&mut p, "app", "q", 0, vec![s]);
        assert_eq!(p.job_state("app"), Some(pb::JobState::Running));
        assert!(p.assign(e0, 10, 0).is_empty(), "no tasks yet");
        let scale = |p: &mut Policy, add: u32, cancel: &[u32], finish: bool, from: u32| {
            p.scale_stage("app", "executors", add, cancel, finish, from, 8, 1, 1).unwrap()
        };
        let out = scale(&mut p, 3, &[], false, 0);
        assert_eq!(out.added, [0, 1, 2]);
        let placed = p.assign(e0, 10, 1);
        assert_eq!(placed.iter().map(|a| a.task_index).collect::<Vec<_>>(), [0, 1], "two fit on 2 CPUs");
        assert_eq!(placed[0].task_count, 3);
        // Task 2 is still queued: cancelling it drops it; cancelling 0 stops its run.
        let out = scale(&mut p, 0, &[2, 0], false, 0);
        assert_eq!((out.queued, out.running, out.ended.len()), (0, 1, 2));
        assert_eq!(p.pool_counts().backlog_tasks, 0);
        assert!(p.take_events().contains(&Event::Cancel {
            executor: e0,
            assignments: vec![AssignmentId::from_wire(placed[0].assignment_id)]
        }));
        // A task that fails or whose executor is lost is never run again; the owner hears why.
        p.report(e0, &pb::TaskResult { message: "exit 137".into(), ..result(&placed[1], pb::TaskOutcome::Oom) }, 2, 1);
        let out = scale(&mut p, 1, &[], false, 2);
        assert_eq!(out.ended.len(), 1);
        assert_eq!(
            (out.ended[0].task_index, out.ended[0].outcome(), out.ended[0].message.as_str()),
            (1, pb::TaskOutcome::Oom, "exit 137")
        );
        assert_eq!((out.added.as_slice(), out.ended_next), (&[3][..], 3));
        let again = p.assign(e0, 10, 3);
        assert_eq!(again.iter().map(|a| (a.task_index, a.attempt)).collect::<Vec<_>>(), [(3, 0)]);
        p.remove_executor(e0, 4);
        let out = scale(&mut p, 0, &[], false, 3);
        assert_eq!((out.ended[0].task_index, out.ended[0].outcome()), (3, pb::TaskOutcome::Lost));
        assert_eq!(p.pool_counts().backlog_tasks, 0, "a lost elastic task is not queued again");
        // Bounded over the stage's life, and only elastic stages scale.
        assert!(matches!(
            p.scale_stage("app", "executors", 5, &[], false, 0, 8, 1, 1),
            Err(ScaleError::Invalid(m)) if m.contains("at most 8")
        ));
        assert!(matches!(p.scale_stage("app", "executors", 0, &[9], false, 0, 8, 1, 1), Err(ScaleError::Invalid(_))));
        assert!(matches!(p.scale_stage("nope", "executors", 1, &[], false, 0, 8, 1, 1), Err(ScaleError::NotFound(_))));
        let out = scale(&mut p, 0, &[], true, 4);
        assert_eq!(out.state, pb::JobState::Succeeded);
        assert_eq!(p.expire_leases(u64::MAX, 1), 0, "no lease was asked for");
        let out = scale(&mut p, 2, &[], false, 4);
        assert!(out.added.is_empty(), "a finished job takes no tasks");
    }

    #[test]
    fn an_elastic_job_whose_owner_stops_renewing_is_cancelled() {
        let mut p = Policy::new(PolicyConfig::default());
        let e0 = executor(&mut p, "h0", 2, 0);
        let mut s = stage("executors", 1, MILLI, 0);
        s.elastic = true;
        s.lease_ms = 1000;
        add(&mut p, "app", "q", 0, vec![s]);
        let placed = p.assign(e0, 10, 0);
        assert_eq!(placed.len(), 1);
        // Each ScaleStage call renews it.
        p.scale_stage("app", "executors", 0, &[], false, 0, 8, 900, 1).unwrap();
        assert_eq!(p.expire_leases(1800, 1), 0);
        p.take_events();
        assert_eq!(p.expire_leases(1900, 1), 1);
        let status = p.job_status("app", false).unwrap();
        assert_eq!(status.state(), pb::JobState::Cancelled);
        assert!(status.error.contains("did not renew its lease"), "{}", status.error);
        assert!(p.take_events().contains(&Event::Cancel {
            executor: e0,
            assignments: vec![AssignmentId::from_wire(placed[0].assignment_id)]
        }));
        assert_eq!(p.expire_leases(u64::MAX, 1), 0, "expired once");
    }

    #[test]
    fn an_elastic_job_gains_stages_of_other_needs_and_ends_when_all_are_finished() {
        let mut p = Policy::new(PolicyConfig::default());
        let e0 = executor(&mut p, "h0", 4, 1);
        let mut s = stage("executors", 1, MILLI, 0);
        s.elastic = true;
        add(&mut p, "app", "q", 0, vec![s]);
        let limits = SpecLimits { max_stages: 3, ..SpecLimits::default() };
        let mut big = stage("executors-rp1", 0, 2 * MILLI, MILLI);
        big.elastic = true;
        assert_eq!(p.add_stage("app", big.clone(), &limits, 1), Ok(true));
        assert_eq!(p.add_stage("app", big.clone(), &limits, 1), Ok(false), "a retried call changes nothing");
        let out = p.scale_stage("app", "executors-rp1", 2, &[], false, 0, 8, 2, 1).unwrap();
        assert_eq!(out.added, [0, 1], "the new stage's own indexes");
        let placed = p.assign(e0, 10, 2);
        let mut granted: Vec<(String, u64, u64)> = placed
            .iter()
            .map(|a| (a.stage.clone(), a.granted.unwrap().cpu_milli, a.granted.unwrap().gpu_milli))
            .collect();
        granted.sort();
        // 4 CPUs, 1 GPU: the default stage's task and one of the profile's (2 CPUs, the GPU).
        assert_eq!(granted, [("executors".into(), MILLI, 0), ("executors-rp1".into(), 2 * MILLI, MILLI)]);
        let status = p.job_status("app", true).unwrap();
        let needs: Vec<_> = status.stages.iter().map(|st| (st.name.as_str(), st.needs.unwrap().cpu_milli)).collect();
        assert_eq!(needs, [("executors", MILLI), ("executors-rp1", 2 * MILLI)]);
        // Refused: tasks at creation, a stage past the limit, a non-elastic stage.
        let mut more = big.clone();
        more.name = "x".into();
        more.tasks = 1;
        let e = p.add_stage("app", more.clone(), &limits, 3).unwrap_err();
        assert!(matches!(&e, ScaleError::Invalid(m) if m.contains("starts with 0")), "{e:?}");
        more.tasks = 0;
        assert_eq!(p.add_stage("app", more.clone(), &limits, 3), Ok(true));
        more.name = "y".into();
        let e = p.add_stage("app", more.clone(), &limits, 3).unwrap_err();
        assert!(matches!(&e, ScaleError::Invalid(m) if m.contains("at most 3")), "{e:?}");
        more.elastic = false;
        assert!(matches!(p.add_stage("app", more, &limits, 3), Err(ScaleError::Invalid(_))));
        // The job succeeds once its owner finished every stage.
        for (i, name) in ["executors", "x", "executors-rp1"].into_iter().enumerate() {
            let out = p.scale_stage("app", name, 0, &[], true, 0, 8, 4, 1).unwrap();
            let want = if i < 2 { pb::JobState::Running } else { pb::JobState::Succeeded };
            assert_eq!(out.state, want, "after finishing {name}");
        }
        let mut late = big;
        late.name = "z".into();
        assert!(matches!(p.add_stage("app", late, &limits, 5), Err(ScaleError::Invalid(_))), "a finished job");
        let mut plain = stage("s", 1, MILLI, 0);
        add(&mut p, "batch", "q", 0, vec![plain.clone()]);
        plain.name = "t".into();
        plain.tasks = 0;
        plain.elastic = true;
        assert!(matches!(p.add_stage("batch", plain, &limits, 5), Err(ScaleError::Invalid(_))), "not an elastic job");
    }
}
