//! The scheduler's Prometheus metrics: backlog and running tasks for external autoscalers, the
//! executors, each queue's share, and dispatch counters. Gauges are refreshed from the policy by
//! the server's ticker; counters are bumped where things happen.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use crate::policy::{PoolCounts, QueueShare};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabel {
    pub queue: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: String,
}

#[derive(Clone, Default)]
pub struct Metrics {
    pub backlog_tasks: Gauge,
    pub backoff_tasks: Gauge,
    pub running_tasks: Gauge,
    pub executors: Gauge,
    pub idle_executors: Gauge,
    pub active_jobs: Gauge,
    pub dispatched: Counter,
    pub results: Family<OutcomeLabel, Counter>,
    pub executors_lost: Counter,
    pub jobs_submitted: Counter,
    pub queue_share: Family<QueueLabel, Gauge<f64, AtomicU64>>,
    pub queue_weight: Family<QueueLabel, Gauge>,
    pub queue_dispatched: Family<QueueLabel, Gauge>,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Metrics {
        let m = Metrics::default();
        let r = registry.sub_registry_with_prefix("tern_scheduler");
        r.register("backlog_tasks", "Tasks ready to run but not placed", m.backlog_tasks.clone());
        r.register("backoff_tasks", "Tasks waiting out a retry backoff", m.backoff_tasks.clone());
        r.register("running_tasks", "Tasks running on executors", m.running_tasks.clone());
        r.register("executors", "Registered live executors", m.executors.clone());
        r.register("idle_executors", "Executors running no task", m.idle_executors.clone());
        r.register("active_jobs", "Jobs not finished", m.active_jobs.clone());
        r.register("dispatched_tasks", "Task attempts handed to executors", m.dispatched.clone());
        r.register("task_results", "Task results reported, by outcome", m.results.clone());
        r.register("executors_lost", "Executors declared lost after missing heartbeats", m.executors_lost.clone());
        r.register("jobs_submitted", "Jobs accepted", m.jobs_submitted.clone());
        r.register("queue_share", "Dominant share of the cluster held by each queue (0 to 1)", m.queue_share.clone());
        r.register("queue_weight", "Configured weight of each queue", m.queue_weight.clone());
        r.register("queue_dispatched_tasks", "Task attempts dispatched per queue", m.queue_dispatched.clone());
        m
    }

    /// Sets the gauges from the policy's counts.
    pub fn refresh(&self, pool: &PoolCounts, queues: &[QueueShare]) {
        self.backlog_tasks.set(pool.backlog_tasks as i64);
        self.backoff_tasks.set(pool.backoff_tasks as i64);
        self.running_tasks.set(pool.running_tasks as i64);
        self.executors.set(i64::from(pool.executors));
        self.idle_executors.set(i64::from(pool.idle_executors));
        self.active_jobs.set(i64::from(pool.active_jobs));
        for q in queues {
            let label = QueueLabel { queue: q.name.clone() };
            self.queue_share.get_or_create(&label).set(q.dominant_share);
            self.queue_weight.get_or_create(&label).set(i64::from(q.weight));
            self.queue_dispatched.get_or_create(&label).set(q.dispatched as i64);
        }
    }
}
