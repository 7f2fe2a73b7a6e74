//! What the policy's unit tests share: a stage spec, a job added as the server adds one (validated
//! first), an executor, a task result, queue weights; and the names every test uses.

pub(super) use tern_proto::sched as pb;

pub(super) use super::{AssignmentId, Event, ExecutorSlot, Policy, PolicyConfig, ScaleError};
use super::{JobInfo, Res, StageInfo};
pub(super) use crate::spec::MILLI;
use crate::spec::{validate, SpecLimits};

pub(super) const GIB: u64 = 1 << 30;

pub(super) fn stage(name: &str, tasks: u32, cpu_milli: u64, gpu_milli: u64) -> pb::StageSpec {
    pb::StageSpec {
        name: name.into(),
        operator: Some(pb::Operator { name: "noop".into(), ..Default::default() }),
        tasks,
        needs: Some(pb::Resources { cpu_milli, memory_bytes: GIB, gpu_milli }),
        ..Default::default()
    }
}

pub(super) fn add(policy: &mut Policy, id: &str, queue: &str, priority: i32, stages: Vec<pb::StageSpec>) {
    let spec = pb::JobSpec { name: id.into(), queue: queue.into(), priority, stages, ..Default::default() };
    let dag = validate(&spec, &SpecLimits::default()).unwrap();
    let infos = spec
        .stages
        .iter()
        .map(|s| StageInfo {
            spec: s.clone(),
            input_shuffle_id: 0,
            input_partitions: 0,
            input_maps: 0,
            output_shuffle_id: 0,
            output_partitions: 0,
            hosts: s.locality.clone(),
        })
        .collect();
    let info = JobInfo {
        job_id: id.into(),
        name: id.into(),
        queue: queue.into(),
        priority,
        tern_job_id: String::new(),
        tern_job_root: String::new(),
        tern_job_token: String::new(),
        tenant_credential: String::new(),
        copies: 1,
        submitted_unix_ms: 1,
    };
    policy.add_job(info, infos, &dag, 0);
}

pub(super) fn executor(policy: &mut Policy, host: &str, cpus: u64, gpus: usize) -> ExecutorSlot {
    let addresses: Vec<String> = (0..gpus).map(|g| g.to_string()).collect();
    policy.add_executor(host, Res { cpu_milli: cpus * MILLI, memory_bytes: 64 * GIB, gpu_milli: 0 }, &addresses, &[])
}

pub(super) fn result(a: &pb::Assignment, outcome: pb::TaskOutcome) -> pb::TaskResult {
    pb::TaskResult { assignment_id: a.assignment_id, outcome: outcome as i32, ..Default::default() }
}

pub(super) fn weights(w: &[(&str, u32)]) -> PolicyConfig {
    PolicyConfig {
        queue_weights: w.iter().map(|(q, n)| (q.to_string(), *n)).collect(),
        default_backoff_ms: 100,
        ..PolicyConfig::default()
    }
}
