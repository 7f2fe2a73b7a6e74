//! `tern terasort` in one process: the classic two-stage job on the shuffle service, with the
//! per-task functions of [`crate::tasks`] and its own retries.
//!
//! M map tasks each read one input part, range-partition its records by key and push them into R
//! reduce partitions; R reduce tasks each read their partition (exactly the committed map
//! outputs), sort it in memory and write one output part. Output part i holds keys below those of
//! part i+1, so the parts in order are the sorted data, which validation checks as valsort would.
//!
//! A failed map or reduce is run again with a new attempt; when a storage server died with the
//! only copy of some maps' output, exactly those maps are recomputed (from regenerated input)
//! before the reduces run again. The driver runs against a cluster it is given: whoever wants a
//! throwaway one (the `tern terasort` command) starts it first, sized by [`dram_per_server`].

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use indicatif::{MultiProgress, ProgressBar};
use serde::Serialize;
use tern_client::{Client, CommitOutcome, CreateOptions, Shuffle, ShuffleOptions, StorageClass};

use crate::external::sort_partition_to_store;
use crate::gensort::RECORD_LEN;
use crate::tasks::{
    bar, generate_part_with, map_part, run_all, run_all_settled, split_records, store_part, teragen, teravalidate,
    Location, PartitionInput,
};

/// Attempts of one map or reduce task (a failure after a storage server died is retried) before
/// the job fails; retries back off from 250 ms to 2 s, about 10 s in all: longer than the
/// metadata server takes to declare a silent server dead (5 s by default).
const TASK_ATTEMPTS: u32 = 8;
const RETRY_BACKOFF_START: Duration = Duration::from_millis(250);
const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// How to run `tern terasort`.
#[derive(Debug, Clone)]
pub struct TerasortOptions {
    pub size_bytes: u64,
    /// The cluster's metadata server.
    pub metadata: String,
    /// How the driver's client reaches the cluster (TLS material, block transport, deadlines).
    pub client: tern_client::ClientOptions,
    pub maps: usize,
    pub reduces: usize,
    /// When the run began: [`TerasortReport::total_seconds`] counts from here, so a caller that
    /// started a cluster for the run first counts that too.
    pub started: Instant,
    /// Show progress bars.
    pub progress: bool,
    /// Copies of the input and output parts' blocks and of the shuffle's segments (1 or 2). With
    /// 2, a storage server lost mid-job costs no recomputation.
    pub replicas: u32,
    /// Where the shuffle's segments may live on their servers (DRAM first, NVMe beneath).
    pub shuffle_class: StorageClass,
    /// Most memory each reduce's sort may hold; a larger partition is sorted in runs on local
    /// scratch disk and merged ([`crate::external`]). `None`: sorted in memory, whatever its size.
    pub reduce_memory: Option<u64>,
}

/// Seconds per phase.
#[derive(Debug, Clone, Serialize)]
pub struct Phases {
    pub teragen: f64,
    pub map: f64,
    pub reduce: f64,
    pub validate: f64,
}

/// The result `tern terasort --json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct TerasortReport {
    pub records: u64,
    pub bytes: u64,
    pub input_checksum: String,
    pub output_checksum: String,
    pub sorted: bool,
    pub duplicates: u64,
    pub maps: usize,
    pub reduces: usize,
    pub phases: Phases,
    pub total_seconds: f64,
    /// Bytes sorted per second over the map and reduce phases (teragen and validation excluded).
    pub sort_mb_per_s: f64,
    /// Copies of the data, as asked.
    pub replicas: u32,
    /// The shuffle's storage class, as asked: "dram", "nvme" or "any".
    pub shuffle_class: String,
    /// Most memory each reduce's sort held, as asked (null: no bound, sorted in memory).
    pub reduce_memory: Option<u64>,
    /// Sorted runs the reduces wrote to scratch disk and merged (0: every partition in memory).
    pub sort_runs: usize,
    /// Maps run again because their committed output lost every copy (a storage server died).
    pub maps_recomputed: usize,
    /// Map and reduce attempts that failed and were retried.
    pub task_retries: usize,
}

impl TerasortReport {
    /// The output is valid: in order, every input record present (same count and checksum).
    pub fn valid(&self) -> bool {
        self.sorted && self.input_checksum == self.output_checksum
    }
}

impl TerasortOptions {
    /// The gensort records to sort: `size_bytes` in whole records, at least one.
    pub fn records(&self) -> anyhow::Result<u64> {
        let records = self.size_bytes / RECORD_LEN as u64;
        if records == 0 {
            bail!("--size {} is less than one 100-byte record", self.size_bytes);
        }
        Ok(records)
    }
}

/// Each storage server's DRAM tier (of two) when a cluster is started for one sort: room for the
/// input and the shuffle, or the shuffle and the output, with a margin for partly filled blocks.
pub fn dram_per_server(size_bytes: u64, replicas: u32) -> String {
    // Every copy takes room: with 2 replicas, twice the data on the same two servers.
    let copies = u64::from(replicas.max(1));
    let size_bytes = size_bytes * copies;
    let per_server = (size_bytes + size_bytes / 4).max(copies * (256 << 20)).div_ceil(1 << 20);
    format!("{per_server}MiB")
}

/// Generates, sorts and validates `options.size_bytes` of records on the cluster at
/// `options.metadata`, under a Tern job of its own (ended, and so freed, at the end).
pub async fn terasort(options: &TerasortOptions) -> anyhow::Result<TerasortReport> {
    let records = options.records()?;
    let client = Client::connect_with(&options.metadata, options.client.clone()).await?;
    let job = client
        .start_job(
            Some(&format!("terasort-{}-{}", std::process::id(), tern_common::unix_ms())),
            Duration::from_secs(60),
        )
        .await?;
    let input = Location::Store(format!("{}/input", job.root()));
    let output = Location::Store(format!("{}/output", job.root()));
    let progress = if options.progress {
        MultiProgress::new()
    } else {
        MultiProgress::with_draw_target(indicatif::ProgressDrawTarget::hidden())
    };

    let create = CreateOptions { replicas: options.replicas, ..CreateOptions::default() };
    let say = |line: String| progress.suspend(|| eprintln!("terasort: {line}"));

    let phase = Instant::now();
    let input_summary = teragen(Some(&client), records, options.maps, &input, create, &progress).await?;
    let teragen_seconds = phase.elapsed().as_secs_f64();

    let phase = Instant::now();
    let shuffle = client
        .register_shuffle(
            job.id(),
            options.reduces as u32,
            ShuffleOptions {
                maps: options.maps as u32,
                replicas: options.replicas,
                storage_class: options.shuffle_class.to_string(),
                ..Default::default()
            },
        )
        .await?;
    say(format!(
        "map phase: {} maps, shuffle {} with {} copies, storage class {}",
        options.maps,
        shuffle.id(),
        options.replicas,
        options.shuffle_class
    ));
    let Location::Store(input_dir) = &input else { bail!("map input must be in the store") };
    let maps = Maps {
        client: client.clone(),
        shuffle: shuffle.clone(),
        input: input_dir.clone(),
        recompute: format!("{}/recompute", job.root()),
        splits: split_records(records, options.maps),
        create,
        next_attempt: Arc::new(std::sync::Mutex::new(vec![0; options.maps])),
        retries: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        say: {
            let progress = progress.clone();
            Arc::new(move |line: String| progress.suspend(|| eprintln!("terasort: {line}")))
        },
    };
    let bytes = records * RECORD_LEN as u64;
    maps.run(&(0..options.maps as u32).collect::<Vec<_>>(), bar(&progress, bytes, "map")).await?;
    // The input is no longer needed: give its memory to the output. A map recomputed later
    // regenerates its part (gensort records are a function of their numbers alone).
    client.delete(input_dir, true).await?;
    let map_seconds = phase.elapsed().as_secs_f64();

    let phase = Instant::now();
    say(format!("reduce phase: {} reduces", options.reduces));
    let (recomputed, sort_runs) =
        run_reduces(&maps, &output, options.reduces, bytes, options.reduce_memory, &progress).await?;
    shuffle.unregister().await?;
    let reduce_seconds = phase.elapsed().as_secs_f64();
    if !recomputed.is_empty() {
        say(format!("recomputed {} maps whose output was lost: {recomputed:?}", recomputed.len()));
    }

    let phase = Instant::now();
    let output_summary = teravalidate(Some(&client), &output, &progress).await?;
    let validate_seconds = phase.elapsed().as_secs_f64();
    job.end().await?;

    let bytes = records * RECORD_LEN as u64;
    Ok(TerasortReport {
        records: output_summary.records,
        bytes,
        input_checksum: format!("{:x}", input_summary.checksum),
        output_checksum: format!("{:x}", output_summary.checksum),
        sorted: output_summary.sorted() && output_summary.records == input_summary.records,
        duplicates: output_summary.duplicates,
        maps: options.maps,
        reduces: options.reduces,
        phases: Phases {
            teragen: teragen_seconds,
            map: map_seconds,
            reduce: reduce_seconds,
            validate: validate_seconds,
        },
        total_seconds: options.started.elapsed().as_secs_f64(),
        sort_mb_per_s: bytes as f64 / (map_seconds + reduce_seconds) / 1e6,
        replicas: options.replicas,
        shuffle_class: options.shuffle_class.to_string(),
        reduce_memory: options.reduce_memory,
        sort_runs,
        maps_recomputed: recomputed.len(),
        task_retries: maps.retries.load(std::sync::atomic::Ordering::Relaxed),
    })
}

/// What map tasks need, to run the first time or again: each map's input is the gensort records
/// `splits[map]`, in part `map` of `input` or, once that is gone, regenerated under `recompute`.
#[derive(Clone)]
struct Maps {
    client: Client,
    shuffle: Shuffle,
    input: String,
    recompute: String,
    splits: Vec<(u64, u64)>,
    create: CreateOptions,
    /// Per map, the attempt number its next attempt takes (attempts are never reused, so a
    /// dead attempt's batches are never mistaken for a new one's).
    next_attempt: Arc<std::sync::Mutex<Vec<u32>>>,
    retries: Arc<std::sync::atomic::AtomicUsize>,
    say: Arc<dyn Fn(String) + Send + Sync>,
}

impl Maps {
    /// Runs the maps `which`, as many at once as there are cores, each retried (with a new
    /// attempt) until it commits or runs out of attempts.
    async fn run(&self, which: &[u32], bar: ProgressBar) -> anyhow::Result<()> {
        let tasks = which.iter().map(|&map| {
            let (maps, bar) = (self.clone(), bar.clone());
            async move { maps.run_one(map, &bar).await }
        });
        run_all("map", tasks).await?;
        bar.finish();
        Ok(())
    }

    async fn run_one(&self, map: u32, bar: &ProgressBar) -> anyhow::Result<()> {
        let mut backoff = tern_common::Backoff::new(RETRY_BACKOFF_START, RETRY_BACKOFF_MAX);
        for tries in 1..=TASK_ATTEMPTS {
            let attempt = {
                let mut next = self.next_attempt.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                next[map as usize] += 1;
                next[map as usize] - 1
            };
            match self.attempt(map, attempt, bar).await {
                // Another attempt's commit won (a retry after a lost reply): the map's output is there.
                Ok(_) => {
                    (self.say)(format!("map {map} committed (attempt {attempt})"));
                    return Ok(());
                }
                Err(e) if tries < TASK_ATTEMPTS => {
                    let pause = backoff.next().expect("an unbounded backoff always has a next delay");
                    (self.say)(format!("map {map} attempt {attempt} failed, retrying in {pause:?}: {e:#}"));
                    self.retries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(pause).await;
                }
                Err(e) => return Err(e.context(format!("map {map}: {TASK_ATTEMPTS} attempts failed"))),
            }
        }
        unreachable!("the last attempt returns")
    }

    /// One attempt: the first reads the input part; later ones regenerate it first, since it may
    /// have been lost with a storage server or deleted after the map phase.
    async fn attempt(&self, map: u32, attempt: u32, bar: &ProgressBar) -> anyhow::Result<CommitOutcome> {
        let path = if attempt == 0 {
            store_part(&self.input, map as usize)
        } else {
            let (first, count) = self.splits[map as usize];
            let path = format!("{}/part-{map:05}.attempt-{attempt}", self.recompute);
            let hidden = ProgressBar::hidden();
            let target = Location::Store(path.clone());
            generate_part_with(Some(&self.client), first, count, &target, 0, &hidden, self.create).await?;
            path
        };
        let shown = if attempt == 0 { bar.clone() } else { ProgressBar::hidden() };
        let outcome = map_part(&self.client, &self.shuffle, map, attempt, std::slice::from_ref(&path), &shown).await;
        if attempt > 0 {
            let _ = self.client.delete(&path, false).await;
        }
        outcome
    }
}

/// Runs the reduce tasks, as many at once as there are cores. A reduce that fails is run again
/// with a new attempt; when the shuffle has lost maps (every copy of some committed output is
/// gone with its storage server), exactly those maps are invalidated and recomputed first.
/// Each sorts in at most `reduce_memory` (see [`crate::external`]). Returns the maps recomputed
/// and the sorted runs the reduces wrote (0: every partition sorted in memory).
async fn run_reduces(
    maps: &Maps,
    output: &Location,
    reduces: usize,
    bytes: u64,
    reduce_memory: Option<u64>,
    progress: &MultiProgress,
) -> anyhow::Result<(BTreeSet<u32>, usize)> {
    let bar = bar(progress, bytes, "reduce");
    let Location::Store(dir) = output else { bail!("reduce output must be in the store") };
    maps.client.mkdir(dir, true).await?;
    let (mut recomputed, mut runs) = (BTreeSet::new(), 0);
    let mut todo: Vec<usize> = (0..reduces).collect();
    let mut backoff = tern_common::Backoff::new(RETRY_BACKOFF_START, RETRY_BACKOFF_MAX);
    for attempt in 0..TASK_ATTEMPTS {
        let tasks = todo.iter().map(|&reduce| {
            let (client, shuffle, bar, path) =
                (maps.client.clone(), maps.shuffle.clone(), bar.clone(), store_part(dir, reduce));
            let (create, memory) = (maps.create, reduce_memory);
            async move {
                let input = PartitionInput::open(&shuffle, reduce as u32).await?;
                let scratch = std::env::temp_dir();
                let sorted = sort_partition_to_store(&client, input, memory, &scratch, &path, attempt, create).await?;
                bar.inc(sorted.bytes);
                Ok(sorted.runs)
            }
        });
        let results = run_all_settled("reduce", tasks).await;
        runs += results.iter().filter_map(|result| result.as_ref().ok()).sum::<usize>();
        let failed: Vec<(usize, anyhow::Error)> =
            todo.iter().zip(results).filter_map(|(&reduce, result)| result.err().map(|e| (reduce, e))).collect();
        let Some((reduce, error)) = failed.first() else {
            bar.finish();
            return Ok((recomputed, runs));
        };
        if attempt + 1 == TASK_ATTEMPTS {
            return Err(
                anyhow::anyhow!("{error:#}").context(format!("reduce {reduce}: {TASK_ATTEMPTS} attempts failed"))
            );
        }
        maps.retries.fetch_add(failed.len(), std::sync::atomic::Ordering::Relaxed);
        (maps.say)(format!("{} reduces failed (reduce {reduce}: {error:#})", failed.len()));
        let lost = maps.shuffle.lost_maps(0..maps.shuffle.partitions(), 0..u32::MAX).await?;
        if lost.is_empty() {
            // Nothing the metadata server knows to be lost: a server may be dying but not yet
            // declared dead. Wait, then try again.
            tokio::time::sleep(backoff.next().expect("an unbounded backoff always has a next delay")).await;
        } else {
            (maps.say)(format!("maps {lost:?} lost their output; recomputing them"));
            maps.shuffle.invalidate_maps(&lost).await?;
            maps.run(&lost, ProgressBar::hidden()).await?;
            recomputed.extend(lost);
        }
        todo = failed.into_iter().map(|(reduce, _)| reduce).collect();
    }
    unreachable!("the last round returns")
}
