//! Operators: what one task of a stage runs on an executor.
//!
//! Built-ins: `noop` (nothing; for dispatch benchmarks and tests), `teragen`, `terasort-map`,
//! `terasort-reduce` (CPU) and `terasort-reduce-gpu` (tern-gpu, with a CPU path when no GPU is
//! usable and the stage is `gpu_optional`); and `command`, any executable. The TeraSort built-ins
//! call the very per-task functions `tern terasort` runs (`tern_terasort::tasks`), so the two
//! sorts are one definition.
//!
//! Out of memory is the executor's contract with every operator: an error with
//! [`tern_common::OutOfMemory`] in its chain is reported OOM (the scheduler retries the task with
//! more memory), any other error failed. Operators turn their own kinds of it (a GPU's) into it.
//! An [`InputLost`] in the chain names the producing tasks whose output the task found lost; the
//! scheduler runs those again, then the task (lineage recovery).
//!
//! Operators keep no state a later stage needs: they read their input from Tern (a shuffle or
//! files) and write their output there.

mod command;
mod noop;
mod spark;
pub mod spark_warm;
mod terasort;

use std::collections::HashMap;
use std::sync::Arc;

use tern_client::{Client, ClientOptions};
use tern_common::{InputLost, OutOfMemory};
use tern_gpu::{GpuError, GpuSorter};
use tern_proto::sched as pb;

pub use command::{process_tree_rss_bytes, MEMORY_CHECK_INTERVAL};

use tern_scheduler_api::Operator;

/// How a task ended, as the executor reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub outcome: pb::TaskOutcome,
    /// Why it failed, or a note on success (which path ran and why, counts).
    pub message: String,
    /// Which path ran: "cpu", or "gpu:<address>".
    pub path: String,
    /// With [`pb::TaskOutcome::InputLost`]: the producing tasks whose output is lost.
    pub lost_inputs: Vec<u32>,
}

impl Report {
    fn new(outcome: pb::TaskOutcome, message: impl Into<String>) -> Report {
        Report { outcome, message: message.into(), path: "cpu".into(), lost_inputs: Vec::new() }
    }

    fn succeeded(message: impl Into<String>) -> Report {
        Report::new(pb::TaskOutcome::Succeeded, message)
    }

    fn failed(message: impl Into<String>) -> Report {
        Report::new(pb::TaskOutcome::Failed, message)
    }

    fn oom(message: impl Into<String>) -> Report {
        Report::new(pb::TaskOutcome::Oom, message)
    }

    /// An operator's error: [`OutOfMemory`] anywhere in its chain becomes OOM, so the scheduler
    /// retries with more memory; [`InputLost`] has the lost producers run again; anything else
    /// is a failure.
    fn from_error(e: anyhow::Error) -> Report {
        if OutOfMemory::is_in(&e) {
            Report::oom(format!("{e:#}"))
        } else if let Some(lost) = InputLost::find_in(&e) {
            Report { lost_inputs: lost.tasks.clone(), ..Report::new(pb::TaskOutcome::InputLost, format!("{e:#}")) }
        } else {
            Report::failed(format!("{e:#}"))
        }
    }
}

/// What the operators of one executor share: the Tern client (connected on first use, so
/// an executor running only `noop` or `command` never connects) and one sorter per GPU (its
/// kernels are compiled once, not per task), and the parked Spark executor JVMs.
pub struct Services {
    metadata: String,
    /// This executor's host, as it registered (Spark executors announce it to their driver).
    host: String,
    options: ClientOptions,
    /// A Tern client per tenant credential the scheduler handed out (at most
    /// [`MAX_TENANT_CLIENTS`]): a task acts for its own tenant, with its job's token.
    clients: parking_lot::Mutex<HashMap<String, Arc<tokio::sync::OnceCell<Client>>>>,
    sorters: parking_lot::Mutex<HashMap<String, Arc<parking_lot::Mutex<GpuSorter>>>>,
    warm_spark: spark_warm::WarmJvms,
}

impl Services {
    pub fn new(metadata: String, options: ClientOptions) -> Services {
        Services {
            metadata,
            host: "localhost".into(),
            options,
            clients: Default::default(),
            sorters: Default::default(),
            warm_spark: spark_warm::WarmJvms::new(0),
        }
    }

    /// Keeps up to `limit` Spark executor JVMs parked ([`spark_warm`]; 0, the default: none).
    pub fn with_warm_spark_executors(mut self, limit: usize) -> Services {
        self.warm_spark = spark_warm::WarmJvms::new(limit);
        self
    }

    /// The parked Spark executor JVMs.
    pub fn warm_spark(&self) -> &spark_warm::WarmJvms {
        &self.warm_spark
    }

    /// The host this executor registered with (default "localhost").
    pub fn with_host(mut self, host: &str) -> Services {
        self.host = host.to_string();
        self
    }

    pub fn host(&self) -> &str {
        &self.host
    }

    /// The metadata server's address, as tasks see it (`TERN_METADATA`).
    pub fn metadata(&self) -> &str {
        &self.metadata
    }

    /// The Tern client acting for `task`'s tenant (its `tenant_credential`; none: the options'
    /// own), connecting on first use, and holding the token of the task's Tern job (its files
    /// and data frames need it).
    pub async fn client_for(&self, task: &pb::Assignment) -> anyhow::Result<Client> {
        let cell = {
            let mut clients = self.clients.lock();
            if clients.len() >= MAX_TENANT_CLIENTS && !clients.contains_key(&task.tenant_credential) {
                // A tenant not seen for a while: its client goes when its running tasks drop it.
                let some = clients.keys().next().cloned().unwrap_or_default();
                clients.remove(&some);
            }
            clients.entry(task.tenant_credential.clone()).or_default().clone()
        };
        let mut options = self.options.clone();
        if !task.tenant_credential.is_empty() {
            options.credential = Some(task.tenant_credential.clone());
        }
        let client = cell
            .get_or_try_init(|| Client::connect_with(&self.metadata, options))
            .await
            .map_err(|e| anyhow::anyhow!("connecting to the metadata server {}: {e}", self.metadata))?
            .clone();
        if !task.tern_job_token.is_empty() {
            client
                .add_job_token(&task.tern_job_token)
                .map_err(|e| anyhow::anyhow!("the token of Tern job {}: {e}", task.tern_job_id))?;
        }
        Ok(client)
    }

    /// The sorter of the GPU at `address`, opened on first use. Tasks sharing a GPU (fractions
    /// of it) take turns sorting on it.
    fn sorter(&self, address: &str) -> Result<Arc<parking_lot::Mutex<GpuSorter>>, GpuError> {
        if let Some(sorter) = self.sorters.lock().get(address) {
            return Ok(sorter.clone());
        }
        // Opened outside the lock: compiling the kernels takes a while.
        let sorter = Arc::new(parking_lot::Mutex::new(GpuSorter::open(address)?));
        Ok(self.sorters.lock().entry(address.to_string()).or_insert(sorter).clone())
    }
}

/// Most tenants whose Tern clients an executor keeps at once.
const MAX_TENANT_CLIENTS: usize = 64;

/// Runs one task to its end. Never panics on bad input: a malformed task fails with a message
/// naming what is wrong.
pub async fn run(task: &pb::Assignment, services: &Services) -> Report {
    let name = task.operator.as_ref().map(|o| o.name.as_str()).unwrap_or_default();
    let operator = match name.parse::<Operator>() {
        Ok(operator) => operator,
        Err(e) => return Report::failed(e.to_string()),
    };
    let result = match operator {
        Operator::Noop => noop::run(task).await,
        Operator::Teragen => terasort::teragen(task, services).await,
        Operator::TerasortMap => terasort::map(task, services).await,
        Operator::TerasortReduce => terasort::reduce(task, services, false).await,
        Operator::TerasortReduceGpu => terasort::reduce(task, services, true).await,
        Operator::Command => return command::run(task, services).await,
        Operator::SparkExecutor => return spark::run(task, services).await,
    };
    result.unwrap_or_else(Report::from_error)
}

/// The environment of a task: the contract every `command` task sees (and built-ins log).
///
/// TERN_JOB_ID, TERN_STAGE, TERN_TASK_INDEX, TERN_TASK_COUNT, TERN_ATTEMPT, TERN_METADATA,
/// TERN_INPUT and TERN_OUTPUT (a shuffle id when a shuffle, else the path), TERN_INPUT_SHUFFLE
/// and TERN_OUTPUT_SHUFFLE (only when shuffles), TERN_INPUT_PARTITIONS/TERN_OUTPUT_PARTITIONS
/// (with the shuffles), TERN_INPUT_MAPS (maps of the input shuffle), TERN_GPU_ADDRESSES
/// (comma-separated, "" when none), TERN_GPU_MILLI (the fraction of each, comma-separated),
/// TERN_JOB_ROOT and TERN_TERN_JOB (the Tern job owning the job's data), TERN_JOB_TOKEN (its
/// token: a Tern client connecting in the task picks it up), TERN_CREDENTIAL (a client
/// credential of the job's tenant, which such a client acts with: files the task makes outside
/// its job's root are its tenant's), TERN_MEMORY_BYTES and
/// TERN_CPU_MILLI (what the task was granted); with GPUs granted, CUDA_VISIBLE_DEVICES (the
/// granted addresses: a CUDA program in the task sees only its devices).
pub fn task_env(task: &pb::Assignment, metadata: &str) -> Vec<(&'static str, String)> {
    let granted = task.granted.unwrap_or_default();
    let mut env = vec![
        ("TERN_JOB_ID", task.job_id.clone()),
        ("TERN_STAGE", task.stage.clone()),
        ("TERN_TASK_INDEX", task.task_index.to_string()),
        ("TERN_TASK_COUNT", task.task_count.to_string()),
        ("TERN_ATTEMPT", task.attempt.to_string()),
        ("TERN_METADATA", metadata.to_string()),
        ("TERN_INPUT", data_ref(task.input_shuffle_id, &task.input_path)),
        ("TERN_OUTPUT", data_ref(task.output_shuffle_id, &task.output_path)),
        ("TERN_GPU_ADDRESSES", gpu_addresses(task)),
        ("TERN_GPU_MILLI", task.gpus.iter().map(|g| g.gpu_milli.to_string()).collect::<Vec<_>>().join(",")),
        ("TERN_JOB_ROOT", task.tern_job_root.clone()),
        ("TERN_TERN_JOB", task.tern_job_id.clone()),
        ("TERN_JOB_TOKEN", task.tern_job_token.clone()),
        ("TERN_CREDENTIAL", task.tenant_credential.clone()),
        ("TERN_MEMORY_BYTES", granted.memory_bytes.to_string()),
        ("TERN_CPU_MILLI", granted.cpu_milli.to_string()),
    ];
    if !task.gpus.is_empty() {
        env.push(("CUDA_VISIBLE_DEVICES", gpu_addresses(task)));
    }
    if task.input_shuffle_id != 0 {
        env.push(("TERN_INPUT_SHUFFLE", task.input_shuffle_id.to_string()));
        env.push(("TERN_INPUT_PARTITIONS", task.input_partitions.to_string()));
        env.push(("TERN_INPUT_MAPS", task.input_maps.to_string()));
    }
    if task.output_shuffle_id != 0 {
        env.push(("TERN_OUTPUT_SHUFFLE", task.output_shuffle_id.to_string()));
        env.push(("TERN_OUTPUT_PARTITIONS", task.output_partitions.to_string()));
    }
    env
}

/// The granted GPUs' addresses, comma-separated.
fn gpu_addresses(task: &pb::Assignment) -> String {
    task.gpus.iter().map(|g| g.address.as_str()).collect::<Vec<_>>().join(",")
}

fn data_ref(shuffle: u64, path: &str) -> String {
    if shuffle != 0 {
        shuffle.to_string()
    } else {
        path.to_string()
    }
}

/// A parameter of the task's operator, parsed, or `None` when absent.
fn param<T: std::str::FromStr>(task: &pb::Assignment, name: &str) -> anyhow::Result<Option<T>>
where
    T::Err: std::fmt::Display,
{
    let Some(value) = task.operator.as_ref().and_then(|o| o.params.get(name)) else {
        return Ok(None);
    };
    value.trim().parse().map(Some).map_err(|e| {
        anyhow::anyhow!(
            "operator {} parameter {name} = {value:?}: {e}",
            task.operator.as_ref().map(|o| o.name.as_str()).unwrap_or_default()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(operator: &str, params: &[(&str, &str)]) -> pb::Assignment {
        pb::Assignment {
            job_id: "j1".into(),
            stage: "s".into(),
            task_index: 3,
            task_count: 8,
            attempt: 1,
            operator: Some(pb::Operator {
                name: operator.into(),
                params: params.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
                ..Default::default()
            }),
            input_shuffle_id: 42,
            input_partitions: 4,
            output_path: "/out".into(),
            gpus: vec![pb::GpuGrant { address: "1".into(), gpu_milli: 250 }],
            ..Default::default()
        }
    }

    #[test]
    fn env_names_the_task_its_data_and_gpus() {
        let env: HashMap<_, _> = task_env(&task("command", &[]), "127.0.0.1:9060").into_iter().collect();
        assert_eq!(env["TERN_JOB_ID"], "j1");
        assert_eq!(env["TERN_TASK_INDEX"], "3");
        assert_eq!(env["TERN_TASK_COUNT"], "8");
        assert_eq!(env["TERN_ATTEMPT"], "1");
        assert_eq!(env["TERN_METADATA"], "127.0.0.1:9060");
        assert_eq!(env["TERN_INPUT"], "42");
        assert_eq!(env["TERN_INPUT_SHUFFLE"], "42");
        assert_eq!(env["TERN_OUTPUT"], "/out");
        assert!(!env.contains_key("TERN_OUTPUT_SHUFFLE"));
        assert_eq!(env["TERN_GPU_ADDRESSES"], "1");
        assert_eq!(env["TERN_GPU_MILLI"], "250");
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "1");
    }

    #[tokio::test]
    async fn unknown_operators_and_bad_params_fail_with_a_reason() {
        let services = Services::new("127.0.0.1:1".into(), ClientOptions::default());
        let report = run(&task("sort-everything", &[]), &services).await;
        assert_eq!(report.outcome, pb::TaskOutcome::Failed);
        assert!(report.message.contains("unknown operator \"sort-everything\""), "{}", report.message);

        let report = run(&task("noop", &[("sleep_ms", "soon")]), &services).await;
        assert_eq!(report.outcome, pb::TaskOutcome::Failed);
        assert!(report.message.contains("sleep_ms"), "{}", report.message);

        let report = run(&task("noop", &[]), &services).await;
        assert_eq!(report.outcome, pb::TaskOutcome::Succeeded);
    }

    #[test]
    fn out_of_memory_errors_become_oom_reports() {
        let e = anyhow::Error::new(OutOfMemory("partition 3 is too big".into())).context("reduce 3");
        assert_eq!(Report::from_error(e).outcome, pb::TaskOutcome::Oom);
        // A GPU out of memory reaches the executor as OutOfMemory (see terasort::gpu_error).
        let e = terasort::gpu_error(GpuError::OutOfMemory("16 GiB".into()));
        assert_eq!(Report::from_error(e).outcome, pb::TaskOutcome::Oom);
        assert_eq!(
            Report::from_error(terasort::gpu_error(GpuError::Cuda("bad".into()))).outcome,
            pb::TaskOutcome::Failed
        );
        assert_eq!(Report::from_error(anyhow::anyhow!("disk on fire")).outcome, pb::TaskOutcome::Failed);
    }
}
