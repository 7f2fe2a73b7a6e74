//! Sorting a reduce partition larger than the memory it may use: sorted runs on local scratch
//! disk, merged into the output part while it is written to the store.
//!
//! Memory bound, for a budget of `memory` bytes: two thirds hold a run being sorted (the run,
//! its sorted copy and the sort's 16-byte entry per record: 216 bytes per 100-byte record); one
//! third holds the read buffers of a merge, [`MERGE_READ_BYTES`] per run, which sets the merge's
//! fan-in (2 to [`MAX_FAN_IN`]). Runs are merged as they come, level by level (fan-in runs of one
//! level make one of the next), so a partition of any size keeps few runs and files open. The
//! last merge streams into the output part, [`OUTPUT_CHUNKS`] chunks of [`OUTPUT_CHUNK_BYTES`]
//! at most waiting for the store. So the sort holds at most `memory` plus about 12 MiB, and a
//! partition that fits the budget whole is sorted in memory as before.
//!
//! Runs live in unnamed temporary files (`O_TMPFILE` where the filesystem has it) in the scratch
//! directory: the kernel frees them when the sort ends, however it ends. Records with equal keys
//! keep their shuffle order (runs are cut in order, only neighbouring runs are merged, and a merge
//! prefers the earlier run), as the in-memory sort keeps them.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use bytes::Bytes;
use tern_client::{Client, CreateOptions};
use tern_common::OutOfMemory;

use crate::gensort::{KEY_LEN, RECORD_LEN};
use crate::sort::try_sort_records;
use crate::tasks::{
    attempt_store_path, publish_part, read_partition_input, sort_partition, write_part_with, PartitionInput,
};

/// Read buffer per run while merging.
pub const MERGE_READ_BYTES: usize = 1 << 20;
/// Most runs one merge reads at once (and files one sort keeps open).
pub const MAX_FAN_IN: usize = 256;
/// Merged records handed to the store's writer at once...
pub const OUTPUT_CHUNK_BYTES: usize = 4 << 20;
/// ...and how many may wait for it.
pub const OUTPUT_CHUNKS: usize = 2;
/// Bytes an in-memory sort holds per 100 bytes of records: the records, their sorted copy, the
/// entries.
const SORT_BYTES_PER_100: u64 = 216;

/// How a partition was sorted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sorted {
    /// Bytes of records.
    pub bytes: u64,
    /// Sorted runs written; 0 when it was sorted in memory.
    pub runs: usize,
}

/// Sorts `input`'s records into the part at `path` in the store (as attempt `attempt`, published
/// as [`write_part_with`] does), holding at most `memory` bytes (`None`: no bound, in memory);
/// runs go to `scratch`. See the module docs for the bound.
pub async fn sort_partition_to_store(
    client: &Client,
    input: PartitionInput,
    memory: Option<u64>,
    scratch: &Path,
    path: &str,
    attempt: u32,
    create: CreateOptions,
) -> anyhow::Result<Sorted> {
    let bytes = input.bytes();
    if memory.is_none_or(|memory| bytes.saturating_mul(SORT_BYTES_PER_100) / 100 <= memory) {
        let records = read_partition_input(input).await?;
        let sorted = sort_partition(records).await?;
        write_part_with(client, path, attempt, Bytes::from(sorted), create).await?;
        return Ok(Sorted { bytes, runs: 0 });
    }
    let memory = memory.expect("bounded: checked above");
    let run_bytes = usize::try_from(memory / 3 * 2 / SORT_BYTES_PER_100 * 100)? / RECORD_LEN * RECORD_LEN;
    if run_bytes == 0 {
        return Err(OutOfMemory(format!("a sort memory of {memory} bytes holds no run of records")).into());
    }
    let fan_in = (memory / 3 / MERGE_READ_BYTES as u64).clamp(2, MAX_FAN_IN as u64) as usize;
    let mut runs = Runs { scratch: scratch.to_path_buf(), fan_in, runs: Vec::new(), written: 0 };
    runs.read_and_sort(input, run_bytes).await?;
    let written = runs.written;
    let runs = runs.finish().await?;
    // Merged off the async threads, chunk by chunk into the part as it is written.
    let (chunks, mut merged) = tokio::sync::mpsc::channel::<Bytes>(OUTPUT_CHUNKS);
    let merging = tokio::task::spawn_blocking(move || merge(runs, |chunk| chunks.blocking_send(chunk).is_ok()));
    let scratch_part = attempt_store_path(path, attempt);
    let mut writer = client.create_with_options(&scratch_part, true, create).await?;
    writer.expect_len(bytes);
    while let Some(chunk) = merged.recv().await {
        writer.write_bytes(chunk).await?;
    }
    let merged = merging.await?.context("merging the sorted runs")?;
    anyhow::ensure!(merged == bytes, "merged {merged} bytes of the partition's {bytes}");
    writer.close().await?;
    publish_part(client, &scratch_part, path, attempt).await?;
    Ok(Sorted { bytes, runs: written })
}

/// A sort's runs on scratch disk, each with its merge level, in input order.
struct Runs {
    scratch: PathBuf,
    fan_in: usize,
    runs: Vec<(u32, File)>,
    /// Runs sorted and written (merged ones not counted).
    written: usize,
}

impl Runs {
    /// Reads `input` in runs of `run_bytes`, each sorted into a scratch file.
    async fn read_and_sort(&mut self, mut input: PartitionInput, run_bytes: usize) -> anyhow::Result<()> {
        let (mut run, mut sorted) = (Vec::new(), Vec::new());
        run.try_reserve_exact(run_bytes).map_err(|e| OutOfMemory(format!("a sort run of {run_bytes} bytes: {e}")))?;
        while let Some(batch) = input.next_batch().await? {
            // Batches need not end on a record: runs are cut by bytes, the rest carried over.
            let mut data = &batch[..];
            while !data.is_empty() {
                let take = data.len().min(run_bytes - run.len());
                run.extend_from_slice(&data[..take]);
                data = &data[take..];
                if run.len() == run_bytes {
                    (run, sorted) = self.add(run, sorted).await?;
                }
            }
        }
        if !run.is_empty() {
            self.add(run, sorted).await?;
        }
        Ok(())
    }

    /// Sorts `run` into a new run file, merging the last runs where a level fills; gives the
    /// buffers back, emptied.
    async fn add(&mut self, run: Vec<u8>, sorted: Vec<u8>) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
        let file = scratch_file(&self.scratch)?;
        let (run, sorted, file) = tokio::task::spawn_blocking(move || sort_run(run, sorted, file)).await??;
        self.runs.push((0, file));
        self.written += 1;
        loop {
            let n = self.runs.len();
            let level = self.runs[n - 1].0;
            if n < self.fan_in || self.runs[n - self.fan_in..].iter().any(|(l, _)| *l != level) {
                return Ok((run, sorted));
            }
            self.merge_last(self.fan_in, level + 1).await?;
        }
    }

    /// Merges the last `count` runs into one of `level`.
    async fn merge_last(&mut self, count: usize, level: u32) -> anyhow::Result<()> {
        let last: Vec<File> = self.runs.split_off(self.runs.len() - count).into_iter().map(|(_, f)| f).collect();
        let out = scratch_file(&self.scratch)?;
        let merged = tokio::task::spawn_blocking(move || merge_into(last, out)).await??;
        self.runs.push((level, merged));
        Ok(())
    }

    /// At most `fan_in` runs, for the last merge.
    async fn finish(mut self) -> anyhow::Result<Vec<File>> {
        while self.runs.len() > self.fan_in {
            let level = self.runs[self.runs.len() - 1].0 + 1;
            self.merge_last(self.fan_in, level).await?;
        }
        Ok(self.runs.into_iter().map(|(_, file)| file).collect())
    }
}

/// An unnamed file in `scratch`, gone when closed.
fn scratch_file(scratch: &Path) -> anyhow::Result<File> {
    tempfile::tempfile_in(scratch).with_context(|| format!("a scratch file for a sort run in {}", scratch.display()))
}

/// Merges `runs` into `out`, rewound.
fn merge_into(runs: Vec<File>, out: File) -> anyhow::Result<File> {
    let mut writer = BufWriter::with_capacity(MERGE_READ_BYTES, out);
    let mut failed = None;
    merge(runs, |chunk| match writer.write_all(&chunk) {
        Ok(()) => true,
        Err(e) => {
            failed = Some(e);
            false
        }
    })
    .map_err(|e| failed.take().map_or(e, |io| anyhow::Error::new(io).context("writing a merged run")))?;
    rewound(writer)
}

/// The file behind `writer`, flushed and rewound for reading.
fn rewound(writer: BufWriter<File>) -> anyhow::Result<File> {
    let mut file = writer.into_inner().map_err(|e| e.into_error()).context("writing a sorted run")?;
    file.seek(SeekFrom::Start(0))?;
    Ok(file)
}

/// Sorts `run` into `sorted` and writes it to `file`; gives both buffers back (emptied) for the
/// next run, and the file rewound.
fn sort_run(mut run: Vec<u8>, mut sorted: Vec<u8>, file: File) -> anyhow::Result<(Vec<u8>, Vec<u8>, File)> {
    try_sort_records(&run, &mut sorted).map_err(anyhow::Error::msg)?;
    let mut out = BufWriter::with_capacity(MERGE_READ_BYTES, file);
    out.write_all(&sorted).context("writing a sorted run")?;
    let file = rewound(out)?;
    run.clear();
    sorted.clear();
    Ok((run, sorted, file))
}

/// Merges the sorted runs, handing each chunk of merged records to `send` (false: stop, the
/// receiver is gone); returns the bytes merged.
fn merge(runs: Vec<File>, mut send: impl FnMut(Bytes) -> bool) -> anyhow::Result<u64> {
    let mut readers: Vec<_> = runs.into_iter().map(|file| BufReader::with_capacity(MERGE_READ_BYTES, file)).collect();
    let mut heads = vec![[0u8; RECORD_LEN]; readers.len()];
    // The smallest key first; on equal keys the earlier run, so equal keys keep shuffle order.
    let mut heap = BinaryHeap::with_capacity(readers.len());
    for (run, reader) in readers.iter_mut().enumerate() {
        if next_record(reader, &mut heads[run])? {
            heap.push(Reverse((key(&heads[run]), run)));
        }
    }
    let (mut chunk, mut merged) = (Vec::with_capacity(OUTPUT_CHUNK_BYTES), 0u64);
    while let Some(Reverse((_, run))) = heap.pop() {
        chunk.extend_from_slice(&heads[run]);
        if chunk.len() + RECORD_LEN > OUTPUT_CHUNK_BYTES {
            merged += chunk.len() as u64;
            anyhow::ensure!(send(Bytes::from(std::mem::take(&mut chunk))), "the part's writer stopped");
            chunk = Vec::with_capacity(OUTPUT_CHUNK_BYTES);
        }
        if next_record(&mut readers[run], &mut heads[run])? {
            heap.push(Reverse((key(&heads[run]), run)));
        }
    }
    if !chunk.is_empty() {
        merged += chunk.len() as u64;
        anyhow::ensure!(send(Bytes::from(chunk)), "the part's writer stopped");
    }
    Ok(merged)
}

fn key(record: &[u8; RECORD_LEN]) -> [u8; KEY_LEN] {
    record[..KEY_LEN].try_into().expect("a record holds its key")
}

/// Reads a run's next record into `record`; false at the run's end.
fn next_record(reader: &mut impl Read, record: &mut [u8; RECORD_LEN]) -> anyhow::Result<bool> {
    match reader.read_exact(record) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e).context("reading a sorted run"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gensort::generate;

    fn runs_of(records: &[u8], run_bytes: usize) -> Vec<File> {
        let dir = std::env::temp_dir();
        records
            .chunks(run_bytes)
            .map(|run| sort_run(run.to_vec(), Vec::new(), scratch_file(&dir).unwrap()).unwrap().2)
            .collect()
    }

    #[test]
    fn merged_runs_equal_the_in_memory_sort_with_equal_keys_in_input_order() {
        let mut records = vec![0; 20_000 * RECORD_LEN];
        generate(0, 20_000, &mut records);
        // Equal keys across runs: copies of early records, their payload marked, late in the input.
        for (n, copy) in [3usize, 17, 4000].iter().enumerate() {
            let mut twin = records[copy * RECORD_LEN..(copy + 1) * RECORD_LEN].to_vec();
            twin[RECORD_LEN - 1] = n as u8;
            records.extend_from_slice(&twin);
        }
        let mut want = Vec::new();
        try_sort_records(&records, &mut want).unwrap();
        for run_records in [50, 999, 5000, 30_000] {
            let mut got = Vec::new();
            let merged = merge(runs_of(&records, run_records * RECORD_LEN), |chunk| {
                got.extend_from_slice(&chunk);
                true
            })
            .unwrap();
            assert_eq!(merged, records.len() as u64);
            assert!(got == want, "runs of {run_records} records");
        }
    }

    #[tokio::test]
    async fn runs_merge_level_by_level_and_stay_in_order() {
        let mut records = vec![0; 20_000 * RECORD_LEN];
        generate(0, 20_000, &mut records);
        let mut want = Vec::new();
        try_sort_records(&records, &mut want).unwrap();
        // 400 runs of 50 records at a fan-in of 4: four levels of merges as the runs come.
        let mut runs = Runs { scratch: std::env::temp_dir(), fan_in: 4, runs: Vec::new(), written: 0 };
        let mut sorted = Vec::new();
        for run in records.chunks(50 * RECORD_LEN) {
            sorted = runs.add(run.to_vec(), sorted).await.unwrap().1;
            assert!(runs.runs.len() <= 4 * 4, "{} runs open", runs.runs.len());
        }
        assert_eq!(runs.written, 400);
        let last = runs.finish().await.unwrap();
        assert!(last.len() <= 4);
        let mut got = Vec::new();
        merge(last, |chunk| {
            got.extend_from_slice(&chunk);
            true
        })
        .unwrap();
        assert!(got == want);
    }

    #[test]
    fn a_stopped_writer_stops_the_merge() {
        let mut records = vec![0; 100_000 * RECORD_LEN];
        generate(0, 100_000, &mut records);
        let err = merge(runs_of(&records, 30_000 * RECORD_LEN), |_| false).unwrap_err();
        assert!(err.to_string().contains("writer stopped"), "{err}");
    }
}
