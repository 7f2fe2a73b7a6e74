//! TeraSort's stages on Tern's scheduler: what one task of `teragen`, `terasort-map`,
//! `terasort-reduce` and `terasort-reduce-gpu` does. Each is the per-task function `tern terasort`
//! itself runs ([`crate::tasks`]), with the task's index, attempt and data; the executor only adapts
//! its assignment to a [`StageTask`] and hands in the GPU, if any, as a [`DeviceSorter`] (tern-gpu
//! depends on this crate for the record layout, so it cannot be called from here).
//!
//! Tasks and parts: teragen task i of N writes part i; map task i of N reads the input parts
//! i, i+N, ... (so any number of parts works with any number of maps); reduce task i of N
//! sorts partitions i, i+N, ... each into output part p (so the parts in name order are the
//! sorted data).
//!
//! Lineage: a map that finds an input part lost names the teragen task that wrote it, and a
//! reduce that finds map output lost names those maps ([`InputLost`]); the scheduler runs them
//! again. Such a rerun first clears what the lost run left (the lost part, the lost commit), which
//! would otherwise refuse its output.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use bytes::Bytes;
use indicatif::ProgressBar;
use tern_client::{Client, CreateOptions, ErrorKind, ShuffleId};
use tern_common::InputLost;

use crate::external::sort_partition_to_store;
use crate::tasks::{self, Location};

/// One task of a TeraSort stage.
#[derive(Debug, Clone)]
pub struct StageTask {
    /// The scheduler job's id (for logs).
    pub job: String,
    /// The task's index in its stage, and the stage's task count (at least 1).
    pub index: u32,
    pub count: u32,
    /// 0 for the first run; more when run again (after a failure or a lost output).
    pub attempt: u32,
    /// Copies of each file it writes.
    pub copies: u32,
    /// The memory it was granted; `None` when unlimited.
    pub memory_bytes: Option<u64>,
}

impl StageTask {
    fn create_options(&self) -> CreateOptions {
        CreateOptions { replicas: self.copies.max(1), ..Default::default() }
    }

    /// Indexes `i, i+N, ...` below `limit`: this task's share of parts or partitions.
    fn share(&self, limit: u32) -> impl Iterator<Item = u32> {
        (self.index..limit).step_by(self.count.max(1) as usize)
    }
}

/// A sorter with memory of its own (a GPU), handed in by whoever runs the task. Its calls block
/// (the device is shared by the tasks granted fractions of it), so they run off the async threads.
pub trait DeviceSorter: Send + Sync + 'static {
    /// Host memory the device copies from at full speed (pinned); sent as it is once sorted.
    type Buffer: AsRef<[u8]> + AsMut<[u8]> + Send + 'static;

    /// Where it is, as the task was granted it (a GPU's address).
    fn address(&self) -> &str;

    /// A buffer of `len` bytes. Out of memory is [`tern_common::OutOfMemory`].
    fn buffer(&self, len: usize) -> anyhow::Result<Self::Buffer>;

    /// Sorts the records in `buffer` in place.
    fn sort(&self, buffer: &mut Self::Buffer) -> anyhow::Result<DeviceSortStats>;
}

/// What one [`DeviceSorter::sort`] took.
#[derive(Debug, Clone, Default)]
pub struct DeviceSortStats {
    /// The device's name and address.
    pub device: String,
    pub records: u64,
    pub h2d_seconds: f64,
    pub sort_seconds: f64,
    pub d2h_seconds: f64,
}

/// `teragen`: task i of N generates its share of `records` gensort records into `<dir>/part-<i>`.
pub async fn teragen(client: &Client, task: &StageTask, dir: &str, records: u64) -> anyhow::Result<String> {
    let (first, count) = tasks::split_records(records, task.count.max(1) as usize)
        .get(task.index as usize)
        .copied()
        .with_context(|| format!("task index {} is not below the task count {}", task.index, task.count))?;
    let part = tasks::store_part(dir, task.index as usize);
    if task.attempt > 0 && matches!(client.open(&part).await, Err(e) if e.kind() == ErrorKind::DataLost) {
        // Run again because the part was lost: the lost file would refuse the new one's rename.
        client.delete(&part, false).await.with_context(|| format!("removing the lost {part}"))?;
    }
    let target = Location::Store(part);
    let bar = ProgressBar::hidden();
    let summary =
        tasks::generate_part_with(Some(client), first, count, &target, task.attempt, &bar, task.create_options())
            .await?;
    Ok(format!("{} records, checksum {:x}", summary.records, summary.checksum))
}

/// `terasort-map`: map task i reads its input parts of `input` and pushes their records,
/// range-partitioned, into shuffle `shuffle`, then commits as attempt `attempt` (a commit lost to
/// an earlier attempt of the same map is success: that attempt's output is the map's). `parts`,
/// when given, is teragen's task count: the parts are then taken by name, so a part being written
/// again is missing rather than skipped.
pub async fn map(
    client: &Client,
    task: &StageTask,
    input: &str,
    parts: Option<usize>,
    shuffle: u64,
) -> anyhow::Result<String> {
    let mine = my_parts(task, client, input, parts).await?;
    match map_parts(task, client, &mine, shuffle).await {
        Err(e) if has_kind(&e, &[ErrorKind::DataLost, ErrorKind::NotFound]) => Err(lost_parts(client, &mine, e).await),
        done => done,
    }
}

/// The input parts map task i of N reads, i, i+N, ..., each with the index of the teragen task
/// that wrote it.
async fn my_parts(
    task: &StageTask,
    client: &Client,
    input: &str,
    parts: Option<usize>,
) -> anyhow::Result<Vec<(u32, String)>> {
    if let Some(parts) = parts {
        return Ok(task.share(parts as u32).map(|j| (j, tasks::store_part(input, j as usize))).collect());
    }
    let parts = tasks::list_parts(Some(client), &Location::Store(input.to_string())).await?;
    if parts.is_empty() {
        bail!("terasort-map: no part-* files in {input}");
    }
    let listed = parts.into_iter().enumerate().skip(task.index as usize).step_by(task.count.max(1) as usize);
    Ok(listed
        .filter_map(|(j, (part, _))| match part {
            Location::Store(path) => Some((j as u32, path)),
            Location::Local(_) => None,
        })
        .collect())
}

/// The teragen tasks whose part among this map's inputs is lost or missing, as [`InputLost`] (or
/// `e` when none is: the loss was passing, and a plain retry will do).
async fn lost_parts(client: &Client, mine: &[(u32, String)], e: anyhow::Error) -> anyhow::Error {
    let mut lost = Vec::new();
    for (j, path) in mine {
        if let Err(e) = client.open(path).await {
            if matches!(e.kind(), ErrorKind::DataLost | ErrorKind::NotFound) {
                lost.push(*j);
            }
        }
    }
    if lost.is_empty() {
        return e;
    }
    InputLost { tasks: lost, why: format!("{e:#}") }.into()
}

async fn map_parts(task: &StageTask, client: &Client, mine: &[(u32, String)], shuffle: u64) -> anyhow::Result<String> {
    let shuffle = client.open_shuffle(ShuffleId::from_wire(shuffle)).await?;
    if task.attempt > 0 {
        // Run again because this map's committed output was lost: that commit would win over
        // this attempt's (an earlier attempt's commit stands), so it is forgotten first.
        let map = task.index;
        if !shuffle.lost_maps(0..shuffle.partitions(), map..map + 1).await?.is_empty() {
            shuffle.invalidate_maps(&[map]).await?;
        }
    }
    let paths: Vec<String> = mine.iter().map(|(_, path)| path.clone()).collect();
    let outcome = tasks::map_part(client, &shuffle, task.index, task.attempt, &paths, &ProgressBar::hidden()).await?;
    Ok(if outcome.committed {
        format!("{} parts mapped", mine.len())
    } else {
        format!("attempt {} had committed this map first; its output stands", outcome.winning_attempt)
    })
}

/// `terasort-reduce` and `terasort-reduce-gpu`: reduce task i sorts its partitions of shuffle
/// `shuffle` (written by `maps` maps), each into output part p of `output`. With a `device`, the
/// records are read into its memory and sorted there in place; without one, on the CPU (a
/// partition larger than half the task's memory in runs on scratch disk, merged).
pub async fn reduce<D: DeviceSorter>(
    client: &Client,
    task: &StageTask,
    shuffle: u64,
    maps: u32,
    output: &str,
    device: Option<Arc<D>>,
) -> anyhow::Result<String> {
    match sort_partitions(client, task, shuffle, output, device).await {
        Err(e) if has_kind(&e, &[ErrorKind::DataLost]) => Err(lost_maps(client, task, shuffle, maps, e).await),
        done => done,
    }
}

/// The maps whose output in this reduce's partitions is lost, as [`InputLost`] (or `e` when none
/// is: the loss was passing, and a plain retry will do).
async fn lost_maps(client: &Client, task: &StageTask, shuffle: u64, maps: u32, e: anyhow::Error) -> anyhow::Error {
    let Ok(shuffle) = client.open_shuffle(ShuffleId::from_wire(shuffle)).await else { return e };
    let mut lost = BTreeSet::new();
    for partition in task.share(shuffle.partitions()) {
        let range = partition..partition + 1;
        let (Ok(lost_here), Ok(committed)) =
            (shuffle.lost_maps(range.clone(), 0..u32::MAX).await, shuffle.lengths(range, 0..u32::MAX).await)
        else {
            return e;
        };
        lost.extend(lost_here);
        // Maps whose commit was forgotten and that have not committed again (another reader
        // found their output lost first) are as lost to this reduce.
        let committed: BTreeSet<u32> = committed.into_iter().map(|(map, _)| map).collect();
        lost.extend((0..maps).filter(|m| !committed.contains(m)));
    }
    if lost.is_empty() {
        return e;
    }
    InputLost { tasks: lost.into_iter().collect(), why: format!("{e:#}") }.into()
}

/// Whether a Tern client error of one of `kinds` is somewhere in `e`'s chain.
fn has_kind(e: &anyhow::Error, kinds: &[ErrorKind]) -> bool {
    e.chain().any(|c| c.downcast_ref::<tern_client::Error>().is_some_and(|e| kinds.contains(&e.kind())))
}

async fn sort_partitions<D: DeviceSorter>(
    client: &Client,
    task: &StageTask,
    shuffle: u64,
    output: &str,
    device: Option<Arc<D>>,
) -> anyhow::Result<String> {
    let shuffle = client.open_shuffle(ShuffleId::from_wire(shuffle)).await?;
    let (mut bytes, mut partitions) = (0u64, 0u32);
    let (mut read_seconds, mut sort_seconds) = (0.0, 0.0);
    for partition in task.share(shuffle.partitions()) {
        let path = tasks::store_part(output, partition as usize);
        let input = tasks::PartitionInput::open(&shuffle, partition).await?;
        let Some(device) = &device else {
            // Half the task's memory for the sort (the rest is the process's own): a partition
            // larger than that is sorted in runs on scratch disk and merged.
            let memory = task.memory_bytes.map(|limit| limit / 2);
            let scratch = std::env::temp_dir();
            let sorted =
                sort_partition_to_store(client, input, memory, &scratch, &path, task.attempt, task.create_options())
                    .await?;
            bytes += sorted.bytes;
            partitions += 1;
            continue;
        };
        // The device path reads the partition straight into the device's host memory, sorts it
        // there in place and writes the output from it: no host copy besides the one out of the
        // shuffle reader.
        input.check_memory(1, task.memory_bytes)?;
        let len = input.bytes() as usize;
        let mut buf = tokio::task::spawn_blocking({
            let device = device.clone();
            move || device.buffer(len)
        })
        .await??;
        let started = Instant::now();
        input.read_into(buf.as_mut()).await?;
        read_seconds += started.elapsed().as_secs_f64();
        bytes += buf.as_ref().len() as u64;
        let (buf, stats) = tokio::task::spawn_blocking({
            let device = device.clone();
            move || device.sort(&mut buf).map(|stats| (buf, stats))
        })
        .await??;
        tracing::info!(
            job = %task.job, task = task.index, partition, gpu = %device.address(), device = %stats.device,
            records = stats.records, h2d_s = stats.h2d_seconds, sort_s = stats.sort_seconds,
            d2h_s = stats.d2h_seconds, "sorted a partition on the GPU"
        );
        sort_seconds += stats.sort_seconds;
        // Sent from the device's buffer itself, which goes back to its pool once written.
        tasks::write_part_with(client, &path, task.attempt, Bytes::from_owner(buf), task.create_options()).await?;
        partitions += 1;
    }
    let on = match &device {
        Some(device) => format!("gpu:{}", device.address()),
        None => "cpu".to_string(),
    };
    let mut message = format!("{partitions} partitions, {bytes} bytes sorted on {on}");
    if device.is_some() && read_seconds > 0.0 && sort_seconds > 0.0 {
        // The figures BENCHMARKS.md records for a GPU: how fast the shuffle feeds pinned memory,
        // and how fast the device sorts.
        message.push_str(&format!(
            " (shuffle read into pinned memory at {:.0} MB/s, sort at {:.0} MB/s on the device)",
            bytes as f64 / read_seconds / 1e6,
            bytes as f64 / sort_seconds / 1e6
        ));
    }
    Ok(message)
}
