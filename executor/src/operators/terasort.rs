//! The TeraSort built-ins: `teragen`, `terasort-map`, `terasort-reduce` and
//! `terasort-reduce-gpu`. What a task does is `tern_terasort::stages` (the per-task functions
//! `tern terasort` itself runs); this adapts an assignment to it: the task's index, attempt, grant
//! and paths, and for the GPU reduce which GPU sorts (or why the CPU does).

use std::sync::Arc;

use anyhow::bail;
use tern_common::{ByteSize, OutOfMemory};
use tern_gpu::{GpuError, GpuSorter};
use tern_proto::sched as pb;
use tern_terasort::stages::{self, DeviceSortStats, DeviceSorter, StageTask};
use tern_terasort::RECORD_LEN;

use super::{param, Report, Services};

/// `teragen`: task i of N generates its share of `records` (or of `size` bytes, e.g. `1GiB`)
/// gensort records into `<output>/part-<i>`.
pub async fn teragen(task: &pb::Assignment, services: &Services) -> anyhow::Result<Report> {
    let records = match (param::<u64>(task, "records")?, param::<ByteSize>(task, "size")?) {
        (Some(records), None) => records,
        (None, Some(size)) => size.bytes() / RECORD_LEN as u64,
        _ => bail!("teragen needs exactly one of the parameters records and size"),
    };
    let dir = output_dir(task)?;
    let client = services.client_for(task).await?;
    Ok(Report::succeeded(stages::teragen(&client, &stage_task(task), &dir, records).await?))
}

/// `terasort-map`: map task i pushes its input parts into the output shuffle (`parts`: teragen's
/// task count, when the parts are to be taken by name).
pub async fn map(task: &pb::Assignment, services: &Services) -> anyhow::Result<Report> {
    let input = input_dir(task)?;
    if task.output_shuffle_id == 0 {
        bail!("terasort-map writes a shuffle, but the stage's output is {:?}", task.output_path);
    }
    let parts = param::<usize>(task, "parts")?;
    let client = services.client_for(task).await?;
    let message = stages::map(&client, &stage_task(task), &input, parts, task.output_shuffle_id).await?;
    Ok(Report::succeeded(message))
}

/// `terasort-reduce` and `terasort-reduce-gpu`: the GPU operator sorts on its granted GPU
/// (tern-gpu: the records are read into pinned host memory and sorted in place by an
/// NVRTC-compiled kernel); with no GPU granted or none usable, a `gpu_optional` stage takes the
/// CPU path and says so.
pub async fn reduce(task: &pb::Assignment, services: &Services, gpu: bool) -> anyhow::Result<Report> {
    if task.input_shuffle_id == 0 {
        bail!("a terasort reduce reads a shuffle, but the stage's input is {:?}", task.input_path);
    }
    let dir = output_dir(task)?;
    let (mut device, mut note) = (None, String::new());
    if gpu {
        match task.gpus.first() {
            Some(grant) => match services.sorter(&grant.address) {
                Ok(sorter) => device = Some(Arc::new(Gpu { address: grant.address.clone(), sorter })),
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
    let path = device.as_ref().map_or_else(|| "cpu".to_string(), |gpu| format!("gpu:{}", gpu.address));
    let client = services.client_for(task).await?;
    let stage_task = stage_task(task);
    let mut message =
        stages::reduce(&client, &stage_task, task.input_shuffle_id, task.input_maps, &dir, device).await?;
    if !note.is_empty() {
        message = format!("{message}; {note}");
    }
    Ok(Report { path, ..Report::succeeded(message) })
}

/// The task as TeraSort's stage functions take it.
fn stage_task(task: &pb::Assignment) -> StageTask {
    StageTask {
        job: task.job_id.clone(),
        index: task.task_index,
        count: task.task_count.max(1),
        attempt: task.attempt,
        copies: task.copies.max(1),
        memory_bytes: task.granted.as_ref().map(|g| g.memory_bytes).filter(|&bytes| bytes > 0),
    }
}

/// A granted GPU as TeraSort's reduce takes it. Tasks sharing a GPU (fractions of it) take turns
/// on its sorter.
struct Gpu {
    address: String,
    sorter: Arc<parking_lot::Mutex<GpuSorter>>,
}

impl DeviceSorter for Gpu {
    type Buffer = tern_gpu::PinnedBuffer;

    fn address(&self) -> &str {
        &self.address
    }

    fn buffer(&self, len: usize) -> anyhow::Result<Self::Buffer> {
        self.sorter.lock().pinned_buffer(len).map_err(gpu_error)
    }

    fn sort(&self, buffer: &mut Self::Buffer) -> anyhow::Result<DeviceSortStats> {
        let stats = self.sorter.lock().sort_pinned(buffer).map_err(gpu_error)?;
        Ok(DeviceSortStats {
            device: stats.device,
            records: stats.records,
            h2d_seconds: stats.h2d_seconds,
            sort_seconds: stats.sort_seconds,
            d2h_seconds: stats.d2h_seconds,
        })
    }
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
