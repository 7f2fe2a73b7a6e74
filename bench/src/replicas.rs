//! `tern bench replicas`: what replication costs a metadata call, three Raft replicas beside one
//! (today's single server) in the same run.
//!
//! Each run starts both clusters in turn, the same shape (`tern up --metadata-replicas N`, one
//! storage server, defaults), the order rotating run by run, and on each measures:
//! - creates of empty files, one after another from one client: p50 and p99 latency;
//! - a shuffle of M maps x R partitions: every map committed (R exact lengths each) one after
//!   another, and again from [`COMMITTERS`] tasks at once as concurrent map tasks commit.
//!
//! Both go through the same client path (the failover channel, which passes a single address
//! straight through). The report gives each figure's median and range over the runs, and the
//! ratio of three replicas to one within each run. Targets (issue 34): create p50 <= 2x, map
//! commits at >= 0.5x the single replica's rate.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tern_common::{median, percentile};
use tern_local::cluster::EmbeddedCluster;

pub struct ReplicasOptions {
    pub tern: std::path::PathBuf,
    pub runs: usize,
    /// Empty files created (each run, each cluster).
    pub files: usize,
    pub maps: u32,
    pub partitions: u32,
}

pub const TARGET_CREATE_P50_RATIO: f64 = 2.0;
pub const TARGET_COMMIT_RATE_RATIO: f64 = 0.5;
/// Tasks committing at once in the concurrent commit measurement.
const COMMITTERS: u32 = 32;

/// One cluster's figures in one run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Figures {
    pub create_p50_us: f64,
    pub create_p99_us: f64,
    pub commits_per_s: f64,
    pub concurrent_commits_per_s: f64,
}

/// One run: both clusters, and the ratios of three replicas to one.
#[derive(Debug, Serialize)]
pub struct Run {
    /// Which went first (the order rotates).
    pub first: u16,
    pub one: Figures,
    pub three: Figures,
    pub create_p50_ratio: f64,
    pub commit_rate_ratio: f64,
    pub concurrent_commit_rate_ratio: f64,
}

#[derive(Debug, Serialize)]
pub struct ReplicasReport {
    pub files: usize,
    pub maps: u32,
    pub partitions: u32,
    pub runs: Vec<Run>,
    pub create_p50_ratio_median: f64,
    pub commit_rate_ratio_median: f64,
    pub concurrent_commit_rate_ratio_median: f64,
    pub target_create_p50_ratio: f64,
    pub target_commit_rate_ratio: f64,
}

pub async fn run(options: &ReplicasOptions) -> anyhow::Result<ReplicasReport> {
    anyhow::ensure!(
        options.runs >= 1 && options.files >= 1 && options.maps >= 1,
        "--runs, --files and --maps: at least 1"
    );
    let mut runs = Vec::with_capacity(options.runs);
    for run in 0..options.runs {
        let order: [u16; 2] = if run % 2 == 0 { [1, 3] } else { [3, 1] };
        let (mut one, mut three) = (None, None);
        for replicas in order {
            eprintln!("bench replicas: run {}/{}: {replicas} metadata replica(s)", run + 1, options.runs);
            let figures = measure(options, replicas).await.with_context(|| format!("{replicas} replica(s)"))?;
            *(if replicas == 1 { &mut one } else { &mut three }) = Some(figures);
        }
        let (one, three) = (one.expect("measured"), three.expect("measured"));
        runs.push(Run {
            first: order[0],
            one,
            three,
            create_p50_ratio: three.create_p50_us / one.create_p50_us,
            commit_rate_ratio: three.commits_per_s / one.commits_per_s,
            concurrent_commit_rate_ratio: three.concurrent_commits_per_s / one.concurrent_commits_per_s,
        });
    }
    let median_of = |f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
    Ok(ReplicasReport {
        files: options.files,
        maps: options.maps,
        partitions: options.partitions,
        create_p50_ratio_median: median_of(|r| r.create_p50_ratio),
        commit_rate_ratio_median: median_of(|r| r.commit_rate_ratio),
        concurrent_commit_rate_ratio_median: median_of(|r| r.concurrent_commit_rate_ratio),
        target_create_p50_ratio: TARGET_CREATE_P50_RATIO,
        target_commit_rate_ratio: TARGET_COMMIT_RATE_RATIO,
        runs,
    })
}

/// One cluster of `replicas` metadata replicas, started, measured and stopped.
async fn measure(options: &ReplicasOptions, replicas: u16) -> anyhow::Result<Figures> {
    let cluster = EmbeddedCluster::start_replicated(&options.tern, replicas).await?;
    let client = tern_client::Client::connect(&cluster.metadata_addr).await?;
    client.mkdir("/bench-replicas", true).await?;
    let mut latencies = Vec::with_capacity(options.files);
    for i in 0..options.files {
        let started = Instant::now();
        client.create_empty(&format!("/bench-replicas/f{i}"), false).await?;
        latencies.push(started.elapsed().as_secs_f64() * 1e6);
    }
    latencies.sort_by(f64::total_cmp);

    let job = client.start_job(Some("bench-replicas"), Duration::from_secs(120)).await?;
    let metadata = crate::shuffle::metadata_for_job(&cluster.metadata_addr, &job.token())?;
    let shape = (options.maps, options.partitions);
    let commits_per_s = f64::from(options.maps) / crate::shuffle::commit_all(&metadata, job.id(), shape, 1).await?;
    let concurrent_commits_per_s =
        f64::from(options.maps) / crate::shuffle::commit_all(&metadata, job.id(), shape, COMMITTERS).await?;
    Ok(Figures {
        create_p50_us: percentile(&latencies, 50.0),
        create_p99_us: percentile(&latencies, 99.0),
        commits_per_s,
        concurrent_commits_per_s,
    })
}

pub fn print_table(r: &ReplicasReport) {
    println!(
        "metadata calls, 3 Raft replicas beside 1, {} runs ({} creates; {} maps x {} partitions):",
        r.runs.len(),
        r.files,
        r.maps,
        r.partitions
    );
    println!("  run  first  create p50 (1 / 3)   ratio  commits/s (1 / 3)    ratio  32 at once/s (1 / 3)   ratio");
    for (i, run) in r.runs.iter().enumerate() {
        println!(
            "  {:>3}  {:>5}  {:>7.0} / {:>7.0} us  {:>5.2}  {:>7.0} / {:>7.0}  {:>6.2}  {:>8.0} / {:>8.0}  {:>6.2}",
            i + 1,
            run.first,
            run.one.create_p50_us,
            run.three.create_p50_us,
            run.create_p50_ratio,
            run.one.commits_per_s,
            run.three.commits_per_s,
            run.commit_rate_ratio,
            run.one.concurrent_commits_per_s,
            run.three.concurrent_commits_per_s,
            run.concurrent_commit_rate_ratio
        );
    }
    let range = |f: fn(&Run) -> f64| {
        let values: Vec<f64> = r.runs.iter().map(f).collect();
        let (low, high) = values.iter().fold((f64::MAX, f64::MIN), |(l, h), &v| (l.min(v), h.max(v)));
        format!("{low:.2}-{high:.2}")
    };
    let verdict = |met: bool| if met { "met" } else { "MISSED" };
    println!(
        "  create p50, 3 over 1: median {:.2} (range {}), target <= {}: {}",
        r.create_p50_ratio_median,
        range(|run| run.create_p50_ratio),
        r.target_create_p50_ratio,
        verdict(r.create_p50_ratio_median <= r.target_create_p50_ratio)
    );
    println!(
        "  map commits, 3 over 1: median {:.2} (range {}), target >= {}: {}; 32 at once: median {:.2} (range {})",
        r.commit_rate_ratio_median,
        range(|run| run.commit_rate_ratio),
        r.target_commit_rate_ratio,
        verdict(r.commit_rate_ratio_median >= r.target_commit_rate_ratio),
        r.concurrent_commit_rate_ratio_median,
        range(|run| run.concurrent_commit_rate_ratio)
    );
}
