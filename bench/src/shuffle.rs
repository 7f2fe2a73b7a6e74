//! `tern bench shuffle`: the shuffle service's metadata cost and a reducer's read rate, each
//! beside a peer measured in the same run on the same embedded cluster.
//!
//! - Metadata: register a shuffle of M maps x R partitions, commit every map (R exact lengths
//!   each), then locate every partition (one call per reducer, as reducers do), over real gRPC.
//!   Peer: as many plain Stat calls, the cheapest metadata round trip.
//! - Read: a reducer streams one partition pushed by several maps. Peer: reading a file of the
//!   same size with 1 MiB blocks and read-ahead, Tern's plain 1 MiB block-read path.

use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use serde::Serialize;
use tern_client::{Client, Shuffle, ShuffleOptions};
use tern_common::median;
use tern_proto::identity::{Presenting, Presents};
use tern_proto::v1::metadata_client::MetadataClient;
use tern_proto::v1::{CommitMapRequest, LocateShuffleRequest, RegisterShuffleRequest, StatRequest};
use tern_transport::failover::Failover;

use tern_local::cluster::EmbeddedCluster;

pub struct ShuffleBenchOptions {
    pub tern: std::path::PathBuf,
    pub maps: u32,
    pub partitions: u32,
    /// Bytes of the partition read (and of the peer file).
    pub read_bytes: u64,
    /// Maps pushing the partition read.
    pub read_maps: u32,
    pub runs: usize,
}

#[derive(Debug, Serialize)]
pub struct ShuffleBenchReport {
    pub maps: u32,
    pub partitions: u32,
    pub register_seconds: f64,
    pub commit_seconds: f64,
    /// The same commits to a second shuffle from COMMITTERS tasks at once, as concurrent map tasks
    /// commit: what the metadata log's group commit amortises (one fsync for many commits).
    pub concurrent_commit_seconds: f64,
    pub locate_seconds: f64,
    /// Register + commits + locates.
    pub metadata_seconds: f64,
    /// The same number of Stat round trips (peer).
    pub stat_peer_seconds: f64,
    pub metadata_ratio_to_stat: f64,
    pub read_bytes: u64,
    pub read_maps: u32,
    /// Median over runs.
    pub file_read_gb_s: f64,
    pub partition_read_gb_s: f64,
    pub partition_read_ratio_to_file: f64,
}

/// Tasks committing at once in the concurrent commit measurement.
const COMMITTERS: u32 = 32;

/// A metadata client presenting a job's token, over the failover channel to `addrs` (one
/// address, or a replicated service's list), as the client library's shuffle calls are.
pub(crate) type Metadata = MetadataClient<Presenting<Failover>>;

pub(crate) fn metadata_for_job(addrs: &str, token: &str) -> anyhow::Result<Metadata> {
    let addrs: Vec<&str> = addrs.split(',').collect();
    let failover = tern_transport::failover::lazy_failover(&addrs, None, |endpoint| endpoint)?;
    let presents = Presents::job_token(token).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(MetadataClient::with_interceptor(failover, presents)
        .max_decoding_message_size(tern_proto::MAX_GRPC_MESSAGE_BYTES)
        .max_encoding_message_size(tern_proto::MAX_GRPC_MESSAGE_BYTES))
}

/// Registers a shuffle of `maps` x `partitions` for `job`, commits all its maps (exact lengths)
/// from `committers` tasks at once, and unregisters it; the seconds the commits took.
pub(crate) async fn commit_all(
    metadata: &Metadata,
    job: &str,
    (maps, partitions): (u32, u32),
    committers: u32,
) -> anyhow::Result<f64> {
    let ask = RegisterShuffleRequest { job_id: job.to_string(), partitions, maps, ..Default::default() };
    let shuffle_id = metadata.clone().register_shuffle(ask).await?.into_inner().shuffle_id;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for first in 0..committers.min(maps) {
        let mut metadata = metadata.clone();
        tasks.spawn(async move {
            for map in (first..maps).step_by(committers as usize) {
                let partition_bytes = (0..partitions).map(|p| 1 + u64::from(map ^ p)).collect();
                let commit =
                    CommitMapRequest { shuffle_id, map_index: map, attempt: 0, partition_bytes, ..Default::default() };
                metadata.commit_map(commit).await?;
            }
            Ok::<(), tonic::Status>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.context("a committing task panicked")?.context("a map commit failed")?;
    }
    let seconds = started.elapsed().as_secs_f64();
    metadata.clone().unregister_shuffle(tern_proto::v1::UnregisterShuffleRequest { shuffle_id }).await?;
    Ok(seconds)
}

pub async fn run(options: &ShuffleBenchOptions) -> anyhow::Result<ShuffleBenchReport> {
    let dram = format!("{}MiB", (options.read_bytes * 3 / 2).max(512 << 20).div_ceil(1 << 20));
    let cluster = EmbeddedCluster::start(&options.tern, 2, &dram).await?;
    let client = Client::connect(&cluster.metadata_addr).await?;
    let job = client.start_job(Some("bench-shuffle"), Duration::from_secs(60)).await?;
    let mut metadata = metadata_for_job(&cluster.metadata_addr, &job.token())?;

    eprintln!("measuring shuffle metadata: {} maps x {} partitions ...", options.maps, options.partitions);
    let started = Instant::now();
    let registered = metadata
        .register_shuffle(RegisterShuffleRequest {
            job_id: job.id().to_string(),
            partitions: options.partitions,
            maps: options.maps,
            ..Default::default()
        })
        .await?
        .into_inner();
    let register_seconds = started.elapsed().as_secs_f64();
    let started = Instant::now();
    for map in 0..options.maps {
        let lengths = (0..options.partitions).map(|p| 1 + u64::from(map ^ p)).collect();
        metadata
            .commit_map(CommitMapRequest {
                shuffle_id: registered.shuffle_id,
                map_index: map,
                attempt: 0,
                partition_bytes: lengths,
                ..Default::default()
            })
            .await?;
    }
    let commit_seconds = started.elapsed().as_secs_f64();
    let concurrent_commit_seconds =
        commit_all(&metadata, job.id(), (options.maps, options.partitions), COMMITTERS).await?;
    let started = Instant::now();
    for partition in 0..options.partitions {
        let located = metadata
            .locate_shuffle(LocateShuffleRequest {
                shuffle_id: registered.shuffle_id,
                start_partition: partition,
                end_partition: partition + 1,
                start_map: 0,
                end_map: u32::MAX,
            })
            .await?
            .into_inner();
        anyhow::ensure!(located.outputs.len() == options.maps as usize, "partition {partition}: not every map located");
    }
    let locate_seconds = started.elapsed().as_secs_f64();
    let calls = 1 + options.maps + options.partitions;
    let started = Instant::now();
    for _ in 0..calls {
        metadata.stat(StatRequest { path: "/".into(), with_blocks: false }).await?;
    }
    let stat_peer_seconds = started.elapsed().as_secs_f64();
    let metadata_seconds = register_seconds + commit_seconds + locate_seconds;

    eprintln!(
        "measuring a reducer's read of {} MiB from {} maps, beside a file read ...",
        options.read_bytes >> 20,
        options.read_maps
    );
    let shuffle =
        client.register_shuffle(job.id(), 1, ShuffleOptions { maps: options.read_maps, ..Default::default() }).await?;
    let per_map = options.read_bytes / u64::from(options.read_maps.max(1));
    push_partition(&shuffle, options.read_maps, per_map).await?;
    let file = format!("{}/peer-file", job.root());
    client.put(&file, Bytes::from(vec![0x5au8; (per_map * u64::from(options.read_maps)) as usize])).await?;
    let (mut file_rates, mut partition_rates) = (Vec::new(), Vec::new());
    for _ in 0..options.runs.max(1) {
        let started = Instant::now();
        let mut reader = client.open(&file).await?;
        let mut bytes = 0u64;
        while let Some(chunk) = reader.next_chunk().await? {
            bytes += chunk.len() as u64;
        }
        file_rates.push(bytes as f64 / started.elapsed().as_secs_f64() / 1e9);
        partition_rates.push(read_partition_gb_s(&shuffle).await?);
    }
    job.end().await.context("ending the bench job")?;
    let (file_read_gb_s, partition_read_gb_s) = (median(file_rates), median(partition_rates));
    Ok(ShuffleBenchReport {
        maps: options.maps,
        partitions: options.partitions,
        register_seconds,
        commit_seconds,
        concurrent_commit_seconds,
        locate_seconds,
        metadata_seconds,
        stat_peer_seconds,
        metadata_ratio_to_stat: metadata_seconds / stat_peer_seconds,
        read_bytes: per_map * u64::from(options.read_maps),
        read_maps: options.read_maps,
        file_read_gb_s,
        partition_read_gb_s,
        partition_read_ratio_to_file: partition_read_gb_s / file_read_gb_s,
    })
}

/// `maps` maps each push `per_map` bytes into partition 0 of `shuffle`, and commit.
pub(crate) async fn push_partition(shuffle: &Shuffle, maps: u32, per_map: u64) -> anyhow::Result<()> {
    let piece: Vec<u8> = (0..64u32 << 10).map(|i| (i * 31 + 7) as u8).collect();
    for map in 0..maps {
        let mut writer = shuffle.writer(map, 0);
        let mut left = per_map;
        while left > 0 {
            let n = left.min(piece.len() as u64) as usize;
            writer.write(0, &piece[..n]).await?;
            left -= n as u64;
        }
        writer.commit().await?;
    }
    Ok(())
}

/// A reducer's read of partition 0 of `shuffle`, whole: GB/s.
pub(crate) async fn read_partition_gb_s(shuffle: &Shuffle) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut reader = shuffle.reader(0..1, 0..u32::MAX).await?;
    let mut bytes = 0u64;
    while let Some(batch) = reader.next_batch().await? {
        bytes += batch.data.len() as u64;
    }
    Ok(bytes as f64 / started.elapsed().as_secs_f64() / 1e9)
}

pub fn print_table(r: &ShuffleBenchReport) {
    println!("shuffle metadata, {} maps x {} partitions (real gRPC, one client):", r.maps, r.partitions);
    println!("  register                 {:>8.3} s", r.register_seconds);
    println!("  {} commits              {:>8.3} s", r.maps, r.commit_seconds);
    println!("  {} commits, {COMMITTERS} at once   {:>8.3} s", r.maps, r.concurrent_commit_seconds);
    println!("  {} locates              {:>8.3} s", r.partitions, r.locate_seconds);
    let verdict = if r.metadata_seconds < 1.0 { "met" } else { "MISSED" };
    println!("  total                    {:>8.3} s   target < 1 s: {verdict}", r.metadata_seconds);
    println!("  peer: as many Stat calls {:>8.3} s   ratio {:.2}", r.stat_peer_seconds, r.metadata_ratio_to_stat);
    println!("reducer read of one partition, {} MiB from {} maps (median):", r.read_bytes >> 20, r.read_maps);
    println!("  peer: file read, 1 MiB blocks   {:>6.2} GB/s", r.file_read_gb_s);
    let verdict = if r.partition_read_ratio_to_file >= 0.8 { "met" } else { "MISSED" };
    println!(
        "  partition read                  {:>6.2} GB/s   {:.2}x the file read, target >= 0.8x: {verdict}",
        r.partition_read_gb_s, r.partition_read_ratio_to_file
    );
}
