//! `tern bench soak`: many concurrent clients doing mixed file and shuffle work on a cluster whose
//! tiers are small enough to fill, for a fixed time, counting what went wrong.
//!
//! Each client is its own [`Client`] (own metadata channel, own block connections) in its own task,
//! looping over a random mix: put a file of random size and read it back byte for byte, stat it,
//! list its directory, delete old files; run a shuffle under a job of its own (register, map
//! writers push, commit, a reader checks every byte and the per-map totals, the job ends). What it
//! writes is derived from a seed, so every byte read is checked against what was written.
//!
//! Outcomes fall in three bins: success; **pushback**, the answers a full cluster is meant to give
//! (`OutOfSpace`, and `Unavailable` after the client's own bounded retries), after which the client
//! frees something of its own and goes on; and **unexpected errors**: any other error, or any wrong
//! byte or length. The run fails on any unexpected error.
//!
//! Memory: every storage server's resident set (procfs `VmRSS`) is sampled through the run. Its
//! DRAM tier is one mapping, faulted in at start, so the peak resident set less the tier size is
//! what the server holds besides stored data (connections, queues, buffers); the run fails when it
//! exceeds a fixed bound ([`DEFAULT_RSS_BOUND`] unless told).

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use serde::Serialize;
use tern_client::{Client, ErrorKind, MapWriterOptions, ShuffleOptions, StorageClass};

use tern_local::cluster::EmbeddedCluster;

/// What a storage server may hold beyond its DRAM tier: its code, runtime and connection buffers
/// for every client at once. 64 clients x 2 connections with a 64 KiB write buffer and a
/// block-sized push buffer each is about 40 MiB at a 256 KiB block; the bound leaves room for the
/// allocator and the runtime.
pub const DEFAULT_RSS_BOUND: u64 = 192 << 20;
/// Files a client keeps before it deletes its oldest.
const FILES_KEPT: usize = 6;
/// Unexpected errors quoted in the report (all are counted).
const ERROR_SAMPLES: usize = 20;
/// How often storage servers' memory is sampled.
const RSS_PERIOD: Duration = Duration::from_millis(100);

#[derive(Debug, Clone)]
pub struct SoakOptions {
    pub tern: PathBuf,
    pub clients: usize,
    pub duration: Duration,
    pub servers: u16,
    /// DRAM tier per storage server, bytes.
    pub dram_bytes: u64,
    pub block_size_bytes: u64,
    /// NVMe tier per storage server, bytes; some files then ask for the NVMe class.
    pub nvme_bytes: Option<u64>,
    /// Directory of the cluster (NVMe files need a filesystem that takes O_DIRECT).
    pub dir: PathBuf,
    /// Largest file put, bytes.
    pub max_file_bytes: u64,
    pub rss_bound_bytes: u64,
    pub seed: u64,
    pub progress: bool,
}

/// Operations that succeeded, by kind.
#[derive(Debug, Default, Serialize)]
pub struct OpCounts {
    pub put: u64,
    pub get: u64,
    pub stat: u64,
    pub list: u64,
    pub delete: u64,
    pub job: u64,
    pub shuffle: u64,
    pub map_commit: u64,
    pub partition_read: u64,
}

#[derive(Debug, Default, Serialize)]
pub struct Pushbacks {
    pub out_of_space: u64,
    pub unavailable: u64,
}

#[derive(Debug, Serialize)]
pub struct SoakReport {
    pub clients: usize,
    pub seconds: f64,
    pub servers: u16,
    pub dram_bytes_per_server: u64,
    pub nvme_bytes_per_server: u64,
    pub block_size_bytes: u64,
    pub ops: OpCounts,
    pub ops_total: u64,
    pub ops_per_s: f64,
    pub bytes_written: u64,
    pub bytes_verified: u64,
    pub pushbacks: Pushbacks,
    pub pushbacks_total: u64,
    pub unexpected_errors: u64,
    pub error_samples: Vec<String>,
    /// Highest resident set of any storage server.
    pub peak_rss_bytes: u64,
    /// The same less the DRAM tier, the figure bounded.
    pub peak_rss_beyond_dram_bytes: u64,
    pub rss_bound_bytes: u64,
    pub rss_samples: u64,
    pub within_bound: bool,
    /// No unexpected error and memory within the bound.
    pub ok: bool,
}

/// Counters shared by the clients.
#[derive(Default)]
struct Tally {
    put: AtomicU64,
    get: AtomicU64,
    stat: AtomicU64,
    list: AtomicU64,
    delete: AtomicU64,
    job: AtomicU64,
    shuffle: AtomicU64,
    map_commit: AtomicU64,
    partition_read: AtomicU64,
    bytes_written: AtomicU64,
    bytes_verified: AtomicU64,
    out_of_space: AtomicU64,
    unavailable: AtomicU64,
    unexpected: AtomicU64,
    samples: Mutex<Vec<String>>,
}

impl Tally {
    fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn ops(&self) -> u64 {
        [&self.put, &self.get, &self.stat, &self.list, &self.delete, &self.job, &self.shuffle]
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    fn pushbacks(&self) -> u64 {
        self.out_of_space.load(Ordering::Relaxed) + self.unavailable.load(Ordering::Relaxed)
    }

    fn unexpected(&self, what: String) {
        Tally::count(&self.unexpected);
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        if samples.len() < ERROR_SAMPLES {
            samples.push(what);
        }
    }
}

/// Why one step of a client's work stopped.
enum Failure {
    /// The cluster said it is full or busy: expected under load.
    Pushback(ErrorKind),
    Unexpected(String),
}

impl From<tern_client::Error> for Failure {
    fn from(e: tern_client::Error) -> Failure {
        match e.kind() {
            ErrorKind::OutOfSpace | ErrorKind::Unavailable => Failure::Pushback(e.kind()),
            _ => Failure::Unexpected(e.to_string()),
        }
    }
}

type Step<T> = std::result::Result<T, Failure>;

use tern_common::SplitMix64 as Rng;

/// `len` bytes derived from `seed`: what a file or a shuffle write holds.
fn content(seed: u64, len: usize) -> Bytes {
    let mut rng = Rng(seed);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    out.truncate(len);
    Bytes::from(out)
}

/// A file a client wrote and keeps until it deletes it.
struct Kept {
    path: String,
    seed: u64,
    len: u64,
}

struct Worker {
    id: usize,
    client: Client,
    rng: Rng,
    tally: Arc<Tally>,
    options: SoakOptions,
    kept: VecDeque<Kept>,
    files: u64,
    dir: String,
}

impl Worker {
    async fn run(mut self, stop: Arc<AtomicBool>) {
        while !stop.load(Ordering::Relaxed) {
            let roll = self.rng.below(100);
            let result = match roll {
                0..=44 => self.put_and_verify().await,
                45..=59 => self.stat_and_list().await,
                60..=69 => self.delete_oldest().await,
                _ => self.shuffle().await,
            };
            match result {
                Ok(()) => {}
                Err(Failure::Pushback(kind)) => {
                    let counter =
                        if kind == ErrorKind::OutOfSpace { &self.tally.out_of_space } else { &self.tally.unavailable };
                    Tally::count(counter);
                    // Make room as a real job would: give back something of its own, then wait a
                    // moment (freed space returns with the servers' next heartbeats).
                    if let Err(Failure::Unexpected(e)) = self.delete_oldest().await {
                        self.tally.unexpected(format!("client {}: {e}", self.id));
                    }
                    tokio::time::sleep(Duration::from_millis(50 + self.rng.below(200))).await;
                }
                Err(Failure::Unexpected(e)) => self.tally.unexpected(format!("client {}: {e}", self.id)),
            }
        }
        // Leave nothing behind, so the next run's cluster (and this one's reaper) has less to do.
        while !self.kept.is_empty() {
            if self.delete_oldest().await.is_err() {
                break;
            }
        }
    }

    /// Puts a file of random size (sometimes empty, sometimes several blocks), reads it back and
    /// checks every byte.
    async fn put_and_verify(&mut self) -> Step<()> {
        if self.kept.len() >= FILES_KEPT {
            self.delete_oldest().await?;
        }
        let len = match self.rng.below(10) {
            0 => 0,
            1..=5 => self.rng.below(64 << 10),
            _ => self.rng.below(self.options.max_file_bytes + 1),
        };
        let seed = self.rng.next_u64();
        self.files += 1;
        let path = format!("{}/f{}", self.dir, self.files);
        let class = if self.options.nvme_bytes.is_some() && self.rng.below(3) == 0 {
            StorageClass::Nvme
        } else {
            StorageClass::Any
        };
        let data = content(seed, len as usize);
        if let Err(e) = self.client.put_with_class(&path, data.clone(), class).await {
            // The writer deletes what it created when dropped unclosed, in the background; delete
            // it here too, so that a listing right after does not see it.
            match self.client.delete(&path, false).await {
                Ok(_) => {}
                Err(gone) if gone.kind() == ErrorKind::NotFound => {}
                Err(other) => return Err(Failure::Unexpected(format!("delete {path} after a failed put: {other}"))),
            }
            return Err(e.into());
        }
        Tally::count(&self.tally.put);
        self.tally.bytes_written.fetch_add(len, Ordering::Relaxed);
        self.kept.push_back(Kept { path: path.clone(), seed, len });
        let read = self.client.open(&path).await?.read_to_end().await?;
        if read != data {
            let first = read.iter().zip(data.iter()).position(|(a, b)| a != b).unwrap_or(read.len().min(data.len()));
            return Err(Failure::Unexpected(format!(
                "{path}: read back {} bytes, wrote {}; first difference at byte {first}",
                read.len(),
                data.len()
            )));
        }
        Tally::count(&self.tally.get);
        self.tally.bytes_verified.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    /// Stats a kept file (length must match) and lists the client's directory (must hold exactly
    /// the kept files); sometimes reads a kept file's range.
    async fn stat_and_list(&mut self) -> Step<()> {
        if let Some(kept) = self.kept.get(self.rng.below(self.kept.len() as u64) as usize) {
            let info = self.client.stat(&kept.path).await?;
            if info.length != kept.len || !info.sealed {
                return Err(Failure::Unexpected(format!(
                    "stat {}: length {} sealed {}, expected length {} sealed",
                    kept.path, info.length, info.sealed, kept.len
                )));
            }
            Tally::count(&self.tally.stat);
            if kept.len > 0 {
                let offset = self.rng.below(kept.len);
                let len = (self.rng.below(kept.len - offset) + 1) as usize;
                let (path, expected) = (kept.path.clone(), content(kept.seed, kept.len as usize));
                let got = self.client.open(&path).await?.read_at(offset, len).await?;
                if got[..] != expected[offset as usize..offset as usize + len] {
                    return Err(Failure::Unexpected(format!("{path}: range {offset}+{len} read back wrong")));
                }
                Tally::count(&self.tally.get);
                self.tally.bytes_verified.fetch_add(len as u64, Ordering::Relaxed);
            }
        }
        if self.files > 0 {
            let listed = self.client.list(&self.dir).await?;
            let mut names: Vec<&str> = listed.iter().map(|f| f.path.as_str()).collect();
            names.sort_unstable();
            let mut expected: Vec<&str> = self.kept.iter().map(|k| k.path.as_str()).collect();
            expected.sort_unstable();
            if names != expected {
                return Err(Failure::Unexpected(format!("list {}: {names:?}, expected {expected:?}", self.dir)));
            }
            Tally::count(&self.tally.list);
        }
        Ok(())
    }

    async fn delete_oldest(&mut self) -> Step<()> {
        let Some(oldest) = self.kept.pop_front() else { return Ok(()) };
        // A delete of a file this client owns cannot be refused for room; any error is unexpected.
        self.client.delete(&oldest.path, false).await.map_err(|e| Failure::Unexpected(e.to_string()))?;
        Tally::count(&self.tally.delete);
        Ok(())
    }

    /// A whole shuffle under a job of its own: maps push, commit; a reader checks every byte and
    /// the per-map totals; the job ends (freeing the shuffle). A pushback ends the job too.
    async fn shuffle(&mut self) -> Step<()> {
        let job = self.client.start_job(None, Duration::from_secs(30)).await?;
        Tally::count(&self.tally.job);
        let result = self.shuffle_in(job.id()).await;
        // Ending the job frees its shuffle whatever happened; its own failure is unexpected.
        if let Err(e) = job.end().await {
            return Err(Failure::Unexpected(format!("end job: {e}")));
        }
        result
    }

    async fn shuffle_in(&mut self, job: &str) -> Step<()> {
        let partitions = 1 + self.rng.below(4) as u32;
        let maps = 1 + self.rng.below(3) as u32;
        let options = ShuffleOptions { maps, ..ShuffleOptions::default() };
        let shuffle = self.client.register_shuffle(job, partitions, options).await?;
        // Expected contents per (partition, map): the concatenation of what the map wrote there.
        let mut expected: BTreeMap<(u32, u32), Vec<u8>> = BTreeMap::new();
        let writer_options = MapWriterOptions { buffer_bytes: 1 << 20, batch_bytes: 32 << 10, pushes_in_flight: 4 };
        for map in 0..maps {
            let mut writer = shuffle.writer_with(map, 0, writer_options.clone());
            for _ in 0..self.rng.below(12) {
                let partition = self.rng.below(u64::from(partitions)) as u32;
                let data = content(self.rng.next_u64(), self.rng.below(16 << 10) as usize + 1);
                writer.write(partition, &data).await?;
                expected.entry((partition, map)).or_default().extend_from_slice(&data);
            }
            let outcome = writer.commit().await?;
            if !outcome.committed {
                return Err(Failure::Unexpected(format!("shuffle {}: map {map}'s only attempt lost", shuffle.id())));
            }
            Tally::count(&self.tally.map_commit);
        }
        // Per-map totals first, from the metadata server alone.
        for (map, lengths) in shuffle.lengths(0..partitions, 0..maps).await? {
            for (partition, &len) in lengths.iter().enumerate() {
                let want = expected.get(&(partition as u32, map)).map_or(0, |v| v.len() as u64);
                if len != want {
                    return Err(Failure::Unexpected(format!(
                        "shuffle {}: map {map} partition {partition}: {len} bytes committed, {want} written",
                        shuffle.id()
                    )));
                }
            }
        }
        let mut got: BTreeMap<(u32, u32), Vec<u8>> = BTreeMap::new();
        let mut reader = shuffle.reader(0..partitions, 0..maps).await?;
        while let Some(batch) = reader.next_batch().await? {
            got.entry((batch.partition, batch.map)).or_default().extend_from_slice(&batch.data);
        }
        expected.retain(|_, v| !v.is_empty());
        if got != expected {
            let keys: Vec<_> = got.iter().map(|(k, v)| (*k, v.len())).collect();
            let want: Vec<_> = expected.iter().map(|(k, v)| (*k, v.len())).collect();
            return Err(Failure::Unexpected(format!(
                "shuffle {}: read (partition, map, bytes) {keys:?}, written {want:?} (or bytes differ)",
                shuffle.id()
            )));
        }
        Tally::count(&self.tally.shuffle);
        let partitions_read = u64::from(partitions);
        self.tally.partition_read.fetch_add(partitions_read, Ordering::Relaxed);
        let bytes: u64 = got.values().map(|v| v.len() as u64).sum();
        self.tally.bytes_verified.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }
}

/// The storage servers' processes, and the peak of their resident sets.
struct Memory {
    pids: Vec<u32>,
    peak: AtomicU64,
    samples: AtomicU64,
}

impl Memory {
    fn sample(&self) {
        for &pid in &self.pids {
            if let Ok(kib) = crate::core::rss_kib(pid) {
                self.peak.fetch_max(kib * 1024, Ordering::Relaxed);
                self.samples.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

pub async fn run(options: &SoakOptions) -> anyhow::Result<SoakReport> {
    anyhow::ensure!(options.clients > 0, "--clients must be at least 1");
    anyhow::ensure!(options.servers > 0, "--servers must be at least 1");
    let dram = format!("{}KiB", options.dram_bytes / 1024);
    let block_size = format!("{}KiB", options.block_size_bytes / 1024);
    let nvme = options.nvme_bytes.map(|n| format!("{}KiB", n / 1024));
    let cluster = EmbeddedCluster::start_with(
        &options.tern,
        options.servers,
        &dram,
        &block_size,
        nvme.as_deref(),
        &options.dir,
        &[],
    )
    .await?;
    let pids = (0..options.servers)
        .map(|i| crate::core::pid_listening_on(&cluster.storage_addr(i)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let memory = Arc::new(Memory { pids, peak: AtomicU64::new(0), samples: AtomicU64::new(0) });
    memory.sample();
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = tokio::task::JoinSet::new();
    for id in 0..options.clients {
        let client = Client::connect(&cluster.metadata_addr).await.context("connecting a soak client")?;
        let worker = Worker {
            id,
            client,
            rng: Rng(options.seed ^ (id as u64).wrapping_mul(0x2545_f491_4f6c_dd1d)),
            tally: tally.clone(),
            options: options.clone(),
            kept: VecDeque::new(),
            files: 0,
            dir: format!("/soak/c{id}"),
        };
        workers.spawn(worker.run(stop.clone()));
    }
    let started = Instant::now();
    let mut last_report = started;
    while started.elapsed() < options.duration {
        tokio::time::sleep(RSS_PERIOD).await;
        memory.sample();
        if options.progress && last_report.elapsed() >= Duration::from_secs(5) {
            last_report = Instant::now();
            eprintln!(
                "soak: {:>4.0} s  ops {:>8}  pushbacks {:>6}  unexpected {:>3}  peak storage RSS {:.1} MiB",
                started.elapsed().as_secs_f64(),
                tally.ops(),
                tally.pushbacks(),
                tally.unexpected.load(Ordering::Relaxed),
                memory.peak.load(Ordering::Relaxed) as f64 / f64::from(1 << 20)
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    // Every client finishes its current step (bounded by the client's own request timeouts).
    let sampler = {
        let memory = memory.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(RSS_PERIOD).await;
                memory.sample();
            }
        })
    };
    while let Some(joined) = workers.join_next().await {
        if let Err(e) = joined {
            tally.unexpected(format!("a client task failed: {e}"));
        }
    }
    sampler.abort();
    let seconds = started.elapsed().as_secs_f64();
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let ops = OpCounts {
        put: load(&tally.put),
        get: load(&tally.get),
        stat: load(&tally.stat),
        list: load(&tally.list),
        delete: load(&tally.delete),
        job: load(&tally.job),
        shuffle: load(&tally.shuffle),
        map_commit: load(&tally.map_commit),
        partition_read: load(&tally.partition_read),
    };
    let peak = memory.peak.load(Ordering::Relaxed);
    let beyond = peak.saturating_sub(options.dram_bytes);
    let unexpected = load(&tally.unexpected);
    let within_bound = beyond <= options.rss_bound_bytes;
    let ops_total = tally.ops();
    let error_samples = tally.samples.lock().unwrap_or_else(|e| e.into_inner()).clone();
    drop(cluster);
    Ok(SoakReport {
        clients: options.clients,
        seconds,
        servers: options.servers,
        dram_bytes_per_server: options.dram_bytes,
        nvme_bytes_per_server: options.nvme_bytes.unwrap_or(0),
        block_size_bytes: options.block_size_bytes,
        ops,
        ops_total,
        ops_per_s: ops_total as f64 / seconds,
        bytes_written: load(&tally.bytes_written),
        bytes_verified: load(&tally.bytes_verified),
        pushbacks: Pushbacks { out_of_space: load(&tally.out_of_space), unavailable: load(&tally.unavailable) },
        pushbacks_total: tally.pushbacks(),
        unexpected_errors: unexpected,
        error_samples,
        peak_rss_bytes: peak,
        peak_rss_beyond_dram_bytes: beyond,
        rss_bound_bytes: options.rss_bound_bytes,
        rss_samples: load(&memory.samples),
        within_bound,
        ok: unexpected == 0 && within_bound,
    })
}

pub fn print_table(report: &SoakReport) {
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    println!(
        "soak: {} clients for {:.1} s on {} storage servers ({:.0} MiB DRAM each{}, {} KiB blocks)",
        report.clients,
        report.seconds,
        report.servers,
        mib(report.dram_bytes_per_server),
        if report.nvme_bytes_per_server > 0 {
            format!(", {:.0} MiB NVMe", mib(report.nvme_bytes_per_server))
        } else {
            String::new()
        },
        report.block_size_bytes / 1024
    );
    let o = &report.ops;
    println!("{:<28} {:>12}", "operation", "count");
    for (name, count) in [
        ("put (file written)", o.put),
        ("get (file or range verified)", o.get),
        ("stat", o.stat),
        ("list", o.list),
        ("delete", o.delete),
        ("job (started and ended)", o.job),
        ("shuffle (verified)", o.shuffle),
        ("  map commits", o.map_commit),
        ("  partitions read", o.partition_read),
    ] {
        println!("{name:<28} {count:>12}");
    }
    println!("{:<28} {:>12} ({:.0}/s)", "operations", report.ops_total, report.ops_per_s);
    println!("{:<28} {:>12.1} MiB", "written", mib(report.bytes_written));
    println!("{:<28} {:>12.1} MiB", "verified byte for byte", mib(report.bytes_verified));
    println!(
        "{:<28} {:>12} (OutOfSpace {}, Unavailable {})",
        "pushbacks (expected)", report.pushbacks_total, report.pushbacks.out_of_space, report.pushbacks.unavailable
    );
    println!("{:<28} {:>12}", "unexpected errors", report.unexpected_errors);
    for sample in &report.error_samples {
        println!("  {sample}");
    }
    println!(
        "{:<28} {:>12.1} MiB peak, {:.1} MiB beyond DRAM (bound {:.0} MiB: {})",
        "storage server RSS",
        mib(report.peak_rss_bytes),
        mib(report.peak_rss_beyond_dram_bytes),
        mib(report.rss_bound_bytes),
        if report.within_bound { "within" } else { "EXCEEDED" }
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_is_deterministic_and_seeded() {
        assert_eq!(content(7, 100), content(7, 100));
        assert_ne!(content(7, 100), content(8, 100));
        assert_eq!(content(7, 13).len(), 13);
        assert_eq!(&content(7, 100)[..13], &content(7, 13)[..]);
    }

    #[test]
    fn pushback_kinds_are_told_apart_from_other_errors() {
        let failure = Failure::from(tern_client::Error::new(ErrorKind::OutOfSpace, "full"));
        assert!(matches!(failure, Failure::Pushback(ErrorKind::OutOfSpace)));
        let failure = Failure::from(tern_client::Error::new(ErrorKind::NotFound, "gone"));
        assert!(matches!(failure, Failure::Unexpected(_)));
    }
}
