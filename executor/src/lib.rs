//! Tern's executor side: what runs tasks the scheduler (`tern-scheduler`) hands out.
//!
//! - [`process`]: `tern executor`, which registers its CPUs, memory and GPUs, pulls batches of
//!   tasks and runs them;
//! - [`operators`]: what a task runs (noop, the TeraSort built-ins on CPU and GPU, any command),
//!   and the executor's contract with them: an error whose chain holds
//!   [`tern_common::OutOfMemory`] is reported as OOM, so the scheduler retries with more memory;
//!   Spark executors among them, from parked JVMs ([`operators::spark_warm`]) when it can;
//! - [`pool`]: the local autoscaler `tern up` runs, starting and stopping executors.

// kill(2) on a command's process group, sysconf(3) for its memory use.
#[allow(unsafe_code)]
pub mod operators;
pub mod pool;
pub mod process;

pub use process::{machine_memory_bytes, run, ExecutorConfig, Exit};
