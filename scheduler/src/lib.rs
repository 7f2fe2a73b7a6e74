//! Tern's serverless task scheduler: the control plane of jobs and executors. What runs on an
//! executor (the executor process, its operators, the local pool) is `tern-executor`; the GPU
//! code is `tern-gpu`; neither is built here.
//!
//! Its wire-facing API (job specs, operators, the typed client) is `tern-scheduler-api`, which is all
//! that callers of the scheduler depend on.
//!
//! Jobs are DAGs of stages; stages pass data only through Tern shuffles and files, so executors
//! hold no state a later stage needs and may join or leave at any moment.
//! - [`policy`]: placement decisions, pure and deterministic (fair share, gangs, GPUs, retries);
//! - [`server`]: the `tern scheduler` gRPC service around the policy;
//! - [`authz`]: who may make each call of the service;
//! - [`config`]: the scheduler's configuration;
//! - [`metrics`]: the scheduler's Prometheus metrics.

pub mod authz;
pub mod config;
pub mod metrics;
pub mod policy;
pub mod server;

pub use config::Config;
// The job specs as the policy and server name them (`crate::spec`).
use tern_scheduler_api::spec;
