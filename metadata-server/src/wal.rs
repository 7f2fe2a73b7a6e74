//! The metadata server's durable state on disk: a write-ahead log with group commit, and
//! snapshots that let the log be cut.
//!
//! Both files are sequences of [`LogRecord`]s (one format, defined in `proto/tern.proto`) in
//! frames: `[u32 length][u32 crc32c of the payload][payload]`, little-endian, after a 16-byte
//! header (8-byte magic, u32 format version, u32 reserved). In `--dir`:
//! - `wal-<seq>`: log files; a new one is started at every snapshot and at every start.
//! - `snapshot`: the records that rebuild the state as it was when `wal-<first>` was started;
//!   its 24-byte header has `first` after the magic, version and reserved word.
//!
//! Group commit: RPC handlers append records to a shared buffer under the state's lock (so the
//! log's order is the order the state changed in) and get a log sequence number; one writer
//! thread takes everything buffered, writes it, fdatasyncs once, and publishes the highest number
//! now durable. Concurrent mutations share one fsync, and an RPC is answered only once its records
//! are durable.
//!
//! Snapshots are written to `snapshot.tmp`, fsynced, renamed over `snapshot`, and the directory
//! fsynced; only then are the log files it covers deleted.
//!
//! Recovery: the snapshot, then every log file from the one it names, in order. A record cut off
//! at the very end of the last log file (the process died mid-write) is discarded with a warning,
//! and the file truncated to the last whole record; a bad record with more behind it, or a bad
//! record in an earlier file, is corruption, and the server refuses to start, naming the file and
//! offset.
//!
//! Every file operation goes through a [`Fs`], so the power-loss tests (`wal/power_loss.rs`) run
//! all of this on a simulated disk that keeps only what was synced.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{bail, Context};
use parking_lot::{Condvar, Mutex};
use prost::Message;
use tern_common::durable::{Fs, FsFile, Open};
use tern_proto::v1::LogRecord;
use tokio::sync::watch;
use tracing::warn;

/// Log files start with this, then the format version.
pub const WAL_MAGIC: &[u8; 8] = b"TERNWAL\0";
/// Snapshot files start with this, then the format version, then the sequence number of the
/// first log file they do not cover (u64).
pub const SNAPSHOT_MAGIC: &[u8; 8] = b"TERNSNAP";
/// The record format's version; a file of another version is refused.
pub const FORMAT_VERSION: u32 = 1;
/// Largest record: a shuffle of a million partitions with its commit fits well under it.
pub const MAX_RECORD_BYTES: u32 = 64 << 20;
/// Most bytes buffered for the writer; appenders wait beyond it (bounded memory under a slow disk).
pub const MAX_BUFFERED_BYTES: usize = 256 << 20;
const FRAME_HEADER: usize = 8;
const WAL_HEADER: usize = 16;
const SNAPSHOT_HEADER: usize = 24;
const SNAPSHOT_FILE: &str = "snapshot";
const SNAPSHOT_TMP: &str = "snapshot.tmp";
/// Bytes of a snapshot gathered before each write.
const SNAPSHOT_WRITE_BYTES: usize = 1 << 20;

/// How far the log is durable; `failed` once a write or fsync failed (nothing is durable after).
#[derive(Debug, Clone, Default)]
pub struct Durable {
    pub lsn: u64,
    pub failed: Option<Arc<str>>,
}

/// Appends a frame for `record` to `out`.
pub fn encode_frame(record: &LogRecord, out: &mut Vec<u8>) {
    let len = record.encoded_len();
    let start = out.len();
    out.extend_from_slice(&[0; FRAME_HEADER]);
    record.encode(out).expect("a Vec grows as needed");
    let crc = crc32c::crc32c(&out[start + FRAME_HEADER..]);
    out[start..start + 4].copy_from_slice(&(len as u32).to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// What reading a file's frames found.
#[derive(Debug)]
pub struct Frames {
    pub records: Vec<LogRecord>,
    /// Bytes of whole, good frames (header included): where a torn tail starts.
    pub good_len: u64,
    /// Why the tail past `good_len` was discarded; `None` when the file ended cleanly.
    pub torn: Option<String>,
}

/// Decodes the frames of `bytes` (the part after the file header, which starts at `base` in the
/// file, for messages). A bad frame that reaches the end of the data is a torn tail; one with
/// data behind it is corruption.
pub fn decode_frames(bytes: &[u8], base: u64, name: &str) -> anyhow::Result<Frames> {
    let mut records = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let offset = base + at as u64;
        let rest = &bytes[at..];
        if rest.len() < FRAME_HEADER {
            let why = format!("{name}: a {}-byte partial record header at offset {offset}", rest.len());
            return Ok(Frames { records, good_len: base + at as u64, torn: Some(why) });
        }
        let len = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
        let crc = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes"));
        let end = FRAME_HEADER as u64 + u64::from(len);
        let problem = if len == 0 || len > MAX_RECORD_BYTES {
            Some(format!("record length {len} out of range 1..={MAX_RECORD_BYTES}"))
        } else if (rest.len() as u64) < end {
            Some(format!("record of {len} bytes cut off after {} bytes", rest.len() - FRAME_HEADER))
        } else {
            let payload = &rest[FRAME_HEADER..end as usize];
            let actual = crc32c::crc32c(payload);
            if actual != crc {
                Some(format!("crc32c {actual:#010x} where the record says {crc:#010x}"))
            } else {
                match LogRecord::decode(payload) {
                    Ok(record) => {
                        records.push(record);
                        at += end as usize;
                        continue;
                    }
                    Err(e) => Some(format!("record does not decode: {e}")),
                }
            }
        };
        let problem = problem.expect("every path without a problem continues");
        // A record that reaches the end of the file (or claims to) was being written when the
        // process died; anything behind a bad record means the file itself is damaged.
        let reaches_end = len == 0 && rest.iter().all(|&b| b == 0) || (rest.len() as u64) <= end;
        if reaches_end {
            let why = format!("{name}: torn record at offset {offset}: {problem}");
            return Ok(Frames { records, good_len: offset, torn: Some(why) });
        }
        bail!(
            "{name} is corrupt at offset {offset}: {problem}, with {} more bytes behind it; the metadata log \
             cannot be trusted past this point",
            rest.len() as u64 - end.min(rest.len() as u64)
        );
    }
    Ok(Frames { records, good_len: base + bytes.len() as u64, torn: None })
}

fn wal_name(seq: u64) -> String {
    format!("wal-{seq:010}")
}

fn wal_seq(name: &str) -> Option<u64> {
    name.strip_prefix("wal-").and_then(|s| s.parse().ok())
}

/// What recovery read from the directory.
#[derive(Debug)]
pub struct Recovered {
    /// The snapshot's records, then every log record, in order.
    pub records: Vec<LogRecord>,
    /// Records from the snapshot (the rest came from log files).
    pub snapshot_records: usize,
    /// Log files read.
    pub wal_files: usize,
    /// The sequence number for the next log file.
    pub next_seq: u64,
}

/// Reads the snapshot and log files of `dir`, truncating a torn tail of the last log file.
pub fn recover(fs: &dyn Fs, dir: &Path) -> anyhow::Result<Recovered> {
    let mut records = Vec::new();
    let mut first_seq = None;
    let snapshot_path = dir.join(SNAPSHOT_FILE);
    if fs.exists(&snapshot_path).with_context(|| format!("looking for {}", snapshot_path.display()))? {
        let bytes = fs.read(&snapshot_path).with_context(|| format!("reading {}", snapshot_path.display()))?;
        let name = snapshot_path.display().to_string();
        if bytes.len() < SNAPSHOT_HEADER || &bytes[..8] != SNAPSHOT_MAGIC {
            bail!("{name} is not a Tern metadata snapshot (bad magic)");
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version != FORMAT_VERSION {
            bail!("{name} has format version {version}; this server reads version {FORMAT_VERSION}");
        }
        first_seq = Some(u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes")));
        // Snapshots are renamed into place whole: any damage is corruption.
        let frames = decode_frames(&bytes[SNAPSHOT_HEADER..], SNAPSHOT_HEADER as u64, &name)?;
        if let Some(why) = frames.torn {
            bail!("{why} (a snapshot is written whole before it is renamed into place, so this is corruption)");
        }
        records = frames.records;
    }
    let snapshot_records = records.len();
    let mut seqs: Vec<u64> = fs
        .list(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .iter()
        .filter_map(|name| name.to_str().and_then(wal_seq))
        .collect();
    seqs.sort_unstable();
    if let Some(first) = first_seq {
        // Files before the snapshot's first are covered by it (left over when a crash came
        // between the snapshot's rename and their deletion).
        seqs.retain(|&seq| seq >= first);
    }
    for pair in seqs.windows(2) {
        if pair[1] != pair[0] + 1 {
            bail!("metadata log files in {} skip from {} to {}", dir.display(), wal_name(pair[0]), wal_name(pair[1]));
        }
    }
    if let (Some(first), Some(&found)) = (first_seq, seqs.first()) {
        if found != first {
            bail!(
                "the snapshot in {} continues with {}, but the first log file is {}",
                dir.display(),
                wal_name(first),
                wal_name(found)
            );
        }
    }
    let last = seqs.last().copied();
    for &seq in &seqs {
        let path = dir.join(wal_name(seq));
        let name = path.display().to_string();
        let bytes = fs.read(&path).with_context(|| format!("reading {name}"))?;
        if bytes.len() < WAL_HEADER {
            // Created, but its header never reached the disk: nothing in it was acknowledged.
            if Some(seq) == last {
                warn!("{name}: {}-byte log file without a whole header discarded", bytes.len());
                continue;
            }
            bail!("{name} has no header but later log files exist");
        }
        if &bytes[..8] != WAL_MAGIC {
            bail!("{name} is not a Tern metadata log (bad magic)");
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version != FORMAT_VERSION {
            bail!("{name} has format version {version}; this server reads version {FORMAT_VERSION}");
        }
        let frames = decode_frames(&bytes[WAL_HEADER..], WAL_HEADER as u64, &name)?;
        if let Some(why) = &frames.torn {
            if Some(seq) != last {
                bail!("{why}, in a log file that later ones follow: corruption");
            }
            warn!("{why}: discarded (never acknowledged), file truncated to {} bytes", frames.good_len);
            let file = fs.open(&path, Open::Existing).with_context(|| format!("opening {name}"))?;
            file.set_len(frames.good_len)
                .and_then(|()| file.sync_all())
                .with_context(|| format!("truncating {name}"))?;
        }
        records.extend(frames.records);
    }
    let next_seq = last.or(first_seq.map(|s| s.saturating_sub(1))).unwrap_or(0) + 1;
    Ok(Recovered { records, snapshot_records, wal_files: seqs.len(), next_seq })
}

/// Writes `records` as the snapshot of `dir` covering every log file before `first_seq`, then
/// deletes those files. Returns the snapshot's size in bytes.
pub fn write_snapshot(fs: &dyn Fs, dir: &Path, first_seq: u64, records: &[LogRecord]) -> anyhow::Result<u64> {
    let tmp = dir.join(SNAPSHOT_TMP);
    let file = fs.open(&tmp, Open::Truncate).with_context(|| format!("creating {}", tmp.display()))?;
    let mut out = Vec::with_capacity(SNAPSHOT_WRITE_BYTES + SNAPSHOT_HEADER);
    out.extend_from_slice(SNAPSHOT_MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&first_seq.to_le_bytes());
    let mut size = 0u64;
    let mut write = |out: &mut Vec<u8>| {
        file.write_at(out, size).with_context(|| format!("writing {}", tmp.display()))?;
        size += out.len() as u64;
        out.clear();
        anyhow::Ok(())
    };
    for record in records {
        encode_frame(record, &mut out);
        if out.len() >= SNAPSHOT_WRITE_BYTES {
            write(&mut out)?;
        }
    }
    write(&mut out)?;
    file.sync_all().with_context(|| format!("syncing {}", tmp.display()))?;
    drop(file);
    fs.rename(&tmp, &dir.join(SNAPSHOT_FILE)).with_context(|| format!("renaming {} into place", tmp.display()))?;
    // The rename must be durable before the log files it replaces are removed.
    fs.sync_dir(dir).with_context(|| format!("syncing directory {}", dir.display()))?;
    for name in fs.list(dir).with_context(|| format!("listing {}", dir.display()))? {
        if let Some(seq) = name.to_str().and_then(wal_seq) {
            if seq < first_seq {
                fs.remove(&dir.join(&name)).with_context(|| format!("removing {name:?}"))?;
            }
        }
    }
    Ok(size)
}

enum Item {
    Bytes(Vec<u8>, u64),
    /// Start log file `seq`; what follows goes there.
    Rotate(u64),
}

#[derive(Default)]
struct Queue {
    items: Vec<Item>,
    /// The last sequence number handed out.
    appended: u64,
    buffered_bytes: usize,
    /// Bytes appended to the current log file (to decide when to snapshot).
    file_bytes: u64,
    seq: u64,
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    room: Condvar,
    durable: watch::Sender<Durable>,
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    fsync: bool,
}

/// The log writer: appends under the caller's lock, one thread writing and syncing.
pub struct Wal {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Wal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wal").field("dir", &self.shared.dir).finish()
    }
}

impl Wal {
    /// Starts log file `seq` in `dir` and the writer thread. `fsync` false skips syncs (tests of
    /// other things only; a crash may then lose acknowledged changes).
    pub fn open(fs: Arc<dyn Fs>, dir: &Path, seq: u64, fsync: bool) -> anyhow::Result<Wal> {
        let file = create_wal_file(&*fs, dir, seq, fsync)?;
        let (durable, _) = watch::channel(Durable::default());
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue { seq, ..Queue::default() }),
            wake: Condvar::new(),
            room: Condvar::new(),
            durable,
            fs,
            dir: dir.to_path_buf(),
            fsync,
        });
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("tern-wal".into())
                .spawn(move || write_loop(&shared, file))
                .context("starting the metadata log writer")?
        };
        Ok(Wal { shared, thread: Mutex::new(Some(thread)) })
    }

    /// Queues `records` (in order); returns the sequence number to wait for, or the last one
    /// handed out when there are none (so a read waits for what it may have seen).
    pub fn append(&self, records: &[LogRecord]) -> u64 {
        let mut queue = self.shared.queue.lock();
        if records.is_empty() {
            return queue.appended;
        }
        while queue.buffered_bytes > MAX_BUFFERED_BYTES && !queue.closed {
            self.shared.room.wait(&mut queue);
        }
        let mut bytes = Vec::new();
        for record in records {
            encode_frame(record, &mut bytes);
        }
        queue.appended += 1;
        let lsn = queue.appended;
        queue.buffered_bytes += bytes.len();
        queue.file_bytes += bytes.len() as u64;
        queue.items.push(Item::Bytes(bytes, lsn));
        self.shared.wake.notify_one();
        lsn
    }

    /// Moves on to a new log file; returns its sequence number. Called under the state's lock
    /// when a snapshot is taken, so the new file holds exactly the changes after the snapshot.
    pub fn rotate(&self) -> u64 {
        let mut queue = self.shared.queue.lock();
        queue.seq += 1;
        queue.file_bytes = 0;
        let seq = queue.seq;
        queue.items.push(Item::Rotate(seq));
        self.shared.wake.notify_one();
        seq
    }

    /// Bytes appended to the current log file.
    pub fn file_bytes(&self) -> u64 {
        self.shared.queue.lock().file_bytes
    }

    /// Waits until `lsn` is durable.
    pub async fn wait(&self, lsn: u64) -> Result<(), Arc<str>> {
        let mut durable = self.shared.durable.subscribe();
        let state = durable
            .wait_for(|d| d.lsn >= lsn || d.failed.is_some())
            .await
            .map_err(|_| Arc::from("the metadata log writer stopped"))?;
        match &state.failed {
            Some(why) => Err(why.clone()),
            None => Ok(()),
        }
    }

    /// Resolves once a write or fsync of the log has failed, with why; the writer stopping counts.
    pub async fn failed(&self) -> Arc<str> {
        let mut durable = self.shared.durable.subscribe();
        let failed = match durable.wait_for(|d| d.failed.is_some()).await {
            Ok(state) => state.failed.clone().unwrap_or_else(|| Arc::from("unknown")),
            Err(_) => Arc::from("the metadata log writer stopped"),
        };
        failed
    }

    /// Writes what is queued and stops the writer.
    pub fn close(&self) {
        {
            let mut queue = self.shared.queue.lock();
            queue.closed = true;
            self.shared.wake.notify_one();
            self.shared.room.notify_all();
        }
        if let Some(thread) = self.thread.lock().take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Wal {
    fn drop(&mut self) {
        self.close();
    }
}

/// A log file being appended to.
struct LogFile {
    file: Box<dyn FsFile>,
    len: u64,
}

impl LogFile {
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.file.write_at(bytes, self.len)?;
        self.len += bytes.len() as u64;
        Ok(())
    }
}

fn create_wal_file(fs: &dyn Fs, dir: &Path, seq: u64, fsync: bool) -> anyhow::Result<LogFile> {
    let path = dir.join(wal_name(seq));
    let file = fs.open(&path, Open::CreateNew).with_context(|| format!("creating metadata log {}", path.display()))?;
    let mut file = LogFile { file, len: 0 };
    let mut header = Vec::with_capacity(WAL_HEADER);
    header.extend_from_slice(WAL_MAGIC);
    header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes());
    file.append(&header).with_context(|| format!("writing {}", path.display()))?;
    if fsync {
        file.file.sync_all().with_context(|| format!("syncing {}", path.display()))?;
        fs.sync_dir(dir).with_context(|| format!("syncing directory {}", dir.display()))?;
    }
    Ok(file)
}

fn write_loop(shared: &Shared, mut file: LogFile) {
    loop {
        let items = {
            let mut queue = shared.queue.lock();
            while queue.items.is_empty() && !queue.closed {
                shared.wake.wait(&mut queue);
            }
            if queue.items.is_empty() {
                return;
            }
            queue.buffered_bytes = 0;
            shared.room.notify_all();
            std::mem::take(&mut queue.items)
        };
        let mut last = None;
        let result: anyhow::Result<()> = (|| {
            for item in items {
                match item {
                    Item::Bytes(bytes, lsn) => {
                        file.append(&bytes).context("writing the metadata log")?;
                        last = Some(lsn);
                    }
                    Item::Rotate(seq) => {
                        sync(&file, shared.fsync)?;
                        file = create_wal_file(&*shared.fs, &shared.dir, seq, shared.fsync)?;
                    }
                }
            }
            sync(&file, shared.fsync)
        })();
        match result {
            Ok(()) => {
                if let Some(lsn) = last {
                    shared.durable.send_modify(|d| d.lsn = d.lsn.max(lsn));
                }
            }
            Err(e) => {
                let why: Arc<str> = Arc::from(format!("{e:#}"));
                tracing::error!("metadata log failed; no change is acknowledged from now on: {why}");
                shared.durable.send_modify(|d| d.failed = Some(why.clone()));
                return;
            }
        }
    }
}

fn sync(file: &LogFile, fsync: bool) -> anyhow::Result<()> {
    if fsync {
        file.file.sync_data().context("syncing the metadata log")?;
    }
    Ok(())
}

#[cfg(test)]
mod power_loss;

#[cfg(test)]
mod tests {
    use std::fs::{self, OpenOptions};
    use std::io::Write;

    use tern_common::durable::RealFs;
    use tern_proto::v1::log_record::Change;
    use tern_proto::v1::MkdirRequest;

    use super::*;

    fn read_all(path: &Path) -> Vec<u8> {
        fs::read(path).unwrap()
    }

    fn mkdir(i: u64) -> LogRecord {
        LogRecord {
            unix_ms: i,
            change: Some(Change::Mkdir(MkdirRequest { path: format!("/d{i}"), parents: false, ..Default::default() })),
        }
    }

    async fn write(dir: &Path, seq: u64, count: u64) {
        let wal = Wal::open(RealFs::shared(), dir, seq, true).unwrap();
        let mut last = 0;
        for i in 0..count {
            last = wal.append(&[mkdir(i)]);
        }
        wal.wait(last).await.unwrap();
        wal.close();
    }

    #[tokio::test]
    async fn records_round_trip_through_log_and_snapshot() {
        let temp = tempfile::tempdir().unwrap();
        write(temp.path(), 1, 10).await;
        let recovered = recover(&RealFs, temp.path()).unwrap();
        assert_eq!(recovered.records, (0..10).map(mkdir).collect::<Vec<_>>());
        assert_eq!((recovered.next_seq, recovered.wal_files), (2, 1));

        // A snapshot covering wal-1 replaces it; wal-2 continues.
        write_snapshot(&RealFs, temp.path(), 2, &recovered.records[..4]).unwrap();
        assert!(!temp.path().join(wal_name(1)).exists());
        write(temp.path(), 2, 3).await;
        let recovered = recover(&RealFs, temp.path()).unwrap();
        let expected: Vec<LogRecord> = (0..4).chain(0..3).map(mkdir).collect();
        assert_eq!((recovered.records, recovered.snapshot_records, recovered.next_seq), (expected, 4, 3));
    }

    #[tokio::test]
    async fn a_torn_tail_is_discarded_and_cut_off() {
        let temp = tempfile::tempdir().unwrap();
        write(temp.path(), 1, 5).await;
        let path = temp.path().join(wal_name(1));
        let whole = read_all(&path).len() as u64;
        // The last record loses its last 3 bytes, as a crash mid-write leaves it.
        OpenOptions::new().write(true).open(&path).unwrap().set_len(whole - 3).unwrap();
        let recovered = recover(&RealFs, temp.path()).unwrap();
        assert_eq!(recovered.records, (0..4).map(mkdir).collect::<Vec<_>>());
        let cut = read_all(&path).len() as u64;
        assert!(cut < whole - 3, "the torn record was not cut off");
        // Appending zeros (a file extended but never written) is torn too.
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(&[0; 100]).unwrap();
        assert_eq!(recover(&RealFs, temp.path()).unwrap().records.len(), 4);
        assert_eq!(read_all(&path).len() as u64, cut);
    }

    #[tokio::test]
    async fn a_bad_crc_in_the_middle_is_corruption() {
        let temp = tempfile::tempdir().unwrap();
        write(temp.path(), 1, 5).await;
        let path = temp.path().join(wal_name(1));
        let mut bytes = read_all(&path);
        // Flip a payload byte of the second record.
        let first = FRAME_HEADER + mkdir(0).encoded_len();
        bytes[WAL_HEADER + first + FRAME_HEADER + 2] ^= 0x40;
        fs::write(&path, &bytes).unwrap();
        let err = format!("{:#}", recover(&RealFs, temp.path()).unwrap_err());
        assert!(err.contains("is corrupt at offset") && err.contains("crc32c"), "{err}");
        // The same damage in the last record is a torn tail.
        let mut bytes = read_all(&path);
        let fixed_at = WAL_HEADER + first + FRAME_HEADER + 2;
        bytes[fixed_at] ^= 0x40;
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        fs::write(&path, &bytes).unwrap();
        assert_eq!(recover(&RealFs, temp.path()).unwrap().records.len(), 4);
    }

    #[tokio::test]
    async fn concurrent_appends_share_syncs_and_all_become_durable() {
        let temp = tempfile::tempdir().unwrap();
        let wal = Arc::new(Wal::open(RealFs::shared(), temp.path(), 1, true).unwrap());
        let mut tasks = Vec::new();
        for t in 0..8u64 {
            let wal = wal.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..50 {
                    let lsn = wal.append(&[mkdir(t * 1000 + i)]);
                    wal.wait(lsn).await.unwrap();
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        wal.close();
        assert_eq!(recover(&RealFs, temp.path()).unwrap().records.len(), 400);
    }

    #[test]
    fn other_versions_and_gaps_are_refused() {
        let temp = tempfile::tempdir().unwrap();
        let mut bytes = Vec::from(&WAL_MAGIC[..]);
        bytes.extend_from_slice(&7u32.to_le_bytes());
        bytes.extend_from_slice(&0u32.to_le_bytes());
        fs::write(temp.path().join(wal_name(1)), &bytes).unwrap();
        let err = format!("{:#}", recover(&RealFs, temp.path()).unwrap_err());
        assert!(err.contains("format version 7"), "{err}");
        fs::remove_file(temp.path().join(wal_name(1))).unwrap();
        for seq in [1, 3] {
            drop(create_wal_file(&RealFs, temp.path(), seq, false).unwrap());
        }
        let err = format!("{:#}", recover(&RealFs, temp.path()).unwrap_err());
        assert!(err.contains("skip from"), "{err}");
    }
}
