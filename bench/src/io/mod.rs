//! `tern bench io`: block write and read throughput and latency of Tern's data plane beside a
//! real redis-server and plain files, in the same run, at each (op, size, concurrency).
//!
//! What one op is, for every system, with `concurrency` workers each holding its own connection
//! (or file handle) and one request in flight:
//! - `tern-tcp`: write = one block write of `size` bytes appended to a block allocated before
//!   timing (as `FileWriter` allocates in batches); read = `FileReader::read_at` of `size` bytes of
//!   an open, sealed file. The embedded cluster (`tern up`, one storage server) uses 4 MiB blocks,
//!   so no op spans two blocks.
//! - `redis`: write = `SET key payload`, read = `GET key` of existing keys, through a lean RESP
//!   client written here (no pipelining), against a redis-server started by the bench on a free
//!   loopback port with persistence off.
//! - `file`: `pwrite` / `pread` of `size` bytes in files under `--dir` (buffered I/O: writes land
//!   in the page cache, as Tern's DRAM tier and persistence-free Redis keep data in memory; the
//!   output says how much of the read file was resident).
//!
//! Adding a system (`tern-quic`, `tern-nvme`) is a [`System`] variant, its name, and an arm in
//! `Target::start` (`target.rs`) that says how to reach it; Tern flavours share `TernTarget` and
//! differ only in [`tern_client::ClientOptions`] and how files are created.
//!
//! The folder, one concern a file; the timing of a cell (warm-up, measured window, latencies) is
//! [`crate::harness`]'s, which knows none of these systems:
//! - `mod.rs` (here): the options, the cells, and [`run`]: every system through every cell, the
//!   systems in rotating order over the runs.
//! - `system.rs`: [`System`], the systems by name, and each Tern system's raw peer.
//! - `target.rs`: `Target`, a started system: the one place that dispatches to each kind.
//! - `tern.rs`: Tern through `tern_client` on an embedded cluster (`tern-tcp`, `-tls`, `-quic`,
//!   `-nvme`, `-local`, `-rdma`).
//! - `raw.rs`: the raw peers (`tcp-raw`, `tls-raw`, `quic-raw`), the transports' limit.
//! - `redis.rs`: a redis-server started for the run, and the check of the bench's client against
//!   redis-benchmark; `resp.rs`: that lean RESP2 client.
//! - `file.rs`: plain files, buffered and O_DIRECT (`file`, `file-direct`).
//! - `result.rs`: [`CellResult`], one cell's figures and the `--json` schema; runs folded into
//!   their median and range.
//! - `report.rs`: the table and JSON Lines; `plot.rs`: the `--plot` chart.

mod file;
mod plot;
mod raw;
mod redis;
mod report;
mod resp;
mod result;
mod system;
mod target;
mod tern;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{ensure, Context};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};
use tern_common::rotation;

use crate::harness::Budget;
use target::Target;

pub use plot::plot;
pub use redis::{redis_installed, REDIS_INSTALL_HINT};
pub use report::{human_size, print_table, write_json_lines};
pub use result::CellResult;
pub use system::System;

/// The block sizes measured by a full run.
pub const SIZES: [u64; 4] = [4 << 10, 64 << 10, 1 << 20, 4 << 20];
/// The concurrencies measured by a full run.
pub const CONCURRENCIES: [u32; 3] = [1, 4, 16];
/// The cells of `--quick`: (size, concurrency).
pub const QUICK_CELLS: [(u64, u32); 2] = [(1 << 20, 4), (4 << 10, 1)];
/// The embedded cluster's block size: at least the largest size measured.
const TERN_BLOCK_SIZE: u64 = 4 << 20;
/// Bytes of each read set (Tern file, Redis keys, plain file), so reads cycle over data that
/// was written before timing; at least [`MIN_READ_ITEMS`] items.
const READ_SET_BYTES: u64 = 16 << 20;
const MIN_READ_ITEMS: u64 = 16;
/// Bytes a Redis or file writer cycles over (overwriting), per worker.
const WRITE_SET_BYTES: u64 = 16 << 20;

/// What a cell's workers do with `size` bytes, one request at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Write,
    Read,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::Read => "read",
        }
    }
}

/// What one `tern bench io` measures: the systems, the cells, and how long and how often.
pub struct IoOptions {
    /// The `tern` binary that starts the embedded cluster (usually the running one).
    pub tern: PathBuf,
    pub systems: Vec<System>,
    /// (size, concurrency) cells; each is measured for every op and system.
    pub cells: Vec<(u64, u32)>,
    /// Measured time per (system, op, size, concurrency), after warm-up.
    pub seconds: f64,
    /// Unmeasured time before each cell's measurement.
    pub warmup_seconds: f64,
    /// Times each cell is measured, the systems in rotating order; tables show the median and
    /// range.
    pub runs: usize,
    /// Bytes one cell may write or read at most (bounds Tern's DRAM use per write cell).
    pub max_bytes: u64,
    /// Where the `file` system's files go.
    pub dir: PathBuf,
    /// DRAM tier of the embedded cluster's storage server.
    pub dram_bytes: u64,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

impl IoOptions {
    /// The (size, concurrency) cells of a full run.
    pub fn full_cells() -> Vec<(u64, u32)> {
        SIZES.iter().flat_map(|&size| CONCURRENCIES.iter().map(move |&c| (size, c))).collect()
    }
}

/// Every (system, op, size, concurrency) folded over its runs, and what a reader needs beside.
pub struct IoReport {
    pub results: Vec<CellResult>,
    /// Things a reader needs to judge the figures (page-cache residency, versions).
    pub notes: Vec<String>,
}

/// Runs every selected system through every cell.
pub async fn run(options: &IoOptions) -> anyhow::Result<IoReport> {
    ensure!(!options.systems.is_empty(), "no system selected");
    ensure!(!options.cells.is_empty(), "no (size, concurrency) cell selected");
    ensure!(options.seconds > 0.0 && options.warmup_seconds >= 0.0, "cell and warm-up times must be positive");
    ensure!((1..=100).contains(&options.runs), "runs {} is not between 1 and 100", options.runs);
    for &(size, concurrency) in &options.cells {
        ensure!((1..=TERN_BLOCK_SIZE).contains(&size), "size {size} is not between 1 byte and {TERN_BLOCK_SIZE}");
        ensure!((1..=1024).contains(&concurrency), "concurrency {concurrency} is not between 1 and 1024");
        ensure!(size <= options.max_bytes, "size {size} is above the per-cell byte budget {}", options.max_bytes);
    }
    let mut notes = Vec::new();
    let mut targets = Vec::new();
    for &system in &options.systems {
        if system == System::TernRdma {
            if let Err(why) = tern_transport::rdma_devices() {
                let note = format!("{system}: {why}; left out of this run");
                eprintln!("{note}");
                notes.push(note);
                continue;
            }
        }
        let target = Target::start(system, options).await?;
        if let Some(note) = target.describe() {
            notes.push(note);
        }
        targets.push(target);
    }

    let mut sizes: Vec<u64> = options.cells.iter().map(|c| c.0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let total = (options.cells.len() * 2 * targets.len() * options.runs) as u64;
    let bar = if options.progress { ProgressBar::new(total) } else { ProgressBar::hidden() };
    bar.set_draw_target(if options.progress { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() });
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} cells  {msg}")
            .context("progress template")?
            .progress_chars("=> "),
    );
    let mut runs: BTreeMap<(System, Op, u64, u32), Vec<CellResult>> = BTreeMap::new();
    let order: Vec<usize> = (0..targets.len()).collect();
    for size in sizes {
        let items = (READ_SET_BYTES / size).max(MIN_READ_ITEMS);
        bar.set_message(format!("preparing {} read sets", human_size(size)));
        for target in &mut targets {
            target.prepare_reads(size, items).await.with_context(|| format!("{}: preparing reads", target.system))?;
        }
        for &(_, concurrency) in options.cells.iter().filter(|c| c.0 == size) {
            for op in [Op::Write, Op::Read] {
                // Rotating order: over the runs each system goes first in turn, and none always
                // follows the same one.
                for run in 0..options.runs {
                    for &t in &rotation(&order, run) {
                        let target = &mut targets[t];
                        bar.set_message(format!(
                            "{} {} {} x{concurrency} (run {} of {})",
                            target.system,
                            op.name(),
                            human_size(size),
                            run + 1,
                            options.runs
                        ));
                        let cell = Cell { op, size, concurrency };
                        let result = target.measure(cell, options).await.with_context(|| {
                            format!("{}: {} of {size} bytes at concurrency {concurrency}", target.system, op.name())
                        })?;
                        runs.entry((target.system, op, size, concurrency)).or_default().push(result);
                        bar.inc(1);
                    }
                }
            }
            // The bench's Redis client, checked against Redis' own on the same payloads.
            if let Some(redis) = targets.iter().find_map(Target::redis) {
                if let Some(ours) = runs.get(&(System::Redis, Op::Read, size, concurrency)) {
                    bar.set_message(format!("redis-benchmark GET {} x{concurrency}", human_size(size)));
                    notes.push(redis.check_against_redis_benchmark(&CellResult::of_runs(ours), options.seconds)?);
                }
            }
        }
        for target in &mut targets {
            if let Some(note) = target.finish_reads(size).await? {
                notes.push(note);
            }
        }
    }
    bar.finish_and_clear();
    for target in targets {
        target.stop().await;
    }
    let results = runs.values().map(|runs| CellResult::of_runs(runs)).collect();
    Ok(IoReport { results, notes })
}

/// One measurement's shape: the op, its size, and how many workers do it at once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cell {
    pub(crate) op: Op,
    pub(crate) size: u64,
    pub(crate) concurrency: u32,
}

impl Cell {
    /// This cell's budget under `options`: `--warmup` and `--seconds`, and the per-cell byte
    /// budget shared out among its workers (one op each at least).
    fn budget(self, options: &IoOptions) -> Budget {
        let ops_per_worker = (options.max_bytes / self.size / u64::from(self.concurrency)).max(1);
        Budget::new(
            Duration::from_secs_f64(options.warmup_seconds),
            Duration::from_secs_f64(options.seconds),
            ops_per_worker,
        )
    }
}
