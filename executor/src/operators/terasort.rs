//! The TeraSort built-ins: `teragen`, `terasort-map`, `terasort-reduce` and
//! `terasort-reduce-gpu`. Each is a thin wrapper around the per-task function `tern terasort`
//! itself runs (`tern_terasort::tasks`), with the task's index, attempt and data from its
//! assignment.
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
use std::time::Instant;

use anyhow::{bail, Context};
use bytes::Bytes;
use indicatif::ProgressBar;
use tern_client::{Client, ErrorKind};
use tern_common::{ByteSize, OutOfMemory};
use tern_gpu::GpuError;
use tern_proto::sched as pb;
use tern_terasort::external::sort_partition_to_store;
use tern_terasort::tasks::{self, Location};
use tern_terasort::RECORD_LEN;

use super::{param, InputLost, Report, Services};

/// `teragen`: task i of N generates its share of `records` (or of `size` bytes, e.g. `1GiB`)
/// gensort records into `<output>/part-<i>`.
pub async fn teragen(task: &pb::Assignment, services: &Services) -> anyhow::Result<Report> {
    let records = match (param::<u64>(task, "records")?, param::<ByteSize>(task, "size")?) {
        (Some(records), None) => records,
        (None, Some(size)) => size.bytes() / RECORD_LEN as u64,
        _ => bail!("teragen needs exactly one of the parameters records and size"),
    };
    let dir = output_dir(task)?;
    let (first, count) = tasks::split_records(records, task.task_count.max(1) as usize)
        .get(task.task_index as usize)
        .copied()
        .with_context(|| format!("task index {} is not below the task count {}", task.task_index, task.task_count))?;
    let client = services.client_for(task).await?;
    let part = tasks::store_part(&dir, task.task_index as usize);
    if task.attempt > 0 && matches!(client.open(&part).await, Err(e) if e.kind() == ErrorKind::DataLost) {
        // Run again because the part was lost: the lost file would refuse the new one's rename.
        client.delete(&part, false).await.with_context(|| format!("removing the lost {part}"))?;
    }
    let target = Location::Store(part);
    let bar = ProgressBar::hidden();
    let summary =
        tasks::generate_part_with(Some(&client), first, count, &target, task.attempt, &bar, create_options(task))
            .await?;
    Ok(Report::succeeded(format!("{} records, checksum {:x}", summary.records, summary.checksum)))
}

/// `terasort-map`: map task i reads its input parts and pushes their records, range-partitioned,
/// into the output shuffle, then commits as attempt `attempt` (a commit lost to an earlier
/// attempt of the same map is success: that attempt's output is the map's).
pub async fn map(task: &pb::Assignment, services: &Services) -> anyhow::Result<Report> {
    let input = input_dir(task)?;
    if task.output_shuffle_id == 0 {
        bail!("terasort-map writes a shuffle, but the stage's output is {:?}", task.output_path);
    }
    let client = services.client_for(task).await?;
    let mine = my_parts(task, &client, &input).await?;
    match map_parts(task, &client, &mine).await {
        Err(e) if has_kind(&e, &[ErrorKind::DataLost, ErrorKind::NotFound]) => Err(lost_parts(&client, &mine, e).await),
        done => done,
    }
}

/// The input parts map task i of N reads, i, i+N, ..., each with the index of the teragen task
/// that wrote it: of `parts` (the map's parameter: teragen's task count) by name, so a part being
/// written again is missing rather than skipped; without it, of the parts listed.
async fn my_parts(task: &pb::Assignment, client: &Client, input: &str) -> anyhow::Result<Vec<(u32, String)>> {
    let (i, n) = (task.task_index as usize, task.task_count.max(1) as usize);
    if let Some(parts) = param::<usize>(task, "parts")? {
        return Ok((i..parts).step_by(n).map(|j| (j as u32, tasks::store_part(input, j))).collect());
    }
    let parts = tasks::list_parts(Some(client), &Location::Store(input.to_string())).await?;
    if parts.is_empty() {
        bail!("terasort-map: no part-* files in {input}");
    }
    let listed = parts.into_iter().enumerate().skip(i).step_by(n);
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

async fn map_parts(task: &pb::Assignment, client: &Client, mine: &[(u32, String)]) -> anyhow::Result<Report> {
    let shuffle = client.open_shuffle(task.output_shuffle_id.into()).await?;
    if task.attempt > 0 {
        // Run again because this map's committed output was lost: that commit would win over
        // this attempt's (an earlier attempt's commit stands), so it is forgotten first.
        let map = task.task_index;
        if !shuffle.lost_maps(0..shuffle.partitions(), map..map + 1).await?.is_empty() {
            shuffle.invalidate_maps(&[map]).await?;
        }
    }
    let paths: Vec<String> = mine.iter().map(|(_, path)| path.clone()).collect();
    let outcome =
        tasks::map_part(client, &shuffle, task.task_index, task.attempt, &paths, &ProgressBar::hidden()).await?;
    Ok(Report::succeeded(if outcome.committed {
        format!("{} parts mapped", mine.len())
    } else {
        format!("attempt {} had committed this map first; its output stands", outcome.winning_attempt)
    }))
}

/// `terasort-reduce` and `terasort-reduce-gpu`: reduce task i sorts its partitions, each into
/// output part p. The GPU operator sorts on its granted GPU (tern-gpu: the records are read into
/// pinned host memory and sorted in place by an NVRTC-compiled kernel); with no GPU granted or
/// none usable, a `gpu_optional` stage takes the CPU path and says so.
pub async fn reduce(task: &pb::Assignment, services: &Services, gpu: bool) -> anyhow::Result<Report> {
    if task.input_shuffle_id == 0 {
        bail!("a terasort reduce reads a shuffle, but the stage's input is {:?}", task.input_path);
    }
    match sort_partitions(task, services, gpu).await {
        Err(e) if has_kind(&e, &[ErrorKind::DataLost]) => Err(lost_maps(task, services, e).await),
        done => done,
    }
}

/// The maps whose output in this reduce's partitions is lost, as [`InputLost`] (or `e` when none
/// is: the loss was passing, and a plain retry will do).
async fn lost_maps(task: &pb::Assignment, services: &Services, e: anyhow::Error) -> anyhow::Error {
    let Ok(client) = services.client_for(task).await else { return e };
    let Ok(shuffle) = client.open_shuffle(task.input_shuffle_id.into()).await else { return e };
    let mut lost = BTreeSet::new();
    for partition in (task.task_index..shuffle.partitions()).step_by(task.task_count.max(1) as usize) {
        let range = partition..partition + 1;
        let (Ok(maps), Ok(committed)) =
            (shuffle.lost_maps(range.clone(), 0..u32::MAX).await, shuffle.lengths(range, 0..u32::MAX).await)
        else {
            return e;
        };
        lost.extend(maps);
        // Maps whose commit was forgotten and that have not committed again (another reader
        // found their output lost first) are as lost to this reduce.
        let committed: BTreeSet<u32> = committed.into_iter().map(|(map, _)| map).collect();
        lost.extend((0..task.input_maps).filter(|m| !committed.contains(m)));
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

async fn sort_partitions(task: &pb::Assignment, services: &Services, gpu: bool) -> anyhow::Result<Report> {
    let dir = output_dir(task)?;
    let (mut sorter, mut note) = (None, String::new());
    if gpu {
        match task.gpus.first() {
            Some(grant) => match services.sorter(&grant.address) {
                Ok(opened) => sorter = Some((grant.address.clone(), opened)),
                Err(GpuError::NoGpu(why)) if task.gpu_optional => {
                    note = format!("GPU {} is unusable ({why}); ran on the CPU", grant.address)
                }
                Err(e) => bail!("GPU {}: {e}", grant.address),
            },
            None if task.gpu_optional => note = "no GPU granted; ran on the CPU".into(),
            None => bail!("terasort-reduce-gpu needs a GPU and the task was granted none"),
        }
        if !note.is_empty() {
            tracing::info!(job = %task.job_id, stage = %task.stage, task = task.task_index, "{note}");
        }
    }
    let client = services.client_for(task).await?;
    let shuffle = client.open_shuffle(task.input_shuffle_id.into()).await?;
    let limit = task.granted.as_ref().map(|g| g.memory_bytes).filter(|&bytes| bytes > 0);
    let count = task.task_count.max(1);
    let (mut bytes, mut partitions) = (0u64, 0u32);
    let (mut read_seconds, mut sort_seconds) = (0.0, 0.0);
    for partition in (task.task_index..shuffle.partitions()).step_by(count as usize) {
        let path = tasks::store_part(&dir, partition as usize);
        let Some((address, sorter)) = &sorter else {
            // Half the task's memory for the sort (the rest is the process's own): a partition
            // larger than that is sorted in runs on scratch disk and merged.
            let input = tasks::PartitionInput::open(&shuffle, partition).await?;
            let memory = limit.map(|limit| limit / 2);
            let scratch = std::env::temp_dir();
            let sorted =
                sort_partition_to_store(&client, input, memory, &scratch, &path, task.attempt, create_options(task))
                    .await?;
            bytes += sorted.bytes;
            partitions += 1;
            continue;
        };
        // The GPU path reads the partition straight into pinned memory, sorts it there in place
        // and writes the output from it: no host copy besides the one out of the shuffle reader.
        let input = tasks::PartitionInput::open(&shuffle, partition).await?;
        input.check_memory(1, limit)?;
        let len = input.bytes() as usize;
        // Off the async threads: the lock waits while another task sorts on this GPU.
        let mut buf = tokio::task::spawn_blocking({
            let sorter = sorter.clone();
            move || sorter.lock().pinned_buffer(len)
        })
        .await?
        .map_err(gpu_error)?;
        let started = Instant::now();
        input.read_into(buf.as_mut()).await?;
        read_seconds += started.elapsed().as_secs_f64();
        bytes += buf.as_ref().len() as u64;
        let sorter = sorter.clone();
        let (buf, stats) = tokio::task::spawn_blocking(move || {
            let stats = sorter.lock().sort_pinned(&mut buf)?;
            Ok::<_, GpuError>((buf, stats))
        })
        .await?
        .map_err(gpu_error)?;
        tracing::info!(
            job = %task.job_id, task = task.task_index, partition, gpu = %address, device = %stats.device,
            records = stats.records, h2d_s = stats.h2d_seconds, sort_s = stats.sort_seconds,
            d2h_s = stats.d2h_seconds, "sorted a partition on the GPU"
        );
        sort_seconds += stats.sort_seconds;
        // Sent from the pinned buffer itself, which goes back to the sorter's pool once written.
        tasks::write_part_with(&client, &path, task.attempt, Bytes::from_owner(buf), create_options(task)).await?;
        partitions += 1;
    }
    let path = match &sorter {
        Some((address, _)) => format!("gpu:{address}"),
        None => "cpu".to_string(),
    };
    let mut message = format!("{partitions} partitions, {bytes} bytes sorted on {path}");
    if sorter.is_some() && read_seconds > 0.0 && sort_seconds > 0.0 {
        // The figures BENCHMARKS.md records for a GPU: how fast the shuffle feeds pinned memory,
        // and how fast the device sorts.
        message.push_str(&format!(
            " (shuffle read into pinned memory at {:.0} MB/s, sort at {:.0} MB/s on the device)",
            bytes as f64 / read_seconds / 1e6,
            bytes as f64 / sort_seconds / 1e6
        ));
    }
    if !note.is_empty() {
        message = format!("{message}; {note}");
    }
    Ok(Report { path, ..Report::succeeded(message) })
}

/// How the task's output files are stored: the job's copies.
fn create_options(task: &pb::Assignment) -> tern_client::CreateOptions {
    tern_client::CreateOptions { replicas: task.copies.max(1), ..Default::default() }
}

/// A GPU's error as the executor's contract has it: out of GPU (or pinned) memory is
/// [`OutOfMemory`], so the task is retried with more memory; the rest stay what they are.
pub(super) fn gpu_error(e: GpuError) -> anyhow::Error {
    match e {
        GpuError::OutOfMemory(why) => OutOfMemory(format!("GPU: {why}")).into(),
        e => e.into(),
    }
}

/// A stage's path in the store: absolute as given, relative to the job's root otherwise
/// (`./out` is `<job root>/out`, freed with the job).
fn store_path(task: &pb::Assignment, path: &str, what: &str) -> anyhow::Result<String> {
    if path.is_empty() {
        bail!("operator {} needs an {what} path", task.operator.as_ref().map(|o| o.name.as_str()).unwrap_or_default());
    }
    Ok(if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{}/{}", task.tern_job_root.trim_end_matches('/'), path.trim_start_matches("./"))
    })
}

fn input_dir(task: &pb::Assignment) -> anyhow::Result<String> {
    store_path(task, &task.input_path, "input")
}

fn output_dir(task: &pb::Assignment) -> anyhow::Result<String> {
    store_path(task, &task.output_path, "output")
}
