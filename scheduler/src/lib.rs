//! Tern's serverless task scheduler: the control plane of jobs and executors. What runs on an
//! executor (the executor process, its operators, the local pool) is `tern-executor`; the GPU
//! code is `tern-gpu`; neither is built here.
//!
//! Jobs are DAGs of stages; stages pass data only through Tern shuffles and files, so executors
//! hold no state a later stage needs and may join or leave at any moment.
//! - [`spec`]: job files (TOML or JSON) and their validation;
//! - [`policy`]: placement decisions, pure and deterministic (fair share, gangs, GPUs, retries);
//! - [`server`]: the `tern scheduler` gRPC service around the policy;
//! - [`client`]: a typed client for jobs and executors;
//! - [`config`]: the scheduler's configuration;
//! - [`metrics`]: the scheduler's Prometheus metrics.

pub mod client;
pub mod config;
pub mod metrics;
pub mod policy;
pub mod server;
pub mod spec;

pub use client::SchedulerClient;
pub use config::Config;

/// The prefix of the Spark master URL that names this scheduler to spark-submit and pyspark
/// (spark-submit 3.5 takes only masters starting yarn, spark, mesos, k8s or local, and Spark serves
/// non-default resource profiles only on masters starting spark:// or local-cluster; Tern's
/// cluster manager, `TernClusterManager.ALIAS` in spark-shuffle's Java, takes this one). The one
/// place Rust spells it.
pub const SPARK_MASTER_PREFIX: &str = "local-cluster-tern://";

/// The Spark master URL of the scheduler at `addr` (HOST:PORT).
pub fn spark_master_url(addr: &str) -> String {
    format!("{SPARK_MASTER_PREFIX}{addr}")
}
