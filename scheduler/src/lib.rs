//! Tern's serverless task scheduler and elastic executor pool.
//!
//! Jobs are DAGs of stages; stages pass data only through Tern shuffles and files, so executors
//! hold no state a later stage needs and may join or leave at any moment.
//! - [`spec`]: job files (TOML or JSON) and their validation;
//! - [`policy`]: placement decisions, pure and deterministic (fair share, gangs, GPUs, retries);
//! - [`server`]: the `tern scheduler` gRPC service around the policy;
//! - [`client`]: a typed client for jobs and executors;
//! - [`config`]: the scheduler's configuration;
//! - [`operators`]: what a task runs (noop, TeraSort built-ins on CPU and GPU, any command);
//! - [`executor`]: `tern executor`, which pulls batches of tasks and runs them;
//! - [`pool`]: the local autoscaler `tern up` runs, starting and stopping executors;
//! - [`bench`]: `tern bench scheduler` (dispatch throughput, executor cold start).

// kill(2) on the benchmark's `tern up` child.
#[allow(unsafe_code)]
pub mod bench;
pub mod client;
pub mod config;
pub mod executor;
pub mod metrics;
// kill(2) on a command's process group, sysconf(3) for its memory use.
#[allow(unsafe_code)]
pub mod operators;
pub mod policy;
// prctl(2) and kill(2) on the pool's executor processes.
#[allow(unsafe_code)]
pub mod pool;
pub mod server;
pub mod spec;

pub use client::SchedulerClient;
pub use config::Config;
