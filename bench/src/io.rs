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
//! [`Target::start`] that says how to reach it; Tern flavours share [`TernTarget`] and differ
//! only in [`tern_client::ClientOptions`] and how files are created.

use std::collections::BTreeMap;
use std::fmt;
use std::io::IoSlice;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use bytes::{Bytes, BytesMut};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};
use tern_client::{BlockLocation, Client, ClientOptions, ErrorKind};
use tern_proto::v1::metadata_client::MetadataClient;
use tern_proto::v1::{AllocateBlocksRequest, CreateRequest};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use tern_common::{rotation, Spread};
use tern_local::cluster::EmbeddedCluster;

use crate::raw::{RawTarget, RawTransport};

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
/// How long a write cell waits for freed Tern blocks to come back before giving up.
const ALLOCATE_PATIENCE: Duration = Duration::from_secs(30);

/// A system under test. To add one: a variant here, its name in [`System::name`] and
/// [`System::ALL`], and an arm in [`Target::start`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum System {
    /// Tern's DRAM tier over plain TCP.
    TernTcp,
    /// Tern's DRAM tier over TLS 1.3 on TCP.
    TernTls,
    /// Tern's DRAM tier over QUIC.
    TernQuic,
    /// Tern's NVMe tier over plain TCP.
    TernNvme,
    /// Tern's DRAM tier from a client on the server's host: the same-host socket, and reads of
    /// leased blocks straight from the shared arena (`tern_transport::local`).
    TernLocal,
    /// Tern's DRAM tier over RDMA; measured only where this host has an RDMA device (else left
    /// out of the run, said in its notes).
    TernRdma,
    /// The raw peers: the same transports with nothing but a request and its bytes ([`crate::raw`]).
    TcpRaw,
    TlsRaw,
    QuicRaw,
    Redis,
    File,
    FileDirect,
}

impl System {
    pub const ALL: [System; 12] = [
        System::TernTcp,
        System::TernTls,
        System::TernQuic,
        System::TernNvme,
        System::TernLocal,
        System::TernRdma,
        System::TcpRaw,
        System::TlsRaw,
        System::QuicRaw,
        System::Redis,
        System::File,
        System::FileDirect,
    ];

    pub fn name(self) -> &'static str {
        match self {
            System::TernTcp => "tern-tcp",
            System::TernTls => "tern-tls",
            System::TernQuic => "tern-quic",
            System::TernNvme => "tern-nvme",
            System::TernLocal => "tern-local",
            System::TernRdma => "tern-rdma",
            System::TcpRaw => "tcp-raw",
            System::TlsRaw => "tls-raw",
            System::QuicRaw => "quic-raw",
            System::Redis => "redis",
            System::File => "file",
            System::FileDirect => "file-direct",
        }
    }

    pub fn is_tern(self) -> bool {
        matches!(
            self,
            System::TernTcp
                | System::TernTls
                | System::TernQuic
                | System::TernNvme
                | System::TernLocal
                | System::TernRdma
        )
    }

    /// The raw peer over the same transport: the limit this Tern system is measured against.
    pub fn raw_peer(self) -> Option<System> {
        match self {
            // A same-host reader's bar is the fastest way to move bytes between two processes
            // here that this bench has: TCP on loopback.
            System::TernTcp | System::TernNvme | System::TernLocal | System::TernRdma => Some(System::TcpRaw),
            System::TernTls => Some(System::TlsRaw),
            System::TernQuic => Some(System::QuicRaw),
            _ => None,
        }
    }
}

impl fmt::Display for System {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for System {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<System> {
        System::ALL.into_iter().find(|system| system.name() == s.trim()).with_context(|| {
            let names: Vec<&str> = System::ALL.iter().map(|s| s.name()).collect();
            format!("unknown system {s:?}; the systems are {}", names.join(", "))
        })
    }
}

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

/// One (system, op, size, concurrency) over its runs: the JSON Lines schema of `--json`.
/// Throughput is the median run's, with the range; latencies are the medians of the runs'
/// percentiles, NaN (JSON null) where a run's samples are too few for the percentile.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CellResult {
    pub system: String,
    pub op: Op,
    pub size_bytes: u64,
    pub concurrency: u32,
    /// Measured ops and seconds, over every run.
    pub ops: u64,
    pub seconds: f64,
    pub runs: usize,
    pub throughput_mib_s: f64,
    pub throughput_min_mib_s: f64,
    pub throughput_max_mib_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
}

impl CellResult {
    /// The runs of one cell of one system folded into one row.
    fn of_runs(runs: &[CellResult]) -> CellResult {
        let first = runs.first().expect("a cell ran at least once").clone();
        let spread = |f: fn(&CellResult) -> f64| Spread::of(runs.iter().map(f).collect());
        let throughput = spread(|r| r.throughput_mib_s);
        CellResult {
            ops: runs.iter().map(|r| r.ops).sum(),
            seconds: runs.iter().map(|r| r.seconds).sum(),
            runs: runs.len(),
            throughput_mib_s: throughput.median,
            throughput_min_mib_s: throughput.min,
            throughput_max_mib_s: throughput.max,
            p50_us: spread(|r| r.p50_us).median,
            p99_us: spread(|r| r.p99_us).median,
            p999_us: spread(|r| r.p999_us).median,
            ..first
        }
    }
}

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

#[derive(Debug, Clone, Copy)]
pub(crate) struct Cell {
    pub(crate) op: Op,
    pub(crate) size: u64,
    pub(crate) concurrency: u32,
}

/// A prepared system: how to reach it, and its read set for the size being measured.
struct Target {
    system: System,
    kind: TargetKind,
}

enum TargetKind {
    Tern(Box<TernTarget>),
    Raw(RawTarget),
    Redis(RedisTarget),
    File(FileTarget),
}

impl Target {
    async fn start(system: System, options: &IoOptions) -> anyhow::Result<Target> {
        let kind = match system {
            System::TernTcp
            | System::TernTls
            | System::TernQuic
            | System::TernNvme
            | System::TernLocal
            | System::TernRdma => TargetKind::Tern(Box::new(TernTarget::start(system, options).await?)),
            System::TcpRaw => TargetKind::Raw(RawTarget::start(RawTransport::Tcp).await?),
            System::TlsRaw => TargetKind::Raw(RawTarget::start(RawTransport::Tls).await?),
            System::QuicRaw => TargetKind::Raw(RawTarget::start(RawTransport::Quic).await?),
            System::Redis => TargetKind::Redis(RedisTarget::start().await?),
            System::File => TargetKind::File(FileTarget::start(&options.dir, false)?),
            System::FileDirect => TargetKind::File(FileTarget::start(&options.dir, true)?),
        };
        Ok(Target { system, kind })
    }

    fn redis(&self) -> Option<&RedisTarget> {
        match &self.kind {
            TargetKind::Redis(redis) => Some(redis),
            _ => None,
        }
    }

    fn describe(&self) -> Option<String> {
        match &self.kind {
            TargetKind::Tern(_) | TargetKind::Raw(_) => None,
            TargetKind::Redis(r) => {
                Some(format!("redis: {} on 127.0.0.1:{}, --save \"\" --appendonly no", r.version, r.port))
            }
            TargetKind::File(f) => Some(format!(
                "{}: {} pwrite/pread in {}",
                self.system,
                if f.direct { "O_DIRECT" } else { "buffered" },
                f.dir.path().display()
            )),
        }
    }

    async fn prepare_reads(&mut self, size: u64, items: u64) -> anyhow::Result<()> {
        match &mut self.kind {
            TargetKind::Tern(t) => t.prepare_reads(size, items).await,
            TargetKind::Raw(_) => Ok(()),
            TargetKind::Redis(r) => r.prepare_reads(size, items).await,
            TargetKind::File(f) => f.prepare_reads(size, items),
        }
    }

    async fn finish_reads(&mut self, size: u64) -> anyhow::Result<Option<String>> {
        match &mut self.kind {
            TargetKind::Tern(t) => t.finish_reads().await.map(|_| None),
            TargetKind::Raw(_) | TargetKind::Redis(_) => Ok(None),
            TargetKind::File(f) => f.finish_reads(size),
        }
    }

    async fn measure(&mut self, cell: Cell, options: &IoOptions) -> anyhow::Result<CellResult> {
        let budget = Budget::new(cell, options);
        let samples = match &mut self.kind {
            TargetKind::Tern(t) => t.measure(cell, budget).await?,
            TargetKind::Raw(r) => r.measure(cell, budget).await?,
            TargetKind::Redis(r) => r.measure(cell, budget).await?,
            TargetKind::File(f) => f.measure(cell, budget).await?,
        };
        Ok(samples.result(self.system, cell))
    }

    async fn stop(self) {
        match self.kind {
            TargetKind::Tern(t) => drop(t),
            TargetKind::Raw(r) => drop(r),
            TargetKind::Redis(r) => r.stop().await,
            TargetKind::File(f) => drop(f),
        }
    }
}

/// When a cell's workers start measuring and stop, and how many ops each may do at most.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget {
    warmup: Duration,
    measure: Duration,
    measure_from: Instant,
    stop_at: Instant,
    /// Measured ops one worker may do at most.
    ops_per_worker: u64,
    /// Warm-up ops one worker may do at most; a worker that reaches it waits for the window.
    warmup_ops_per_worker: u64,
}

impl Budget {
    fn new(cell: Cell, options: &IoOptions) -> Budget {
        let ops = (options.max_bytes / cell.size / u64::from(cell.concurrency)).max(1);
        Budget {
            warmup: Duration::from_secs_f64(options.warmup_seconds),
            measure: Duration::from_secs_f64(options.seconds),
            measure_from: Instant::now(),
            stop_at: Instant::now(),
            ops_per_worker: ops,
            warmup_ops_per_worker: (ops / 8).max(1),
        }
    }

    /// Starts the clock: warm-up from now, then the measured window. Called once per-cell setup
    /// (connecting, allocating) is done, so setup is never timed.
    /// Ops one worker may do in all, warm-up included (what a Tern writer needs room for).
    fn ops_in_all(&self) -> u64 {
        self.ops_per_worker + self.warmup_ops_per_worker
    }

    pub(crate) fn start(self) -> Budget {
        let measure_from = Instant::now() + self.warmup;
        Budget { measure_from, stop_at: measure_from + self.measure, ..self }
    }
}

/// What a worker does next.
enum Next {
    Go,
    /// Its warm-up ops are spent: wait this long for the measured window.
    Wait(Duration),
    Stop,
}

/// One worker's latencies and the end of its last measured op.
pub(crate) struct Recorder {
    budget: Budget,
    warmed: u64,
    done: u64,
    histogram: Histogram,
    last_end: Option<Instant>,
}

impl Recorder {
    pub(crate) fn new(budget: Budget) -> Recorder {
        Recorder { budget, warmed: 0, done: 0, histogram: Histogram::default(), last_end: None }
    }

    fn next(&self) -> Next {
        let now = Instant::now();
        if now < self.budget.measure_from {
            if self.warmed < self.budget.warmup_ops_per_worker {
                return Next::Go;
            }
            return Next::Wait(self.budget.measure_from - now);
        }
        // At least one measured op each, so a cell whose warm-up ran past its window (ops slower
        // than the window, on a loaded machine) still measures something.
        if self.done < self.budget.ops_per_worker && (now < self.budget.stop_at || self.done == 0) {
            Next::Go
        } else {
            Next::Stop
        }
    }

    /// Records an op that started at `started` (ops started during warm-up are not measured).
    pub(crate) fn record(&mut self, started: Instant) {
        if started < self.budget.measure_from {
            self.warmed += 1;
        } else {
            self.done += 1;
            let end = Instant::now();
            self.histogram.record((end - started).as_nanos() as u64);
            self.last_end = Some(end);
        }
    }
}

/// Whether a worker's next op may start, waiting out the rest of the warm-up if its warm-up ops
/// are spent.
pub(crate) async fn go(recorder: &Recorder) -> bool {
    loop {
        match recorder.next() {
            Next::Go => return true,
            Next::Stop => return false,
            Next::Wait(wait) => tokio::time::sleep(wait).await,
        }
    }
}

/// [`go`] for a worker on its own thread.
fn go_blocking(recorder: &Recorder) -> bool {
    loop {
        match recorder.next() {
            Next::Go => return true,
            Next::Stop => return false,
            Next::Wait(wait) => std::thread::sleep(wait),
        }
    }
}

/// Every worker's recorders of one cell, merged.
pub(crate) struct Samples {
    measure_from: Instant,
    histogram: Histogram,
    last_end: Option<Instant>,
}

impl Samples {
    pub(crate) fn merge(recorders: Vec<Recorder>) -> anyhow::Result<Samples> {
        let first = recorders.first().context("a cell ran no worker")?;
        let mut samples =
            Samples { measure_from: first.budget.measure_from, histogram: Histogram::default(), last_end: None };
        for r in recorders {
            samples.histogram.merge(&r.histogram);
            samples.last_end = samples.last_end.max(r.last_end);
        }
        Ok(samples)
    }

    fn result(&self, system: System, cell: Cell) -> CellResult {
        let ops = self.histogram.count();
        let seconds = self.last_end.map(|end| (end - self.measure_from).as_secs_f64()).unwrap_or(0.0);
        let throughput_mib_s =
            if seconds > 0.0 { (ops * cell.size) as f64 / seconds / f64::from(1 << 20) } else { 0.0 };
        // A percentile needs enough samples to be more than the maximum (p99: 100, p99.9: 1000).
        let us = |q: f64| {
            let supported = q <= 0.5 || ops as f64 >= (1.0 / (1.0 - q)).round();
            if supported {
                self.histogram.quantile_ns(q) as f64 / 1e3
            } else {
                f64::NAN
            }
        };
        CellResult {
            system: system.name().to_string(),
            op: cell.op,
            size_bytes: cell.size,
            concurrency: cell.concurrency,
            ops,
            seconds,
            runs: 1,
            throughput_mib_s,
            throughput_min_mib_s: throughput_mib_s,
            throughput_max_mib_s: throughput_mib_s,
            p50_us: us(0.5),
            p99_us: us(0.99),
            p999_us: us(0.999),
        }
    }
}

/// A log-linear latency histogram (HDR-like): exact below 128 ns, then 64 buckets per power of
/// two (under 1.6% error), 3776 counters in all whatever the number of samples.
#[derive(Clone)]
pub struct Histogram {
    counts: Vec<u64>,
}

const SUB_BUCKETS: u64 = 64;
const LINEAR: u64 = 2 * SUB_BUCKETS;

impl Default for Histogram {
    fn default() -> Histogram {
        Histogram { counts: vec![0; Histogram::index(u64::MAX) + 1] }
    }
}

impl Histogram {
    fn index(value: u64) -> usize {
        if value < LINEAR {
            return value as usize;
        }
        let exponent = 63 - u64::from(value.leading_zeros()); // >= 7
        let mantissa = value >> (exponent - 6); // 64..128
        (LINEAR + (exponent - 7) * SUB_BUCKETS + (mantissa - SUB_BUCKETS)) as usize
    }

    /// The middle of bucket `index`'s range.
    fn value(index: usize) -> u64 {
        let index = index as u64;
        if index < LINEAR {
            return index;
        }
        let exponent = (index - LINEAR) / SUB_BUCKETS + 7;
        let mantissa = (index - LINEAR) % SUB_BUCKETS + SUB_BUCKETS;
        let low = mantissa << (exponent - 6);
        low + ((1u64 << (exponent - 6)) >> 1)
    }

    pub fn record(&mut self, value: u64) {
        self.counts[Histogram::index(value)] += 1;
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The value at quantile `q` (0..=1); 0 when empty.
    pub fn quantile_ns(&self, q: f64) -> u64 {
        let count = self.count();
        if count == 0 {
            return 0;
        }
        let rank = ((q * count as f64).ceil() as u64).clamp(1, count);
        let mut seen = 0;
        for (index, n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Histogram::value(index);
            }
        }
        Histogram::value(self.counts.len() - 1)
    }
}

/// A payload of `size` pseudo-random bytes (incompressible, the same for every system).
pub(crate) fn payload(size: u64, seed: u64) -> Bytes {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ seed.wrapping_mul(0xff51_afd7_ed55_8ccd);
    let mut out = BytesMut::with_capacity(size as usize + 8);
    while (out.len() as u64) < size {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(size as usize);
    out.freeze()
}

pub(crate) async fn join_all<T: Send + 'static>(
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<T>>>,
) -> anyhow::Result<Vec<T>> {
    let mut out = Vec::with_capacity(tasks.len());
    for task in tasks {
        out.push(task.await.context("a bench worker panicked")??);
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Tern

/// Tern reached through `tern_client` with `options`; the embedded cluster lives as long as this.
struct TernTarget {
    cluster: EmbeddedCluster,
    options: ClientOptions,
    /// The storage class of the files it writes and reads.
    class: tern_client::StorageClass,
    admin: Client,
    metadata: MetadataClient<tonic::transport::Channel>,
    /// The read set: path of a sealed file of `items` x `size` bytes.
    reads: Option<(String, u64)>,
    cells: u64,
}

impl TernTarget {
    /// One storage server with a DRAM tier of `--dram`; for `tern-nvme` also an NVMe tier as
    /// large in a file beside the `file` systems' (on the disk of `--dir`).
    async fn start(system: System, io: &IoOptions) -> anyhow::Result<TernTarget> {
        let dram = format!("{}MiB", io.dram_bytes.div_ceil(1 << 20));
        let block_size = format!("{}MiB", TERN_BLOCK_SIZE >> 20);
        let nvme = (system == System::TernNvme).then(|| dram.clone());
        let cluster =
            EmbeddedCluster::start_with(&io.tern, 1, &dram, &block_size, nvme.as_deref(), &io.dir, &[]).await?;
        let mut options = ClientOptions::default();
        let mut class = tern_client::StorageClass::Dram;
        match system {
            System::TernQuic | System::TernTls => {
                let quic = system == System::TernQuic;
                options.transport =
                    if quic { tern_client::TransportKind::Quic } else { tern_client::TransportKind::Tls };
                options.tls_dir = Some(cluster.tls_dir());
            }
            System::TernNvme => {
                class = tern_client::StorageClass::Nvme;
                options.transport = tern_client::TransportKind::Tcp;
            }
            System::TernLocal => options.transport = tern_client::TransportKind::Local,
            System::TernRdma => {
                // The embedded servers serve RDMA on loopback (rdma = auto) where a device is;
                // a figure labelled tern-rdma must not be TCP's, so RDMA is checked first.
                let addr = cluster.storage_addr(0);
                if let Err(e) = tern_transport::rdma_or::rdma_connect(&addr).await {
                    anyhow::bail!("tern-rdma: the embedded storage server {addr} does not answer over RDMA: {e}");
                }
                options.transport = tern_client::TransportKind::Rdma;
            }
            _ => options.transport = tern_client::TransportKind::Tcp,
        }
        // The embedded cluster's control plane is plain on loopback, QUIC or not.
        let metadata_url = format!("http://{}", cluster.metadata_addr);
        let admin = Client::connect_with(&metadata_url, options.clone()).await?;
        let metadata = MetadataClient::connect(metadata_url).await?;
        let block_size = admin.block_size().await?;
        ensure!(
            u64::from(block_size) >= TERN_BLOCK_SIZE,
            "the embedded cluster has {block_size}-byte blocks, less than the {TERN_BLOCK_SIZE} bytes measured"
        );
        Ok(TernTarget { cluster, options, class, admin, metadata, reads: None, cells: 0 })
    }

    /// A client of its own per worker, with one connection to the storage server, so each worker
    /// has its own connection as each Redis worker does.
    async fn worker_client(&self) -> anyhow::Result<Client> {
        let options = ClientOptions { connections_per_server: 1, ..self.options.clone() };
        Ok(Client::connect_with(&format!("http://{}", self.cluster.metadata_addr), options).await?)
    }

    async fn prepare_reads(&mut self, size: u64, items: u64) -> anyhow::Result<()> {
        let path = format!("/bench-io/read-{size}");
        let mut writer = self.admin.create_with_class(&path, true, self.class).await?;
        for item in 0..items {
            writer.write_bytes(payload(size, item)).await?;
        }
        writer.close().await?;
        self.reads = Some((path, items));
        Ok(())
    }

    async fn finish_reads(&mut self) -> anyhow::Result<()> {
        if let Some((path, _)) = self.reads.take() {
            self.admin.delete(&path, false).await?;
        }
        Ok(())
    }

    async fn measure(&mut self, cell: Cell, budget: Budget) -> anyhow::Result<Samples> {
        self.cells += 1;
        let mut clients = Vec::with_capacity(cell.concurrency as usize);
        for _ in 0..cell.concurrency {
            clients.push(self.worker_client().await?);
        }
        match cell.op {
            Op::Write => {
                let per_block = TERN_BLOCK_SIZE / cell.size;
                let blocks_per_worker = budget.ops_in_all().div_ceil(per_block);
                let path = format!("/bench-io/write-{}", self.cells);
                let file_id = self
                    .metadata
                    .create(CreateRequest {
                        path: path.clone(),
                        parents: true,
                        sealed: false,
                        storage_class: self.class.to_string(),
                        replicas: 1,
                    })
                    .await?
                    .into_inner()
                    .file_id;
                let blocks = self.allocate(file_id, blocks_per_worker * u64::from(cell.concurrency)).await?;
                let budget = budget.start();
                let mut tasks = Vec::new();
                for (worker, client) in clients.into_iter().enumerate() {
                    let start = worker * blocks_per_worker as usize;
                    let mine = blocks[start..start + blocks_per_worker as usize].to_vec();
                    tasks.push(tokio::spawn(tern_writer(client, mine, cell.size, budget)));
                }
                let recorders = join_all(tasks).await;
                // Unsealed: deleting frees every block, written or not.
                self.admin.delete(&path, false).await?;
                Samples::merge(recorders?)
            }
            Op::Read => {
                let (path, items) = self.reads.clone().context("no Tern read set prepared")?;
                let mut readers = Vec::new();
                for client in clients {
                    readers.push(client.open(&path).await?);
                }
                let budget = budget.start();
                let mut tasks = Vec::new();
                for (worker, reader) in readers.into_iter().enumerate() {
                    let concurrency = u64::from(cell.concurrency);
                    tasks.push(tokio::spawn(async move {
                        let mut recorder = Recorder::new(budget);
                        let mut item = worker as u64;
                        while go(&recorder).await {
                            let started = Instant::now();
                            let data = reader.read_at((item % items) * cell.size, cell.size as usize).await?;
                            ensure!(data.len() as u64 == cell.size, "read returned {} bytes", data.len());
                            recorder.record(started);
                            item += concurrency;
                        }
                        Ok(recorder)
                    }));
                }
                Samples::merge(join_all(tasks).await?)
            }
        }
    }

    /// Allocates `count` blocks in batches before timing, waiting (bounded) for blocks freed by
    /// the previous cell to come back.
    async fn allocate(&mut self, file_id: u64, count: u64) -> anyhow::Result<Vec<BlockLocation>> {
        let deadline = Instant::now() + ALLOCATE_PATIENCE;
        let mut blocks = Vec::with_capacity(count as usize);
        while (blocks.len() as u64) < count {
            let batch = (count - blocks.len() as u64).min(u64::from(tern_proto::MAX_ALLOCATE_BLOCKS)) as u32;
            let request = AllocateBlocksRequest { file_id, count: batch, client_host: "127.0.0.1".into() };
            match self.metadata.allocate_blocks(request).await {
                Ok(reply) => blocks.extend(reply.into_inner().blocks),
                Err(status) => {
                    let error = tern_client::Error::from(status);
                    if !matches!(error.kind(), ErrorKind::Unavailable | ErrorKind::OutOfSpace)
                        || Instant::now() > deadline
                    {
                        bail!("allocating {count} blocks of {TERN_BLOCK_SIZE} bytes: {error}");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        Ok(blocks)
    }
}

/// Appends `size`-byte writes to each of `blocks` in turn until the budget ends.
async fn tern_writer(
    client: Client,
    blocks: Vec<BlockLocation>,
    size: u64,
    budget: Budget,
) -> anyhow::Result<Recorder> {
    let data = payload(size, 7);
    let mut recorder = Recorder::new(budget);
    let (mut block, mut offset) = (0usize, 0u64);
    while go(&recorder).await {
        if offset + size > TERN_BLOCK_SIZE {
            block += 1;
            offset = 0;
        }
        let Some(location) = blocks.get(block) else { break };
        let started = Instant::now();
        // The files are outside /jobs: the volume principal's, no token needed.
        client.write_block("", location, offset as u32, data.clone()).await?;
        recorder.record(started);
        offset += size;
    }
    Ok(recorder)
}

// ---------------------------------------------------------------------------------------------
// Redis

/// A redis-server started on a free loopback port with persistence off, stopped at the end.
struct RedisTarget {
    child: Child,
    port: u16,
    version: String,
    _dir: tempfile::TempDir,
    /// Keys of the read set: (size, items).
    reads: Option<(u64, u64)>,
}

/// How to get redis-server when it is missing.
pub const REDIS_INSTALL_HINT: &str =
    "redis-server is not installed; install it with `apt-get install redis-server` (Debian/Ubuntu), \
     or leave redis out with --systems";

/// Whether `redis-server` is on PATH.
pub fn redis_installed() -> bool {
    find_on_path("redis-server").is_some()
}

fn find_on_path(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|dir| Path::new(dir).join(program)).find(|p| p.is_file())
}

impl RedisTarget {
    async fn start() -> anyhow::Result<RedisTarget> {
        let server = find_on_path("redis-server").context(REDIS_INSTALL_HINT)?;
        let version = Command::new(&server)
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_default();
        let dir = tempfile::tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let log = std::fs::File::create(dir.path().join("redis.log"))?;
        let child = Command::new(&server)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--protected-mode", "no", "--dir", &dir.path().to_string_lossy()])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", server.display()))?;
        let mut redis = RedisTarget { child, port, version, _dir: dir, reads: None };
        let started = Instant::now();
        loop {
            if let Some(status) = redis.child.try_wait()? {
                let log = std::fs::read_to_string(redis._dir.path().join("redis.log")).unwrap_or_default();
                bail!("redis-server exited ({status}):\n{log}");
            }
            if let Ok(mut conn) = RespConnection::connect(port).await {
                if conn.ping().await.is_ok() {
                    return Ok(redis);
                }
            }
            if started.elapsed() > Duration::from_secs(10) {
                bail!("redis-server did not answer PING on port {port} within 10 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn prepare_reads(&mut self, size: u64, items: u64) -> anyhow::Result<()> {
        let mut conn = RespConnection::connect(self.port).await?;
        for item in 0..items {
            conn.set(&read_key(size, item), &payload(size, item)).await?;
        }
        self.reads = Some((size, items));
        Ok(())
    }

    async fn measure(&mut self, cell: Cell, budget: Budget) -> anyhow::Result<Samples> {
        let mut conns = Vec::new();
        for _ in 0..cell.concurrency {
            conns.push(RespConnection::connect(self.port).await?);
        }
        let (read_size, items) = self.reads.context("no Redis read set prepared")?;
        ensure!(read_size == cell.size, "the Redis read set holds {read_size}-byte values, not {}", cell.size);
        let budget = budget.start();
        let concurrency = u64::from(cell.concurrency);
        // Writers overwrite their own few keys, so Redis holds a bounded amount whatever the run.
        let write_keys = (WRITE_SET_BYTES / concurrency / cell.size).max(1);
        let mut tasks = Vec::new();
        for (worker, mut conn) in conns.into_iter().enumerate() {
            let size = cell.size;
            let op = cell.op;
            tasks.push(tokio::spawn(async move {
                let data = payload(size, 7);
                let mut recorder = Recorder::new(budget);
                let mut item = worker as u64;
                while go(&recorder).await {
                    let started = Instant::now();
                    match op {
                        Op::Write => conn.set(&format!("w:{worker}:{}", item % write_keys), &data).await?,
                        Op::Read => {
                            let value = conn.get(&read_key(size, item % items)).await?;
                            ensure!(value.len() as u64 == size, "GET returned {} bytes, not {size}", value.len());
                        }
                    }
                    recorder.record(started);
                    item += if op == Op::Read { concurrency } else { 1 };
                }
                Ok(recorder)
            }));
        }
        Samples::merge(join_all(tasks).await?)
    }

    /// Runs redis-benchmark (SET then GET of `ours`' payload size, at its concurrency, for about
    /// `seconds`) and says how its GET throughput compares with the bench's client's: more than
    /// 10% apart means one of the two clients is costing Redis' figure something.
    fn check_against_redis_benchmark(&self, ours: &CellResult, seconds: f64) -> anyhow::Result<String> {
        let (size, concurrency) = (ours.size_bytes, ours.concurrency);
        let label = format!("redis-benchmark GET {} x{concurrency}", human_size(size));
        let Some(program) = find_on_path("redis-benchmark") else {
            return Ok(format!("{label}: not checked, redis-benchmark is not installed (it comes with redis-server)"));
        };
        let ops_per_s = ours.throughput_mib_s * f64::from(1 << 20) / size as f64;
        let requests = (ops_per_s * seconds.max(1.0)).clamp(200.0, 1_000_000.0) as u64;
        let out = Command::new(program)
            .args(["-p", &self.port.to_string(), "-t", "set,get", "--csv"])
            .args(["-d", &size.to_string(), "-c", &concurrency.to_string(), "-n", &requests.to_string()])
            .stdin(Stdio::null())
            .output()
            .context("running redis-benchmark")?;
        ensure!(out.status.success(), "{label}: {}", String::from_utf8_lossy(&out.stderr).trim());
        let csv = String::from_utf8_lossy(&out.stdout);
        let rps = csv
            .lines()
            .find_map(|line| line.strip_prefix("\"GET\",\""))
            .and_then(|rest| rest.split('"').next())
            .and_then(|rps| rps.parse::<f64>().ok())
            .with_context(|| format!("{label}: no GET figure in its output:\n{csv}"))?;
        let theirs = rps * size as f64 / f64::from(1 << 20);
        let ratio = ours.throughput_mib_s / theirs;
        let verdict = if (ratio - 1.0).abs() > 0.10 { "DIFFER by more than 10%" } else { "agree within 10%" };
        Ok(format!(
            "{label}: {theirs:.0} MiB/s; the bench's Redis client {:.0} MiB/s ({ratio:.2}x): {verdict}",
            ours.throughput_mib_s
        ))
    }

    async fn stop(mut self) {
        if let Ok(mut conn) = RespConnection::connect(self.port).await {
            let _ = conn.command(&[b"SHUTDOWN", b"NOSAVE"]).await;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for RedisTarget {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn read_key(size: u64, item: u64) -> String {
    format!("r:{size}:{item}")
}

/// A minimal RESP2 client: one command in flight, the reply read in full before the next.
struct RespConnection {
    reader: BufReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
    line: String,
}

impl RespConnection {
    async fn connect(port: u16) -> anyhow::Result<RespConnection> {
        let stream = TcpStream::connect(("127.0.0.1", port)).await?;
        stream.set_nodelay(true)?;
        let (read_half, writer) = stream.into_split();
        Ok(RespConnection { reader: BufReader::with_capacity(64 << 10, read_half), writer, line: String::new() })
    }

    async fn ping(&mut self) -> anyhow::Result<()> {
        self.command(&[b"PING"]).await.map(|_| ())
    }

    async fn set(&mut self, key: &str, value: &[u8]) -> anyhow::Result<()> {
        match self.command(&[b"SET", key.as_bytes(), value]).await? {
            Reply::Status(s) if s == "OK" => Ok(()),
            other => bail!("SET {key}: unexpected reply {other:?}"),
        }
    }

    async fn get(&mut self, key: &str) -> anyhow::Result<Bytes> {
        match self.command(&[b"GET", key.as_bytes()]).await? {
            Reply::Bulk(Some(value)) => Ok(value),
            other => bail!("GET {key}: unexpected reply {other:?}"),
        }
    }

    /// Sends one command as a RESP array of bulk strings (headers and arguments in one
    /// vectored write, no copy of the arguments) and reads its reply.
    async fn command(&mut self, args: &[&[u8]]) -> anyhow::Result<Reply> {
        let heads: Vec<Vec<u8>> = args
            .iter()
            .enumerate()
            .map(|(i, arg)| {
                let count = if i == 0 { format!("*{}\r\n", args.len()) } else { String::new() };
                format!("{count}${}\r\n", arg.len()).into_bytes()
            })
            .collect();
        let parts: Vec<&[u8]> =
            heads.iter().zip(args).flat_map(|(head, arg)| [head.as_slice(), arg, b"\r\n"]).collect();
        write_all_vectored(&mut self.writer, &parts).await?;
        self.read_reply().await
    }

    async fn read_reply(&mut self) -> anyhow::Result<Reply> {
        self.line.clear();
        if self.reader.read_line(&mut self.line).await? == 0 {
            bail!("redis closed the connection");
        }
        let line = self.line.trim_end_matches("\r\n");
        let (kind, rest) = line.split_at(line.len().min(1));
        match kind {
            "+" => Ok(Reply::Status(rest.to_string())),
            "-" => bail!("redis error: {rest}"),
            ":" => Ok(Reply::Status(rest.to_string())),
            "$" => {
                let len: i64 = rest.parse().with_context(|| format!("bad bulk length {rest:?}"))?;
                if len < 0 {
                    return Ok(Reply::Bulk(None));
                }
                ensure!(len <= 512 << 20, "bulk reply of {len} bytes is beyond Redis' limit");
                // Read into spare capacity, as Tern's reader does: no zeroing of the buffer first.
                let want = len as usize + 2;
                let mut value = BytesMut::with_capacity(want);
                let mut limited = (&mut self.reader).take(want as u64);
                while value.len() < want {
                    if limited.read_buf(&mut value).await? == 0 {
                        bail!("redis closed the connection in a bulk reply");
                    }
                }
                ensure!(value.ends_with(b"\r\n"), "bulk reply not ended by CRLF");
                value.truncate(len as usize);
                Ok(Reply::Bulk(Some(value.freeze())))
            }
            _ => bail!("unexpected RESP reply {line:?}"),
        }
    }
}

#[derive(Debug)]
enum Reply {
    Status(String),
    Bulk(Option<Bytes>),
}

async fn write_all_vectored(writer: &mut tokio::net::tcp::OwnedWriteHalf, parts: &[&[u8]]) -> std::io::Result<()> {
    let (mut part, mut within) = (0usize, 0usize);
    while part < parts.len() {
        let slices: Vec<IoSlice<'_>> = std::iter::once(IoSlice::new(&parts[part][within..]))
            .chain(parts[part + 1..].iter().map(|p| IoSlice::new(p)))
            .collect();
        let mut n = writer.write_vectored(&slices).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while part < parts.len() && n >= parts[part].len() - within {
            n -= parts[part].len() - within;
            part += 1;
            within = 0;
        }
        within += n;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Plain files

/// Files in a temp dir on the disk the user named, written and read with pwrite / pread from
/// one thread per worker.
struct FileTarget {
    dir: tempfile::TempDir,
    /// O_DIRECT: every op reaches the disk, none the page cache.
    direct: bool,
    /// The read set: (path, size, items).
    reads: Option<(PathBuf, u64, u64)>,
}

impl FileTarget {
    fn start(dir: &Path, direct: bool) -> anyhow::Result<FileTarget> {
        let dir = tempfile::Builder::new()
            .prefix("tern-bench-io-")
            .tempdir_in(dir)
            .with_context(|| format!("making a temp dir in {}", dir.display()))?;
        Ok(FileTarget { dir, direct, reads: None })
    }

    fn prepare_reads(&mut self, size: u64, items: u64) -> anyhow::Result<()> {
        let path = self.dir.path().join(format!("read-{size}"));
        let file = std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        for item in 0..items {
            file.write_all_at(&payload(size, item), item * size)?;
        }
        file.sync_all()?;
        self.reads = Some((path, size, items));
        Ok(())
    }

    /// Deletes the read set; for buffered reads, says how much of it sat in the page cache after
    /// the reads (O_DIRECT reads bypass the cache: nothing to say).
    fn finish_reads(&mut self, size: u64) -> anyhow::Result<Option<String>> {
        let (path, _, items) = self.reads.take().context("no file read set prepared")?;
        let resident = (!self.direct).then(|| resident_fraction(&path).unwrap_or(f64::NAN));
        std::fs::remove_file(&path)?;
        Ok(resident.map(|resident| {
            format!(
                "file: {} reads cycled over a {} file, {:.0}% of it in the page cache after reading: \
                 reads {} the page cache",
                human_size(size),
                human_size(size * items),
                resident * 100.0,
                if resident >= 0.99 { "hit" } else { "partly missed" }
            )
        }))
    }

    async fn measure(&mut self, cell: Cell, budget: Budget) -> anyhow::Result<Samples> {
        let (path, items) = match cell.op {
            Op::Read => {
                let (path, size, items) = self.reads.clone().context("no file read set prepared")?;
                ensure!(size == cell.size, "the file read set holds {size}-byte items, not {}", cell.size);
                (path, items)
            }
            Op::Write => (PathBuf::new(), 0),
        };
        let write_items = (WRITE_SET_BYTES / u64::from(cell.concurrency) / cell.size).max(1);
        let budget = budget.start();
        let mut threads = Vec::new();
        for worker in 0..cell.concurrency as u64 {
            let file = match cell.op {
                Op::Read => self.open(&path, false)?,
                Op::Write => self.open(&self.dir.path().join(format!("write-{worker}")), true)?,
            };
            let (size, op, concurrency) = (cell.size, cell.op, u64::from(cell.concurrency));
            threads.push(std::thread::spawn(move || -> anyhow::Result<Recorder> {
                // Aligned for O_DIRECT (sizes are multiples of 4 KiB).
                let mut data = AlignedVec::new(size as usize);
                data.as_mut().copy_from_slice(&payload(size, 7));
                let data = data;
                let mut buf = AlignedVec::new(size as usize);
                let buf = buf.as_mut();
                let mut recorder = Recorder::new(budget);
                let mut item = worker;
                while go_blocking(&recorder) {
                    let started = Instant::now();
                    match op {
                        Op::Write => file.write_all_at(data.as_ref(), (item % write_items) * size)?,
                        Op::Read => file.read_exact_at(buf, (item % items) * size)?,
                    }
                    recorder.record(started);
                    item += if op == Op::Read { concurrency } else { 1 };
                }
                Ok(recorder)
            }));
        }
        let recorders = tokio::task::spawn_blocking(move || {
            threads
                .into_iter()
                .map(|t| t.join().map_err(|_| anyhow::anyhow!("a file worker panicked"))?)
                .collect::<anyhow::Result<Vec<_>>>()
        })
        .await??;
        if cell.op == Op::Write {
            for worker in 0..cell.concurrency {
                std::fs::remove_file(self.dir.path().join(format!("write-{worker}")))?;
            }
        }
        Samples::merge(recorders)
    }
}

impl FileTarget {
    /// Opens `path` for the measured ops, with O_DIRECT if this target is direct.
    fn open(&self, path: &Path, create: bool) -> anyhow::Result<std::fs::File> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut options = std::fs::OpenOptions::new();
        options.read(true).write(create).create(create).truncate(create);
        if self.direct {
            options.custom_flags(libc::O_DIRECT);
        }
        options.open(path).with_context(|| {
            format!(
                "opening {}{}",
                path.display(),
                if self.direct { " with O_DIRECT (tmpfs may refuse it)" } else { "" }
            )
        })
    }
}

/// A zeroed byte buffer aligned to 4 KiB, as O_DIRECT needs.
pub(crate) struct AlignedVec {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedVec {
    const ALIGN: usize = 4096;

    pub(crate) fn new(len: usize) -> AlignedVec {
        let raw = vec![0u8; len + AlignedVec::ALIGN];
        let start = raw.as_ptr().align_offset(AlignedVec::ALIGN);
        AlignedVec { raw, start, len }
    }

    pub(crate) fn as_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
}

impl AsRef<[u8]> for AlignedVec {
    fn as_ref(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }
}

/// The fraction of `path`'s pages resident in the page cache (mincore of a read-only mapping).
#[allow(unsafe_code)] // mmap(2) and mincore(2): std has neither
fn resident_fraction(path: &Path) -> anyhow::Result<f64> {
    let file = std::fs::File::open(path)?;
    let len = file.metadata()?.len() as usize;
    if len == 0 {
        return Ok(1.0);
    }
    // SAFETY: a private read-only mapping of a file we opened, unmapped below; only mincore
    // looks at it, no byte of it is read.
    unsafe {
        use std::os::fd::AsRawFd;
        let map = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0);
        if map == libc::MAP_FAILED {
            bail!("mmap of {}: {}", path.display(), std::io::Error::last_os_error());
        }
        let page = libc::sysconf(libc::_SC_PAGESIZE) as usize;
        let mut pages = vec![0u8; len.div_ceil(page)];
        let rc = libc::mincore(map, len, pages.as_mut_ptr());
        let error = std::io::Error::last_os_error();
        libc::munmap(map, len);
        if rc != 0 {
            bail!("mincore of {}: {error}", path.display());
        }
        Ok(pages.iter().filter(|p| *p & 1 == 1).count() as f64 / pages.len() as f64)
    }
}

// ---------------------------------------------------------------------------------------------
// Output

/// "4KiB", "1MiB".
pub fn human_size(bytes: u64) -> String {
    tern_common::ByteSize(bytes).to_string()
}

/// The table: one block per (op, size, concurrency), a row per system with its median throughput
/// and range over the runs, and each Tern system's ratios to its raw peer (the transport's limit
/// on this machine) and to Redis.
pub fn print_table(report: &IoReport) {
    let mut groups: BTreeMap<(Op, u64, u32), Vec<&CellResult>> = BTreeMap::new();
    for r in &report.results {
        groups.entry((r.op, r.size_bytes, r.concurrency)).or_default().push(r);
    }
    let runs = report.results.iter().map(|r| r.runs).max().unwrap_or(0);
    println!(
        "{:<5} {:>6} {:>4}  {:<11} {:>21} {:>9} {:>9} {:>9}  {:>6} {:>9}  {:>7}",
        "OP", "SIZE", "CONC", "SYSTEM", "MiB/s [range]", "p50 us", "p99 us", "p999 us", "x raw", "p50 x raw", "x redis"
    );
    let us = |v: f64| if v.is_nan() { "n/a".to_string() } else { format!("{v:.1}") };
    for ((op, size, concurrency), rows) in groups {
        let find = |system: System| rows.iter().find(|r| r.system == system.name());
        let redis = find(System::Redis);
        for r in &rows {
            let system = r.system.parse::<System>().ok();
            let raw = match system.and_then(System::raw_peer).and_then(find) {
                Some(raw) => {
                    format!("{:>6.2} {:>9.2}", r.throughput_mib_s / raw.throughput_mib_s, r.p50_us / raw.p50_us)
                }
                None => format!("{:>6} {:>9}", "", ""),
            };
            let x_redis = match redis {
                Some(redis) if r.system != redis.system => {
                    format!("{:>7.2}", r.throughput_mib_s / redis.throughput_mib_s)
                }
                _ => String::new(),
            };
            let throughput =
                format!("{:.0} [{:.0}-{:.0}]", r.throughput_mib_s, r.throughput_min_mib_s, r.throughput_max_mib_s);
            println!(
                "{:<5} {:>6} {:>4}  {:<11} {:>21} {:>9} {:>9} {:>9}  {raw}  {x_redis}",
                op.name(),
                human_size(size),
                concurrency,
                r.system,
                throughput,
                us(r.p50_us),
                us(r.p99_us),
                us(r.p999_us)
            );
        }
    }
    println!(
        "medians of {runs} runs in rotating order, [min-max]; latencies: medians of the runs' percentiles (n/a: \
         too few samples); x raw: throughput over the raw peer of the same transport (tcp-raw, tls-raw, \
         quic-raw), p50 x raw: p50 latency over its (below 1 is better); x redis: throughput over Redis'"
    );
    for note in &report.notes {
        println!("{note}");
    }
}

/// Writes one JSON object per result, one per line.
pub fn write_json_lines(results: &[CellResult], path: &Path) -> anyhow::Result<()> {
    let mut out = String::new();
    for r in results {
        out.push_str(&serde_json::to_string(r)?);
        out.push('\n');
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

/// Draws throughput against size, a line per system, a panel per (op, concurrency); SVG or PNG
/// by the file's extension.
pub fn plot(results: &[CellResult], path: &Path) -> anyhow::Result<()> {
    use plotters::prelude::*;

    register_font()?;
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or_default().to_ascii_lowercase();
    let mut concurrencies: Vec<u32> = results.iter().map(|r| r.concurrency).collect();
    concurrencies.sort_unstable();
    concurrencies.dedup();
    let (width, height) = (420 * concurrencies.len().max(1) as u32, 720u32);
    match extension.as_str() {
        "svg" => {
            let root = SVGBackend::new(path, (width, height)).into_drawing_area();
            draw(&root, results, &concurrencies)?;
            root.present().with_context(|| format!("writing {}", path.display()))?;
        }
        "png" => {
            let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
            draw(&root, results, &concurrencies)?;
            root.present().with_context(|| format!("writing {}", path.display()))?;
        }
        _ => bail!("--plot {}: the file must end in .svg or .png", path.display()),
    }
    Ok(())
}

fn draw<DB: plotters::prelude::DrawingBackend>(
    root: &plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    results: &[CellResult],
    concurrencies: &[u32],
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    use plotters::prelude::*;

    let fail = |e: &dyn fmt::Display| anyhow::anyhow!("drawing the chart: {e}");
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut sizes: Vec<u64> = results.iter().map(|r| r.size_bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut systems: Vec<&str> = Vec::new();
    for r in results {
        if !systems.contains(&r.system.as_str()) {
            systems.push(&r.system);
        }
    }
    let panels = root.split_evenly((2, concurrencies.len().max(1)));
    for (i, panel) in panels.iter().enumerate() {
        let op = if i / concurrencies.len().max(1) == 0 { Op::Write } else { Op::Read };
        let Some(&concurrency) = concurrencies.get(i % concurrencies.len().max(1)) else { continue };
        let cells: Vec<&CellResult> = results.iter().filter(|r| r.op == op && r.concurrency == concurrency).collect();
        let top = cells.iter().map(|r| r.throughput_mib_s).fold(1.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{} x{concurrency}", op.name()), ("sans-serif", 18))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(55)
            .build_cartesian_2d(-0.5f64..(sizes.len() as f64 - 0.5), 0f64..top)
            .map_err(|e| fail(&e))?;
        let labels = sizes.clone();
        chart
            .configure_mesh()
            .x_labels(sizes.len().max(1))
            .x_label_formatter(&|x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 {
                    labels.get(i as usize).map(|s| human_size(*s)).unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc("MiB/s")
            .draw()
            .map_err(|e| fail(&e))?;
        for (s, system) in systems.iter().enumerate() {
            let color = Palette99::pick(s).to_rgba();
            let points: Vec<(f64, f64)> = sizes
                .iter()
                .enumerate()
                .filter_map(|(x, size)| {
                    cells
                        .iter()
                        .find(|r| r.system == *system && r.size_bytes == *size)
                        .map(|r| (x as f64, r.throughput_mib_s))
                })
                .collect();
            if points.is_empty() {
                continue;
            }
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(|e| fail(&e))?
                .label(*system)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
            chart.draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled()))).map_err(|e| fail(&e))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| fail(&e))?;
    }
    Ok(())
}

/// Plotters needs a font to lay out text; use the first common sans TTF on this machine.
fn register_font() -> anyhow::Result<()> {
    static REGISTERED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            const CANDIDATES: [&str; 5] = [
                "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
                "/usr/share/fonts/TTF/DejaVuSans.ttf",
                "/usr/share/fonts/dejavu/DejaVuSans.ttf",
                "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
                "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
            ];
            let bytes = CANDIDATES.iter().find_map(|p| std::fs::read(p).ok()).ok_or_else(|| {
                format!(
                    "--plot needs a TrueType font and found none of {}; install one with \
                     `apt-get install fonts-dejavu-core`",
                    CANDIDATES.join(", ")
                )
            })?;
            // Registered once per process, so leaking it is bounded.
            let bytes: &'static [u8] = bytes.leak();
            plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, bytes)
                .map_err(|_| "the font could not be loaded".to_string())
        })
        .clone()
        .map_err(|e| anyhow::anyhow!(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_are_within_two_percent() {
        let mut h = Histogram::default();
        for v in 1..=100_000u64 {
            h.record(v * 1000);
        }
        assert_eq!(h.count(), 100_000);
        for (q, want) in [(0.5, 50_000_000.0), (0.99, 99_000_000.0), (0.999, 99_900_000.0)] {
            let got = h.quantile_ns(q) as f64;
            assert!((got - want).abs() / want < 0.02, "q{q}: {got} vs {want}");
        }
        assert_eq!(Histogram::default().quantile_ns(0.5), 0);
        let mut small = Histogram::default();
        small.record(5);
        assert_eq!(small.quantile_ns(0.99), 5);
    }

    #[test]
    fn systems_parse_by_name() {
        for system in System::ALL {
            assert_eq!(system.name().parse::<System>().unwrap(), system);
        }
        assert!("memcached".parse::<System>().unwrap_err().to_string().contains(
            "tern-tcp, tern-tls, tern-quic, tern-nvme, tern-local, tern-rdma, tcp-raw, tls-raw, quic-raw, redis, file, file-direct"
        ));
        assert!(System::TernTcp.is_tern() && !System::Redis.is_tern() && !System::TcpRaw.is_tern());
        assert_eq!(System::TernNvme.raw_peer(), Some(System::TcpRaw));
        assert_eq!(System::TernQuic.raw_peer(), Some(System::QuicRaw));
        assert_eq!(System::TernRdma.raw_peer(), Some(System::TcpRaw));
        assert_eq!(System::Redis.raw_peer(), None);
    }

    #[test]
    fn json_lines_have_exactly_the_schema_fields() {
        let r = CellResult {
            system: "redis".into(),
            op: Op::Read,
            size_bytes: 4096,
            concurrency: 1,
            ops: 10,
            seconds: 0.5,
            runs: 1,
            throughput_mib_s: 1.0,
            throughput_min_mib_s: 1.0,
            throughput_max_mib_s: 1.0,
            p50_us: 40.0,
            p99_us: 80.0,
            p999_us: 90.0,
        };
        let value: serde_json::Value = serde_json::to_value(&r).unwrap();
        let mut keys: Vec<&str> = value.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        keys.sort_unstable();
        let mut want = [
            "system",
            "op",
            "size_bytes",
            "concurrency",
            "ops",
            "seconds",
            "runs",
            "throughput_mib_s",
            "throughput_min_mib_s",
            "throughput_max_mib_s",
            "p50_us",
            "p99_us",
            "p999_us",
        ];
        want.sort_unstable();
        assert_eq!(keys, want);
        assert_eq!(value["op"], "read");
        // Runs fold into their median and range.
        let runs: Vec<CellResult> = [3.0, 1.0, 2.0]
            .into_iter()
            .map(|mib_s| CellResult { throughput_mib_s: mib_s, p50_us: 10.0 * mib_s, ..r.clone() })
            .collect();
        let folded = CellResult::of_runs(&runs);
        assert_eq!((folded.runs, folded.ops), (3, 30));
        assert_eq!(
            (folded.throughput_mib_s, folded.throughput_min_mib_s, folded.throughput_max_mib_s),
            (2.0, 1.0, 3.0)
        );
        assert_eq!(folded.p50_us, 20.0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn raw_peers_move_every_byte() {
        let options = IoOptions {
            tern: PathBuf::new(),
            systems: vec![],
            cells: vec![],
            seconds: 0.05,
            warmup_seconds: 0.0,
            runs: 1,
            max_bytes: 8 << 20,
            dir: std::env::temp_dir(),
            dram_bytes: 0,
            progress: false,
        };
        for transport in [RawTransport::Tcp, RawTransport::Tls, RawTransport::Quic] {
            let raw = RawTarget::start(transport).await.unwrap();
            for op in [Op::Write, Op::Read] {
                let cell = Cell { op, size: 1 << 20, concurrency: 2 };
                let samples = raw.measure(cell, Budget::new(cell, &options)).await.unwrap();
                let result = samples.result(System::TcpRaw, cell);
                assert!(result.ops >= 2 && result.throughput_mib_s > 0.0, "{transport:?} {op:?}: {result:?}");
            }
        }
    }

    #[tokio::test]
    async fn vectored_writes_send_every_byte() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let big = vec![7u8; 3 << 20];
        let parts: Vec<&[u8]> = vec![b"*3\r\n", &big, b"\r\n"];
        let reader = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut all = Vec::new();
            s.read_to_end(&mut all).await.unwrap();
            all
        });
        let stream = TcpStream::connect(addr).await.unwrap();
        let (_r, mut w) = stream.into_split();
        write_all_vectored(&mut w, &parts).await.unwrap();
        drop(w);
        drop(_r);
        let all = reader.await.unwrap();
        assert_eq!(all.len(), 4 + big.len() + 2);
        assert!(all.starts_with(b"*3\r\n") && all.ends_with(b"\r\n"));
    }
}
