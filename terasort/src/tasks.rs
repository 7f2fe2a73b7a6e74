//! TeraSort's per-task functions on a Tern cluster, one definition for `tern teragen`,
//! `tern teravalidate`, the in-process driver ([`crate::driver`]) and the executor's TeraSort
//! operators: generate a part, map a part into the shuffle, read a reduce partition, sort it,
//! write an output part, and publish a part once whole (an attempt writes under its own name and
//! is renamed into place, so the first whole attempt wins). Also the whole-dataset steps built on
//! them: [`teragen`] and [`teravalidate`] over every part, in parallel.
//!
//! Memory: a reduce partition larger than the sort's memory is sorted in runs on scratch disk
//! ([`crate::external`]); an allocation the system refuses fails with
//! [`tern_common::OutOfMemory`], which the executor reports as OOM (the scheduler then retries
//! with more memory).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use bytes::{Bytes, BytesMut};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use tern_client::{Client, CommitOutcome, CreateOptions, MapWriterOptions, Shuffle, ShuffleReader};
use tern_common::OutOfMemory;
use tokio::sync::Semaphore;

use crate::gensort::{self, RECORD_LEN};
use crate::partition::RangePartitioner;
use crate::sort::try_sort_records;
use crate::validate::{Summary, Validator};

/// Records generated per call into the generator (about 8 MB).
const GENERATE_CHUNK_RECORDS: u64 = 80_000;
/// Bytes of one map task's records bucketed before they are handed to the shuffle writer.
const MAP_CHUNK_BYTES: usize = 4 << 20;
/// Records per shuffle write: a batch closes when the next write would not fit, so with 64 KB
/// writes a 1 MiB batch is at least 94% full.
const WRITE_RECORDS: usize = 655;

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
pub(crate) async fn run_all<T, F>(what: &str, tasks: impl IntoIterator<Item = F>) -> anyhow::Result<Vec<T>>
where
    F: std::future::Future<Output = anyhow::Result<T>> + Send + 'static,
    T: Send + 'static,
{
    run_all_settled(what, tasks).await.into_iter().collect()
}

/// As [`run_all`], but every task runs to its end whatever the others do: each one's result.
pub(crate) async fn run_all_settled<T, F>(what: &str, tasks: impl IntoIterator<Item = F>) -> Vec<anyhow::Result<T>>
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

pub(crate) fn bar(progress: &MultiProgress, total: u64, phase: &str) -> ProgressBar {
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
        async move { generate_part_retried(client.as_ref(), first, count, &target, &bar, create).await }
    });
    let summary = run_all("teragen", tasks).await?.iter().fold(Summary::default(), |all, part| all.merge(part));
    bar.finish();
    Ok(summary)
}

/// Attempts of one teragen part before teragen fails. A part whose storage server was cut off
/// mid-write fails at the block's deadline; the metadata server has declared the server dead by
/// then (its heartbeat timeout is shorter), so the next attempt's blocks go to live servers.
const PART_ATTEMPTS: u32 = 8;
const PART_RETRY_FIRST: std::time::Duration = std::time::Duration::from_millis(250);
const PART_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// [`generate_part_with`], each failed attempt followed by a new one (under its own name, so
/// the first whole attempt wins), at most [`PART_ATTEMPTS`] in all. Only the first attempt
/// counts on `bar`.
async fn generate_part_retried(
    client: Option<&Client>,
    first: u64,
    count: u64,
    target: &Location,
    bar: &ProgressBar,
    create: CreateOptions,
) -> anyhow::Result<Summary> {
    let mut backoff = tern_common::Backoff::new(PART_RETRY_FIRST, PART_RETRY_MAX);
    for attempt in 0..PART_ATTEMPTS {
        let shown = if attempt == 0 { bar.clone() } else { ProgressBar::hidden() };
        match generate_part_with(client, first, count, target, attempt, &shown, create).await {
            Ok(summary) => return Ok(summary),
            // A local disk's failure is not one a retry mends.
            Err(_) if attempt + 1 < PART_ATTEMPTS && matches!(target, Location::Store(_)) => {
                tokio::time::sleep(backoff.next().expect("an unbounded backoff always has a next delay")).await;
            }
            Err(e) => return Err(e.context(format!("teragen part {target:?}: attempt {attempt} failed"))),
        }
    }
    unreachable!("the last attempt returns")
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
            let (records, checksum) = crate::validate::checksum(&chunk);
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

pub(crate) fn attempt_store_path(path: &str, attempt: u32) -> String {
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

/// The committed records of one reduce partition (every map's winning attempt), located and
/// ready to read: [`PartitionInput::bytes`] says how many there are before any is read, so the
/// caller can check its memory and place them where it wants ([`PartitionInput::read_into`]).
pub struct PartitionInput {
    partition: u32,
    reader: ShuffleReader,
    bytes: u64,
    /// Bytes read so far.
    read: u64,
}

impl PartitionInput {
    pub async fn open(shuffle: &Shuffle, partition: u32) -> anyhow::Result<PartitionInput> {
        let reader = shuffle.reader(partition..partition + 1, 0..u32::MAX).await?;
        let committed: BTreeSet<u32> = reader.outputs().iter().map(|o| o.map_index).collect();
        let missing: Vec<u32> = (0..reader.map_count()).filter(|m| !committed.contains(m)).collect();
        if !missing.is_empty() {
            // A map whose lost output is being recomputed: sorting without it would drop records.
            let why =
                format!("reduce {partition}: maps {missing:?} of {} have no committed output", reader.map_count());
            return Err(tern_client::Error::new(tern_client::ErrorKind::DataLost, why).into());
        }
        let bytes = reader.outputs().iter().map(|o| o.partition_bytes.first().copied().unwrap_or(0)).sum();
        if bytes % RECORD_LEN as u64 != 0 {
            bail!("reduce {partition}: {bytes} bytes is not a whole number of records");
        }
        Ok(PartitionInput { partition, reader, bytes, read: 0 })
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

    /// Hands every batch to `take`, in order (see [`PartitionInput::next_batch`]).
    async fn read_batches(mut self, mut take: impl FnMut(&[u8])) -> anyhow::Result<()> {
        while let Some(batch) = self.next_batch().await? {
            take(&batch);
        }
        Ok(())
    }

    /// The next batch of records, checked to stay within the commits' total (so a caller may
    /// index by it); `None` at the end, which is an error unless the total was read.
    pub async fn next_batch(&mut self) -> anyhow::Result<Option<Bytes>> {
        let Some(batch) = self.reader.next_batch().await? else {
            if self.read != self.bytes {
                bail!("reduce {}: read {} bytes of the commits' {}", self.partition, self.read, self.bytes);
            }
            return Ok(None);
        };
        self.read += batch.data.len() as u64;
        if self.read > self.bytes {
            bail!("reduce {}: the shuffle yielded more than its commits' {} bytes", self.partition, self.bytes);
        }
        Ok(Some(batch.data))
    }
}

/// Reads all of `input`'s records into one buffer.
pub(crate) async fn read_partition_input(input: PartitionInput) -> anyhow::Result<Vec<u8>> {
    let mut records = Vec::new();
    records.try_reserve_exact(input.bytes() as usize).map_err(|e| {
        OutOfMemory(format!("partition {}: allocating {} bytes for its records: {e}", input.partition, input.bytes()))
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
    publish_part(client, &scratch, path, attempt).await
}

/// Publishes the whole part written at `scratch` (attempt `attempt`) as `path`; see [`publish`].
pub(crate) async fn publish_part(client: &Client, scratch: &str, path: &str, attempt: u32) -> anyhow::Result<()> {
    publish(Some(client), &Location::Store(scratch.to_string()), &Location::Store(path.to_string()), attempt).await
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
