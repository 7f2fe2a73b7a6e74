//! `tern bench spark-small`: the Spark plugin's fixed cost. A suite of small SQL jobs (the plugin
//! jar's `SmallJobs` driver: 18 queries of a few shuffles each over 100k rows, Spark's defaults)
//! runs in one application per backend, built-in shuffle and Tern alternating over `pairs` pairs,
//! who goes first rotating. Every job's result digest must be the same in every run; the report
//! gives each backend's total (median and range) and Tern's ratio per pair.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, ensure};
use serde::{Deserialize, Serialize};
use tern_common::{rotation, Spread};
use tern_local::cluster::EmbeddedCluster;

use crate::spark::{plugin_confs, submit_for_result, SparkSetup};

pub struct SparkSmallOptions {
    pub tern: PathBuf,
    pub spark: SparkSetup,
    /// Pairs of runs (one per backend each).
    pub pairs: usize,
    /// Rows each job's facts table has.
    pub rows: u64,
    /// Only these jobs (all when empty).
    pub jobs: Vec<String>,
    pub quiet: bool,
}

/// One job of one run, as the driver prints it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobRun {
    pub name: String,
    pub seconds: f64,
    pub rows: u64,
    pub digest: i64,
}

/// One application's run of the suite.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SuiteRun {
    pub seconds: f64,
    pub jobs: Vec<JobRun>,
}

#[derive(Debug, Serialize)]
pub struct SparkSmallReport {
    /// The Spark it ran on (--spark-home's).
    pub spark_version: String,
    pub pairs: usize,
    pub rows: u64,
    /// The suite's seconds (every job, in one application), per backend.
    pub builtin_seconds: Spread,
    pub tern_seconds: Spread,
    /// Tern's seconds over the built-in's, per pair.
    pub ratio: Spread,
    /// Median seconds of each job: (name, built-in, Tern).
    pub jobs: Vec<(String, f64, f64)>,
    pub builtin_runs: Vec<SuiteRun>,
    pub tern_runs: Vec<SuiteRun>,
}

pub async fn run(options: &SparkSmallOptions) -> anyhow::Result<SparkSmallReport> {
    ensure!(options.pairs >= 1, "--pairs must be at least 1");
    let (plugin, spark_home, submit) = options.spark.resolve()?;
    let cluster = EmbeddedCluster::start(&options.tern, 2, "1GiB").await?;

    let (mut builtin_runs, mut tern_runs) = (Vec::new(), Vec::new());
    for pair in 0..options.pairs {
        for tern in rotation(&[false, true], pair) {
            let name = if tern { "tern" } else { "builtin" };
            if !options.quiet {
                eprintln!("spark-small: pair {} of {}, {name} shuffle ...", pair + 1, options.pairs);
            }
            let mut command = tokio::process::Command::new(&submit);
            command
                .env("SPARK_HOME", &spark_home)
                .args(["--master", &options.spark.master, "--class", "io.tern.spark.tools.SmallJobs"])
                .args(options.spark.memory_args());
            let metadata = tern.then_some(cluster.metadata_addr.as_str());
            for conf in plugin_confs(&plugin, metadata) {
                command.args(["--conf", &conf]);
            }
            command.arg(&plugin.jar).arg(options.rows.to_string());
            if !options.jobs.is_empty() {
                command.arg(options.jobs.join(","));
            }
            let run: SuiteRun = submit_for_result(command, "SMALLJOBS ", name, Duration::from_secs(1800)).await?;
            if !options.quiet {
                eprintln!("spark-small: {name}: {:.2} s", run.seconds);
            }
            if tern {
                tern_runs.push(run)
            } else {
                builtin_runs.push(run)
            }
        }
    }
    drop(cluster);
    same_results(&builtin_runs, &tern_runs)?;

    let seconds = |runs: &[SuiteRun]| Spread::of(runs.iter().map(|r| r.seconds).collect());
    let ratio = Spread::of(tern_runs.iter().zip(&builtin_runs).map(|(t, b)| t.seconds / b.seconds).collect());
    let job_median =
        |runs: &[SuiteRun], job: usize| Spread::of(runs.iter().map(|r| r.jobs[job].seconds).collect()).median;
    let jobs = builtin_runs[0]
        .jobs
        .iter()
        .enumerate()
        .map(|(i, job)| (job.name.clone(), job_median(&builtin_runs, i), job_median(&tern_runs, i)))
        .collect();
    Ok(SparkSmallReport {
        spark_version: plugin.spark_version,
        pairs: options.pairs,
        rows: options.rows,
        builtin_seconds: seconds(&builtin_runs),
        tern_seconds: seconds(&tern_runs),
        ratio,
        jobs,
        builtin_runs,
        tern_runs,
    })
}

/// Every run ran the same jobs with the same results; the first difference is an error naming
/// the job and the runs.
fn same_results(builtin: &[SuiteRun], tern: &[SuiteRun]) -> anyhow::Result<()> {
    let mut seen: BTreeMap<&str, (u64, i64, String)> = BTreeMap::new();
    let labelled = builtin.iter().enumerate().map(|(i, r)| (format!("built-in run {}", i + 1), r));
    let labelled = labelled.chain(tern.iter().enumerate().map(|(i, r)| (format!("Tern run {}", i + 1), r)));
    let mut names: Option<Vec<&str>> = None;
    for (label, run) in labelled {
        let these: Vec<&str> = run.jobs.iter().map(|j| j.name.as_str()).collect();
        match &names {
            Some(names) if *names != these => bail!("{label} ran jobs {these:?}, another run {names:?}"),
            _ => names = Some(these),
        }
        for job in &run.jobs {
            let (rows, digest, first) = seen.entry(&job.name).or_insert((job.rows, job.digest, label.clone()));
            if (*rows, *digest) != (job.rows, job.digest) {
                bail!(
                    "job {} gave different results: {first} {rows} rows (digest {digest}), {label} {} rows (digest {})",
                    job.name,
                    job.rows,
                    job.digest
                );
            }
        }
    }
    Ok(())
}

pub fn print_table(r: &SparkSmallReport) {
    println!(
        "Spark {} small SQL jobs: {} jobs over {} rows, {} alternated pairs",
        r.spark_version,
        r.jobs.len(),
        r.rows,
        r.pairs
    );
    println!("  {:<20} {:>10} {:>10} {:>7}", "job (median s)", "built-in", "Tern", "ratio");
    for (name, builtin, tern) in &r.jobs {
        println!("  {name:<20} {builtin:>10.3} {tern:>10.3} {:>7.2}", tern / builtin);
    }
    println!("  suite, built-in shuffle  {:.2} s", r.builtin_seconds);
    println!("  suite, Tern shuffle      {:.2} s", r.tern_seconds);
    println!("  ratio (Tern / built-in, per pair)  {:.3}   (target <= 1.05)", r.ratio);
    println!("  every job's result is the same in every run");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(digests: &[(&str, i64)]) -> SuiteRun {
        SuiteRun {
            seconds: 1.0,
            jobs: digests
                .iter()
                .map(|(name, digest)| JobRun { name: name.to_string(), seconds: 0.5, rows: 3, digest: *digest })
                .collect(),
        }
    }

    #[test]
    fn results_must_match_across_runs() {
        let a = run(&[("join", 1), ("distinct", 2)]);
        assert!(same_results(&[a.clone(), a.clone()], std::slice::from_ref(&a)).is_ok());
        let err =
            same_results(std::slice::from_ref(&a), &[run(&[("join", 1), ("distinct", 9)])]).unwrap_err().to_string();
        assert!(err.contains("job distinct gave different results") && err.contains("Tern run 1"), "{err}");
        let err = same_results(&[a], &[run(&[("join", 1)])]).unwrap_err().to_string();
        assert!(err.contains("ran jobs"), "{err}");
    }
}
