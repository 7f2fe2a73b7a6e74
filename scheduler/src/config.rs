//! The scheduler's configuration: one typed struct, loaded from TOML by the `tern` binary.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::bail;
use serde::{Deserialize, Serialize};
use tern_common::config::Serve;

/// Configuration of `tern scheduler`. Read it with `tern_common::config::load`, which lays a file
/// and settings over [`Config::default`], the one place the defaults are written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `listen`: the gRPC service (jobs and executors; `tern up` puts it at its port + 2);
    /// `tls_dir`: serve gRPC over mutual TLS, and use it towards the metadata server;
    /// `trusted_network`: allow plain gRPC on a non-loopback address without TLS.
    #[serde(flatten)]
    pub serve: Serve,
    /// The metadata server the scheduler's jobs use (told to executors).
    pub metadata: String,
    /// The cluster secret, with which the scheduler proves its role to the metadata server (it
    /// registers the Tern job of every queue's tenant). Unset: `cluster.secret` in `tls_dir`;
    /// without either it does not start.
    pub cluster_secret_file: Option<std::path::PathBuf>,
    /// Queue weights by name; queues not listed get `default_queue_weight`.
    pub queues: BTreeMap<String, u32>,
    /// Weight of a queue not listed in `queues`.
    pub default_queue_weight: u32,
    /// How often executors heartbeat.
    pub heartbeat_interval_ms: u64,
    /// An executor silent this long is lost; its running tasks run again elsewhere.
    pub executor_timeout_ms: u64,
    /// Longest a poll is held waiting for work.
    pub max_poll_wait_ms: u64,
    /// Most assignments one poll returns and most results it carries.
    pub max_batch: u32,
    /// Most executors registered at once.
    pub max_executors: u32,
    /// Most tasks running on one executor at once, whatever its resources.
    pub max_tasks_per_executor: u32,
    /// Most unfinished jobs (finished ones are forgotten oldest first beyond `max_finished_jobs`).
    pub max_jobs: u32,
    /// Finished jobs kept for `tern job status`.
    pub max_finished_jobs: u32,
    /// Most tasks of one stage.
    pub max_tasks_per_stage: u32,
    /// Most tasks of all unfinished jobs together.
    pub max_queued_tasks: u64,
    /// Attempts per task when a stage gives none.
    pub default_max_attempts: u32,
    /// First retry delay when a stage gives none, doubled per retry.
    pub default_backoff_ms: u64,
    /// Longest retry delay.
    pub max_backoff_ms: u64,
    /// Lease of each job's Tern job on the metadata server (renewed at a third).
    pub tern_job_lease_ms: u64,
    /// How long a task with a locality hint waits for an executor on its host before it takes
    /// any.
    pub locality_wait_ms: u64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            serve: Serve::on_loopback(tern_common::ports::SCHEDULER, tern_common::ports::SCHEDULER_ADMIN),
            metadata: tern_common::ports::default_metadata(),
            cluster_secret_file: None,
            queues: BTreeMap::from([("default".to_string(), 1)]),
            default_queue_weight: 1,
            heartbeat_interval_ms: 1000,
            executor_timeout_ms: 5000,
            max_poll_wait_ms: 1000,
            max_batch: 1024,
            max_executors: 1024,
            max_tasks_per_executor: 4096,
            max_jobs: 1000,
            max_finished_jobs: 1000,
            max_tasks_per_stage: 100_000,
            max_queued_tasks: 1_000_000,
            default_max_attempts: 4,
            default_backoff_ms: 200,
            max_backoff_ms: 30_000,
            tern_job_lease_ms: 30_000,
            locality_wait_ms: 50,
        }
    }
}

impl Config {
    /// Refuses values the scheduler cannot run with, naming the key.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.heartbeat_interval_ms == 0 || self.heartbeat_interval_ms >= self.executor_timeout_ms {
            bail!(
                "heartbeat_interval_ms = {} must be above 0 and below executor_timeout_ms = {}",
                self.heartbeat_interval_ms,
                self.executor_timeout_ms
            );
        }
        for (key, value) in [
            ("default_queue_weight", u64::from(self.default_queue_weight)),
            ("max_batch", u64::from(self.max_batch)),
            ("max_executors", u64::from(self.max_executors)),
            ("max_tasks_per_executor", u64::from(self.max_tasks_per_executor)),
            ("max_jobs", u64::from(self.max_jobs)),
            ("max_tasks_per_stage", u64::from(self.max_tasks_per_stage)),
            ("max_queued_tasks", self.max_queued_tasks),
            ("default_max_attempts", u64::from(self.default_max_attempts)),
            ("tern_job_lease_ms", self.tern_job_lease_ms),
        ] {
            if value == 0 {
                bail!("{key} must be at least 1");
            }
        }
        for (queue, weight) in &self.queues {
            crate::spec::check_name("queue", queue, 64)?;
            if *weight == 0 {
                bail!("queues.{queue} = 0: a weight is at least 1");
            }
        }
        if self.max_batch > 65_536 {
            bail!("max_batch = {} is above 65536", self.max_batch);
        }
        if self.default_backoff_ms > self.max_backoff_ms {
            bail!("default_backoff_ms = {} is above max_backoff_ms = {}", self.default_backoff_ms, self.max_backoff_ms);
        }
        self.serve.check("gRPC", true)
    }

    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }

    pub fn executor_timeout(&self) -> Duration {
        Duration::from_millis(self.executor_timeout_ms)
    }

    /// The weight of `queue`.
    pub fn queue_weight(&self, queue: &str) -> u32 {
        self.queues.get(queue).copied().unwrap_or(self.default_queue_weight)
    }

    pub fn spec_limits(&self) -> crate::spec::SpecLimits {
        crate::spec::SpecLimits { max_tasks_per_stage: self.max_tasks_per_stage, ..Default::default() }
    }
}
