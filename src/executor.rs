//! `tern executor`: runs tasks the scheduler hands out (tern_executor does the work).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use tern_common::ByteSize;
use tern_executor::ExecutorConfig;

#[derive(Args)]
pub struct ExecutorArgs {
    /// The scheduler's address (host:port, http:// or https://).
    #[arg(long, env = "TERN_SCHEDULER", default_value_t = tern_common::ports::default_scheduler())]
    scheduler: String,
    /// The metadata server tasks use [default: the one the scheduler names].
    #[arg(long, env = "TERN_METADATA")]
    metadata: Option<String>,
    /// TLS material (mutual TLS towards the scheduler and the metadata server).
    #[arg(long, env = "TERN_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    /// Its executor credential, which the scheduler hands tasks to (`tern up` writes
    /// DIR/credentials/executor; `tern cert credential --role executor` issues one)
    /// [default: TLS_DIR/credentials/executor].
    #[arg(long, env = "TERN_EXECUTOR_CREDENTIAL_FILE", value_name = "FILE")]
    credential_file: Option<PathBuf>,
    /// CPUs offered to tasks; fractions allowed [default: this machine's cores].
    #[arg(long)]
    cpus: Option<f64>,
    /// Memory offered to tasks, e.g. 8GiB [default: this machine's memory].
    #[arg(long)]
    memory: Option<ByteSize>,
    /// Declare N GPUs (addresses "0".."N-1") instead of detecting them. GPUs come from, in
    /// order: --gpus, --gpu-discovery-script, the CUDA driver (cudarc).
    #[arg(long, conflicts_with = "gpu_discovery_script")]
    gpus: Option<u32>,
    /// A script printing Spark's {"name":"gpu","addresses":[...]} naming this executor's GPUs.
    #[arg(long)]
    gpu_discovery_script: Option<PathBuf>,
    /// Name in the scheduler's logs [default: the executor id it is given].
    #[arg(long)]
    name: Option<String>,
    /// The host this executor runs on, for locality, as storage servers name theirs.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Leave after this long with nothing to run, e.g. 30s [default: stay until stopped].
    #[arg(long, value_parser = tern_common::parse_duration)]
    idle_exit_after: Option<Duration>,
    /// Spark executor JVMs kept started and loaded, at most, so a Spark application's executor
    /// is a hand-off rather than a JVM start (each holds about 190 MiB outside any task's
    /// grant; 0 = none). Learned per kind of executor from the first one that ran here.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=tern_executor::operators::spark_warm::MAX_LIMIT as i64))]
    warm_spark_executors: u32,
}

pub async fn run(args: ExecutorArgs) -> anyhow::Result<()> {
    let cpus = args.cpus.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()) as f64);
    anyhow::ensure!(cpus.is_finite() && cpus > 0.0 && cpus <= 65_536.0, "--cpus {cpus} must be above 0");
    let memory_bytes = match args.memory {
        Some(memory) => memory.bytes(),
        None => tern_executor::machine_memory_bytes()?,
    };
    let gpus = tern_gpu::resolve(args.gpus, args.gpu_discovery_script.as_deref())?;
    let credential_file = args
        .credential_file
        .or_else(|| args.tls_dir.as_ref().map(|dir| dir.join(crate::cert::CREDENTIALS_DIR).join("executor")))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "an executor proves its role to the scheduler with an executor credential: --credential-file FILE \
                 (`tern up` writes DIR/credentials/executor; `tern cert credential --role executor` issues one)"
            )
        })?;
    let credential = tern_proto::identity::load_credential(&credential_file).map_err(|e| anyhow::anyhow!("{e}"))?;
    let config = ExecutorConfig {
        scheduler: args.scheduler,
        metadata: args.metadata,
        tls_dir: args.tls_dir,
        credential,
        name: args.name.unwrap_or_default(),
        host: args.host,
        cpu_milli: (cpus * 1000.0).round() as u64,
        memory_bytes,
        gpus,
        idle_exit: args.idle_exit_after,
        warm_spark_executors: args.warm_spark_executors as usize,
    };
    tern_executor::run(config, tern_common::shutdown_signal()).await?;
    Ok(())
}
