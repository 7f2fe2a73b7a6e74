//! `tern bench core`: the figures the core issue promises, beside the loopback TCP they ride on.
//!
//! - `tern fs put` / `tern fs get` of a large file between tmpfs and the store, as the whole
//!   command (process start included), and a single loopback TCP stream as the peer;
//! - create + seal latency of empty files (two round trips, and one), and `tern status` wall time;
//! - a storage server's resident memory beyond its DRAM tier with many client connections open.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use serde::Serialize;
use tern_common::{median, percentile};
use tern_proto::frame::{self, Frame};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

use tern_local::cluster::EmbeddedCluster;

pub struct CoreOptions {
    /// The `tern` binary to run (usually the running one).
    pub tern: PathBuf,
    pub size_bytes: u64,
    /// Times each transfer is measured (the median is reported).
    pub runs: usize,
    pub empty_files: usize,
    pub status_runs: usize,
    pub connections: usize,
    /// Where the local files live; tmpfs so the local disk is not what is measured.
    pub scratch: PathBuf,
}

/// One run's figures; every field a number a reader can compare across runs.
#[derive(Debug, Serialize)]
pub struct CoreReport {
    pub size_bytes: u64,
    /// Transfers of each kind; the transfer figures are medians.
    pub runs: usize,
    pub tcp_loopback_gb_s: f64,
    /// Copying the input file to another file on the same tmpfs (std::fs::copy).
    pub local_copy_gb_s: f64,
    pub put_seconds: f64,
    pub put_gb_s: f64,
    pub put_ratio_to_tcp: f64,
    pub get_seconds: f64,
    pub get_gb_s: f64,
    /// Local copy time over get time: how close a download comes to writing the file locally.
    pub get_ratio_to_local_copy: f64,
    pub empty_files: usize,
    /// `create` then `close` of a writer: two metadata round trips.
    pub create_close_p50_us: f64,
    pub create_close_p99_us: f64,
    /// `create_empty`: one round trip.
    pub create_sealed_p50_us: f64,
    pub create_sealed_p99_us: f64,
    pub status_runs: usize,
    pub status_p50_ms: f64,
    pub status_max_ms: f64,
    pub connections: usize,
    pub storage_rss_beyond_dram_mib: f64,
}

/// Each storage server's DRAM tier in the embedded cluster.
const DRAM: &str = "1GiB";
const DRAM_BYTES: u64 = 1 << 30;

pub async fn run(options: &CoreOptions) -> anyhow::Result<CoreReport> {
    let cluster = EmbeddedCluster::start(&options.tern, 2, DRAM).await?;
    let client = tern_client::Client::connect(&cluster.metadata_addr).await?;

    progress(&format!("peer: one loopback TCP stream carrying {} bytes", options.size_bytes));
    let tcp_loopback_gb_s = loopback_tcp_gb_s(options.size_bytes).await?;

    let input = options.scratch.join(format!("tern-bench-in-{}", std::process::id()));
    let output = options.scratch.join(format!("tern-bench-out-{}", std::process::id()));
    let _cleanup = Cleanup(vec![input.clone(), output.clone()]);
    write_random_file(&input, options.size_bytes)?;
    // Each transfer runs `runs` times and the median counts: the first touch of fresh pages in
    // a VM is much slower than later ones, and one run says little on a shared machine.
    let (mut put_seconds, mut get_seconds, mut copy_seconds) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..options.runs {
        progress(&format!("run {} of {}: local copy (peer), tern fs put, tern fs get", run + 1, options.runs));
        let _ = std::fs::remove_file(&output);
        let started = Instant::now();
        std::fs::copy(&input, &output).context("copying the input file")?;
        copy_seconds.push(started.elapsed().as_secs_f64());
        std::fs::remove_file(&output)?;
        let remote = format!("/bench/file-{run}");
        put_seconds.push(time_command(&options.tern, &cluster, &["fs", "put", path_str(&input)?, &remote])?);
        get_seconds.push(time_command(&options.tern, &cluster, &["fs", "get", &remote, path_str(&output)?])?);
        if run == 0 && !files_equal(&input, &output)? {
            bail!("tern fs get returned different bytes than tern fs put stored");
        }
        // Keep the last file for the connection test; free the others so the tier has room.
        if run + 1 < options.runs {
            client.delete(&remote, false).await?;
            wait_until_freed(&client).await?;
        }
    }
    let last_file = format!("/bench/file-{}", options.runs - 1);

    progress(&format!("{} creates + closes, and as many sealed creates, of empty files", options.empty_files));
    let (create_close_us, create_sealed_us) = empty_file_latencies(&cluster.metadata_addr, options.empty_files)?;

    progress(&format!("{} runs of tern status", options.status_runs));
    let mut status_ms = Vec::with_capacity(options.status_runs);
    for _ in 0..options.status_runs {
        status_ms.push(time_command(&options.tern, &cluster, &["status"])? * 1e3);
    }
    status_ms.sort_by(f64::total_cmp);

    progress(&format!("{} connections open to one storage server", options.connections));
    let storage_rss_beyond_dram_mib = rss_with_connections(&client, &cluster, &last_file, options.connections).await?;

    let gb_s = |seconds: f64| options.size_bytes as f64 / seconds / 1e9;
    let (put_seconds, get_seconds, copy_seconds) = (median(put_seconds), median(get_seconds), median(copy_seconds));
    Ok(CoreReport {
        size_bytes: options.size_bytes,
        runs: options.runs,
        tcp_loopback_gb_s,
        local_copy_gb_s: gb_s(copy_seconds),
        put_seconds,
        put_gb_s: gb_s(put_seconds),
        put_ratio_to_tcp: gb_s(put_seconds) / tcp_loopback_gb_s,
        get_seconds,
        get_gb_s: gb_s(get_seconds),
        get_ratio_to_local_copy: copy_seconds / get_seconds,
        empty_files: options.empty_files,
        create_close_p50_us: percentile(&create_close_us, 50.0),
        create_close_p99_us: percentile(&create_close_us, 99.0),
        create_sealed_p50_us: percentile(&create_sealed_us, 50.0),
        create_sealed_p99_us: percentile(&create_sealed_us, 99.0),
        status_runs: options.status_runs,
        status_p50_ms: percentile(&status_ms, 50.0),
        status_max_ms: status_ms.last().copied().unwrap_or(f64::NAN),
        connections: options.connections,
        storage_rss_beyond_dram_mib,
    })
}

/// The report as a table, each figure beside its target.
pub fn print_table(report: &CoreReport) {
    let gib = report.size_bytes as f64 / (1u64 << 30) as f64;
    let rows: [(String, String, &str, bool); 8] = [
        ("loopback TCP, one stream (peer)".to_string(), format!("{:.2} GB/s", report.tcp_loopback_gb_s), "-", true),
        ("copy tmpfs -> tmpfs (peer)".to_string(), format!("{:.2} GB/s", report.local_copy_gb_s), "-", true),
        (
            format!("tern fs put {gib:.2} GiB, tmpfs -> store"),
            format!("{:.2} GB/s ({:.2}x TCP)", report.put_gb_s, report.put_ratio_to_tcp),
            ">= 1 GB/s",
            report.put_gb_s >= 1.0,
        ),
        (
            format!("tern fs get {gib:.2} GiB, store -> tmpfs"),
            format!("{:.2} GB/s ({:.2}x copy)", report.get_gb_s, report.get_ratio_to_local_copy),
            ">= 1 GB/s",
            report.get_gb_s >= 1.0,
        ),
        (
            "create + close of an empty file (2 RPCs), p50".into(),
            format!("{:.0} us (p99 {:.0} us)", report.create_close_p50_us, report.create_close_p99_us),
            "-",
            true,
        ),
        (
            "create of a sealed empty file (1 RPC), p50".into(),
            format!("{:.0} us (p99 {:.0} us)", report.create_sealed_p50_us, report.create_sealed_p99_us),
            "<= 200 us",
            report.create_sealed_p50_us <= 200.0,
        ),
        (
            "tern status, whole command, p50".into(),
            format!("{:.1} ms (max {:.1} ms)", report.status_p50_ms, report.status_max_ms),
            "< 50 ms",
            report.status_p50_ms < 50.0,
        ),
        (
            format!("storage server memory beyond DRAM, {} conns", report.connections),
            format!("{:.1} MiB", report.storage_rss_beyond_dram_mib),
            "< 64 MiB",
            report.storage_rss_beyond_dram_mib < 64.0,
        ),
    ];
    println!("medians of {} runs", report.runs);
    println!("{:<46} {:>28} {:>10}", "MEASURE", "FIGURE", "TARGET");
    for (name, figure, target, met) in rows {
        let verdict = if target == "-" {
            ""
        } else if met {
            "met"
        } else {
            "MISSED"
        };
        println!("{name:<46} {figure:>28} {target:>10}  {verdict}");
    }
}

/// Waits until the storage servers have carried out every free (within a heartbeat or two),
/// so the next transfer measures writing, not waiting for space.
async fn wait_until_freed(client: &tern_client::Client) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.status().await?.servers.iter().map(|s| s.allocated_blocks).sum::<u64>() > 0 {
        if Instant::now() > deadline {
            bail!("deleted blocks were not freed within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Latencies (us, sorted) of `count` create + close pairs and of `count` sealed creates, from a
/// single-threaded client on its own thread: one caller waiting on one call at a time, as a
/// task writing markers would, with no hop between runtime workers in the way.
fn empty_file_latencies(metadata_addr: &str, count: usize) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let metadata_addr = metadata_addr.to_string();
    let measure = move || -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        runtime.block_on(async {
            let client = tern_client::Client::connect(&metadata_addr).await?;
            client.mkdir("/bench/empty", true).await?;
            let (mut create_close, mut create_sealed) = (Vec::with_capacity(count), Vec::with_capacity(count));
            for i in 0..count {
                let started = Instant::now();
                client.create(&format!("/bench/empty/closed-{i}"), false).await?.close().await?;
                create_close.push(started.elapsed().as_secs_f64() * 1e6);
                let started = Instant::now();
                client.create_empty(&format!("/bench/empty/sealed-{i}"), false).await?;
                create_sealed.push(started.elapsed().as_secs_f64() * 1e6);
            }
            create_close.sort_by(f64::total_cmp);
            create_sealed.sort_by(f64::total_cmp);
            Ok((create_close, create_sealed))
        })
    };
    std::thread::spawn(measure).join().map_err(|_| anyhow::anyhow!("latency thread panicked"))?
}

fn progress(what: &str) {
    eprintln!("measuring {what} ...");
}

fn path_str(path: &Path) -> anyhow::Result<&str> {
    path.to_str().context("scratch paths must be UTF-8")
}

/// Wall time of one `tern` command against the cluster, process start included.
fn time_command(tern: &Path, cluster: &EmbeddedCluster, args: &[&str]) -> anyhow::Result<f64> {
    let started = Instant::now();
    let out = Command::new(tern).args(args).env("TERN_METADATA", &cluster.metadata_addr).output()?;
    let seconds = started.elapsed().as_secs_f64();
    if !out.status.success() {
        bail!("tern {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    }
    Ok(seconds)
}

/// Throughput of one loopback TCP stream sending `bytes` in 1 MiB writes to a reader that
/// discards them: the ceiling a single Tern connection could reach.
async fn loopback_tcp_gb_s(bytes: u64) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let sink = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await?;
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            match stream.read(&mut buf).await? {
                0 => return Ok::<u64, std::io::Error>(total),
                n => total += n as u64,
            }
        }
    });
    let chunk = Bytes::from(vec![0x5au8; 1 << 20]);
    let started = Instant::now();
    let mut stream = TcpStream::connect(addr).await?;
    let mut sent = 0u64;
    while sent < bytes {
        let n = chunk.len().min((bytes - sent) as usize);
        tokio::io::AsyncWriteExt::write_all(&mut stream, &chunk[..n]).await?;
        sent += n as u64;
    }
    drop(stream);
    let received = sink.await??;
    let seconds = started.elapsed().as_secs_f64();
    if received != bytes {
        bail!("loopback peer received {received} of {bytes} bytes");
    }
    Ok(bytes as f64 / seconds / 1e9)
}

fn write_random_file(path: &Path, bytes: u64) -> anyhow::Result<()> {
    // A 16 MiB random pattern, repeated: incompressible enough, and cheap to make.
    let mut pattern = vec![0u8; 16 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15 ^ tern_common::unix_ms();
    for word in pattern.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        word.copy_from_slice(&x.to_le_bytes());
    }
    let mut out =
        std::io::BufWriter::new(std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?);
    let mut left = bytes;
    while left > 0 {
        let n = left.min(pattern.len() as u64) as usize;
        out.write_all(&pattern[..n])?;
        left -= n as u64;
    }
    out.flush()?;
    Ok(())
}

fn files_equal(a: &Path, b: &Path) -> anyhow::Result<bool> {
    use std::io::Read;
    let (mut a, mut b) = (std::fs::File::open(a)?, std::fs::File::open(b)?);
    if a.metadata()?.len() != b.metadata()?.len() {
        return Ok(false);
    }
    let (mut x, mut y) = (vec![0u8; 8 << 20], vec![0u8; 8 << 20]);
    loop {
        let n = a.read(&mut x)?;
        if n == 0 {
            return Ok(true);
        }
        b.read_exact(&mut y[..n])?;
        if x[..n] != y[..n] {
            return Ok(false);
        }
    }
}

/// Opens `count` connections to storage server 0, reads a block on each, and returns the
/// server's resident memory beyond its DRAM tier while they are all open.
async fn rss_with_connections(
    client: &tern_client::Client,
    cluster: &EmbeddedCluster,
    file: &str,
    count: usize,
) -> anyhow::Result<f64> {
    let addr = cluster.storage_addr(0);
    let (_, blocks) = client.stat_with_blocks(file, true).await?;
    let block = blocks.iter().map(|(b, _)| b).find(|b| b.address == addr).context("no block on storage server 0")?;
    let mut open = Vec::with_capacity(count);
    for i in 0..count {
        let mut stream = TcpStream::connect(&addr).await?;
        // The file is outside /jobs: slot 0 (the volume principal) with the block's grant.
        let grant = block.grant.as_slice().try_into().context("a block location without its grant")?;
        let read = Frame::read(i as u64, block.block_id, 0, block.length).authorized(0, grant);
        frame::write_frame(&mut stream, &read).await?;
        let reply = frame::read_frame(&mut stream, frame::MAX_PAYLOAD_BYTES).await?.context("server closed")?;
        if reply.header.status != 0 || reply.payload.len() != block.length as usize {
            bail!("reading block {} on connection {i} failed", block.block_id);
        }
        open.push(stream);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pid = pid_listening_on(&addr)?;
    let rss_kib = rss_kib(pid)?;
    drop(open);
    Ok((rss_kib as f64 * 1024.0 - DRAM_BYTES as f64) / (1 << 20) as f64)
}

/// The pid of the `tern storage-server` process started with `--listen addr`.
pub(crate) fn pid_listening_on(addr: &str) -> anyhow::Result<u32> {
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if args.iter().any(|a| *a == b"storage-server")
            && args.windows(2).any(|w| w[0] == b"--listen" && w[1] == addr.as_bytes())
        {
            return Ok(pid);
        }
    }
    bail!("no storage-server process listening on {addr}")
}

pub(crate) fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS in /proc/<pid>/status")
}

struct Cleanup(Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}
