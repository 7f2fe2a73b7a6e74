//! TeraSort through Tern: `tern teragen`, `tern teravalidate` and `tern terasort`.
//!
//! The sort is the classic two-stage job on the shuffle service: M map tasks each read one input
//! part, range-partition its records by key and push them into R reduce partitions; R reduce
//! tasks each read their partition (exactly the committed map outputs), sort it in memory and
//! write one output part. Output part i holds keys below those of part i+1, so the parts in
//! order are the sorted data, which validation checks as valsort would.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::{Bytes, BytesMut};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde::Serialize;
use tern_client::{Client, CommitOutcome, CreateOptions, MapWriterOptions, Shuffle, ShuffleOptions, ShuffleReader};
use tokio::sync::Semaphore;

use crate::cluster::EmbeddedCluster;
use crate::terasort::gensort::{self, RECORD_LEN};
use crate::terasort::partition::RangePartitioner;
use crate::terasort::sort::try_sort_records;
use crate::terasort::validate::{Summary, Validator};

/// Records generated per call into the generator (about 8 MB).
const GENERATE_CHUNK_RECORDS: u64 = 80_000;
/// Bytes of one map task's records bucketed before they are handed to the shuffle writer.
const MAP_CHUNK_BYTES: usize = 4 << 20;
/// Records per shuffle write: a batch closes when the next write would not fit, so with 64 KB
/// writes a 1 MiB batch is at least 94% full.
const WRITE_RECORDS: usize = 655;
/// Attempts of one map or reduce task (a failure after a storage server died is retried) before
/// the job fails; retries back off from 250 ms to 2 s, about 10 s in all: longer than the
/// metadata server takes to declare a silent server dead (5 s by default).
const TASK_ATTEMPTS: u32 = 8;
const RETRY_BACKOFF_START: Duration = Duration::from_millis(250);
const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Where a dataset lives: a directory in the store, or on local disk.
#[derive(Debug, Clone)]
pub enum Location {
    Store(String),
    Local(PathBuf),
}

impl Location {
    fn part(&self, i: usize) -> Location {
        match self {
            Location::Store(dir) => Location::Store(store_part(dir, i)),
            Location::Local(dir) => Location::Local(dir.join(part_name(i))),
        }
    }
}

/// Runs `tasks`, as many at once as this machine has cores, and returns their results in order.
async fn run_all<T, F>(what: &str, tasks: impl IntoIterator<Item = F>) -> anyhow::Result<Vec<T>>
where
    F: std::future::Future<Output = anyhow::Result<T>> + Send + 'static,
    T: Send + 'static,
{
    run_all_settled(what, tasks).await.into_iter().collect()
}

/// As [`run_all`], but every task runs to its end whatever the others do: each one's result.
async fn run_all_settled<T, F>(what: &str, tasks: impl IntoIterator<Item = F>) -> Vec<anyhow::Result<T>>
where
    F: std::future::Future<Output = anyhow::Result<T>> + Send + 'static,
    T: Send + 'static,
{
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let limit = Arc::new(Semaphore::new(cores));
    let handles: Vec<_> = tasks
        .into_iter()
        .map(|task| {
            let limit = limit.clone();
            tokio::spawn(async move {
                let _slot = limit.acquire_owned().await?;
                task.await
            })
        })
        .collect();
    let mut results = Vec::with_capacity(handles.len());
    for handle in handles {
        results.push(handle.await.with_context(|| format!("{what} task")).and_then(|r| r));
    }
    results
}

fn part_name(i: usize) -> String {
    format!("part-{i:05}")
}

/// Part `i` of a dataset in the store directory `dir`.
pub fn store_part(dir: &str, i: usize) -> String {
    format!("{}/{}", dir.trim_end_matches('/'), part_name(i))
}

/// Splits `records` into `parts` nearly equal runs: (first record, count) of each.
pub fn split_records(records: u64, parts: usize) -> Vec<(u64, u64)> {
    let parts = parts.max(1) as u64;
    (0..parts).map(|i| (records * i / parts, records * (i + 1) / parts - records * i / parts)).collect()
}

fn bar(progress: &MultiProgress, total: u64, phase: &str) -> ProgressBar {
    let bar = progress.add(ProgressBar::new(total));
    bar.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(phase.to_string());
    bar
}

/// Generates `records` gensort records into `parts` parts at `out`, in parallel; returns the
/// input summary (count and checksum).
pub async fn teragen(
    client: Option<&Client>,
    records: u64,
    parts: usize,
    out: &Location,
    create: CreateOptions,
    progress: &MultiProgress,
) -> anyhow::Result<Summary> {
    let bar = bar(progress, records * RECORD_LEN as u64, "teragen");
    match out {
        Location::Store(dir) => client.context("teragen into the store needs a cluster")?.mkdir(dir, true).await?,
        Location::Local(dir) => std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?,
    }
    let tasks = split_records(records, parts).into_iter().enumerate().map(|(i, (first, count))| {
        let (client, target, bar) = (client.cloned(), out.part(i), bar.clone());
        async move { generate_part_with(client.as_ref(), first, count, &target, 0, &bar, create).await }
    });
    let summary = run_all("teragen", tasks).await?.iter().fold(Summary::default(), |all, part| all.merge(part));
    bar.finish();
    Ok(summary)
}

/// Generates records `first..first + count` as one part at `target`, chunk by chunk (bounded
/// memory), and returns their summary. One definition for `tern teragen`, `tern terasort` and
/// the executor's teragen operator.
///
/// The part is written under an attempt's own name and renamed into place when whole, so a
/// retry never meets a half-written part of a dead attempt, and the first whole attempt wins.
pub async fn generate_part(
    client: Option<&Client>,
    first: u64,
    count: u64,
    target: &Location,
    attempt: u32,
    bar: &ProgressBar,
) -> anyhow::Result<Summary> {
    generate_part_with(client, first, count, target, attempt, bar, CreateOptions::default()).await
}

/// [`generate_part`], a part in the store stored as `create` says (e.g. 2 replicas).
pub async fn generate_part_with(
    client: Option<&Client>,
    first: u64,
    count: u64,
    target: &Location,
    attempt: u32,
    bar: &ProgressBar,
    create: CreateOptions,
) -> anyhow::Result<Summary> {
    enum Sink {
        Store(tern_client::FileWriter),
        Local(std::io::BufWriter<std::fs::File>),
    }
    let scratch = attempt_location(target, attempt);
    let mut sink = match &scratch {
        Location::Store(path) => {
            let client = client.context("store output needs a client")?;
            let mut writer = client.create_with_options(path, true, create).await?;
            writer.expect_len(count * RECORD_LEN as u64);
            Sink::Store(writer)
        }
        Location::Local(path) => Sink::Local(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        )),
    };
    let mut summary = Summary::default();
    let mut done = 0;
    while done < count {
        let n = GENERATE_CHUNK_RECORDS.min(count - done);
        let start = first + done;
        let (chunk, part_summary) = tokio::task::spawn_blocking(move || {
            let mut chunk = vec![0u8; n as usize * RECORD_LEN];
            gensort::generate_parallel(start, n, &mut chunk);
            let (records, checksum) = crate::terasort::validate::checksum(&chunk);
            (chunk, Summary { records, checksum, ..Summary::default() })
        })
        .await?;
        summary = summary.add_unordered(&part_summary);
        match &mut sink {
            Sink::Store(writer) => writer.write_bytes(Bytes::from(chunk)).await?,
            Sink::Local(file) => std::io::Write::write_all(file, &chunk)?,
        }
        bar.inc(n * RECORD_LEN as u64);
        done += n;
    }
    match sink {
        Sink::Store(writer) => {
            writer.close().await?;
        }
        Sink::Local(mut file) => std::io::Write::flush(&mut file)?,
    }
    publish(client, &scratch, target, attempt).await?;
    Ok(summary)
}

/// Where attempt `attempt` writes the part that belongs at `target`: a hidden name beside it
/// (not `part-*`, so validation never reads it).
fn attempt_location(target: &Location, attempt: u32) -> Location {
    match target {
        Location::Store(path) => Location::Store(attempt_store_path(path, attempt)),
        Location::Local(path) => {
            let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            Location::Local(path.with_file_name(format!(".{name}.attempt-{attempt}")))
        }
    }
}

fn attempt_store_path(path: &str, attempt: u32) -> String {
    let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
    format!("{dir}/.{name}.attempt-{attempt}")
}

/// Most earlier attempts whose leftovers a retry removes.
const CLEANUP_ATTEMPTS: u32 = 16;

/// Renames an attempt's whole part to `target`. In the store the rename refuses an existing
/// target, so when another attempt got there first this attempt's copy (the same records: parts
/// are deterministic) is dropped and that is success. Then leftovers of earlier, dead attempts
/// are removed (best effort).
async fn publish(client: Option<&Client>, scratch: &Location, target: &Location, attempt: u32) -> anyhow::Result<()> {
    match (scratch, target) {
        (Location::Store(from), Location::Store(to)) => {
            let client = client.context("store output needs a client")?;
            if let Err(e) = client.rename(from, to).await {
                if e.kind() != tern_client::ErrorKind::AlreadyExists {
                    return Err(e).with_context(|| format!("renaming {from} to {to}"));
                }
                client.delete(from, false).await?;
            }
            for earlier in attempt.saturating_sub(CLEANUP_ATTEMPTS)..attempt {
                if let Location::Store(stale) = attempt_location(target, earlier) {
                    let _ = client.delete(&stale, false).await;
                }
            }
        }
        (Location::Local(from), Location::Local(to)) => {
            std::fs::rename(from, to).with_context(|| format!("renaming {} to {}", from.display(), to.display()))?;
            for earlier in attempt.saturating_sub(CLEANUP_ATTEMPTS)..attempt {
                if let Location::Local(stale) = attempt_location(target, earlier) {
                    let _ = std::fs::remove_file(stale);
                }
            }
        }
        _ => bail!("an attempt's part and its target are in different places"),
    }
    Ok(())
}

/// valsort over the parts of `dir` in name order: order across all parts, count, checksum,
/// duplicates.
pub async fn teravalidate(
    client: Option<&Client>,
    dir: &Location,
    progress: &MultiProgress,
) -> anyhow::Result<Summary> {
    let parts = list_parts(client, dir).await?;
    if parts.is_empty() {
        bail!("no part-* files in {dir:?}");
    }
    let total: u64 = parts.iter().map(|(_, len)| len).sum();
    let bar = bar(progress, total, "validate");
    let tasks = parts.into_iter().map(|(part, _)| validate_part(client.cloned(), part, bar.clone()));
    let summary = run_all("validate", tasks).await?.into_iter().reduce(|so_far, part| so_far.merge(&part));
    bar.finish();
    summary.context("no parts")
}

/// The `part-*` files of `dir` with their lengths, in name order.
pub async fn list_parts(client: Option<&Client>, dir: &Location) -> anyhow::Result<Vec<(Location, u64)>> {
    let mut parts = Vec::new();
    match dir {
        Location::Store(path) => {
            for entry in client.context("reading the store needs a cluster")?.list(path).await? {
                if entry.path.rsplit('/').next().is_some_and(|n| n.starts_with("part-")) {
                    parts.push((Location::Store(entry.path.clone()), entry.length));
                }
            }
        }
        Location::Local(path) => {
            for entry in std::fs::read_dir(path).with_context(|| format!("listing {}", path.display()))? {
                let entry = entry?;
                if entry.file_name().to_string_lossy().starts_with("part-") {
                    parts.push((Location::Local(entry.path()), entry.metadata()?.len()));
                }
            }
            parts.sort_by(|a, b| format!("{:?}", a.0).cmp(&format!("{:?}", b.0)));
        }
    }
    Ok(parts)
}

async fn validate_part(client: Option<Client>, part: Location, bar: ProgressBar) -> anyhow::Result<Summary> {
    let mut validator = Validator::default();
    match &part {
        Location::Store(path) => {
            let mut reader = client.context("store input needs a client")?.open(path).await?;
            while let Some(chunk) = reader.next_chunk().await? {
                bar.inc(chunk.len() as u64);
                validator = tokio::task::spawn_blocking(move || {
                    validator.feed(&chunk);
                    validator
                })
                .await?;
            }
        }
        Location::Local(path) => {
            let data = tokio::fs::read(path).await.with_context(|| format!("reading {}", path.display()))?;
            bar.inc(data.len() as u64);
            validator = tokio::task::spawn_blocking(move || {
                validator.feed(&data);
                validator
            })
            .await?;
        }
    }
    validator.finish().map_err(|e| anyhow::anyhow!("{part:?}: {e}"))
}

/// How to run `tern terasort`.
#[derive(Debug, Clone)]
pub struct TerasortOptions {
    pub size_bytes: u64,
    /// A running cluster; `None` starts an embedded one.
    pub metadata: Option<String>,
    pub maps: usize,
    pub reduces: usize,
    /// The `tern` binary, to start an embedded cluster.
    pub tern: PathBuf,
    /// Show progress bars.
    pub progress: bool,
    /// Copies of the input and output parts' blocks and of the shuffle's segments (1 or 2). With
    /// 2, a storage server lost mid-job costs no recomputation.
    pub replicas: u32,
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

/// Each storage server's DRAM tier when terasort starts its own cluster: room for the input and
/// the shuffle, or the shuffle and the output, with a margin for partly filled blocks.
fn embedded_dram_per_server(size_bytes: u64, replicas: u32) -> String {
    // Every copy takes room: with 2 replicas, twice the data on the same two servers.
    let copies = u64::from(replicas.max(1));
    let size_bytes = size_bytes * copies;
    let per_server = (size_bytes + size_bytes / 4).max(copies * (256 << 20)).div_ceil(1 << 20);
    format!("{per_server}MiB")
}

pub async fn terasort(options: &TerasortOptions) -> anyhow::Result<TerasortReport> {
    let started = Instant::now();
    let records = options.size_bytes / RECORD_LEN as u64;
    if records == 0 {
        bail!("--size {} is less than one 100-byte record", options.size_bytes);
    }
    let embedded = match &options.metadata {
        Some(_) => None,
        None => Some(
            EmbeddedCluster::start(&options.tern, 2, &embedded_dram_per_server(options.size_bytes, options.replicas))
                .await?,
        ),
    };
    let metadata = options
        .metadata
        .clone()
        .or_else(|| embedded.as_ref().map(|c| c.metadata_addr.clone()))
        .context("no cluster")?;
    let client = Client::connect(&metadata).await?;
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
            ShuffleOptions { maps: options.maps as u32, replicas: options.replicas, ..Default::default() },
        )
        .await?;
    say(format!("map phase: {} maps, shuffle {} with {} copies", options.maps, shuffle.id(), options.replicas));
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
    let recomputed = run_reduces(&maps, &output, options.reduces, bytes, &progress).await?;
    shuffle.unregister().await?;
    let reduce_seconds = phase.elapsed().as_secs_f64();
    if !recomputed.is_empty() {
        say(format!("recomputed {} maps whose output was lost: {recomputed:?}", recomputed.len()));
    }

    let phase = Instant::now();
    let output_summary = teravalidate(Some(&client), &output, &progress).await?;
    let validate_seconds = phase.elapsed().as_secs_f64();
    job.end().await?;
    drop(embedded);

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
        total_seconds: started.elapsed().as_secs_f64(),
        sort_mb_per_s: bytes as f64 / (map_seconds + reduce_seconds) / 1e6,
        replicas: options.replicas,
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
        let mut backoff = RETRY_BACKOFF_START;
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
                    (self.say)(format!("map {map} attempt {attempt} failed, retrying in {backoff:?}: {e:#}"));
                    self.retries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RETRY_BACKOFF_MAX);
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

/// One map attempt: read the input parts at `paths`, bucket records by reduce partition, push,
/// commit. One definition for `tern terasort` and the executor's terasort-map operator. The
/// outcome says whether this attempt's output is the map's output (another attempt may have
/// committed first; that is not an error).
pub async fn map_part(
    client: &Client,
    shuffle: &Shuffle,
    map: u32,
    attempt: u32,
    paths: &[String],
    bar: &ProgressBar,
) -> anyhow::Result<CommitOutcome> {
    let partitioner = Arc::new(RangePartitioner::new(shuffle.partitions()));
    let mut writer = shuffle.writer_with(map, attempt, MapWriterOptions::default());
    // Whole records per write, so records stay whole in every batch; and small writes, so the
    // writer fills each batch (and so each storage block) nearly to the brim.
    let max_write = WRITE_RECORDS * RECORD_LEN;
    for path in paths {
        let mut reader = client.open(path).await?;
        let mut carry = BytesMut::new();
        let mut done = false;
        while !done {
            // Gather a few blocks, whole records only; the tail waits for the next round.
            while carry.len() < MAP_CHUNK_BYTES {
                match reader.next_chunk().await? {
                    Some(chunk) => carry.extend_from_slice(&chunk),
                    None => {
                        done = true;
                        break;
                    }
                }
            }
            let whole = carry.len() / RECORD_LEN * RECORD_LEN;
            if done && whole != carry.len() {
                bail!("{path}: {} trailing bytes are not a whole record", carry.len() - whole);
            }
            let records = carry.split_to(whole).freeze();
            bar.inc(records.len() as u64);
            let partitioner = partitioner.clone();
            let buckets = tokio::task::spawn_blocking(move || bucket(&records, &partitioner)).await?;
            for (partition, bucket) in buckets.iter().enumerate() {
                for piece in bucket.chunks(max_write) {
                    writer.write(partition as u32, piece).await?;
                }
            }
        }
    }
    Ok(writer.commit().await?)
}

/// Records grouped by reduce partition, each group in input order.
fn bucket(records: &[u8], partitioner: &RangePartitioner) -> Vec<Vec<u8>> {
    let partitions = partitioner.partitions() as usize;
    let mut buckets: Vec<Vec<u8>> =
        (0..partitions).map(|_| Vec::with_capacity(records.len() / partitions + RECORD_LEN)).collect();
    for record in records.chunks_exact(RECORD_LEN) {
        buckets[partitioner.partition(record) as usize].extend_from_slice(record);
    }
    buckets
}

/// Runs the reduce tasks, as many at once as there are cores. A reduce that fails is run again
/// with a new attempt; when the shuffle has lost maps (every copy of some committed output is
/// gone with its storage server), exactly those maps are invalidated and recomputed first.
/// Returns the maps recomputed.
async fn run_reduces(
    maps: &Maps,
    output: &Location,
    reduces: usize,
    bytes: u64,
    progress: &MultiProgress,
) -> anyhow::Result<BTreeSet<u32>> {
    let bar = bar(progress, bytes, "reduce");
    let Location::Store(dir) = output else { bail!("reduce output must be in the store") };
    maps.client.mkdir(dir, true).await?;
    let mut recomputed = BTreeSet::new();
    let mut todo: Vec<usize> = (0..reduces).collect();
    let mut backoff = RETRY_BACKOFF_START;
    for attempt in 0..TASK_ATTEMPTS {
        let tasks = todo.iter().map(|&reduce| {
            let (client, shuffle, bar, path) =
                (maps.client.clone(), maps.shuffle.clone(), bar.clone(), store_part(dir, reduce));
            let create = maps.create;
            async move {
                let records = read_partition(&shuffle, reduce as u32, None).await?;
                let sorted = sort_partition(records).await?;
                let len = sorted.len() as u64;
                write_part_with(&client, &path, attempt, Bytes::from(sorted), create).await?;
                bar.inc(len);
                Ok(())
            }
        });
        let results = run_all_settled("reduce", tasks).await;
        let failed: Vec<(usize, anyhow::Error)> =
            todo.iter().zip(results).filter_map(|(&reduce, result)| result.err().map(|e| (reduce, e))).collect();
        let Some((reduce, error)) = failed.first() else {
            bar.finish();
            return Ok(recomputed);
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
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(RETRY_BACKOFF_MAX);
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

/// A partition too large for the memory a task may use, or an allocation the system refused:
/// the task should be retried with more memory.
#[derive(Debug)]
pub struct OutOfMemory(pub String);

impl std::fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "out of memory: {}", self.0)
    }
}

impl std::error::Error for OutOfMemory {}

/// The committed records of one reduce partition (every map's winning attempt), located and
/// ready to read: [`PartitionInput::bytes`] says how many there are before any is read, so the
/// caller can check its memory and place them where it wants ([`PartitionInput::read_into`]).
pub struct PartitionInput {
    partition: u32,
    reader: ShuffleReader,
    bytes: u64,
}

impl PartitionInput {
    pub async fn open(shuffle: &Shuffle, partition: u32) -> anyhow::Result<PartitionInput> {
        let reader = shuffle.reader(partition..partition + 1, 0..u32::MAX).await?;
        let bytes = reader.outputs().iter().map(|o| o.partition_bytes.first().copied().unwrap_or(0)).sum();
        if bytes % RECORD_LEN as u64 != 0 {
            bail!("reduce {partition}: {bytes} bytes is not a whole number of records");
        }
        Ok(PartitionInput { partition, reader, bytes })
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Fails with [`OutOfMemory`] when `copies` copies of the records would exceed
    /// `memory_limit` bytes (a task's memory; `None`: no limit).
    pub fn check_memory(&self, copies: u64, memory_limit: Option<u64>) -> anyhow::Result<()> {
        let need = self.bytes.saturating_mul(copies);
        match memory_limit {
            Some(limit) if need > limit => Err(OutOfMemory(format!(
                "partition {} holds {} bytes; sorting it needs {need} bytes, the task may use {limit}",
                self.partition, self.bytes
            ))
            .into()),
            _ => Ok(()),
        }
    }

    /// Reads the records into `dst`, which must be exactly [`PartitionInput::bytes`] long.
    pub async fn read_into(self, dst: &mut [u8]) -> anyhow::Result<()> {
        if dst.len() as u64 != self.bytes {
            bail!("reduce {}: a buffer of {} bytes for {} bytes of records", self.partition, dst.len(), self.bytes);
        }
        let mut filled = 0;
        self.read_batches(|data| {
            dst[filled..filled + data.len()].copy_from_slice(data);
            filled += data.len();
        })
        .await
    }

    /// Hands every batch to `take`, in order, after checking it stays within the commits' total
    /// (so `take` may index by it), and checks the total at the end.
    async fn read_batches(mut self, mut take: impl FnMut(&[u8])) -> anyhow::Result<()> {
        let mut read = 0u64;
        while let Some(batch) = self.reader.next_batch().await? {
            read += batch.data.len() as u64;
            if read > self.bytes {
                bail!("reduce {}: the shuffle yielded more than its commits' {} bytes", self.partition, self.bytes);
            }
            take(&batch.data);
        }
        if read != self.bytes {
            bail!("reduce {}: read {read} bytes of the commits' {}", self.partition, self.bytes);
        }
        Ok(())
    }
}

/// Reads the committed records of reduce partition `partition` into one buffer. With
/// `memory_limit`, a partition whose records and sorted copy would not fit fails with
/// [`OutOfMemory`] before anything is read; so does a refused allocation.
pub async fn read_partition(shuffle: &Shuffle, partition: u32, memory_limit: Option<u64>) -> anyhow::Result<Vec<u8>> {
    let input = PartitionInput::open(shuffle, partition).await?;
    // The records and their sorted copy are both held at the peak.
    input.check_memory(2, memory_limit)?;
    let mut records = Vec::new();
    records.try_reserve_exact(input.bytes() as usize).map_err(|e| {
        OutOfMemory(format!("partition {partition}: allocating {} bytes for its records: {e}", input.bytes()))
    })?;
    input.read_batches(|data| records.extend_from_slice(data)).await?;
    Ok(records)
}

/// Sorts whole records by key on the CPU (off the async threads).
pub async fn sort_partition(records: Vec<u8>) -> anyhow::Result<Vec<u8>> {
    tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        out.try_reserve_exact(records.len())
            .map_err(|e| OutOfMemory(format!("allocating {} bytes for the sorted records: {e}", records.len())))?;
        try_sort_records(&records, &mut out).map_err(anyhow::Error::msg)?;
        Ok(out)
    })
    .await?
}

/// Writes one output part (sorted records) at `path` in the store, under the attempt's own name
/// first and then renamed into place, so the first whole attempt wins and a retry never meets a
/// dead attempt's half-written part.
pub async fn write_part(client: &Client, path: &str, attempt: u32, data: Bytes) -> anyhow::Result<()> {
    write_part_with(client, path, attempt, data, CreateOptions::default()).await
}

/// [`write_part`] stored as `create` says (e.g. 2 replicas).
pub async fn write_part_with(
    client: &Client,
    path: &str,
    attempt: u32,
    data: Bytes,
    create: CreateOptions,
) -> anyhow::Result<()> {
    let scratch = attempt_store_path(path, attempt);
    let mut writer = client.create_with_options(&scratch, true, create).await?;
    writer.expect_len(data.len() as u64);
    writer.write_bytes(data).await?;
    writer.close().await?;
    publish(Some(client), &Location::Store(scratch), &Location::Store(path.to_string()), attempt).await
}

/// The default number of map and of reduce tasks for `size_bytes`: parts of about 256 MiB, at
/// least two (one per core).
pub fn default_tasks(size_bytes: u64) -> usize {
    (size_bytes.div_ceil(256 << 20) as usize).max(2)
}

/// Where `tern teragen`/`teravalidate` read or write: the store unless `local`.
pub fn location(path: &str, local: bool) -> Location {
    if local {
        Location::Local(Path::new(path).to_path_buf())
    } else {
        Location::Store(path.to_string())
    }
}
