//! `tern bench scale`: a scale model of the metadata server, without a data plane.
//!
//! A real metadata server (`tern_metadata::start`, in this process, over its real gRPC services
//! and write-ahead log) is driven by simulated storage servers (RegisterServer, an empty
//! ReportInventory, then Heartbeats at a stated rate that acknowledge their free queues) and by
//! clients that create, allocate and seal files, register jobs and a shuffle and commit its maps.
//! Each step is a fresh server with more of everything: S storage servers, and blocks, jobs and
//! shuffle maps and partitions scaled by S over the largest step's S. Per step it reports:
//!
//! - memory per object: growth of the allocator's bytes in use (glibc's mallinfo2) over the
//!   loading of each kind, divided by how many were loaded (the clients keep nothing per object,
//!   so the growth is the server's; RSS is reported too, but it hides objects in memory an
//!   earlier step freed and the allocator kept);
//! - RPC latency p50/p99 of create+allocate+seal, allocate alone (placement), open,
//!   register_shuffle, commit_map and heartbeat, each kind paced at `--probe-rate` per second, one
//!   at a time, while the simulated servers heartbeat at `--heartbeat-rate` per second (open
//!   loop, up to [`HEARTBEATS_IN_FLIGHT`] at once);
//! - heartbeat processing time on the server (its own request-duration metric, scraped);
//! - snapshot size and time: the server is stopped and started again on its directory, which
//!   replays the snapshot and log and writes a fresh snapshot (the server has no RPC to ask for
//!   one; this is also the restart time).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tern_common::config::Serve;
use tern_common::{percentile, ByteSize, SplitMix64};
use tern_proto::identity::{ClusterSecret, Presenting, Presents};
use tern_proto::v1::metadata_client::MetadataClient;
use tern_proto::v1::registry_client::RegistryClient;
use tern_proto::v1::{
    AllocateBlocksRequest, CommitMapRequest, CreateRequest, OpenRequest, RegisterJobRequest, RegisterShuffleRequest,
    SealRequest, UnregisterShuffleRequest,
};
use tokio::task::JoinSet;
use tonic::transport::Channel;

mod fleet;

use fleet::{fleet_credentials, heartbeats, register_fleet};

use crate::harness::chart::{self, Panel};

/// Blocks per file: one AllocateBlocks call at the server's batch limit.
const BLOCKS_PER_FILE: u32 = 1024;
/// Partitions of the shuffles the register_shuffle and commit_map probes use, the same at every
/// step so their latencies compare.
const PROBE_PARTITIONS: u32 = 100;
/// DRAM blocks each simulated server offers: more than any step places on it.
const SERVER_CAPACITY_BLOCKS: u64 = 1 << 32;

/// `tern bench scale`'s flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleOptions {
    /// Storage servers of each step, comma-separated, ascending (the sizes: 1000,10000).
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000")]
    pub servers: Vec<u32>,
    /// Blocks at the largest step (the 10 million: 10000000); smaller steps scale blocks,
    /// jobs, maps and partitions by their servers over the largest step's.
    #[arg(long, default_value_t = 1_000_000)]
    pub blocks: u64,
    /// Live jobs at the largest step (the 100000).
    #[arg(long, default_value_t = 10_000)]
    pub jobs: u32,
    /// Maps of the step's shuffle at the largest step (the 10000).
    #[arg(long, default_value_t = 1000)]
    pub maps: u32,
    /// Partitions of the step's shuffle at the largest step (the 10000).
    #[arg(long, default_value_t = 1000)]
    pub partitions: u32,
    /// Heartbeats per second offered by all simulated servers together, round robin.
    #[arg(long, default_value_t = 500.0)]
    pub heartbeat_rate: f64,
    /// Calls per second of each probed RPC kind, one at a time.
    #[arg(long, default_value_t = 100.0)]
    pub probe_rate: f64,
    /// Calls of each probed kind (p99 needs 100).
    #[arg(long, default_value_t = 200)]
    pub samples: usize,
    /// Clients loading at once.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Directory in which each step's metadata directory is made (a temp dir inside).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    pub dir: PathBuf,
    /// Turn the metadata log's fsync off (it is on by default, as in production).
    #[arg(long)]
    pub no_fsync: bool,
}

/// Latency of one probed kind, microseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Latency {
    pub p50_us: f64,
    pub p99_us: f64,
    pub samples: usize,
}

#[derive(Debug, Serialize)]
pub struct ScaleStep {
    pub servers: u32,
    pub blocks: u64,
    pub files: u64,
    pub jobs: u32,
    pub maps: u32,
    pub partitions: u32,
    /// Map x partition lengths committed (maps x partitions).
    pub committed_lengths: u64,
    /// Registering the servers and loading everything below.
    pub load_seconds: f64,
    /// Creating, allocating and sealing the blocks' files, `--concurrency` at once.
    pub blocks_seconds: f64,
    /// Registering the jobs, `--concurrency` at once.
    pub jobs_seconds: f64,
    /// Registering the shuffle and committing every map, `--concurrency` at once.
    pub shuffle_seconds: f64,
    pub rss_baseline_bytes: u64,
    pub rss_end_bytes: u64,
    /// The allocator's bytes in use at the end of the step (see `heap_bytes`).
    pub heap_end_bytes: u64,
    pub bytes_per_server: f64,
    pub bytes_per_block: f64,
    pub bytes_per_job: f64,
    /// Per committed (map, partition) length, the shuffle's segments included.
    pub bytes_per_committed_length: f64,
    /// Per reduce partition of the shuffle: its segments and every map's length for it.
    pub bytes_per_partition: f64,
    pub create_allocate_seal: Latency,
    pub allocate: Latency,
    pub open: Latency,
    pub register_shuffle: Latency,
    pub commit_map: Latency,
    pub heartbeat: Latency,
    /// Heartbeats sent per second during the probes (the offered rate, if the server kept up).
    pub heartbeat_rate_achieved: f64,
    /// Mean time the server spent in a Heartbeat (its request-duration metric), microseconds.
    pub heartbeat_server_us: f64,
    /// Mean time the server spent in an AllocateBlocks of one block (placement and the log
    /// append; the wait for the log's sync included, as the metric counts it), microseconds.
    pub allocate_server_us: f64,
    pub log_bytes: u64,
    pub snapshot_bytes: u64,
    /// Stop and start on the same directory: replay of snapshot and log, and a fresh snapshot.
    pub restart_seconds: f64,
}

#[derive(Debug, Serialize)]
pub struct ScaleReport {
    pub heartbeat_rate: f64,
    pub probe_rate: f64,
    pub fsync: bool,
    /// Settings of the model's metadata server that differ from the defaults, and why.
    pub raised: Vec<String>,
    pub steps: Vec<ScaleStep>,
}

fn scaled(full: u64, servers: u32, largest: u32) -> u64 {
    (full * u64::from(servers)).div_ceil(u64::from(largest.max(1))).max(1)
}

/// RSS of this process, from /proc/self/status.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// Bytes the allocator has handed out and not had back (glibc's mallinfo2, all arenas): unlike
/// RSS, it does not hide objects in memory an earlier step freed and the allocator kept.
// mallinfo2(3): the one call into libc here.
#[allow(unsafe_code)]
fn heap_bytes() -> u64 {
    // SAFETY: mallinfo2 takes no pointers and only reads the allocator's counters (under its
    // arena locks); it returns a plain struct by value.
    let info = unsafe { libc::mallinfo2() };
    (info.uordblks + info.hblkhd) as u64
}

fn per(delta: u64, count: u64) -> f64 {
    delta as f64 / count.max(1) as f64
}

fn latency(mut us: Vec<f64>) -> Latency {
    us.sort_by(f64::total_cmp);
    Latency { p50_us: percentile(&us, 50.0), p99_us: percentile(&us, 99.0), samples: us.len() }
}

/// A Metadata client presenting what the caller holds (a job's token, or nothing).
type Metadata = MetadataClient<Presenting<Channel>>;

fn metadata_client(channel: Channel, presents: Presents) -> Metadata {
    MetadataClient::with_interceptor(channel, presents)
        .max_decoding_message_size(tern_proto::MAX_GRPC_MESSAGE_BYTES)
        .max_encoding_message_size(tern_proto::MAX_GRPC_MESSAGE_BYTES)
}

fn server_config(dir: &Path, servers: u32, jobs: u32, options: &ScaleOptions) -> (tern_metadata::Config, Vec<String>) {
    // Each simulated server heartbeats every servers / rate seconds: tell them so, and give a
    // timeout that a loaded 2-core machine cannot miss (the model measures, it does not test
    // failure detection).
    let interval_ms = ((f64::from(servers) / options.heartbeat_rate.max(0.001)) * 1000.0).ceil().max(1000.0) as u64;
    let defaults = tern_metadata::Config::default();
    let config = tern_metadata::Config {
        serve: Serve::on_loopback(0, 0),
        dir: dir.to_path_buf(),
        heartbeat_interval_ms: interval_ms,
        server_timeout_ms: (interval_ms * 10).max(3_600_000),
        max_jobs: defaults.max_jobs.max(jobs + 16),
        fsync: !options.no_fsync,
        ..defaults.clone()
    };
    let mut raised = Vec::new();
    if config.max_jobs != defaults.max_jobs {
        raised.push(format!(
            "max_jobs {} -> {}: the step registers {jobs} live jobs (the issue asks for 100,000)",
            defaults.max_jobs, config.max_jobs
        ));
    }
    if config.heartbeat_interval_ms != defaults.heartbeat_interval_ms {
        raised.push(format!(
            "heartbeat_interval_ms {} -> {interval_ms}: {servers} simulated servers share {} heartbeats/s, so each \
             beats every {interval_ms} ms",
            defaults.heartbeat_interval_ms, options.heartbeat_rate
        ));
    }
    raised.push(format!(
        "server_timeout_ms {} -> {}: past the run, so no simulated server is declared dead while the machine is \
         busy loading (the model measures; it does not test failure detection)",
        defaults.server_timeout_ms, config.server_timeout_ms
    ));
    (config, raised)
}

/// Creates `files` files of [`BLOCKS_PER_FILE`] blocks (the last one the remainder), sealed.
async fn load_blocks(metadata: &Metadata, blocks: u64, concurrency: usize) -> anyhow::Result<u64> {
    let files = blocks.div_ceil(u64::from(BLOCKS_PER_FILE));
    let block_size = u64::from(tern_proto::DEFAULT_BLOCK_SIZE);
    let workers = concurrency.max(1) as u64;
    let mut tasks = JoinSet::new();
    for first in 0..workers.min(files) {
        let mut metadata = metadata.clone();
        tasks.spawn(async move {
            for f in (first..files).step_by(workers as usize) {
                let count = (blocks - f * u64::from(BLOCKS_PER_FILE)).min(u64::from(BLOCKS_PER_FILE)) as u32;
                let file_id = metadata
                    .create(CreateRequest { path: format!("/scale/f{f}"), parents: true, ..Default::default() })
                    .await?
                    .into_inner()
                    .file_id;
                metadata.allocate_blocks(AllocateBlocksRequest { file_id, count, ..Default::default() }).await?;
                metadata.seal(SealRequest { file_id, length: u64::from(count) * block_size }).await?;
            }
            Ok::<(), tonic::Status>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.context("a loading task failed")??;
    }
    Ok(files)
}

/// Registers `jobs` jobs; their ids, and each one's token.
async fn load_jobs(metadata: &Metadata, jobs: u32, concurrency: usize) -> anyhow::Result<Vec<(String, String)>> {
    let workers = concurrency.max(1) as u32;
    let mut tasks = JoinSet::new();
    for first in 0..workers.min(jobs) {
        let mut metadata = metadata.clone();
        tasks.spawn(async move {
            let mut ids = Vec::new();
            for j in (first..jobs).step_by(workers as usize) {
                let reply = metadata
                    .register_job(RegisterJobRequest {
                        name: format!("scale-{j}"),
                        lease_ms: 3_600_000,
                        ..Default::default()
                    })
                    .await?;
                let reply = reply.into_inner();
                ids.push((reply.job_id, reply.token));
            }
            Ok::<_, tonic::Status>(ids)
        });
    }
    let mut ids = Vec::new();
    while let Some(done) = tasks.join_next().await {
        ids.extend(done.context("a job-registering task failed")??);
    }
    Ok(ids)
}

/// Registers a shuffle of `maps` x `partitions` under `job` and commits every map.
async fn load_shuffle(
    metadata: &Metadata,
    job: &str,
    maps: u32,
    partitions: u32,
    concurrency: usize,
) -> anyhow::Result<u64> {
    let shuffle_id = metadata
        .clone()
        .register_shuffle(RegisterShuffleRequest { job_id: job.to_string(), partitions, maps, ..Default::default() })
        .await?
        .into_inner()
        .shuffle_id;
    let workers = concurrency.max(1) as u32;
    let mut tasks = JoinSet::new();
    for first in 0..workers.min(maps) {
        let mut metadata = metadata.clone();
        tasks.spawn(async move {
            for map in (first..maps).step_by(workers as usize) {
                let partition_bytes = (0..partitions).map(|p| 1 + u64::from(map ^ p)).collect();
                metadata
                    .commit_map(CommitMapRequest {
                        shuffle_id,
                        map_index: map,
                        attempt: 0,
                        partition_bytes,
                        ..Default::default()
                    })
                    .await?;
            }
            Ok::<(), tonic::Status>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.context("a committing task failed")??;
    }
    Ok(shuffle_id)
}

/// Runs `call` `samples` times, one at a time, at `rate` per second; returns what each returned.
async fn paced<T, F, Fut>(samples: usize, rate: f64, mut call: F) -> anyhow::Result<Vec<T>>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(0.001)));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut out = Vec::with_capacity(samples);
    for i in 0..samples {
        ticks.tick().await;
        out.push(call(i).await?);
    }
    Ok(out)
}

/// Sum and count of the server's request-duration metric for `method`, from its admin endpoint.
async fn server_time(admin: std::net::SocketAddr, method: &str) -> anyhow::Result<(f64, f64)> {
    let text = crate::harness::scrape(admin).await?;
    let label = format!("method=\"{method}\"");
    let value = |suffix: &str| {
        text.lines()
            .filter(|l| {
                l.starts_with(&format!("tern_metadata_request_duration_seconds_{suffix}{{")) && l.contains(&label)
            })
            .find_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .unwrap_or(0.0)
    };
    Ok((value("sum"), value("count")))
}

fn dir_bytes(dir: &Path, prefix: &str) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

async fn step(
    options: &ScaleOptions,
    servers: u32,
    largest: u32,
    raised: &mut Vec<String>,
) -> anyhow::Result<ScaleStep> {
    let blocks = scaled(options.blocks, servers, largest);
    let jobs = scaled(u64::from(options.jobs), servers, largest) as u32;
    let maps = scaled(u64::from(options.maps), servers, largest) as u32;
    let partitions = scaled(u64::from(options.partitions), servers, largest) as u32;
    let temp =
        tempfile::tempdir_in(&options.dir).with_context(|| format!("a temp dir in {}", options.dir.display()))?;
    let dir = temp.path().join("metadata");
    let (config, why) = server_config(&dir, servers, jobs, options);
    if raised.is_empty() || servers == largest {
        *raised = why;
    }
    let rss_baseline_bytes = rss_bytes();
    let server = tern_metadata::start(config.clone()).await?;
    let url = format!("http://{}", server.addr());
    let channel = Channel::from_shared(url)?.connect().await?;
    let metadata = metadata_client(channel.clone(), Presents::default());
    let registry = RegistryClient::new(channel.clone());
    let secret = ClusterSecret::load(&dir.join("cluster.secret")).map_err(|e| anyhow::anyhow!("{e}"))?;
    eprintln!(
        "step: {servers} servers, {blocks} blocks, {jobs} jobs, a shuffle of {maps} x {partitions} (dir {})",
        dir.display()
    );
    let loading = Instant::now();

    let credentials = fleet_credentials(&secret, servers)?;
    let before = heap_bytes();
    let fleet = Arc::new(register_fleet(&registry, credentials, servers, options.concurrency).await?);
    let after_servers = heap_bytes();
    let stop = Arc::new(AtomicBool::new(false));
    let measure = Arc::new(AtomicBool::new(false));
    let beating = tokio::spawn(heartbeats(
        registry.clone(),
        fleet.clone(),
        options.heartbeat_rate,
        stop.clone(),
        measure.clone(),
    ));

    let phase = Instant::now();
    let files = load_blocks(&metadata, blocks, options.concurrency).await?;
    let blocks_seconds = phase.elapsed().as_secs_f64();
    let after_blocks = heap_bytes();
    eprintln!("  {blocks} blocks in {blocks_seconds:.1} s");
    let phase = Instant::now();
    let job_ids = load_jobs(&metadata, jobs, options.concurrency).await?;
    let jobs_seconds = phase.elapsed().as_secs_f64();
    let after_jobs = heap_bytes();
    eprintln!("  {jobs} jobs in {jobs_seconds:.1} s");
    let (probe_job, probe_token) = job_ids.first().cloned().context("no job registered")?;
    // The probe job's shuffle calls present its token, as its tasks would.
    let presents = Presents::job_token(&probe_token).map_err(|e| anyhow::anyhow!("{e}"))?;
    let job_metadata = metadata_client(channel, presents);
    let phase = Instant::now();
    load_shuffle(&job_metadata, &probe_job, maps, partitions, options.concurrency).await?;
    let shuffle_seconds = phase.elapsed().as_secs_f64();
    let after_shuffle = heap_bytes();
    let load_seconds = loading.elapsed().as_secs_f64();
    eprintln!("  a shuffle of {maps} x {partitions} registered and committed in {shuffle_seconds:.1} s; probing ...");

    // Probes, one kind after another, with the heartbeats going on.
    let (hb_sum0, hb_count0) = server_time(server.admin_addr(), "heartbeat").await?;
    let (al_sum0, al_count0) = server_time(server.admin_addr(), "allocate_blocks").await?;
    measure.store(true, Ordering::Relaxed);
    let probing = Instant::now();
    let block_size = u64::from(tern_proto::DEFAULT_BLOCK_SIZE);
    let cas = paced(options.samples, options.probe_rate, |i| {
        let mut m = metadata.clone();
        async move {
            let started = Instant::now();
            let file_id = m
                .create(CreateRequest { path: format!("/probe/f{i}"), parents: true, ..Default::default() })
                .await?
                .into_inner()
                .file_id;
            let placing = Instant::now();
            m.allocate_blocks(AllocateBlocksRequest { file_id, count: 1, ..Default::default() }).await?;
            let allocate_us = placing.elapsed().as_secs_f64() * 1e6;
            m.seal(SealRequest { file_id, length: block_size }).await?;
            Ok((started.elapsed().as_secs_f64() * 1e6, allocate_us))
        }
    })
    .await?;
    let (cas, allocate_us): (Vec<f64>, Vec<f64>) = cas.into_iter().unzip();
    let (al_sum1, al_count1) = server_time(server.admin_addr(), "allocate_blocks").await?;
    let mut rng = SplitMix64(u64::from(servers));
    let open = paced(options.samples, options.probe_rate, |_| {
        let mut m = metadata.clone();
        let path = format!("/scale/f{}", rng.below(files));
        async move {
            let started = Instant::now();
            m.open(OpenRequest { path }).await?;
            Ok(started.elapsed().as_secs_f64() * 1e6)
        }
    })
    .await?;
    let register = paced(options.samples, options.probe_rate, |_| {
        let mut m = job_metadata.clone();
        let job_id = probe_job.clone();
        async move {
            let started = Instant::now();
            let reply = m
                .register_shuffle(RegisterShuffleRequest {
                    job_id,
                    partitions: PROBE_PARTITIONS,
                    maps: 1,
                    ..Default::default()
                })
                .await?;
            Ok((started.elapsed().as_secs_f64() * 1e6, reply.into_inner().shuffle_id))
        }
    })
    .await?;
    let (register, probe_shuffles): (Vec<f64>, Vec<u64>) = register.into_iter().unzip();
    let mut unregister = job_metadata.clone();
    for shuffle_id in probe_shuffles {
        unregister.unregister_shuffle(UnregisterShuffleRequest { shuffle_id }).await?;
    }
    let commit_shuffle = job_metadata
        .clone()
        .register_shuffle(RegisterShuffleRequest {
            job_id: probe_job.clone(),
            partitions: PROBE_PARTITIONS,
            maps: options.samples as u32,
            ..Default::default()
        })
        .await?
        .into_inner()
        .shuffle_id;
    let commit = paced(options.samples, options.probe_rate, |i| {
        let mut m = job_metadata.clone();
        async move {
            let started = Instant::now();
            m.commit_map(CommitMapRequest {
                shuffle_id: commit_shuffle,
                map_index: i as u32,
                attempt: 0,
                partition_bytes: vec![4096; PROBE_PARTITIONS as usize],
                ..Default::default()
            })
            .await?;
            Ok(started.elapsed().as_secs_f64() * 1e6)
        }
    })
    .await?;
    let probe_seconds = probing.elapsed().as_secs_f64();
    let (hb_sum1, hb_count1) = server_time(server.admin_addr(), "heartbeat").await?;
    stop.store(true, Ordering::Relaxed);
    let heartbeat_us = beating.await.context("the heartbeat task failed")??;
    let rss_end_bytes = rss_bytes();
    let heap_end_bytes = heap_bytes();

    let log_bytes = dir_bytes(&dir, "wal-");
    drop((metadata, job_metadata));
    drop(registry);
    server.shutdown().await;
    let restarting = Instant::now();
    let again = tern_metadata::start(config).await?;
    let restart_seconds = restarting.elapsed().as_secs_f64();
    let snapshot_bytes = dir_bytes(&dir, "snapshot");
    again.shutdown().await;

    let lengths = u64::from(maps) * u64::from(partitions);
    let shuffle_growth = after_shuffle.saturating_sub(after_jobs);
    Ok(ScaleStep {
        servers,
        blocks,
        files,
        jobs,
        maps,
        partitions,
        committed_lengths: lengths,
        load_seconds,
        blocks_seconds,
        jobs_seconds,
        shuffle_seconds,
        rss_baseline_bytes,
        rss_end_bytes,
        heap_end_bytes,
        bytes_per_server: per(after_servers.saturating_sub(before), u64::from(servers)),
        bytes_per_block: per(after_blocks.saturating_sub(after_servers), blocks),
        bytes_per_job: per(after_jobs.saturating_sub(after_blocks), u64::from(jobs)),
        bytes_per_committed_length: per(shuffle_growth, lengths),
        bytes_per_partition: per(shuffle_growth, u64::from(partitions)),
        create_allocate_seal: latency(cas),
        allocate: latency(allocate_us),
        open: latency(open),
        register_shuffle: latency(register),
        commit_map: latency(commit),
        heartbeat_rate_achieved: heartbeat_us.len() as f64 / probe_seconds.max(1e-9),
        heartbeat: latency(heartbeat_us),
        heartbeat_server_us: (hb_sum1 - hb_sum0) / (hb_count1 - hb_count0).max(1.0) * 1e6,
        allocate_server_us: (al_sum1 - al_sum0) / (al_count1 - al_count0).max(1.0) * 1e6,
        log_bytes,
        snapshot_bytes,
        restart_seconds,
    })
}

pub async fn run(options: &ScaleOptions) -> anyhow::Result<ScaleReport> {
    anyhow::ensure!(!options.servers.is_empty(), "--servers names no step");
    anyhow::ensure!(options.samples > 0 && options.probe_rate > 0.0, "--samples and --probe-rate must be above 0");
    anyhow::ensure!(options.heartbeat_rate > 0.0, "--heartbeat-rate must be above 0");
    let mut servers = options.servers.clone();
    servers.sort_unstable();
    servers.dedup();
    anyhow::ensure!(servers[0] > 0, "a step needs at least one storage server");
    let largest = *servers.last().context("no step")?;
    let mut raised = Vec::new();
    let mut steps = Vec::new();
    for &s in &servers {
        steps.push(step(options, s, largest, &mut raised).await?);
    }
    Ok(ScaleReport {
        heartbeat_rate: options.heartbeat_rate,
        probe_rate: options.probe_rate,
        fsync: !options.no_fsync,
        raised,
        steps,
    })
}

pub fn print_table(report: &ScaleReport) {
    let us = |l: &Latency| format!("{:.0}/{:.0}", l.p50_us, l.p99_us);
    println!(
        "tern bench scale: heartbeats {}/s offered; each probed RPC {}/s, one at a time; fsync {}",
        report.heartbeat_rate, report.probe_rate, report.fsync
    );
    println!(
        "{:>7} {:>9} {:>7} {:>11} {:>8} {:>8} {:>8} {:>9} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>8} {:>8} {:>9} {:>8}",
        "servers",
        "blocks",
        "jobs",
        "shuffle",
        "B/block",
        "B/job",
        "B/len",
        "B/part",
        "cas us",
        "alloc us",
        "open us",
        "reg us",
        "commit us",
        "hb us",
        "hb srv",
        "hb/s",
        "snap MiB",
        "restart"
    );
    for s in &report.steps {
        println!(
            "{:>7} {:>9} {:>7} {:>11} {:>8.0} {:>8.0} {:>8.1} {:>9.0} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>8.0} {:>8.0} {:>9.1} {:>7.3}s",
            s.servers,
            s.blocks,
            s.jobs,
            format!("{}x{}", s.maps, s.partitions),
            s.bytes_per_block,
            s.bytes_per_job,
            s.bytes_per_committed_length,
            s.bytes_per_partition,
            us(&s.create_allocate_seal),
            us(&s.allocate),
            us(&s.open),
            us(&s.register_shuffle),
            us(&s.commit_map),
            us(&s.heartbeat),
            s.heartbeat_server_us,
            s.heartbeat_rate_achieved,
            s.snapshot_bytes as f64 / f64::from(1u32 << 20),
            s.restart_seconds,
        );
    }
    println!("latencies are p50/p99 in microseconds; B/len: bytes per committed (map, partition) length;");
    println!("B/part: bytes per reduce partition of the shuffle; hb srv: the server's mean time per heartbeat (us);");
    println!("restart: stop and start on the directory (replay, then a fresh snapshot of snap MiB)");
    for line in &report.raised {
        println!("raised: {line}");
    }
    if let Some(last) = report.steps.last() {
        println!(
            "at the end of the last step: rss {}, heap in use {}",
            ByteSize(last.rss_end_bytes),
            ByteSize(last.heap_end_bytes)
        );
    }
}

/// A series' name and its value at each step.
type Series = (&'static str, Vec<Option<f64>>);

/// Draws each figure against the number of storage servers, a panel per kind, SVG or PNG.
pub fn plot(report: &ScaleReport, path: &Path) -> anyhow::Result<()> {
    let steps = &report.steps;
    let of = |f: fn(&ScaleStep) -> f64| steps.iter().map(|s| Some(f(s))).collect::<Vec<_>>();
    let panels: [(&str, &str, Vec<Series>); 4] = [
        (
            "RPC latency p50",
            "us",
            vec![
                ("create+allocate+seal", of(|s| s.create_allocate_seal.p50_us)),
                ("allocate", of(|s| s.allocate.p50_us)),
                ("open", of(|s| s.open.p50_us)),
                ("register_shuffle", of(|s| s.register_shuffle.p50_us)),
                ("commit_map", of(|s| s.commit_map.p50_us)),
                ("heartbeat", of(|s| s.heartbeat.p50_us)),
            ],
        ),
        (
            "RPC latency p99",
            "us",
            vec![
                ("create+allocate+seal", of(|s| s.create_allocate_seal.p99_us)),
                ("allocate", of(|s| s.allocate.p99_us)),
                ("open", of(|s| s.open.p99_us)),
                ("register_shuffle", of(|s| s.register_shuffle.p99_us)),
                ("commit_map", of(|s| s.commit_map.p99_us)),
                ("heartbeat", of(|s| s.heartbeat.p99_us)),
            ],
        ),
        (
            "memory per object",
            "bytes",
            vec![
                ("per block", of(|s| s.bytes_per_block)),
                ("per job", of(|s| s.bytes_per_job)),
                ("per server / 100", of(|s| s.bytes_per_server / 100.0)),
                ("per committed length x 10", of(|s| s.bytes_per_committed_length * 10.0)),
            ],
        ),
        (
            "server time, snapshot",
            "us / MiB / s",
            vec![
                ("heartbeat on server (us)", of(|s| s.heartbeat_server_us)),
                ("allocate on server (us)", of(|s| s.allocate_server_us)),
                ("snapshot (MiB)", of(|s| s.snapshot_bytes as f64 / f64::from(1u32 << 20))),
                ("restart (s)", of(|s| s.restart_seconds)),
            ],
        ),
    ];
    let labels: Vec<String> = steps.iter().map(|s| format!("{} srv", s.servers)).collect();
    let panels: Vec<Panel> = panels
        .into_iter()
        .map(|(title, unit, series)| Panel {
            title: title.into(),
            unit: unit.into(),
            labels: labels.clone(),
            series: series.into_iter().map(|(name, values)| (name.into(), values)).collect(),
        })
        .collect();
    chart::save(path, (1200, 800), (2, 2), &panels)
}
