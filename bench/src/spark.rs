//! `tern bench spark-terasort`: one Spark TeraSort on Spark's built-in shuffle and one on Tern, in
//! the same run, with the same input and the same executors; both outputs validated as valsort does.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use indicatif::{MultiProgress, ProgressDrawTarget};
use serde::Serialize;
use tern_terasort::tasks::{self, Location};
use tern_terasort::RECORD_LEN;

use tern_local::cluster::EmbeddedCluster;

pub struct SparkTerasortOptions {
    pub tern: PathBuf,
    pub size_bytes: u64,
    /// Reduce partitions (0: one per 64 MiB, at least 4).
    pub partitions: usize,
    /// The plugin jar (spark-shuffle/build.sh).
    pub jar: PathBuf,
    pub spark_home: Option<PathBuf>,
    pub master: String,
    pub executor_memory: String,
    /// Where input and outputs go (local disk; about 3x the size).
    pub scratch: PathBuf,
    pub quiet: bool,
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

#[derive(Debug, Serialize)]
pub struct SparkTerasortReport {
    pub size_bytes: u64,
    pub partitions: usize,
    pub builtin_seconds: f64,
    pub tern_seconds: f64,
    /// tern_seconds / builtin_seconds.
    pub ratio: f64,
    pub builtin_valid: bool,
    pub tern_valid: bool,
    /// Executor process CPU seconds over the map stage per GiB of records shuffled (the same
    /// records for both), and Tern's over the built-in's: the write path's CPU per byte.
    pub builtin_map_cpu_s_per_gib: f64,
    pub tern_map_cpu_s_per_gib: f64,
    pub map_cpu_ratio: f64,
    pub builtin: SparkRun,
    pub tern: SparkRun,
}

pub(crate) fn spark_home(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(home) = given {
        return Ok(home.to_path_buf());
    }
    if let Ok(home) = std::env::var("SPARK_HOME") {
        return Ok(home.into());
    }
    let out = std::process::Command::new("python3")
        .args(["-c", "import os, pyspark; print(os.path.dirname(pyspark.__file__))"])
        .output()
        .context("running python3 to find pyspark")?;
    anyhow::ensure!(out.status.success(), "no SPARK_HOME and no pyspark (pip install pyspark==3.5.3)");
    Ok(String::from_utf8(out.stdout)?.trim().into())
}

pub async fn run(options: &SparkTerasortOptions) -> anyhow::Result<SparkTerasortReport> {
    anyhow::ensure!(
        options.jar.exists(),
        "no plugin jar at {} (run spark-shuffle/build.sh --release)",
        options.jar.display()
    );
    // Executors run in their own work directories: the jar path must be absolute.
    let jar_path = std::fs::canonicalize(&options.jar)?;
    let spark_home = spark_home(options.spark_home.as_deref())?;
    let submit = spark_home.join("bin/spark-submit");
    anyhow::ensure!(submit.exists(), "no {}", submit.display());
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
    // Enough DRAM for the shuffle (compressed, well under the input) on two servers.
    let dram = format!("{}MiB", ((options.size_bytes >> 20) + 256).max(512));
    let cluster = EmbeddedCluster::start(&options.tern, 2, &dram).await?;

    let mut runs = Vec::new();
    for tern in [false, true] {
        let name = if tern { "tern" } else { "builtin" };
        let out = work.path().join(format!("out-{name}"));
        let mut command = tokio::process::Command::new(&submit);
        command
            .env("SPARK_HOME", &spark_home)
            .args(["--master", &options.master, "--class", "io.tern.spark.tools.TeraSort"])
            .args(["--driver-memory", "1g", "--executor-memory", &options.executor_memory]);
        let jar = jar_path.to_string_lossy().to_string();
        let mut confs = vec![
            format!("spark.driver.extraClassPath={jar}"),
            format!("spark.executor.extraClassPath={jar}"),
            "spark.ui.enabled=false".into(),
            "spark.serializer=org.apache.spark.serializer.KryoSerializer".into(),
        ];
        if tern {
            confs.push("spark.shuffle.manager=io.tern.spark.TernShuffleManager".into());
            confs.push("spark.shuffle.sort.io.plugin.class=io.tern.spark.TernShuffleDataIO".into());
            confs.push(format!("spark.tern.metadata={}", cluster.metadata_addr));
        }
        for conf in confs {
            command.args(["--conf", &conf]);
        }
        command.arg(&jar).arg(&input).arg(&out).arg(partitions.to_string());
        if !options.quiet {
            eprintln!("spark-terasort: {name} shuffle ...");
        }
        let output = tokio::time::timeout(Duration::from_secs(3600), command.output())
            .await
            .context("spark-submit ran over an hour")?
            .context("running spark-submit")?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let Some(line) = stdout.lines().find_map(|l| l.strip_prefix("TERASORT ")) else {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(60).collect();
            bail!(
                "{name} run printed no result ({}):\n{}",
                output.status,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        };
        let run: SparkRun = serde_json::from_str(line).with_context(|| format!("parsing {line}"))?;
        let summary = tasks::teravalidate(None, &Location::Local(out.clone()), &progress).await?;
        let valid = summary.sorted() && summary.checksum == generated.checksum && summary.records == generated.records;
        std::fs::remove_dir_all(&out).ok();
        if !options.quiet {
            eprintln!("spark-terasort: {name}: {:.2} s, output valid: {valid}", run.seconds);
        }
        runs.push((run, valid));
    }
    drop(cluster);
    let (builtin, builtin_valid) = runs.remove(0);
    let (tern, tern_valid) = runs.remove(0);
    let gib = (records * RECORD_LEN as u64) as f64 / (1u64 << 30) as f64;
    let per_gib = |r: &SparkRun| r.map_process_cpu_ns as f64 / 1e9 / gib;
    Ok(SparkTerasortReport {
        size_bytes: records * RECORD_LEN as u64,
        partitions,
        builtin_seconds: builtin.seconds,
        tern_seconds: tern.seconds,
        ratio: tern.seconds / builtin.seconds,
        builtin_valid,
        tern_valid,
        builtin_map_cpu_s_per_gib: per_gib(&builtin),
        tern_map_cpu_s_per_gib: per_gib(&tern),
        map_cpu_ratio: per_gib(&tern) / per_gib(&builtin),
        builtin,
        tern,
    })
}

pub fn print_table(r: &SparkTerasortReport) {
    println!("Spark TeraSort of {} bytes, {} reduce partitions", r.size_bytes, r.partitions);
    println!(
        "  built-in shuffle  {:>8.2} s  output {}",
        r.builtin_seconds,
        if r.builtin_valid { "VALID" } else { "INVALID" }
    );
    println!(
        "  Tern shuffle      {:>8.2} s  output {}",
        r.tern_seconds,
        if r.tern_valid { "VALID" } else { "INVALID" }
    );
    println!("  ratio (tern/builtin)  {:.3}", r.ratio);
    println!(
        "  map stage CPU (executor processes) per GiB shuffled: built-in {:.2} s, Tern {:.2} s (ratio {:.3})",
        r.builtin_map_cpu_s_per_gib, r.tern_map_cpu_s_per_gib, r.map_cpu_ratio
    );
}

/// The `--conf` settings of a spark-submit with the plugin jar on both classpaths and, when
/// `tern_metadata` is given, Tern's shuffle manager switched on against that metadata server.
pub(crate) fn plugin_confs(jar: &Path, tern_metadata: Option<&str>) -> Vec<String> {
    let jar = jar.to_string_lossy();
    let mut confs = vec![
        format!("spark.driver.extraClassPath={jar}"),
        format!("spark.executor.extraClassPath={jar}"),
        "spark.ui.enabled=false".into(),
    ];
    if let Some(metadata) = tern_metadata {
        confs.push("spark.shuffle.manager=io.tern.spark.TernShuffleManager".into());
        confs.push("spark.shuffle.sort.io.plugin.class=io.tern.spark.TernShuffleDataIO".into());
        confs.push(format!("spark.tern.metadata={metadata}"));
    }
    confs
}
