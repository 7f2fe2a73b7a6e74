//! `tern bench tiers`: shuffles on NVMe against their peers, in the same run.
//!
//! - **Reducer read.** One storage server (64 MiB of DRAM) takes an `nvme` shuffle of one
//!   partition from several maps; once the mover has written it down, a reducer streams the
//!   partition. Peer: plain O_DIRECT 1 MiB `pread`s of a file of the same size on the same disk,
//!   with as many reads in flight as the reducer keeps fetches (16), and one at a time.
//! - **Sort.** `tern terasort` of `--size` with the shuffle in `dram` and in `nvme`, each run on
//!   a fresh embedded cluster of the same shape (DRAM and NVMe tiers both large enough for the
//!   whole job), in rotating order: the NVMe shuffle's sort rate as a share of the DRAM one's.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tern_client::{Client, ShuffleOptions, StorageClass};
use tern_common::{rotation, Spread};
use tern_local::cluster::EmbeddedCluster;
use tern_terasort::driver::{self, TerasortOptions};

use crate::harness::AlignedVec;
use crate::shuffle::{push_partition, read_partition_gb_s};

/// Reads in flight on the peer's parallel reader: the reducer's fetch streams at once.
const PEER_READS_IN_FLIGHT: usize = 16;
/// One O_DIRECT read of the peer.
const PEER_READ_BYTES: usize = 1 << 20;
/// How long the mover may take to write the read set down.
const MOVE_DEADLINE: Duration = Duration::from_secs(120);

pub struct TiersBenchOptions {
    pub tern: PathBuf,
    /// Bytes of the partition read, and of the peer's file.
    pub read_bytes: u64,
    /// Bytes sorted by each terasort.
    pub sort_bytes: u64,
    pub runs: usize,
    /// Where the clusters' NVMe files and the peer's file go (a disk that takes O_DIRECT).
    pub dir: PathBuf,
    pub progress: bool,
}

#[derive(Debug, Serialize)]
pub struct TiersBenchReport {
    pub read_bytes: u64,
    /// GB/s over runs.
    pub partition_read_gb_s: Spread,
    pub direct_read_gb_s: Spread,
    pub direct_read_qd1_gb_s: Spread,
    /// The partition read over the parallel O_DIRECT read, per run.
    pub read_ratio: Spread,
    pub sort_bytes: u64,
    /// Sort rate (MB/s, map and reduce phases) per shuffle class over runs.
    pub dram_sort_mb_s: Spread,
    pub nvme_sort_mb_s: Spread,
    /// NVMe over DRAM, per run.
    pub sort_ratio: Spread,
}

pub async fn run(options: &TiersBenchOptions) -> anyhow::Result<TiersBenchReport> {
    let say = |line: String| {
        if options.progress {
            eprintln!("{line}");
        }
    };
    let (reads, direct, direct_qd1) = read_rates(options, &say).await?;
    let read_ratio = reads.iter().zip(&direct).map(|(tern, peer)| tern / peer).collect();
    let (mut dram, mut nvme) = (Vec::new(), Vec::new());
    for run in 0..options.runs {
        for class in rotation(&[StorageClass::Dram, StorageClass::Nvme], run) {
            say(format!("run {}: terasort of {} MiB, shuffle class {class} ...", run + 1, options.sort_bytes >> 20));
            let rate = sort_rate(options, class).await?;
            say(format!("  {rate:.0} MB/s"));
            match class {
                StorageClass::Nvme => nvme.push(rate),
                _ => dram.push(rate),
            }
        }
    }
    let sort_ratio = nvme.iter().zip(&dram).map(|(n, d)| n / d).collect();
    Ok(TiersBenchReport {
        read_bytes: options.read_bytes,
        partition_read_gb_s: Spread::of(reads),
        direct_read_gb_s: Spread::of(direct),
        direct_read_qd1_gb_s: Spread::of(direct_qd1),
        read_ratio: Spread::of(read_ratio),
        sort_bytes: options.sort_bytes,
        dram_sort_mb_s: Spread::of(dram),
        nvme_sort_mb_s: Spread::of(nvme),
        sort_ratio: Spread::of(sort_ratio),
    })
}

/// Per run: the reducer's partition read, the parallel O_DIRECT read and the one-at-a-time one
/// (GB/s), in rotating order.
async fn read_rates(
    options: &TiersBenchOptions,
    say: &impl Fn(String),
) -> anyhow::Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    let read_mib = options.read_bytes.div_ceil(1 << 20);
    let nvme = format!("{}MiB", read_mib * 2 + 64);
    let cluster =
        EmbeddedCluster::start_with(&options.tern, 1, "64MiB", "1MiB", Some(&nvme), &options.dir, &[]).await?;
    let client = Client::connect(&cluster.metadata_addr).await?;
    let job = client.start_job(Some("bench-tiers"), Duration::from_secs(60)).await?;
    say(format!("pushing a partition of {read_mib} MiB as an nvme shuffle ..."));
    let maps = 4u32;
    let options_nvme = ShuffleOptions { maps, storage_class: "nvme".into(), ..Default::default() };
    let shuffle = client.register_shuffle(job.id(), 1, options_nvme).await?;
    let per_map = options.read_bytes / u64::from(maps);
    push_partition(&shuffle, maps, per_map).await?;
    wait_until_moved(&client, per_map * u64::from(maps)).await?;
    let peer = PeerFile::write(&options.dir, per_map * u64::from(maps))?;
    let (mut reads, mut direct, mut direct_qd1) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..options.runs {
        for which in rotation(&[0, 1, 2], run) {
            match which {
                0 => reads.push(read_partition_gb_s(&shuffle).await?),
                1 => direct.push(peer.read(PEER_READS_IN_FLIGHT).await?),
                _ => direct_qd1.push(peer.read(1).await?),
            }
        }
        say(format!(
            "run {}: partition {:.2} GB/s, O_DIRECT x{PEER_READS_IN_FLIGHT} {:.2} GB/s, x1 {:.2} GB/s",
            run + 1,
            reads[run],
            direct[run],
            direct_qd1[run]
        ));
    }
    job.end().await.context("ending the bench job")?;
    Ok((reads, direct, direct_qd1))
}

/// Waits until the storage server holds at most one DRAM slot per segment of the shuffle (the
/// one still open: a partition continues in a new segment every 256 MiB) and the rest on NVMe.
async fn wait_until_moved(client: &Client, bytes: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + MOVE_DEADLINE;
    let open_slots = (bytes.div_ceil(256 << 20) + 1) << 20;
    loop {
        let status = client.status().await?;
        let shuffle = |tier: &str| -> u64 {
            let tiers = status.servers.iter().flat_map(|s| s.tiers.iter());
            tiers.filter(|t| t.tier == tier).map(|t| t.shuffle_bytes).sum()
        };
        if shuffle("dram") <= open_slots && shuffle("nvme") + shuffle("dram") >= bytes {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the shuffle did not move down to NVMe within {MOVE_DEADLINE:?}: {} bytes in DRAM, {} on NVMe",
            shuffle("dram"),
            shuffle("nvme")
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The peer's file: written once (real bytes, so reads reach the disk), read with O_DIRECT.
struct PeerFile {
    _dir: tempfile::TempDir,
    path: PathBuf,
    bytes: u64,
}

impl PeerFile {
    fn write(dir: &Path, bytes: u64) -> anyhow::Result<PeerFile> {
        let dir = tempfile::Builder::new().prefix("tern-bench-tiers-").tempdir_in(dir)?;
        let path = dir.path().join("peer");
        let file = std::fs::File::create(&path)?;
        let chunk: Vec<u8> = (0..PEER_READ_BYTES as u32).map(|i| (i * 17 + 3) as u8).collect();
        let chunks = bytes.div_ceil(PEER_READ_BYTES as u64);
        for n in 0..chunks {
            file.write_all_at(&chunk, n * PEER_READ_BYTES as u64)?;
        }
        file.sync_all()?;
        Ok(PeerFile { _dir: dir, path, bytes: chunks * PEER_READ_BYTES as u64 })
    }

    /// Reads the whole file in 1 MiB O_DIRECT preads, `in_flight` at a time; GB/s.
    async fn read(&self, in_flight: usize) -> anyhow::Result<f64> {
        let (path, bytes) = (self.path.clone(), self.bytes);
        tokio::task::spawn_blocking(move || -> anyhow::Result<f64> {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
                .with_context(|| format!("opening {} with O_DIRECT", path.display()))?;
            let chunks = bytes / PEER_READ_BYTES as u64;
            let started = Instant::now();
            std::thread::scope(|scope| -> anyhow::Result<()> {
                let readers: Vec<_> = (0..in_flight as u64)
                    .map(|first| {
                        let file = &file;
                        scope.spawn(move || -> anyhow::Result<()> {
                            let mut buf = AlignedVec::new(PEER_READ_BYTES);
                            for chunk in (first..chunks).step_by(in_flight) {
                                file.read_exact_at(buf.as_mut(), chunk * PEER_READ_BYTES as u64)?;
                            }
                            Ok(())
                        })
                    })
                    .collect();
                for reader in readers {
                    reader.join().map_err(|_| anyhow::anyhow!("a reader thread panicked"))??;
                }
                Ok(())
            })?;
            Ok(bytes as f64 / started.elapsed().as_secs_f64() / 1e9)
        })
        .await?
    }
}

/// One terasort of `sort_bytes` with the shuffle in `class`, on its own cluster; MB/s.
async fn sort_rate(options: &TiersBenchOptions, class: StorageClass) -> anyhow::Result<f64> {
    // Both tiers hold the whole job, so the class alone decides where the shuffle lives.
    let tier = driver::dram_per_server(options.sort_bytes, 1);
    let cluster = EmbeddedCluster::start_with(&options.tern, 2, &tier, "1MiB", Some(&tier), &options.dir, &[]).await?;
    let report = driver::terasort(&TerasortOptions {
        size_bytes: options.sort_bytes,
        metadata: cluster.metadata_addr.clone(),
        client: tern_client::ClientOptions::default(),
        maps: tern_terasort::tasks::default_tasks(options.sort_bytes),
        reduces: tern_terasort::tasks::default_tasks(options.sort_bytes),
        started: Instant::now(),
        progress: false,
        replicas: 1,
        shuffle_class: class,
        reduce_memory: None,
    })
    .await?;
    anyhow::ensure!(report.valid(), "the terasort with a {class} shuffle did not validate");
    Ok(report.sort_mb_per_s)
}

pub fn print_table(r: &TiersBenchReport) {
    println!("reducer read of one nvme partition, {} MiB (median [range] over runs):", r.read_bytes >> 20);
    println!("  partition read                       {:.2} GB/s", r.partition_read_gb_s);
    println!("  peer: O_DIRECT 1 MiB x{PEER_READS_IN_FLIGHT} in flight   {:.2} GB/s", r.direct_read_gb_s);
    println!("  peer: O_DIRECT 1 MiB, one at a time  {:.2} GB/s", r.direct_read_qd1_gb_s);
    let verdict = if r.read_ratio.median >= 0.8 { "met" } else { "MISSED" };
    println!("  partition / O_DIRECT x{PEER_READS_IN_FLIGHT}: {:.2}   target >= 0.8: {verdict}", r.read_ratio);
    println!("terasort of {} MiB, shuffle in dram and in nvme (rotating order):", r.sort_bytes >> 20);
    println!("  dram shuffle  {:.0} MB/s", r.dram_sort_mb_s);
    println!("  nvme shuffle  {:.0} MB/s", r.nvme_sort_mb_s);
    let verdict = if r.sort_ratio.median >= 0.5 { "met" } else { "MISSED" };
    println!("  nvme / dram per run: {:.2}   target >= 0.5: {verdict}", r.sort_ratio);
}
