//! The scheduler's wire-facing API, apart from its policy and server (as neon's `*_api` crates):
//! whoever only calls the scheduler (the executor and its pool, the Spark library, the benches,
//! `tern job`) depends on this crate, so none of them compiles the placement policy.
//! - [`spec`]: job files (TOML or JSON), turned into the wire's job spec and validated;
//! - [`operator`]: the operators a stage may name, one enum for the scheduler and the executor;
//! - [`client`]: a typed client for jobs and executors.

pub mod client;
pub mod operator;
pub mod spec;

pub use client::SchedulerClient;
pub use operator::{Operator, UnknownOperator};

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
