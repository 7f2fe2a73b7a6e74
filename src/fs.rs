//! `tern fs ...`: files in the store, from the shell.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use bytes::{Bytes, BytesMut};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use tern_client::{Client, CreateOptions, EntryKind, ErrorKind, FileWriter, StorageClass, Tier};

use crate::cli::MetadataAddr;
use crate::show;

#[derive(Args)]
pub struct FsArgs {
    #[command(flatten)]
    metadata: MetadataAddr,
    #[command(subcommand)]
    command: FsCommand,
}

#[derive(Subcommand)]
enum FsCommand {
    /// Upload a local file ("-" for stdin). REMOTE may be a directory (ending in '/' or existing).
    Put {
        /// The local file, or "-" for stdin.
        local: PathBuf,
        /// The path in the store (a directory: the local file's name in it).
        remote: String,
        /// Storage class: dram, nvme, or any (DRAM first, NVMe when no server has DRAM room).
        #[arg(long, default_value = "any")]
        class: StorageClass,
        /// Copies of each block, each on a different storage server (1 or 2). With 2, reads fail
        /// over to the other copy, and the upload needs 2 live servers.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=tern_proto::MAX_REPLICAS as i64))]
        replicas: u32,
        /// Print a JSON summary (path, bytes, seconds, mib_per_s) on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Download a file. LOCAL may be a directory, or "-" for stdout.
    Get {
        /// The file in the store.
        remote: String,
        /// Where to write it: a file, a directory (the remote name in it), or "-" for stdout.
        local: PathBuf,
        /// Print a JSON summary (path, bytes, seconds, mib_per_s) on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Write a file to stdout.
    Cat {
        /// The file in the store.
        remote: String,
    },
    /// List a directory (or show one file).
    Ls {
        /// A directory, or a file.
        path: String,
        /// Long format: kind, size, blocks, creation time.
        #[arg(short, long)]
        long: bool,
        /// One JSON array on one line: an object per entry (path, kind, length, ...).
        #[arg(long)]
        json: bool,
    },
    /// Show a file or directory, with the blocks of a file and where they live.
    Stat {
        /// A file or directory.
        path: String,
        /// Print one JSON object: the entry, and a file's blocks with where each lives.
        #[arg(long)]
        json: bool,
    },
    /// Delete a file, or a directory with -r.
    Rm {
        /// A file, or a directory (empty, or with -r).
        path: String,
        /// Delete a directory with everything in it.
        #[arg(short, long)]
        recursive: bool,
    },
    /// Create a directory.
    Mkdir {
        /// The directory to create.
        path: String,
        /// Create missing parents; no error if it exists.
        #[arg(short, long)]
        parents: bool,
    },
    /// Rename a file or directory.
    Mv {
        /// The file or directory to rename.
        from: String,
        /// Its new path (not across jobs' directories).
        to: String,
    },
}

/// Bytes handed to the writer per call: several blocks, so whole blocks pass without copying.
const PUT_CHUNK_BYTES: usize = 8 << 20;
/// Chunks queued between the threads touching local disk and the network side.
const LOCAL_QUEUE_CHUNKS: usize = 8;
/// Threads writing a downloaded file.
const LOCAL_WRITERS: usize = 2;

pub async fn run(args: FsArgs) -> anyhow::Result<()> {
    let client = args.metadata.connect().await?;
    match args.command {
        FsCommand::Put { local, remote, class, replicas, json } => {
            put(&client, &local, &remote, CreateOptions { class, replicas }, json).await
        }
        FsCommand::Get { remote, local, json } => get(&client, &remote, &local, json).await,
        FsCommand::Cat { remote } => get(&client, &remote, Path::new("-"), false).await,
        FsCommand::Ls { path, long, json } => ls(&client, &path, long, json).await,
        FsCommand::Stat { path, json } => stat(&client, &path, json).await,
        FsCommand::Rm { path, recursive } => {
            client.delete(&path, recursive).await?;
            Ok(())
        }
        FsCommand::Mkdir { path, parents } => Ok(client.mkdir(&path, parents).await?),
        FsCommand::Mv { from, to } => Ok(client.rename(&from, &to).await?),
    }
}

async fn put(client: &Client, local: &Path, remote: &str, options: CreateOptions, json: bool) -> anyhow::Result<()> {
    // The local side first: a file that cannot be opened must leave nothing behind in the store.
    let source = LocalSource::open(local)?;
    let name = local.file_name().and_then(|n| n.to_str()).filter(|_| local != Path::new("-"));
    let remote = match name {
        Some(name) if remote_is_dir(client, remote).await? => format!("{}/{name}", remote.trim_end_matches('/')),
        _ => remote.to_string(),
    };
    let started = Instant::now();
    let (whole, chunks) = match source {
        LocalSource::Empty => {
            client.create_empty(&remote, true).await?;
            report("put", &remote, 0, started, json);
            return Ok(());
        }
        LocalSource::Mapped(whole) => (Some(whole), None),
        LocalSource::Stream(chunks) => (None, Some(chunks)),
    };
    let mut writer = client.create_with_options(&remote, true, options).await?;
    let progress = progress_bar(local_len(local), &format!("put {remote}"));
    let sent = send(&mut writer, whole, chunks, local, &progress).await;
    progress.finish_and_clear();
    if let Err(e) = sent {
        // A failed put leaves nothing behind: the file is given up now, so a retry can write it.
        if let Err(abort) = writer.abort().await {
            tracing::warn!("{abort}");
        }
        return Err(e);
    }
    let info = writer.close().await?;
    report("put", &remote, info.length, started, json);
    Ok(())
}

/// Hands `put`'s bytes to the writer: a mapped file's slices, or the chunks a reader thread sends.
async fn send(
    writer: &mut FileWriter,
    whole: Option<Bytes>,
    chunks: Option<tokio::sync::mpsc::Receiver<std::io::Result<Bytes>>>,
    local: &Path,
    progress: &ProgressBar,
) -> anyhow::Result<()> {
    if let Some(whole) = whole {
        // A regular file goes out straight from the page cache: the writer slices blocks off
        // the mapping without a copy.
        let mut at = 0;
        while at < whole.len() {
            let end = (at + PUT_CHUNK_BYTES).min(whole.len());
            writer.write_bytes(whole.slice(at..end)).await?;
            progress.inc((end - at) as u64);
            at = end;
        }
    }
    if let Some(mut chunks) = chunks {
        while let Some(chunk) = chunks.recv().await {
            let chunk = chunk.with_context(|| format!("reading {}", local.display()))?;
            progress.inc(chunk.len() as u64);
            writer.write_bytes(chunk).await?;
        }
    }
    Ok(())
}

/// What `put` uploads, opened before anything is created in the store.
enum LocalSource {
    /// An empty regular file.
    Empty,
    /// A whole regular file, memory-mapped.
    Mapped(Bytes),
    /// Stdin, a pipe or a device, read in chunks on a thread.
    Stream(tokio::sync::mpsc::Receiver<std::io::Result<Bytes>>),
}

impl LocalSource {
    fn open(local: &Path) -> anyhow::Result<LocalSource> {
        if local.is_dir() {
            anyhow::bail!("{} is a directory; put uploads one file (name a file, or - for stdin)", local.display());
        }
        if local_len(local) == Some(0) {
            return Ok(LocalSource::Empty);
        }
        Ok(match map_local(local)? {
            Some(whole) => LocalSource::Mapped(whole),
            None => LocalSource::Stream(spawn_local_reader(local)?),
        })
    }
}

async fn get(client: &Client, remote: &str, local: &Path, json: bool) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut reader = client.open(remote).await?;
    let local =
        if local.is_dir() { local.join(remote.rsplit('/').next().unwrap_or("file")) } else { local.to_path_buf() };
    let to_stdout = local == Path::new("-");
    let progress =
        if to_stdout { ProgressBar::hidden() } else { progress_bar(Some(reader.len()), &format!("get {remote}")) };
    let (chunks, writing) = spawn_local_writer(&local)?;
    let mut bytes = 0u64;
    while let Some(chunk) = reader.next_chunk().await? {
        bytes += chunk.len() as u64;
        progress.inc(chunk.len() as u64);
        if chunks.send(chunk).await.is_err() {
            break; // the writer failed; its error is reported below
        }
    }
    drop(chunks);
    writing.await.context("local writer thread")?.with_context(|| format!("writing {}", local.display()))?;
    progress.finish_and_clear();
    if !to_stdout {
        report("get", remote, bytes, started, json);
    }
    Ok(())
}

async fn remote_is_dir(client: &Client, remote: &str) -> anyhow::Result<bool> {
    if remote.ends_with('/') {
        return Ok(true);
    }
    match client.stat(remote).await {
        Ok(info) => Ok(info.kind() == EntryKind::Directory),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e.into()),
    }
}

fn local_len(local: &Path) -> Option<u64> {
    std::fs::metadata(local).ok().filter(|m| m.is_file()).map(|m| m.len())
}

/// The whole of a regular local file, memory-mapped; `None` for stdin, pipes and empty files.
#[allow(unsafe_code)] // a memory map is unsafe to make: another process may truncate the file
fn map_local(local: &Path) -> anyhow::Result<Option<Bytes>> {
    if local == Path::new("-") || local_len(local).unwrap_or(0) == 0 {
        return Ok(None);
    }
    let file = std::fs::File::open(local).with_context(|| format!("opening {}", local.display()))?;
    // SAFETY: the mapping is read-only and private to this process; like any reader of a file,
    // `put` expects nobody to truncate it while it is being uploaded.
    let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("mapping {}", local.display()))?;
    let _ = map.advise(memmap2::Advice::Sequential);
    Ok(Some(Bytes::from_owner(map)))
}

/// Reads `local` (or stdin) on a thread, in chunks, into a bounded queue.
fn spawn_local_reader(local: &Path) -> anyhow::Result<tokio::sync::mpsc::Receiver<std::io::Result<Bytes>>> {
    let mut source: Box<dyn Read + Send> = if local == Path::new("-") {
        Box::new(std::io::stdin())
    } else {
        Box::new(std::fs::File::open(local).with_context(|| format!("opening {}", local.display()))?)
    };
    let (tx, rx) = tokio::sync::mpsc::channel(LOCAL_QUEUE_CHUNKS);
    std::thread::spawn(move || loop {
        let mut chunk = BytesMut::zeroed(PUT_CHUNK_BYTES);
        let mut filled = 0;
        let result = loop {
            match source.read(&mut chunk[filled..]) {
                Ok(0) => break Ok(()),
                Ok(n) => {
                    filled += n;
                    if filled == chunk.len() {
                        break Ok(());
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        chunk.truncate(filled);
        let done = result.is_err() || filled < PUT_CHUNK_BYTES;
        let item = result.map(|()| chunk.freeze());
        if (item.as_ref().map_or(true, |c| !c.is_empty()) && tx.blocking_send(item).is_err()) || done {
            return;
        }
    });
    Ok(rx)
}

/// Writes chunks to `local` (or stdout) in order; the handle yields the outcome. A regular file
/// is written by `LOCAL_WRITERS` threads at the chunks' offsets: on tmpfs the cost is the kernel
/// allocating pages, and two threads allocate twice as fast as one.
fn spawn_local_writer(
    local: &Path,
) -> anyhow::Result<(tokio::sync::mpsc::Sender<Bytes>, tokio::task::JoinHandle<std::io::Result<()>>)> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(LOCAL_QUEUE_CHUNKS);
    if local == Path::new("-") {
        let handle = tokio::task::spawn_blocking(move || {
            let mut out = std::io::stdout().lock();
            while let Some(chunk) = rx.blocking_recv() {
                out.write_all(&chunk)?;
            }
            out.flush()
        });
        return Ok((tx, handle));
    }
    let file =
        std::sync::Arc::new(std::fs::File::create(local).with_context(|| format!("creating {}", local.display()))?);
    let handle = tokio::task::spawn_blocking(move || {
        use std::os::unix::fs::FileExt;
        let mut lanes = Vec::with_capacity(LOCAL_WRITERS);
        for _ in 0..LOCAL_WRITERS {
            let (lane_tx, lane_rx) = std::sync::mpsc::sync_channel::<(u64, Bytes)>(LOCAL_QUEUE_CHUNKS / LOCAL_WRITERS);
            let file = file.clone();
            let worker = std::thread::spawn(move || -> std::io::Result<()> {
                for (offset, chunk) in lane_rx {
                    file.write_all_at(&chunk, offset)?;
                }
                Ok(())
            });
            lanes.push((lane_tx, worker));
        }
        let mut offset = 0u64;
        let mut turn = 0;
        while let Some(chunk) = rx.blocking_recv() {
            let len = chunk.len() as u64;
            if lanes[turn % LOCAL_WRITERS].0.send((offset, chunk)).is_err() {
                break; // that writer failed; its error is collected below
            }
            offset += len;
            turn += 1;
        }
        let mut outcome = Ok(());
        for (lane_tx, worker) in lanes {
            drop(lane_tx);
            let result = worker.join().unwrap_or_else(|_| Err(std::io::Error::other("local writer thread panicked")));
            outcome = outcome.and(result);
        }
        outcome?;
        file.set_len(offset)
    });
    Ok((tx, handle))
}

fn progress_bar(total: Option<u64>, message: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(total, indicatif::ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "{msg} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
    )
    .expect("valid template")
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(message.to_string());
    bar
}

fn report(op: &str, path: &str, bytes: u64, started: Instant, json: bool) {
    let seconds = started.elapsed().as_secs_f64();
    let mib_per_s = bytes as f64 / (1 << 20) as f64 / seconds.max(1e-9);
    if json {
        outln!("{}", json!({ "op": op, "path": path, "bytes": bytes, "seconds": seconds, "mib_per_s": mib_per_s }));
    } else {
        eprintln!("{op} {path}: {} in {seconds:.2}s ({mib_per_s:.0} MiB/s)", show::size(bytes));
    }
}

async fn ls(client: &Client, path: &str, long: bool, json: bool) -> anyhow::Result<()> {
    let entries = client.list(path).await?;
    if json {
        show::print_json(&serde_json::Value::Array(entries.iter().map(show::file_json).collect()));
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    for entry in &entries {
        let name = if entry.path == path.trim_end_matches('/') && entry.kind() == EntryKind::File {
            entry.path.as_str()
        } else {
            entry.path.rsplit('/').next().unwrap_or_default()
        };
        let slash = if entry.kind() == EntryKind::Directory { "/" } else { "" };
        if long {
            writeln!(
                out,
                "{:<7} {:>10} {:>6} {}  {name}{slash}",
                show::listed_kind(entry),
                show::size(entry.length),
                entry.block_count,
                show::utc_time(entry.created_unix_ms)
            )?;
        } else {
            writeln!(out, "{name}{slash}")?;
        }
    }
    Ok(())
}

async fn stat(client: &Client, path: &str, json: bool) -> anyhow::Result<()> {
    let (info, blocks) = client.stat_with_blocks(path, true).await?;
    if json {
        let mut value = show::file_json(&info);
        let replicas = info.replicas.max(1) as usize;
        // Grouped by block: `index` is the block's place in the file, `copy` which of its copies.
        value["blocks"] = blocks
            .iter()
            .enumerate()
            .map(|(i, (b, alive))| {
                let mut block = show::block_json(b, *alive);
                block["index"] = json!(i / replicas);
                block["copy"] = json!(i % replicas);
                block
            })
            .collect();
        outln!("{value}");
        return Ok(());
    }
    outln!("path:     {}", info.path);
    outln!("kind:     {}", show::kind_name(&info));
    if info.kind() == EntryKind::File {
        outln!("length:   {} ({} bytes)", show::size(info.length), info.length);
        outln!("file id:  {}", info.file_id);
        outln!("blocks:   {}", info.block_count);
        outln!("class:    {}", info.storage_class);
        outln!("replicas: {}", info.replicas.max(1));
        if info.lost_blocks > 0 {
            outln!(
                "lost:     {} of {}: every copy's server is dead or restarted without it; reads fail with \
                 data-lost, and `tern fs rm` removes the file",
                info.lost_blocks,
                tern_common::text::count(info.block_count, "block")
            );
        }
    }
    outln!("created:  {} UTC", show::utc_time(info.created_unix_ms));
    if !info.job.is_empty() {
        outln!("job:      {}", info.job);
    }
    if !blocks.is_empty() {
        let replicas = info.replicas.max(1) as usize;
        outln!("{:>7} {:>20} {:<5} {:>7} {:<22} {:>10} STATE", "INDEX", "BLOCK", "TIER", "SERVER", "ADDRESS", "LENGTH");
        for (i, (block, alive)) in blocks.iter().enumerate() {
            let state = if *alive { "ok" } else { "lost" };
            // Copies of one block share its index: "3" alone, or "3.0", "3.1" with 2 replicas.
            let index = if replicas == 1 { format!("{i}") } else { format!("{}.{}", i / replicas, i % replicas) };
            outln!(
                "{index:>7} {:>20} {:<5} {:>7} {:<22} {:>10} {state}",
                block.block_id,
                Tier::of_block(block.block_id),
                block.server_id,
                block.address,
                block.length
            );
        }
    }
    Ok(())
}
