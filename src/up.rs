//! `tern up`: a whole cluster on this machine, in the foreground, with no configuration.
//!
//! Every daemon runs as its own `tern` process (as in production), logging to `DIR/logs`.
//! `tern up` first locks DIR (`DIR/LOCK`) and checks what it can before it writes anything there
//! (`up/preflight.rs`: memory, ports, the NVMe tiers an earlier run left); once the cluster is up
//! it supervises it (`tern_local::supervise`): a daemon that exits unexpectedly is restarted with
//! a backoff, at most 5 times a minute, and the rest keep running; every event is printed and
//! `DIR/daemons.json` (`up/report.rs`) says how each daemon stands. Ctrl-C or SIGTERM stops them
//! all; with `--exit-on-failure`, so does any one of them exiting.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use tern_common::dirlock::DirLock;
use tern_common::ByteSize;
use tern_executor::pool::{Pool, PoolConfig};
use tern_local::{Daemon, DaemonReport, DaemonSpec, Deadline, Host, PortLayout, RestartLimits, Stopped, Supervisor};

mod preflight;
mod report;
mod spark_conf;

#[derive(Args)]
pub struct UpArgs {
    /// Directory for metadata state and logs.
    #[arg(long, default_value = "tern-data")]
    dir: PathBuf,
    /// Metadata server port on 127.0.0.1; the metrics endpoint is PORT+1, the task scheduler
    /// (with --executors) PORT+2 with metrics on PORT+3, storage server i listens on PORT+10+2i
    /// with metrics on PORT+11+2i.
    #[arg(long, default_value_t = tern_common::ports::METADATA)]
    port: u16,
    /// Number of storage servers.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=32))]
    storage_servers: u16,
    /// Metadata servers: 1, or the 3 or 5 replicas of one replicated metadata service (Raft),
    /// which keeps serving while a majority is up (a restarted replica catches up). Replica 1
    /// is on PORT; replica K on PORT+12+2S+2(K-2) for S storage servers, metrics on the port
    /// after; state in DIR/metadata, or DIR/metadata-K for replicas. With --tls, Raft runs over
    /// mutual TLS too.
    #[arg(long, default_value_t = 1, value_parser = parse_replicas)]
    metadata_replicas: u16,
    /// DRAM tier of each storage server.
    #[arg(long, default_value = "1GiB")]
    dram: ByteSize,
    /// Cluster block size.
    #[arg(long, default_value = "1MiB")]
    block_size: ByteSize,
    /// Serve the control plane (gRPC) over mutual TLS too; clients then need --tls-dir DIR/tls.
    /// (Storage servers always serve TLS over TCP and QUIC with the cluster's own CA in DIR/tls.)
    #[arg(long)]
    tls: bool,
    /// Each storage server's NVMe tier, a file DIR/nvme/storage-I.nvme on the disk holding DIR
    /// (opened with O_DIRECT), where shuffles spill past DRAM and `nvme` files live: a size,
    /// `off`, or `auto`: a quarter of that disk's free space over the storage servers, at most
    /// 2GiB each, an existing file's own size, and none on tmpfs (no O_DIRECT) or under 64MiB.
    #[arg(long, default_value = "auto")]
    nvme_size: NvmeSize,
    /// io engine of the NVMe tiers: uring, psync or auto.
    #[arg(long, default_value = "auto")]
    io_engine: String,
    /// Each daemon's log in DIR/logs rotates to NAME.log.1 (replacing the one before) past this
    /// size, so a long-running cluster's logs stay under twice this per daemon.
    #[arg(long, default_value = "64MiB")]
    log_max_size: ByteSize,
    /// Tern's Spark plugin jar, put on the driver's and executors' class paths in the Spark
    /// configuration `tern up` writes (DIR/spark/spark-defaults.conf) [default: the jar for the
    /// Spark's line that spark-shuffle/build.sh leaves beside this binary's build,
    /// target/tern-spark/tern-spark-3.5.jar or tern-spark-4.jar, when it is there].
    #[arg(long, env = "TERN_SPARK_JAR")]
    spark_jar: Option<PathBuf>,
    /// The Spark installation (SPARK_HOME, or a pyspark package) the Spark configuration is
    /// written for: its line picks the jar and the shuffle manager class [default: $SPARK_HOME,
    /// else python3's pyspark package; Spark 3.5's settings when none is found].
    #[arg(long)]
    spark_home: Option<PathBuf>,
    /// Keep files across restarts: files of the default class `any` are written to the NVMe
    /// tiers (as class `nvme`) instead of DRAM first, so they survive a restart of `tern up`
    /// or of a storage server. `dram` files and shuffles stay in DRAM. Needs NVMe tiers.
    #[arg(long)]
    durable: bool,
    /// Stop the whole cluster when any daemon exits, and exit non-zero, instead of restarting
    /// it (for scripts and tests that want a failure to end the run).
    #[arg(long)]
    exit_on_failure: bool,
    #[command(flatten)]
    pool: PoolArgs,
}

/// What `--nvme-size` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NvmeSize {
    Auto,
    Off,
    Size(ByteSize),
}

impl std::str::FromStr for NvmeSize {
    type Err = String;
    fn from_str(s: &str) -> Result<NvmeSize, String> {
        match s {
            "auto" => Ok(NvmeSize::Auto),
            "off" | "0" => Ok(NvmeSize::Off),
            size => match size.parse::<ByteSize>() {
                Ok(size) if size.bytes() == 0 => Ok(NvmeSize::Off),
                Ok(size) => Ok(NvmeSize::Size(size)),
                Err(e) => Err(format!("{e}; or auto, or off")),
            },
        }
    }
}

/// The task scheduler and its executor pool: started when any of these is given.
#[derive(Args)]
struct PoolArgs {
    /// Start the task scheduler (on PORT+2, metrics on PORT+3) and keep N executors running
    /// (the pool's min and max, unless --min-executors/--max-executors say otherwise).
    #[arg(long)]
    executors: Option<u32>,
    /// Executors kept running whatever the load; 0 lets the pool scale to zero
    /// [default: --executors, else 0].
    #[arg(long)]
    min_executors: Option<u32>,
    /// Most executors the pool starts as the backlog grows [default: --executors, else the min].
    #[arg(long)]
    max_executors: Option<u32>,
    /// An executor above the min leaves after this long with nothing to run, e.g. 30s or 500ms.
    #[arg(long, default_value = "30s", value_parser = tern_common::parse_duration)]
    executor_idle_timeout: Duration,
    /// CPUs each executor offers [default: this machine's cores over --max-executors, at least 1].
    #[arg(long)]
    executor_cpus: Option<f64>,
    /// Memory each executor offers [default: this machine's memory over --max-executors].
    #[arg(long)]
    executor_memory: Option<ByteSize>,
    /// GPUs each executor declares (`tern executor --gpus`) [default: each detects its own].
    #[arg(long)]
    executor_gpus: Option<u32>,
    /// A GPU discovery script each executor runs to name its GPUs (`tern executor
    /// --gpu-discovery-script`), e.g. to declare GPUs on a machine without any.
    #[arg(long, conflicts_with = "executor_gpus")]
    executor_gpu_discovery_script: Option<PathBuf>,
    /// A queue's weight in the scheduler's fair share, NAME=WEIGHT (repeatable; the scheduler's
    /// `queues.NAME`); queues not named weigh 1.
    #[arg(long = "queue", value_name = "NAME=WEIGHT", value_parser = parse_queue)]
    queues: Vec<(String, u32)>,
}

/// `--metadata-replicas`: 1, 3 or 5 (an even count tolerates no more failures than the odd one
/// below it, and more than 5 is slower for nothing on one machine).
fn parse_replicas(s: &str) -> Result<u16, String> {
    match s.parse::<u16>() {
        Ok(n @ (1 | 3 | 5)) => Ok(n),
        _ => Err(format!("{s:?}: give 1, 3 or 5")),
    }
}

/// `NAME=WEIGHT` of `--queue`: the scheduler checks the name; a weight is a whole number >= 1.
fn parse_queue(s: &str) -> Result<(String, u32), String> {
    let (name, weight) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected NAME=WEIGHT"))?;
    match weight.parse::<u32>() {
        Ok(weight) if weight >= 1 && !name.is_empty() => Ok((name.to_string(), weight)),
        _ => Err(format!("{s:?}: expected NAME=WEIGHT with a weight of at least 1")),
    }
}

impl PoolArgs {
    fn wanted(&self) -> bool {
        self.executors.is_some()
            || self.min_executors.is_some()
            || self.max_executors.is_some()
            || !self.queues.is_empty()
    }

    /// The pool's config, beside a scheduler at `scheduler`.
    fn config(
        &self,
        scheduler: &str,
        tls_dir: Option<&Path>,
        credential_file: PathBuf,
        logs: &Path,
        log_max_bytes: u64,
    ) -> anyhow::Result<PoolConfig> {
        let min = self.min_executors.or(self.executors).unwrap_or(0);
        let max = self.max_executors.or(self.executors).unwrap_or(min);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let share = f64::from(max.max(1));
        let cpus = self.executor_cpus.unwrap_or_else(|| (cores / share).floor().max(1.0));
        if !(cpus.is_finite() && cpus > 0.0) {
            bail!("--executor-cpus {cpus} must be above 0");
        }
        let memory = match self.executor_memory {
            Some(memory) => memory.bytes(),
            None => tern_executor::machine_memory_bytes()? / u64::from(max.max(1)),
        };
        let config = PoolConfig {
            min,
            max,
            idle_timeout: self.executor_idle_timeout,
            tick: POOL_TICK,
            scheduler: scheduler.to_string(),
            metadata: None,
            tls_dir: tls_dir.map(Path::to_path_buf),
            credential_file,
            executor_cpu_milli: (cpus * 1000.0).round() as u64,
            executor_memory_bytes: memory,
            executor_gpus: self.executor_gpus,
            executor_gpu_discovery_script: self.executor_gpu_discovery_script.clone(),
            tern: std::env::current_exe().context("locating the tern binary")?,
            logs: logs.to_path_buf(),
            log_max_bytes: Some(log_max_bytes),
        };
        config.validate()?;
        Ok(config)
    }
}

/// How long the cluster may take to come up before `tern up` gives up.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How often the executor pool looks at the scheduler's backlog.
const POOL_TICK: Duration = Duration::from_millis(200);
/// How long a daemon gets to exit after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    // From here on Ctrl-C stops the cluster cleanly, even while it is still starting.
    let shutdown = tern_common::shutdown_signal();
    tokio::pin!(shutdown);
    // The lock before anything else in DIR: a second `tern up` on a running cluster's directory
    // must find out before it touches that cluster's logs, Spark configuration or NVMe files.
    let _lock = DirLock::acquire(&args.dir, "tern up")?;
    let ports = PortLayout::new(args.port, args.storage_servers)
        .and_then(|ports| ports.with_metadata_replicas(args.metadata_replicas))
        .context("--port is too high for the ports the cluster needs")?;
    let host = Host::local();
    // Every check that can fail comes before the first write in DIR, each a line naming the flag
    // to change. A daemon that cannot bind its port would otherwise fail only after another
    // cluster on these ports had answered for it.
    ports.check_free(host.ip(), args.pool.wanted())?;
    if let Some(memory) = preflight::memory() {
        preflight::check_dram(args.dram.bytes(), args.storage_servers, &memory)?;
    }
    let nvme_dir = args.dir.join("nvme");
    let disk = preflight::NvmeDisk::read(&nvme_dir, &args.dir)?;
    let (nvme_sizes, no_nvme) =
        preflight::plan_nvme(args.nvme_size, args.storage_servers, args.block_size.bytes(), &disk)?;
    if args.durable && nvme_sizes.is_none() {
        match &no_nvme {
            Some(note) => bail!("--durable keeps files on NVMe tiers, and there would be none ({note}): put --dir on a disk with room, or leave out --durable"),
            None => bail!("--durable keeps files on NVMe tiers, and --nvme-size off gives none: pass --nvme-size auto (or a size), or leave out --durable"),
        }
    }
    let logs = args.dir.join("logs");
    let tls_dir = args.dir.join("tls");
    let tls_dir_arg = tls_dir.to_string_lossy().to_string();
    let replicas = metadata_replicas(&args.dir, &host, &ports)?;
    // Every replica's address, as clients are given them (`a,b,c`; one for a single server).
    let metadata_addr = replicas.iter().map(|r| r.addr.as_str()).collect::<Vec<_>>().join(",");
    // The scheme tells storage servers (which have TLS material for QUIC either way) whether the
    // control plane is TLS.
    let scheme = if args.tls { "https" } else { "http" };
    let metadata_url = replicas.iter().map(|r| format!("{scheme}://{}", r.addr)).collect::<Vec<_>>().join(",");
    let scheduler_addr = host.addr(ports.scheduler()).to_string();
    let scheduler_tls = args.tls.then_some(tls_dir.as_path());
    let pool_config = match args.pool.wanted() {
        true => {
            // `ensure_credentials` below writes it.
            let credential = args.dir.join(crate::cert::CREDENTIALS_DIR).join("executor");
            Some(args.pool.config(&scheduler_addr, scheduler_tls, credential, &logs, args.log_max_size.bytes())?)
        }
        false => None,
    };
    let tern = std::env::current_exe().context("locating the tern binary")?;
    let spark = spark_conf::find_spark(args.spark_home.as_deref())?;
    let line = spark.as_ref().map_or(tern_common::spark::SparkLine::V3_5, |spark| spark.line);
    let spark_conf = spark_conf::SparkConf {
        master: args.pool.wanted().then(|| tern_scheduler_api::spark_master_url(&scheduler_addr)),
        metadata: metadata_addr.clone(),
        tls_dir: args.tls.then(|| std::path::absolute(&tls_dir)).transpose().context("the TLS directory's path")?,
        jar: spark_conf::plugin_jar(args.spark_jar.as_deref(), &tern, line)?,
        spark,
    };

    // The checks passed: from here on DIR is written.
    if let Some(note) = no_nvme {
        eprintln!("tern up: {note}");
    }
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    ensure_tls(&tls_dir)?;
    let secret_file = crate::cert::ensure_credentials(&args.dir)?;
    let secret_set = format!("cluster_secret_file={}", secret_file.display());
    let spark_conf_dir = spark_conf.write(&args.dir.join("spark"))?;
    let daemon = |name: &str, port: u16| {
        DaemonSpec::new(name, &tern, logs.join(format!("{name}.log")))
            .on(host.clone())
            .serving(host.addr(port))
            .rotate_log_at(args.log_max_size.bytes())
            .without_tern_env()
    };
    let block_size = args.block_size.to_string();
    // Raft's members, each `ID=HOST:PORT` (ids from 1).
    let peers = format!(
        "peers=[{}]",
        replicas.iter().enumerate().map(|(i, r)| format!("\"{}={}\"", i + 1, r.addr)).collect::<Vec<_>>().join(",")
    );
    let mut daemons = Vec::new();
    for (i, replica) in replicas.iter().enumerate() {
        let metadata_dir = replica.dir.to_string_lossy().to_string();
        let node_id = format!("node_id={}", i + 1);
        let mut metadata_args = vec![
            "metadata-server",
            "--listen",
            &replica.addr,
            "--dir",
            &metadata_dir,
            "--admin",
            &replica.admin,
            "--block-size",
            &block_size,
        ];
        if args.tls {
            metadata_args.extend(["--tls-dir", &tls_dir_arg]);
        }
        if args.durable {
            metadata_args.extend(["--set", "durable_files=true"]);
        }
        if replicas.len() > 1 {
            metadata_args.extend(["--set", &peers, "--set", &node_id]);
        }
        metadata_args.extend(["--set", &secret_set]);
        daemons.push(daemon(&replica.name, replica.port).args(metadata_args).spawn()?);
    }
    if nvme_sizes.is_some() {
        std::fs::create_dir_all(&nvme_dir).with_context(|| format!("creating {}", nvme_dir.display()))?;
    }
    let mut storage = Vec::new();
    for i in 0..args.storage_servers {
        let (listen, admin, dram) = (
            host.addr(ports.storage(i)).to_string(),
            host.addr(ports.storage_admin(i)).to_string(),
            args.dram.to_string(),
        );
        let mut storage_args = vec![
            "storage-server",
            "--metadata",
            &metadata_url,
            "--tls-dir",
            &tls_dir_arg,
            "--listen",
            &listen,
            "--admin",
            &admin,
            "--dram",
            &dram,
            // The whole cluster stops together: there is nowhere to drain to.
            "--set",
            "drain_grace_ms=0",
            "--set",
            &secret_set,
        ];
        let nvme_path = nvme_dir.join(format!("storage-{i}.nvme")).to_string_lossy().to_string();
        // Given even for a file that is there (its own size, as planned): the storage server
        // then never has to be told how big a file it finds empty.
        let nvme_bytes = nvme_sizes.as_ref().map(|sizes| sizes[usize::from(i)].to_string()).unwrap_or_default();
        if nvme_sizes.is_some() {
            storage_args.extend(["--nvme", &nvme_path, "--nvme-size", &nvme_bytes, "--io-engine", &args.io_engine]);
        }
        daemons.push(daemon(&format!("storage-{i}"), ports.storage(i)).args(storage_args).spawn()?);
        storage.push((daemons.len() - 1, host.addr(ports.storage(i))));
    }
    let options = tern_client::ClientOptions { tls_dir: Some(tls_dir.clone()), ..Default::default() };
    let deadline = Deadline::after(STARTUP_TIMEOUT);
    let ready = tokio::select! {
        ready = tern_local::cluster_ready(&mut daemons, 0, &metadata_url, &options, &storage, &deadline) => {
            Some(ready.map(drop))
        }
        _ = &mut shutdown => None,
    };
    // The scheduler and its pool come up once the storage is there, so the first jobs find it.
    let (pool_stop, pool_stopped) = tokio::sync::watch::channel(false);
    let mut pool = None;
    let ready = match (ready, pool_config) {
        (Some(Ok(())), Some(pool_config)) => {
            let scheduler_admin = host.addr(ports.scheduler_admin()).to_string();
            let mut scheduler_args = vec![
                "scheduler",
                "--listen",
                &scheduler_addr,
                "--admin",
                &scheduler_admin,
                "--metadata",
                &metadata_url,
                "--set",
                &secret_set,
            ];
            if args.tls {
                scheduler_args.extend(["--tls-dir", &tls_dir_arg]);
            }
            let queues: Vec<String> =
                args.pool.queues.iter().map(|(name, weight)| format!("queues.{name}={weight}")).collect();
            for queue in &queues {
                scheduler_args.extend(["--set", queue]);
            }
            daemons.push(daemon("scheduler", ports.scheduler()).args(scheduler_args).spawn()?);
            let scheduler = daemons.len() - 1;
            let deadline = Deadline::after(STARTUP_TIMEOUT);
            let addr = scheduler_addr.as_str();
            let answers = move || async move {
                let client = tern_scheduler_api::SchedulerClient::connect(addr, scheduler_tls, None).await?;
                client.pool_status().await?;
                Ok::<_, anyhow::Error>(())
            };
            let up = tokio::select! {
                up = tern_local::wait_ready(&mut daemons, scheduler, &deadline, "the scheduler to answer", answers) => Some(up),
                _ = &mut shutdown => None,
            };
            if let Some(Ok(())) = up {
                let mut stopped = pool_stopped.clone();
                let pool_run = Pool::new(pool_config)?.run(async move {
                    let _ = stopped.wait_for(|&stop| stop).await;
                });
                pool = Some(tokio::spawn(pool_run));
            }
            up
        }
        (ready, _) => ready,
    };
    let mut report = report::DaemonsFile::new(&args.dir, &metadata_addr);
    let outcome = match ready {
        // Whatever answered on the cluster's ports, a daemon that exited means it is not up.
        // (Supervision starts once the cluster is up: a daemon that cannot start is not retried.)
        Some(Ok(())) => match tern_local::first_exited(&mut daemons) {
            Some(died) => Err(died),
            None => {
                let supervisor = (!args.exit_on_failure)
                    .then(|| Supervisor::new(std::mem::take(&mut daemons), RestartLimits::default()));
                // Written before the banner: whoever waits for the banner finds the file.
                match &supervisor {
                    Some(supervisor) => report.write(&supervisor.report()),
                    None => report.write(&daemons.iter().map(DaemonReport::running).collect::<Vec<_>>()),
                }
                let spark = spark_conf.banner(&spark_conf_dir);
                let metadata = (metadata_addr.as_str(), metadata_url.as_str());
                print_banner(&args, &ports, metadata, &tls_dir, &logs, &spark, nvme_sizes.is_some());
                match supervisor {
                    Some(mut supervisor) => {
                        let outcome = supervise(&mut supervisor, &mut report, &mut shutdown, &mut pool).await;
                        daemons = supervisor.into_daemons();
                        outcome
                    }
                    None => tokio::select! {
                        _ = &mut shutdown => Ok(()),
                        died = tern_local::first_exit(&mut daemons) => Err(died),
                        ended = wait_pool(&mut pool) => Err(ended),
                    },
                }
            }
        },
        Some(Err(e)) => Err(e),
        None => Ok(()),
    };
    eprintln!("stopping the cluster...");
    // Executors first, while the scheduler can still hear them leave.
    let _ = pool_stop.send(true);
    if let Some(pool) = pool.take() {
        let _ = pool.await;
    }
    stop_all(&mut daemons).await;
    report.remove();
    outcome
}

/// Keeps the cluster's daemons running until Ctrl-C (`Ok`) or the pool fails: prints each
/// exit, restart and give-up as it happens, and keeps `DIR/daemons.json` up to date.
async fn supervise(
    supervisor: &mut Supervisor,
    report: &mut report::DaemonsFile,
    shutdown: &mut (impl std::future::Future<Output = ()> + Unpin),
    pool: &mut Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
) -> anyhow::Result<()> {
    loop {
        let event = tokio::select! {
            _ = &mut *shutdown => return Ok(()),
            ended = wait_pool(pool) => return Err(ended),
            event = supervisor.next_event() => event,
        };
        eprintln!("tern up: {event}");
        report.write(&supervisor.report());
    }
}

/// Resolves when the pool's task ends (only on an error: it runs until told to stop).
async fn wait_pool(pool: &mut Option<tokio::task::JoinHandle<anyhow::Result<()>>>) -> anyhow::Error {
    match pool {
        Some(handle) => {
            let ended = handle.await;
            *pool = None;
            match ended {
                Ok(Ok(())) => anyhow::anyhow!("the executor pool stopped"),
                Ok(Err(e)) => e.context("the executor pool failed"),
                Err(e) => anyhow::anyhow!("the executor pool panicked: {e}"),
            }
        }
        None => std::future::pending().await,
    }
}

/// Makes the cluster's CA and node certificate in `dir` on first start; reuses them later.
fn ensure_tls(dir: &Path) -> anyhow::Result<()> {
    if !dir.join(tern_transport::tls::CA_CERT).exists() {
        tern_transport::tls::init(dir, &tern_transport::tls::InitOptions::default())
            .with_context(|| format!("making the cluster's TLS material in {}", dir.display()))?;
    }
    tern_transport::tls::TlsMaterial::load(dir).map(|_| ()).with_context(|| {
        format!("the cluster's TLS material; delete {} to have `tern up` make new material", dir.display())
    })
}

/// One metadata server `tern up` starts: its daemon name, ports and directory.
struct Replica {
    name: String,
    port: u16,
    addr: String,
    admin: String,
    dir: PathBuf,
}

/// The metadata servers of `ports`' layout: one, `metadata` in DIR/metadata, or replicas
/// `metadata-K` in DIR/metadata-K. Refuses a layout other than the one whose state DIR holds: a
/// single server's log is not a Raft log, and `tern up` cannot change a replicated service's
/// membership, so the cluster would come up without its namespace or with two views of it.
fn metadata_replicas(dir: &Path, host: &Host, ports: &PortLayout) -> anyhow::Result<Vec<Replica>> {
    let count = ports.metadata_replicas();
    let single = dir.join("metadata");
    let found = (1..).take_while(|k| dir.join(format!("metadata-{k}")).exists()).count() as u16;
    let had = match (single.exists(), found) {
        (true, _) => Some(1),
        (false, 0) => None,
        (false, found) => Some(found),
    };
    if let Some(had) = had.filter(|&had| had != count) {
        bail!(
            "{} holds the state of {} and --metadata-replicas {count} would start another: give \
             --metadata-replicas {had}, or another --dir",
            dir.display(),
            match had {
                1 => "a single metadata server".to_string(),
                n => format!("{n} metadata replicas"),
            }
        );
    }
    Ok((0..count)
        .map(|k| {
            let (name, dir) = match count {
                1 => ("metadata".to_string(), single.clone()),
                _ => (format!("metadata-{}", k + 1), dir.join(format!("metadata-{}", k + 1))),
            };
            let port = ports.metadata_replica(k);
            let admin = host.addr(ports.metadata_replica_admin(k)).to_string();
            Replica { name, port, addr: host.addr(port).to_string(), admin, dir }
        })
        .collect())
}

/// The scheduler first, then storage servers, then the metadata server, each stopped in turn:
/// SIGTERM, then SIGKILL after a grace period.
async fn stop_all(daemons: &mut [Daemon]) {
    for daemon in daemons.iter_mut().rev() {
        if daemon.stop(STOP_GRACE).await == Stopped::Killed {
            eprintln!("{} did not stop within {STOP_GRACE:?}; killing it", daemon.name());
        }
    }
}

/// What the banner says survives a restart of `tern up` on the same directory.
fn restart_line(nvme: bool, durable: bool) -> String {
    match nvme {
        true if durable => {
            "Restarts: --durable: files (class any, and nvme) are on NVMe and survive a restart on this \
                            --dir, with the namespace; `dram` files and shuffles in DRAM do not.\n"
                .to_string()
        }
        true => "Restarts: the namespace and blocks on NVMe survive a restart on this --dir; blocks in DRAM \
                 (class any while DRAM has room, and dram) do not: `tern fs put --class nvme` keeps a file, \
                 `tern up --durable` every file.\n"
            .to_string(),
        false => "Restarts: no NVMe tier, so no file's blocks survive a restart (the namespace does).\n".to_string(),
    }
}

/// The banner goes to stdout; a stdout that went away costs the banner, not the cluster.
fn print_banner(
    args: &UpArgs,
    ports: &PortLayout,
    (metadata_addr, metadata_url): (&str, &str),
    tls_dir: &Path,
    logs: &Path,
    spark: &str,
    nvme: bool,
) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "Tern is up: {} {metadata_addr}, {} with {} of DRAM each, {} blocks.",
        match ports.metadata_replicas() {
            1 => "metadata server".to_string(),
            n => format!("{n} metadata replicas (Raft)"),
        },
        tern_common::text::count(u64::from(args.storage_servers), "storage server"),
        args.dram,
        args.block_size
    );
    let _ = writeln!(out);
    let _ = writeln!(out, "In another shell:");
    let _ = writeln!(out, "  export TERN_METADATA={metadata_addr}");
    if args.tls {
        let _ = writeln!(
            out,
            "  export TERN_TLS_DIR={}   # the control plane is TLS: clients need the cluster's certificates",
            tls_dir.display()
        );
    }
    let _ = writeln!(out, "  tern fs put ./some-file /data/some-file");
    let _ = writeln!(out, "  tern fs get /data/some-file ./copy");
    let _ = writeln!(out, "  tern fs ls -l /data");
    let _ = writeln!(out, "  tern status");
    let _ = writeln!(
        out,
        "  tern admin --as {} servers   # operators' calls need the admin credential",
        args.dir.join(crate::cert::CREDENTIALS_DIR).join("admin").display()
    );
    if args.tls {
        let _ = writeln!(out, "  tern fs --transport tls get /data/some-file ./copy   # block data over TLS (or quic)");
    } else {
        // The URL's scheme says the control plane is plain, though --tls-dir is given for the blocks.
        let _ = writeln!(
            out,
            "  tern fs --metadata {metadata_url} --tls-dir {} --transport tls ls /data   # block data over TLS (or quic)",
            tls_dir.display()
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "Metrics: http://127.0.0.1:{}/metrics (metadata), storage server i on port {}+2i",
        ports.metadata_admin(),
        ports.storage_admin(0)
    );
    if args.pool.wanted() {
        let min = args.pool.min_executors.or(args.pool.executors).unwrap_or(0);
        let max = args.pool.max_executors.or(args.pool.executors).unwrap_or(min);
        let _ = writeln!(
            out,
            "Scheduler: 127.0.0.1:{} (metrics on {}), executors: {min} to {max}, idle ones leave after {:?}",
            ports.scheduler(),
            ports.scheduler_admin(),
            args.pool.executor_idle_timeout
        );
        let _ = writeln!(out, "  tern job --scheduler 127.0.0.1:{} terasort --size 1GiB", ports.scheduler());
    }
    let _ = write!(out, "{spark}");
    let _ = write!(out, "{}", restart_line(nvme, args.durable));
    let _ = writeln!(out, "Logs:    {}", logs.display());
    if args.exit_on_failure {
        let _ = writeln!(out, "Daemons: --exit-on-failure: the cluster stops when any daemon exits.");
    } else {
        let _ = writeln!(
            out,
            "Daemons: one that exits unexpectedly is restarted (at most 5 times a minute); how each stands: {}",
            args.dir.join(report::FILE).display()
        );
    }
    let _ = writeln!(out, "Ctrl-C stops the cluster.");
}

#[cfg(test)]
mod tests {
    use super::parse_queue;

    #[test]
    fn queue_weights_are_name_equals_a_whole_number_of_at_least_one() {
        assert_eq!(parse_queue("gold=2"), Ok(("gold".to_string(), 2)));
        for bad in ["gold", "gold=0", "gold=-1", "gold=1.5", "=2"] {
            let e = parse_queue(bad).unwrap_err();
            assert!(e.contains("NAME=WEIGHT"), "{bad}: {e}");
        }
    }
}
