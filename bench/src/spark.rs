//! `tern bench spark-terasort`: Spark TeraSort on Spark's built-in shuffle and on Tern, in pairs
//! (who goes first rotates from pair to pair), with the same input, the same executors and the
//! same kind of storage under both shuffles; every output validated as valsort does.
//!
//! - `memory`: Spark's local dir (spark.local.dir and SPARK_LOCAL_DIRS, where the built-in
//!   shuffle writes) on a tmpfs under /dev/shm; Tern's shuffle in its DRAM tier.
//! - `disk`: Spark's local dir in the scratch directory (a disk); Tern's shuffle on its NVMe tier
//!   (class `nvme`: DRAM only buffers a segment's open slot), the tier's files in the same
//!   scratch directory.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use indicatif::{MultiProgress, ProgressDrawTarget};
use serde::Serialize;
use tern_common::spark::SparkLine;
use tern_common::Spread;
use tern_terasort::tasks::{self, Location};
use tern_terasort::RECORD_LEN;

use tern_local::cluster::EmbeddedCluster;

pub struct SparkTerasortOptions {
    pub tern: PathBuf,
    pub size_bytes: u64,
    /// Reduce partitions (0: one per 64 MiB, at least 4).
    pub partitions: usize,
    pub spark: SparkSetup,
    /// Where input and outputs go (local disk; about 3x the size).
    pub scratch: PathBuf,
    /// Pairs of runs (one built-in, one Tern) per storage.
    pub pairs: usize,
    pub storage: StorageChoice,
    pub quiet: bool,
}

/// Which storage the shuffles are compared on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageChoice {
    Memory,
    Disk,
    Both,
}

impl std::str::FromStr for StorageChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "memory" => Ok(StorageChoice::Memory),
            "disk" => Ok(StorageChoice::Disk),
            "both" => Ok(StorageChoice::Both),
            other => Err(format!("{other}: expected memory, disk or both")),
        }
    }
}

impl StorageChoice {
    fn storages(self) -> Vec<Storage> {
        match self {
            StorageChoice::Memory => vec![Storage::Memory],
            StorageChoice::Disk => vec![Storage::Disk],
            StorageChoice::Both => vec![Storage::Memory, Storage::Disk],
        }
    }
}

/// The storage under both shuffles in one comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Storage {
    Memory,
    Disk,
}

impl Storage {
    /// What each shuffle is on, in words.
    pub fn describe(self) -> &'static str {
        match self {
            Storage::Memory => "built-in on tmpfs (/dev/shm) vs Tern in DRAM",
            Storage::Disk => "built-in on disk (scratch dir) vs Tern on its NVMe tier (class nvme, same scratch dir)",
        }
    }
}

/// The two shuffles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Builtin,
    Tern,
}

/// The order of pair `pair`: built-in first in even pairs, Tern first in odd ones.
pub fn pair_order(pair: usize) -> Vec<Backend> {
    tern_common::rotation(&[Backend::Builtin, Backend::Tern], pair)
}

/// One backend's run, as the driver program reports it.
#[derive(Debug, Serialize, serde::Deserialize, Default, Clone)]
pub struct SparkRun {
    pub seconds: f64,
    pub records: u64,
    /// CPU time of the executor processes, every thread, over the map stage (read input,
    /// serialize, compress, shuffle write and, for Tern, the native pushes).
    pub map_process_cpu_ns: u64,
    /// Spark's executorCpuTime of the map tasks: their task threads only.
    pub map_cpu_ns: u64,
    pub shuffle_bytes_written: u64,
    pub reduce_cpu_ns: u64,
    pub shuffle_bytes_read: u64,
}

/// One pair of runs.
#[derive(Debug, Serialize)]
pub struct SparkPair {
    /// Which ran first.
    pub first: Backend,
    pub builtin: SparkRun,
    pub tern: SparkRun,
    pub builtin_valid: bool,
    pub tern_valid: bool,
    /// tern.seconds / builtin.seconds.
    pub ratio: f64,
}

/// The pairs on one storage, summed up.
#[derive(Debug, Serialize)]
pub struct StorageComparison {
    pub storage: Storage,
    /// What each shuffle was on, in words.
    pub description: String,
    /// Spark's local dir in these runs.
    pub spark_local_dir: String,
    pub builtin_seconds: Spread,
    pub tern_seconds: Spread,
    /// Of the per-pair ratios tern / built-in (the target: at most 0.8).
    pub ratio: Spread,
    /// Executor process CPU seconds over the map stage per GiB of records shuffled (the same
    /// records for both): the write path's CPU per byte.
    pub builtin_map_cpu_s_per_gib: Spread,
    pub tern_map_cpu_s_per_gib: Spread,
    pub all_valid: bool,
    pub pairs: Vec<SparkPair>,
}

#[derive(Debug, Serialize)]
pub struct SparkTerasortReport {
    /// The Spark it ran on (--spark-home's).
    pub spark_version: String,
    pub size_bytes: u64,
    pub partitions: usize,
    pub pairs: usize,
    pub comparisons: Vec<StorageComparison>,
    /// Every output of every run validated.
    pub all_valid: bool,
}

/// Sums up the pairs run on `storage`.
fn compare(storage: Storage, spark_local_dir: String, size_bytes: u64, pairs: Vec<SparkPair>) -> StorageComparison {
    let gib = size_bytes as f64 / (1u64 << 30) as f64;
    let per_gib = |r: &SparkRun| r.map_process_cpu_ns as f64 / 1e9 / gib;
    let spread = |f: &dyn Fn(&SparkPair) -> f64| Spread::of(pairs.iter().map(f).collect());
    StorageComparison {
        storage,
        description: storage.describe().into(),
        spark_local_dir,
        builtin_seconds: spread(&|p| p.builtin.seconds),
        tern_seconds: spread(&|p| p.tern.seconds),
        ratio: spread(&|p| p.ratio),
        builtin_map_cpu_s_per_gib: spread(&|p| per_gib(&p.builtin)),
        tern_map_cpu_s_per_gib: spread(&|p| per_gib(&p.tern)),
        all_valid: pairs.iter().all(|p| p.builtin_valid && p.tern_valid),
        pairs,
    }
}

/// Where Spark and the plugin jar are, and the executors the Spark benches run on.
#[derive(Debug, Clone)]
pub struct SparkSetup {
    /// The plugin jar (None: the one spark-shuffle/build.sh leaves for the Spark's line,
    /// target/tern-spark/tern-spark-3.5.jar or tern-spark-4.jar).
    pub jar: Option<PathBuf>,
    /// Spark's installation (None: $SPARK_HOME, else the pyspark package's).
    pub spark_home: Option<PathBuf>,
    pub master: String,
    pub executor_memory: String,
    pub driver_memory: String,
}

/// The plugin jar a bench runs, and the Spark line it runs on.
#[derive(Debug, Clone)]
pub(crate) struct Plugin {
    /// Absolute: executors run in their own work directories.
    pub jar: PathBuf,
    pub line: SparkLine,
    /// The Spark version, for the reports.
    pub spark_version: String,
}

impl SparkSetup {
    /// The plugin (its jar checked to exist), Spark's home and its spark-submit.
    pub(crate) fn resolve(&self) -> anyhow::Result<(Plugin, PathBuf, PathBuf)> {
        let home = spark_home(self.spark_home.as_deref())?;
        let submit = home.join("bin/spark-submit");
        anyhow::ensure!(submit.exists(), "no {}", submit.display());
        let (line, spark_version) = tern_common::spark::spark_line(&home)?;
        let jar = self.jar.clone().unwrap_or_else(|| Path::new("target/tern-spark").join(line.jar()));
        anyhow::ensure!(
            jar.exists(),
            "no plugin jar at {} for Spark {spark_version} (run spark-shuffle/build.sh)",
            jar.display()
        );
        let jar = std::fs::canonicalize(&jar)?;
        Ok((Plugin { jar, line, spark_version }, home, submit))
    }

    /// spark-submit's flags for the driver's and the executors' memory.
    pub(crate) fn memory_args(&self) -> Vec<String> {
        let (driver, executor) = (self.driver_memory.clone(), self.executor_memory.clone());
        vec!["--driver-memory".into(), driver, "--executor-memory".into(), executor]
    }
}

fn spark_home(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    match given {
        Some(home) => Ok(home.to_path_buf()),
        None => tern_common::spark::default_home().context("no SPARK_HOME and no pyspark (pip install pyspark==3.5.3)"),
    }
}

pub async fn run(options: &SparkTerasortOptions) -> anyhow::Result<SparkTerasortReport> {
    let (plugin, spark_home, submit) = options.spark.resolve()?;
    let partitions =
        if options.partitions > 0 { options.partitions } else { ((options.size_bytes >> 26) as usize).max(4) };
    std::fs::create_dir_all(&options.scratch)?;
    let work = tempfile::tempdir_in(&options.scratch)?;
    let progress = MultiProgress::with_draw_target(if options.quiet {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    });
    let input = work.path().join("input");
    let records = options.size_bytes / RECORD_LEN as u64;
    let parts = tasks::default_tasks(options.size_bytes);
    let generated = tasks::teragen(
        None,
        records,
        parts,
        &Location::Local(input.clone()),
        tern_client::CreateOptions::default(),
        &progress,
    )
    .await?;
    let spark = Spark {
        submit,
        home: spark_home,
        plugin,
        master: options.spark.master.clone(),
        memory_args: options.spark.memory_args(),
    };
    let mut comparisons = Vec::new();
    for storage in options.storage.storages() {
        // Spark's local dir (the built-in shuffle's files, spills, broadcast blocks).
        let local = match storage {
            Storage::Memory => tempfile::Builder::new().prefix("tern-spark-local-").tempdir_in("/dev/shm")?,
            Storage::Disk => tempfile::Builder::new().prefix("tern-spark-local-").tempdir_in(work.path())?,
        };
        // Tern's shuffle, in the tier the storage names, with room for it (compressed, well under
        // the input) on each of two servers. On disk, DRAM only buffers each segment's open slot.
        let room = format!("{}MiB", ((options.size_bytes >> 20) + 256).max(512));
        let (cluster, class) = match storage {
            Storage::Memory => (EmbeddedCluster::start(&options.tern, 2, &room).await?, "dram"),
            Storage::Disk => {
                let cluster =
                    EmbeddedCluster::start_with(&options.tern, 2, "256MiB", "1MiB", Some(&room), work.path(), &[]);
                (cluster.await?, "nvme")
            }
        };
        let tern_confs = [format!("spark.tern.storageClass={class}")];
        let mut pairs = Vec::new();
        for pair in 0..options.pairs {
            let order = pair_order(pair);
            let mut results = Vec::new();
            for backend in &order {
                let tern = (*backend == Backend::Tern).then_some(cluster.metadata_addr.as_str());
                let name = format!("{storage:?}-{backend:?}-{pair}").to_lowercase();
                let out = work.path().join(format!("out-{name}"));
                if !options.quiet {
                    eprintln!("spark-terasort: {} pair {}: {backend:?} ...", storage.describe(), pair + 1);
                }
                let run = spark.terasort(&input, &out, partitions, local.path(), tern, &tern_confs).await?;
                let summary = tasks::teravalidate(None, &Location::Local(out.clone()), &progress).await?;
                let valid =
                    summary.sorted() && summary.checksum == generated.checksum && summary.records == generated.records;
                std::fs::remove_dir_all(&out).ok();
                if !options.quiet {
                    eprintln!("spark-terasort: {name}: {:.2} s, output valid: {valid}", run.seconds);
                }
                results.push((*backend, run, valid));
            }
            let take = |want: Backend| results.iter().find(|r| r.0 == want).cloned().context("a run is missing");
            let (_, builtin, builtin_valid) = take(Backend::Builtin)?;
            let (_, tern, tern_valid) = take(Backend::Tern)?;
            let ratio = tern.seconds / builtin.seconds;
            pairs.push(SparkPair { first: order[0], builtin, tern, builtin_valid, tern_valid, ratio });
        }
        drop(cluster);
        let local_dir = local.path().display().to_string();
        comparisons.push(compare(storage, local_dir, records * RECORD_LEN as u64, pairs));
    }
    Ok(SparkTerasortReport {
        spark_version: spark.plugin.spark_version.clone(),
        size_bytes: records * RECORD_LEN as u64,
        partitions,
        pairs: options.pairs,
        all_valid: comparisons.iter().all(|c| c.all_valid),
        comparisons,
    })
}

/// How to run spark-submit.
struct Spark {
    submit: PathBuf,
    home: PathBuf,
    plugin: Plugin,
    master: String,
    memory_args: Vec<String>,
}

impl Spark {
    /// One TeraSort of `input` into `out`, with Spark's local dir `local`, on the built-in
    /// shuffle or on Tern's (at this metadata address, with `tern_confs` too).
    async fn terasort(
        &self,
        input: &Path,
        out: &Path,
        partitions: usize,
        local: &Path,
        tern: Option<&str>,
        tern_confs: &[String],
    ) -> anyhow::Result<SparkRun> {
        let mut command = tokio::process::Command::new(&self.submit);
        command
            .env("SPARK_HOME", &self.home)
            // Read by the local-cluster workers, which hand it to their executors.
            .env("SPARK_LOCAL_DIRS", local)
            .args(["--master", &self.master, "--class", "io.tern.spark.tools.TeraSort"])
            .args(&self.memory_args);
        let mut confs = plugin_confs(&self.plugin, tern);
        if tern.is_some() {
            confs.extend_from_slice(tern_confs);
        }
        confs.push(format!("spark.local.dir={}", local.display()));
        confs.push("spark.serializer=org.apache.spark.serializer.KryoSerializer".into());
        for conf in confs {
            command.args(["--conf", &conf]);
        }
        command.arg(&self.plugin.jar).arg(input).arg(out).arg(partitions.to_string());
        let name = if tern.is_some() { "tern" } else { "builtin" };
        submit_for_result(command, "TERASORT ", name, Duration::from_secs(3600)).await
    }
}

/// The `--conf` settings of a spark-submit with the plugin jar on both classpaths and, when
/// `tern_metadata` is given, Tern's shuffle manager (its class for the Spark line) switched on
/// against that metadata server.
pub(crate) fn plugin_confs(plugin: &Plugin, tern_metadata: Option<&str>) -> Vec<String> {
    let jar = plugin.jar.to_string_lossy();
    let mut confs = vec![
        format!("spark.driver.extraClassPath={jar}"),
        format!("spark.executor.extraClassPath={jar}"),
        "spark.ui.enabled=false".into(),
    ];
    if let Some(metadata) = tern_metadata {
        confs.extend(plugin.line.shuffle_settings().map(|(key, class)| format!("{key}={class}")));
        confs.push(format!("spark.tern.metadata={metadata}"));
    }
    confs
}

/// Runs a spark-submit of one of the jar's drivers, within `limit`, and parses the JSON the
/// driver prints after `marker`; without it, the error carries the end of Spark's stderr.
pub(crate) async fn submit_for_result<T: serde::de::DeserializeOwned>(
    command: tokio::process::Command,
    marker: &str,
    name: &str,
    limit: Duration,
) -> anyhow::Result<T> {
    submit_streaming(command, marker, name, limit, |_| Ok(())).await
}

fn parse_result<T: serde::de::DeserializeOwned>(json: &str) -> anyhow::Result<T> {
    serde_json::from_str(json).with_context(|| format!("parsing {json}"))
}

/// Lines of Spark's stderr an error carries.
const STDERR_TAIL_LINES: usize = 60;

/// As [`submit_for_result`], handing every other line the driver prints to `on_line` as it comes
/// (a long application's progress and partial results); an error from `on_line` ends the run.
/// spark-submit is killed when the run ends early or passes `limit`.
pub(crate) async fn submit_streaming<T: serde::de::DeserializeOwned>(
    mut command: tokio::process::Command,
    marker: &str,
    name: &str,
    limit: Duration,
    mut on_line: impl FnMut(&str) -> anyhow::Result<()>,
) -> anyhow::Result<T> {
    use tokio::io::AsyncBufReadExt;
    command.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).kill_on_drop(true);
    let mut child = command.spawn().context("running spark-submit")?;
    let mut stdout = tokio::io::BufReader::new(child.stdout.take().context("spark-submit's stdout")?).lines();
    let mut stderr = tokio::io::BufReader::new(child.stderr.take().context("spark-submit's stderr")?).lines();
    let run = async {
        let (mut result, mut tail) = (None, std::collections::VecDeque::with_capacity(STDERR_TAIL_LINES));
        let (mut stdout_open, mut stderr_open) = (true, true);
        while stdout_open || stderr_open {
            tokio::select! {
                line = stdout.next_line(), if stdout_open => match line? {
                    Some(line) => match line.strip_prefix(marker) {
                        Some(json) => result = Some(parse_result(json)?),
                        None => on_line(&line)?,
                    },
                    None => stdout_open = false,
                },
                line = stderr.next_line(), if stderr_open => match line? {
                    Some(line) => {
                        if tail.len() == STDERR_TAIL_LINES {
                            tail.pop_front();
                        }
                        tail.push_back(line);
                    }
                    None => stderr_open = false,
                },
            }
        }
        let status = child.wait().await?;
        result.with_context(|| format!("{name} run printed no result ({status}):\n{}", Vec::from(tail).join("\n")))
    };
    tokio::time::timeout(limit, run).await.with_context(|| format!("spark-submit ran over {limit:?}"))?
}

pub fn print_table(r: &SparkTerasortReport) {
    println!(
        "Spark {} TeraSort of {} bytes, {} reduce partitions, {} pairs per storage (who goes first rotates)",
        r.spark_version, r.size_bytes, r.partitions, r.pairs
    );
    for c in &r.comparisons {
        println!("{}  (Spark local dir {}), median [min-max]:", c.description, c.spark_local_dir);
        println!("  built-in shuffle  {} s", c.builtin_seconds);
        println!("  Tern shuffle      {} s", c.tern_seconds);
        println!("  ratio tern/built-in, per pair  {:.3}   (target <= 0.8)", c.ratio);
        println!(
            "  map stage CPU (executor processes) per GiB shuffled: built-in {} s, Tern {} s",
            c.builtin_map_cpu_s_per_gib, c.tern_map_cpu_s_per_gib
        );
        let valid = |v: bool| if v { "VALID" } else { "INVALID" };
        for (i, p) in c.pairs.iter().enumerate() {
            println!(
                "  pair {} ({:?} first): built-in {:.2} s {}, Tern {:.2} s {}, ratio {:.3}",
                i + 1,
                p.first,
                p.builtin.seconds,
                valid(p.builtin_valid),
                p.tern.seconds,
                valid(p.tern_valid),
                p.ratio
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_alternate_who_goes_first() {
        assert_eq!(pair_order(0), [Backend::Builtin, Backend::Tern]);
        assert_eq!(pair_order(1), [Backend::Tern, Backend::Builtin]);
        assert_eq!(pair_order(2), [Backend::Builtin, Backend::Tern]);
        assert_eq!("both".parse::<StorageChoice>().unwrap().storages(), [Storage::Memory, Storage::Disk]);
        assert_eq!("disk".parse::<StorageChoice>().unwrap().storages(), [Storage::Disk]);
        assert!("ssd".parse::<StorageChoice>().is_err());
    }

    #[test]
    fn comparisons_report_spreads_of_seconds_and_per_pair_ratios() {
        let run = |seconds: f64, cpu_s: u64| SparkRun {
            seconds,
            map_process_cpu_ns: cpu_s * 1_000_000_000,
            ..Default::default()
        };
        let pair = |b: f64, t: f64, first| SparkPair {
            first,
            builtin: run(b, 4),
            tern: run(t, 2),
            builtin_valid: true,
            tern_valid: true,
            ratio: t / b,
        };
        let pairs =
            vec![pair(10.0, 8.0, Backend::Builtin), pair(20.0, 10.0, Backend::Tern), pair(12.0, 9.0, Backend::Builtin)];
        let c = compare(Storage::Disk, "/d".into(), 2 << 30, pairs);
        assert_eq!((c.builtin_seconds.median, c.builtin_seconds.min, c.builtin_seconds.max), (12.0, 10.0, 20.0));
        assert_eq!(c.tern_seconds.median, 9.0);
        // The ratios of each pair, not the ratio of the medians (9 / 12).
        assert_eq!((c.ratio.min, c.ratio.median, c.ratio.max), (0.5, 0.75, 0.8));
        assert_eq!(c.builtin_map_cpu_s_per_gib.median, 2.0);
        assert_eq!(c.tern_map_cpu_s_per_gib.median, 1.0);
        assert!(c.all_valid);
        let json = serde_json::to_value(&c).unwrap();
        assert_eq!(json["storage"], "disk");
        assert_eq!(json["pairs"][1]["first"], "tern");
    }
}
