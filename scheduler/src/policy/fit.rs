//! Whether a task fits an executor's free resources, and on which GPU devices: GPUs are accounted
//! exactly in milli-units per device; a fraction goes to the device with the least room that
//! still fits it (best fit), whole GPUs take free devices. Used for placement, gang trials and
//! the status's "why blocked".

use super::executors::{Executor, Gpu};
use super::ids::JobKey;
use super::{ExecutorSlot, Policy, Res};
use crate::spec::MILLI;

/// GPU devices (by index on the executor) and the milli-units taken on each.
pub(super) type GpuPicks = Vec<(usize, u32)>;

impl Policy {
    /// Resources for task `t` on executor `slot`, with GPU devices chosen; None if it does not fit.
    pub(super) fn fit(&self, slot: ExecutorSlot, key: JobKey, s: usize, t: u32) -> Option<(Res, Vec<(usize, u32)>)> {
        let executor = self.executors[slot.index()].as_ref()?;
        let stage = &self.jobs[&key].stages[s];
        if !executor.runs(stage.operator) || executor.running >= self.config.max_tasks_per_executor {
            return None;
        }
        let task = &stage.tasks[t as usize];
        let res = Res { memory_bytes: task.memory_bytes, ..stage.needs };
        fit_on(executor, res, stage.info.spec.gpu_optional)
    }
}

/// Whether `res` fits on `executor`, and on which GPUs: a fraction on the device with the least
/// room that fits it (best fit, so whole devices stay free for whole-GPU tasks), whole GPUs on
/// fully free devices. A GPU-optional task fits an executor without GPUs on the CPU path.
pub(super) fn fit_on(executor: &Executor, res: Res, gpu_optional: bool) -> Option<(Res, Vec<(usize, u32)>)> {
    if executor.free_cpu < res.cpu_milli || executor.free_memory < res.memory_bytes {
        return None;
    }
    if res.gpu_milli == 0 {
        return Some((res, Vec::new()));
    }
    if executor.gpus.is_empty() && gpu_optional {
        return Some((Res { gpu_milli: 0, ..res }, Vec::new()));
    }
    if res.gpu_milli < MILLI {
        let want = res.gpu_milli as u32;
        let best = executor
            .gpus
            .iter()
            .enumerate()
            .filter(|(_, g)| g.free_milli >= want)
            .min_by_key(|(i, g)| (g.free_milli, *i))?;
        return Some((res, vec![(best.0, want)]));
    }
    let whole = (res.gpu_milli / MILLI) as usize;
    let free: Vec<(usize, u32)> = executor
        .gpus
        .iter()
        .enumerate()
        .filter(|(_, g)| u64::from(g.free_milli) == MILLI)
        .take(whole)
        .map(|(i, _)| (i, MILLI as u32))
        .collect();
    (free.len() == whole).then_some((res, free))
}

pub(super) fn take(executor: &mut Executor, res: Res, gpus: &[(usize, u32)]) {
    executor.free_cpu -= res.cpu_milli;
    executor.free_memory -= res.memory_bytes;
    for &(g, milli) in gpus {
        executor.gpus[g].free_milli -= milli;
    }
    executor.running += 1;
}

/// `e` as it would be with nothing running.
pub(super) fn idle_copy(e: &Executor) -> Executor {
    Executor {
        free_cpu: e.capacity.cpu_milli,
        free_memory: e.capacity.memory_bytes,
        gpus: e.gpus.iter().map(|g| Gpu { address: g.address.clone(), free_milli: MILLI as u32 }).collect(),
        outbox: Vec::new(),
        operators: e.operators.clone(),
        host: String::new(),
        ..*e
    }
}

#[cfg(test)]
mod tests {
    use crate::policy::testkit::*;

    #[test]
    fn fractional_gpus_pack_exactly_with_no_capacity_lost() {
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 64, 2);
        add(&mut p, "big", "q", 3, vec![stage("s", 2, 100, 600)]);
        add(&mut p, "small", "q", 2, vec![stage("s", 2, 100, 400)]);
        let got = p.assign(e, 100, 0);
        assert_eq!(got.len(), 4, "0.6 + 0.4 twice fills two GPUs exactly");
        let ex = p.executors[e.index()].as_ref().unwrap();
        assert!(ex.gpus.iter().all(|g| g.free_milli == 0), "{:?}", ex.gpus);
        let grants: Vec<(String, u32)> = got.iter().map(|a| (a.gpus[0].address.clone(), a.gpus[0].gpu_milli)).collect();
        assert_eq!(grants, [("0".into(), 600), ("1".into(), 600), ("0".into(), 400), ("1".into(), 400)]);
        add(&mut p, "more", "q", 0, vec![stage("s", 1, 100, 1)]);
        assert!(p.assign(e, 100, 0).is_empty(), "no GPU room is left");
        for a in &got {
            p.report(e, &result(a, pb::TaskOutcome::Succeeded), 0, 1);
        }
        // Everything came back; a whole-GPU task and four quarters now share the two devices.
        add(&mut p, "whole", "q", 9, vec![stage("s", 1, 100, 1000)]);
        add(&mut p, "quarters", "q", 8, vec![stage("s", 4, 100, 250)]);
        let got = p.assign(e, 100, 0);
        assert_eq!(got.len(), 5, "{got:?}");
        let ex = p.executors[e.index()].as_ref().unwrap();
        assert!(ex.gpus.iter().all(|g| g.free_milli == 0), "{:?}", ex.gpus);
        assert_eq!(p.pool_counts().backlog_tasks, 1, "the milli-GPU task still waits");
    }

    #[test]
    fn gpu_optional_tasks_run_on_cpu_executors() {
        let mut p = Policy::new(PolicyConfig::default());
        let e = executor(&mut p, "h", 4, 0);
        let mut s = stage("s", 1, MILLI, 250);
        add(&mut p, "strict", "q", 0, vec![s.clone()]);
        assert!(p.assign(e, 1, 0).is_empty(), "a GPU task needs a GPU");
        s.gpu_optional = true;
        add(&mut p, "optional", "q", 0, vec![s]);
        let a = p.assign(e, 1, 0).pop().unwrap();
        assert_eq!((a.job_id.as_str(), a.gpus.len(), a.granted.unwrap().gpu_milli), ("optional", 0, 0));
    }
}
