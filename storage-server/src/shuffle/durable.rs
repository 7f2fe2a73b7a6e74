//! The NVMe shuffle index: which segment each NVMe extent belongs to, so that segments wholly on
//! NVMe come back when the storage server restarts on the same `--nvme` path.
//!
//! A [`SlotFile`] beside the tier (`<nvme path>.shuffles`) holds one 64-byte entry per NVMe slot:
//! the segment (shuffle, partition, segment index), its storage class, the extent's place among
//! the segment's extents and how many it has, the extent's length, the seal's generation, and a
//! crc32c of all of it. The batches need no record of their own: an extent holds them as a Fetch
//! serves them, each behind its [`BatchHeader`](tern_proto::shuffle::BatchHeader), so walking the
//! headers rebuilds the segment's index.
//!
//! A segment is *sealed* when its every extent is on NVMe: the tier's data is fdatasynced, then
//! every extent's entry written with a new generation, and synced. Before a sealed segment takes
//! another batch, its first extent's entry is cleared (and synced), so a crash from then on drops
//! the segment rather than serve it without the batch. At start a segment comes back only if its
//! entries are all there, agree on generation and extent count, and name the extents 0..n in
//! order (a seal that a crash cut short does not); every other entry is cleared. Segments with
//! any part in DRAM never have a complete seal, so they are never restored.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tern_common::durable::Fs;
use tern_proto::{PartitionIndex, ShuffleId, StorageClass};

use super::SegmentId;
use crate::nvme::index::{Layout, SlotFile};

const LAYOUT: Layout = Layout { magic: b"TERNNVSH", version: 1, entry_bytes: 64, what: "NVMe shuffle index" };
const ENTRY: usize = LAYOUT.entry_bytes as usize;

/// One extent of a sealed segment, as its slot's entry records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ExtentRecord {
    pub segment: SegmentId,
    pub class: StorageClass,
    /// Its place among the segment's extents.
    pub ordinal: u32,
    /// How many extents the segment had when sealed.
    pub extents: u32,
    /// Bytes in the extent (batches with their headers).
    pub len: u32,
    /// The seal that wrote it; every extent of a segment restored carries the same.
    pub generation: u64,
}

impl ExtentRecord {
    fn encode(&self) -> [u8; ENTRY] {
        let mut entry = [0u8; ENTRY];
        entry[..8].copy_from_slice(&self.segment.shuffle.get().to_le_bytes());
        entry[8..12].copy_from_slice(&self.segment.partition.get().to_le_bytes());
        entry[12..16].copy_from_slice(&self.segment.index.to_le_bytes());
        entry[16..20].copy_from_slice(&self.ordinal.to_le_bytes());
        entry[20..24].copy_from_slice(&self.extents.to_le_bytes());
        entry[24..28].copy_from_slice(&self.len.to_le_bytes());
        entry[28..36].copy_from_slice(&self.generation.to_le_bytes());
        entry[36] = self.class.code();
        let crc = crc32c::crc32c(&entry[..ENTRY - 4]);
        entry[ENTRY - 4..].copy_from_slice(&crc.to_le_bytes());
        entry
    }

    /// The record in `entry`, or `None` when it is damaged (its crc or a field is wrong).
    fn decode(entry: &[u8], block_size: u32) -> Option<ExtentRecord> {
        let u32_at = |at: usize| u32::from_le_bytes(entry[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(entry[at..at + 8].try_into().expect("8 bytes"));
        if u32_at(ENTRY - 4) != crc32c::crc32c(&entry[..ENTRY - 4]) {
            return None;
        }
        let record = ExtentRecord {
            segment: SegmentId {
                shuffle: ShuffleId::from_wire(u64_at(0)),
                partition: PartitionIndex::from_wire(u32_at(8)),
                index: u32_at(12),
            },
            class: StorageClass::from_code(entry[36])?,
            ordinal: u32_at(16),
            extents: u32_at(20),
            len: u32_at(24),
            generation: u64_at(28),
        };
        (record.ordinal < record.extents && record.len <= block_size).then_some(record)
    }
}

/// A segment whose seal was found whole at start: its extents' slots and lengths, in order.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Sealed {
    pub segment: SegmentId,
    pub class: StorageClass,
    pub generation: u64,
    /// (slot, length) of extent 0, 1, ...
    pub extents: Vec<(usize, u32)>,
}

/// The NVMe shuffle index of one tier; see the module docs.
pub(crate) struct ShuffleIndex {
    file: SlotFile,
}

impl ShuffleIndex {
    /// The index file beside the tier at `nvme`.
    pub(crate) fn path_for(nvme: &Path) -> PathBuf {
        let mut name = nvme.as_os_str().to_owned();
        name.push(".shuffles");
        PathBuf::from(name)
    }

    /// Opens (or creates) the index at `path` for a tier of `slots` slots of `block_size`;
    /// returns the segments whose seal is whole, and the slots of every other entry (a seal cut
    /// short, a segment unsealed for a push, damage), which the caller clears once it has taken
    /// what it restores.
    pub(crate) fn open_in(
        fs: Arc<dyn Fs>,
        path: &Path,
        block_size: u32,
        slots: usize,
    ) -> anyhow::Result<(ShuffleIndex, Vec<Sealed>, Vec<usize>)> {
        let (file, found) = SlotFile::open_in(fs, path, &LAYOUT, block_size, slots)?;
        let mut stale = Vec::new();
        let mut by_segment: BTreeMap<(u64, u32, u32), Vec<(usize, ExtentRecord)>> = BTreeMap::new();
        for (slot, entry) in found {
            match ExtentRecord::decode(&entry, block_size) {
                Some(record) => {
                    let s = record.segment;
                    by_segment.entry((s.shuffle.get(), s.partition.get(), s.index)).or_default().push((slot, record));
                }
                None => {
                    tracing::warn!("{}: slot {slot}'s entry is damaged; its segment is not restored", path.display());
                    stale.push(slot);
                }
            }
        }
        let mut sealed = Vec::new();
        for (_, mut records) in by_segment {
            records.sort_by_key(|(_, r)| r.ordinal);
            let (_, first) = records[0];
            let whole = records.len() == first.extents as usize
                && (0..).zip(&records).all(|(ordinal, (_, r))| {
                    r.ordinal == ordinal
                        && r.extents == first.extents
                        && r.generation == first.generation
                        && r.class == first.class
                });
            if whole {
                let extents = records.iter().map(|&(slot, r)| (slot, r.len)).collect();
                sealed.push(Sealed {
                    segment: first.segment,
                    class: first.class,
                    generation: first.generation,
                    extents,
                });
            } else {
                tracing::debug!(
                    "{}: {} was not sealed whole (a part in DRAM, or a crash during its seal); not restored",
                    path.display(),
                    first.segment
                );
                stale.extend(records.iter().map(|&(slot, _)| slot));
            }
        }
        Ok((ShuffleIndex { file }, sealed, stale))
    }

    /// Writes the entries of a seal and makes them durable (one sync). The extents' data must
    /// be durable first.
    pub(crate) fn record(&self, records: &[(usize, ExtentRecord)]) -> std::io::Result<()> {
        for (slot, record) in records {
            self.file.write(*slot, &record.encode())?;
        }
        self.file.sync()
    }

    /// Clears the entries of `slots`, durably (one sync for all).
    pub(crate) fn clear(&self, slots: &[usize]) -> std::io::Result<()> {
        self.file.clear(slots)
    }

    pub(crate) fn path(&self) -> &Path {
        self.file.path()
    }

    /// Test hook: writes raw bytes at `offset` of the file, as damage would.
    #[cfg(test)]
    pub(crate) fn damage(&self, bytes: &[u8], offset: u64) {
        self.file.damage(bytes, offset);
    }
}

/// Logs a failed clear of a freed segment's entries. They stay until the next start, which may
/// take the segment back; its shuffle, unknown to the metadata server by then, is freed again.
pub(crate) fn log_clear_failure(index: &ShuffleIndex, error: std::io::Error) {
    tracing::error!("{}: clearing entries failed: {error}", index.path().display());
}
