//! Raft's log, vote and snapshots on disk (through [`Fs`], so the power-loss simulation can run
//! them), and the state machine: [`State`] itself, applied record by record through the same
//! [`State::replay`] (and so [`State::apply`]) that a restart replays.
//!
//! Files in `<dir>/raft/`, each `[u32 length][u32 crc32c][payload]` frames as in `wal.rs`:
//! - `log`: a first frame with the last log id a snapshot made redundant, then one frame per
//!   entry (openraft's `Entry`). Every frame's payload is in `codec`'s encoding. Appended and fdatasynced before openraft is
//!   told; a torn last frame is discarded on start (never acknowledged). Truncations and purges
//!   rewrite it (`log.tmp`, synced, renamed, directory synced).
//! - `vote`: one frame (the vote), replaced whole the same way.
//! - `snapshot`: a frame with the snapshot's meta, then the state's snapshot records in
//!   today's frame format (`wal::encode_frame`).
//!
//! A leader runs calls on its live state before their entry commits (speculative apply, see
//! `raft/mod.rs`); entries it proposed in its current term are therefore skipped here (their
//! records are applied already), and everything else is applied. A leader that loses its
//! leadership rebuilds its state from the snapshot and the committed log ([`Machine::rebuild`]).

#![expect(clippy::result_large_err, reason = "openraft's traits fix the error type: StorageError")]

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use openraft::storage::{LogState, RaftLogReader, RaftSnapshotBuilder, RaftStorage, Snapshot, SnapshotMeta};
use openraft::{
    Entry, EntryPayload, LeaderId, LogId, OptionalSend, StorageError, StorageIOError, StoredMembership, Vote,
};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tern_common::durable::{Fs, Open};
use tern_common::Now;
use tracing::{error, warn};

use super::{codec, Batch, TypeConfig};
use crate::config::Config;
use crate::state::State;
use crate::wal;

/// Largest frame of the Raft files: the largest value `codec` decodes.
const MAX_FRAME_BYTES: usize = codec::MAX_BYTES as usize;

type Error = StorageError<u64>;

fn io_err(what: &str, e: impl std::fmt::Display) -> Error {
    StorageIOError::write(&std::io::Error::other(format!("{what}: {e}"))).into()
}

fn frame(payload: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// The good frames of `bytes`, and where they end; a bad frame must be the last thing in the
/// file (torn) or it is corruption.
fn frames<'a>(bytes: &'a [u8], name: &str) -> anyhow::Result<(Vec<&'a [u8]>, usize)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let rest = &bytes[at..];
        let good = rest.len() >= 8 && {
            let len = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
            let crc = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes"));
            len <= MAX_FRAME_BYTES && rest.len() >= 8 + len && crc32c::crc32c(&rest[8..8 + len]) == crc && {
                out.push(&rest[8..8 + len]);
                at += 8 + len;
                true
            }
        };
        if !good {
            let len = if rest.len() >= 4 { u32::from_le_bytes(rest[..4].try_into().expect("4")) as usize } else { 0 };
            if rest.len() < 8 || rest.len() <= 8 + len {
                warn!("{name}: torn frame at offset {at} discarded (never acknowledged)");
                return Ok((out, at));
            }
            anyhow::bail!("{name} is corrupt at offset {at} with {} bytes behind it", rest.len());
        }
    }
    Ok((out, at))
}

#[derive(Serialize, Deserialize, Default)]
struct LogHeader {
    purged: Option<LogId<u64>>,
}

/// Raft's side of the state machine, kept beside the [`State`] and changed only under its lock.
#[derive(Debug, Default)]
pub struct Meta {
    pub last_applied: Option<LogId<u64>>,
    pub membership: StoredMembership<u64, openraft::BasicNode>,
    /// The leadership whose entries were applied when they were proposed (`raft/mod.rs`).
    pub serving: Option<LeaderId<u64>>,
    /// The last proposal sequence number handed out, and the last whose entry was applied.
    pub proposed_seq: u64,
    pub applied_seq: u64,
    snapshot: Option<(SnapshotMeta<u64, openraft::BasicNode>, Vec<u8>)>,
}

/// The state machine: the metadata state, its Raft meta (locked inside the state's lock).
pub struct Machine {
    pub state: Arc<Mutex<State>>,
    pub meta: Mutex<Meta>,
    config: Config,
}

/// Applies the records of one entry's batch to `state`.
fn apply_batch(state: &mut State, batch: &Batch, now: Now, at: &LogId<u64>) {
    let records = match wal::decode_frames(&batch.records, 0, "a Raft entry") {
        Ok(frames) if frames.torn.is_none() => frames.records,
        Ok(frames) => return error!("Raft entry {at}: {}", frames.torn.unwrap_or_default()),
        Err(e) => return error!("Raft entry {at}: {e:#}"),
    };
    for record in &records {
        if let Err(refusal) = state.replay(record, now) {
            // The leader applied it; a replica that cannot is diverging. Say so loudly.
            error!("Raft entry {at}: a record does not apply here: {} ({:?})", refusal.reason, record.change);
        }
    }
}

impl Machine {
    /// A fresh state, with the snapshot `data` (state records in frames) replayed into it.
    fn state_from(&self, data: &[u8], now: Now) -> anyhow::Result<State> {
        let mut state = State::new(&self.config, now);
        let frames = wal::decode_frames(data, 0, "a Raft snapshot")?;
        if let Some(why) = frames.torn {
            anyhow::bail!("{why}");
        }
        state.restore(&frames.records, now)?;
        Ok(state)
    }

    /// The state as the committed log says it is: the snapshot, then every entry after it up to
    /// the last applied one (read from `log`). Speculative changes are gone.
    pub fn rebuild(&self, log: &LogStore, meta: &Meta, now: Now) -> anyhow::Result<State> {
        let (data, from) = match &meta.snapshot {
            Some((snap, data)) => (&data[..], snap.last_log_id.map_or(0, |id| id.index + 1)),
            None => (&[][..], 0),
        };
        let mut state = self.state_from(data, now)?;
        let to = meta.last_applied.map_or(0, |id| id.index + 1);
        let entries = log.entries.lock();
        for index in from..to {
            match entries.get(&index) {
                Some(entry) => {
                    if let EntryPayload::Normal(batch) = &entry.payload {
                        apply_batch(&mut state, batch, now, &entry.log_id);
                    }
                }
                None if log.header.lock().purged.is_some_and(|p| p.index >= index) => {}
                None => anyhow::bail!("Raft entry {index} is applied but no longer in the log"),
            }
        }
        Ok(state)
    }
}

/// The log on disk and its entries in memory (bounded by the snapshot policy: purged after each
/// snapshot).
pub struct LogStore {
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    fsync: bool,
    entries: Mutex<BTreeMap<u64, Entry<TypeConfig>>>,
    header: Mutex<LogHeader>,
    file_len: Mutex<u64>,
    vote: Mutex<Option<Vote<u64>>>,
}

/// openraft's storage: the log and the state machine together (the v1 `RaftStorage`, split by
/// openraft's `Adaptor`).
#[derive(Clone)]
pub struct Store {
    pub log: Arc<LogStore>,
    pub machine: Arc<Machine>,
}

impl LogStore {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Writes `bytes` as file `name`, whole: tmp, sync, rename, sync the directory.
    fn replace(&self, name: &str, bytes: &[u8]) -> Result<(), Error> {
        let tmp = self.path(&format!("{name}.tmp"));
        let file = self.fs.open(&tmp, Open::Truncate).map_err(|e| io_err("creating a Raft file", e))?;
        file.write_at(bytes, 0).map_err(|e| io_err("writing a Raft file", e))?;
        if self.fsync {
            file.sync_all().map_err(|e| io_err("syncing a Raft file", e))?;
        }
        drop(file);
        self.fs.rename(&tmp, &self.path(name)).map_err(|e| io_err("renaming a Raft file", e))?;
        if self.fsync {
            self.fs.sync_dir(&self.dir).map_err(|e| io_err("syncing the Raft directory", e))?;
        }
        Ok(())
    }

    /// Rewrites the log file from memory (after a truncation or a purge).
    fn rewrite(&self) -> Result<(), Error> {
        let mut out = Vec::new();
        frame(&codec::encode(&*self.header.lock()), &mut out);
        for entry in self.entries.lock().values() {
            frame(&codec::encode(entry), &mut out);
        }
        self.replace("log", &out)?;
        *self.file_len.lock() = out.len() as u64;
        Ok(())
    }
}

impl Store {
    /// Opens (or makes) the Raft files in `dir` and loads the snapshot into a state.
    pub fn open(fs: Arc<dyn Fs>, dir: &Path, config: &Config, now: Now) -> anyhow::Result<Store> {
        // (The directory is made by the caller: `Fs` has no mkdir.)
        let dir = dir.join("raft");
        let read = |name: &str| -> anyhow::Result<Option<Vec<u8>>> {
            let path = dir.join(name);
            if fs.exists(&path)? {
                Ok(Some(fs.read(&path)?))
            } else {
                Ok(None)
            }
        };
        let vote = match read("vote")? {
            Some(bytes) => match frames(&bytes, "raft/vote")?.0.first() {
                Some(payload) => Some(codec::decode(payload)?),
                None => None,
            },
            None => None,
        };
        let mut header = LogHeader::default();
        let mut entries = BTreeMap::new();
        let mut file_len = 0;
        if let Some(bytes) = read("log")? {
            let (payloads, good) = frames(&bytes, "raft/log")?;
            for (i, payload) in payloads.iter().enumerate() {
                if i == 0 {
                    header = codec::decode(payload)?;
                } else {
                    let entry: Entry<TypeConfig> = codec::decode(payload)?;
                    entries.insert(entry.log_id.index, entry);
                }
            }
            file_len = good as u64;
        }
        let log = Arc::new(LogStore {
            fs: fs.clone(),
            dir: dir.clone(),
            fsync: config.fsync,
            entries: Mutex::new(entries),
            header: Mutex::new(header),
            file_len: Mutex::new(file_len),
            vote: Mutex::new(vote),
        });
        // The header frame goes first in a fresh file; a torn tail is cut off by the rewrite.
        if file_len == 0 || read("log")?.is_some_and(|b| b.len() as u64 != file_len) {
            log.rewrite().map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        let machine = Machine {
            state: Arc::new(Mutex::new(State::new(config, now))),
            meta: Mutex::new(Meta::default()),
            config: config.clone(),
        };
        if let Some(bytes) = read("snapshot")? {
            let (payloads, _) = frames(&bytes, "raft/snapshot")?;
            let meta: SnapshotMeta<u64, openraft::BasicNode> =
                codec::decode(payloads.first().ok_or_else(|| anyhow::anyhow!("raft/snapshot is empty"))?)?;
            let data: Vec<u8> = payloads.get(1).map(|d| d.to_vec()).unwrap_or_default();
            *machine.state.lock() = machine.state_from(&data, now)?;
            let mut m = machine.meta.lock();
            m.last_applied = meta.last_log_id;
            m.membership = meta.last_membership.clone();
            m.snapshot = Some((meta, data));
        }
        Ok(Store { log, machine: Arc::new(machine) })
    }

    fn save_snapshot(&self, meta: &SnapshotMeta<u64, openraft::BasicNode>, data: &[u8]) -> Result<(), Error> {
        let mut out = Vec::with_capacity(data.len() + 1024);
        frame(&codec::encode(meta), &mut out);
        frame(data, &mut out);
        self.log.replace("snapshot", &out)
    }
}

impl RaftLogReader<TypeConfig> for Store {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, Error> {
        Ok(self.log.entries.lock().range(range).map(|(_, e)| e.clone()).collect())
    }
}

impl RaftSnapshotBuilder<TypeConfig> for Store {
    #[expect(clippy::disallowed_methods, reason = "the edge: a snapshot's replay time is read here")]
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, Error> {
        let now = Now::read();
        let (meta, data) = {
            let state = self.machine.state.lock();
            let meta = self.machine.meta.lock();
            // A leader's live state may hold changes not yet committed: then the snapshot is
            // taken of the state rebuilt from the committed log instead.
            let records = if meta.serving.is_some() && meta.proposed_seq > meta.applied_seq {
                let rebuilt = self.machine.rebuild(&self.log, &meta, now).map_err(|e| io_err("rebuilding", e))?;
                rebuilt.snapshot(now)
            } else {
                state.snapshot(now)
            };
            let mut data = Vec::new();
            for record in &records {
                wal::encode_frame(record, &mut data);
            }
            let last = meta.last_applied;
            let id = format!("{}-{}", last.map_or(0, |l| l.leader_id.term), last.map_or(0, |l| l.index));
            let snap = SnapshotMeta { last_log_id: last, last_membership: meta.membership.clone(), snapshot_id: id };
            (snap, data)
        };
        self.save_snapshot(&meta, &data)?;
        self.machine.meta.lock().snapshot = Some((meta.clone(), data.clone()));
        Ok(Snapshot { meta, snapshot: Box::new(Cursor::new(data)) })
    }
}

impl RaftStorage<TypeConfig> for Store {
    type LogReader = Store;
    type SnapshotBuilder = Store;

    async fn save_vote(&mut self, vote: &Vote<u64>) -> Result<(), Error> {
        let mut out = Vec::new();
        frame(&codec::encode(vote), &mut out);
        self.log.replace("vote", &out)?;
        *self.log.vote.lock() = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<u64>>, Error> {
        Ok(*self.log.vote.lock())
    }

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, Error> {
        let purged = self.log.header.lock().purged;
        let last = self.log.entries.lock().values().next_back().map(|e| e.log_id).or(purged);
        Ok(LogState { last_purged_log_id: purged, last_log_id: last })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn append_to_log<I>(&mut self, entries: I) -> Result<(), Error>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
    {
        let entries: Vec<_> = entries.into_iter().collect();
        let mut out = Vec::new();
        for entry in &entries {
            frame(&codec::encode(entry), &mut out);
        }
        {
            let mut len = self.log.file_len.lock();
            let file =
                self.log.fs.open(&self.log.path("log"), Open::Create).map_err(|e| io_err("opening raft/log", e))?;
            file.write_at(&out, *len).map_err(|e| io_err("appending to raft/log", e))?;
            if self.log.fsync {
                file.sync_data().map_err(|e| io_err("syncing raft/log", e))?;
            }
            *len += out.len() as u64;
        }
        let mut map = self.log.entries.lock();
        for entry in entries {
            map.insert(entry.log_id.index, entry);
        }
        Ok(())
    }

    async fn delete_conflict_logs_since(&mut self, log_id: LogId<u64>) -> Result<(), Error> {
        self.log.entries.lock().retain(|&index, _| index < log_id.index);
        self.log.rewrite()
    }

    async fn purge_logs_upto(&mut self, log_id: LogId<u64>) -> Result<(), Error> {
        self.log.header.lock().purged = Some(log_id);
        self.log.entries.lock().retain(|&index, _| index > log_id.index);
        self.log.rewrite()
    }

    async fn last_applied_state(
        &mut self,
    ) -> Result<(Option<LogId<u64>>, StoredMembership<u64, openraft::BasicNode>), Error> {
        let meta = self.machine.meta.lock();
        Ok((meta.last_applied, meta.membership.clone()))
    }

    #[expect(clippy::disallowed_methods, reason = "the edge: committed entries are applied at the time read here")]
    async fn apply_to_state_machine(&mut self, entries: &[Entry<TypeConfig>]) -> Result<Vec<()>, Error> {
        let now = Now::read();
        let mut state = self.machine.state.lock();
        let mut meta = self.machine.meta.lock();
        for entry in entries {
            meta.last_applied = Some(entry.log_id);
            match &entry.payload {
                EntryPayload::Blank => {}
                EntryPayload::Membership(m) => meta.membership = StoredMembership::new(Some(entry.log_id), m.clone()),
                EntryPayload::Normal(batch) => {
                    if meta.serving == Some(entry.log_id.leader_id) {
                        // Proposed by this leader: applied when its calls ran.
                        meta.applied_seq = meta.applied_seq.max(batch.last_seq);
                    } else {
                        apply_batch(&mut state, batch, now, &entry.log_id);
                    }
                }
            }
        }
        Ok(vec![(); entries.len()])
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, Error> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    #[expect(clippy::disallowed_methods, reason = "the edge: an installed snapshot is replayed at the time read here")]
    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<u64, openraft::BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), Error> {
        let data = snapshot.into_inner();
        let now = Now::read();
        let fresh = self.machine.state_from(&data, now).map_err(|e| io_err("installing a snapshot", e))?;
        self.save_snapshot(meta, &data)?;
        let mut state = self.machine.state.lock();
        let mut m = self.machine.meta.lock();
        *state = fresh;
        m.last_applied = meta.last_log_id;
        m.membership = meta.last_membership.clone();
        m.snapshot = Some((meta.clone(), data));
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, Error> {
        let meta = self.machine.meta.lock();
        Ok(meta
            .snapshot
            .as_ref()
            .map(|(m, d)| Snapshot { meta: m.clone(), snapshot: Box::new(Cursor::new(d.clone())) }))
    }
}
