//! The NVMe tier's durable slot records, so its data survives a restart of the storage server:
//! the block index here, and the shuffle index of [`crate::shuffle::durable`], both kept in a
//! [`SlotFile`].
//!
//! A slot file (`<nvme path>.index` for blocks) holds a header (magic, format version, block
//! size, slot count, crc32c) and one fixed-size entry per slot, all zeros when the slot holds
//! nothing; each entry carries its own crc32c. An entry is updated in place, so one must never be
//! torn (that would lose the length acknowledged before): entries are 32 or 64 bytes, so one never
//! straddles a 512-byte sector, and a disk writes a sector whole or not at all.
//!
//! A new file is written whole (header, zeroed entries), synced, and its directory synced, before
//! anything is recorded in it; a file that a crash left short of that (shorter than a header, a
//! header of zeros, or our header on a file cut short) held nothing and is made again. File I/O
//! goes through a [`Fs`], so the power-loss tests (`index/power_loss.rs`,
//! `shuffle/durable_tests.rs`) run it on a simulated disk that keeps only what was synced.
//!
//! Block index entries (32 bytes): block id (0 = free), published length, crc32c of those 12
//! bytes. A write updates its slot's entry and syncs it before it is acknowledged; a free clears
//! the entries (and syncs) before the slots can be reused. At start every entry with a good crc
//! comes back as a block of that length; one with a bad crc (damage) is dropped with a warning.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use tern_common::durable::{parent_dir, Fs, FsFile, Open, RealFs};
use tern_proto::BlockId;

/// What kind of slot file, and its entries' size.
pub(crate) struct Layout {
    pub magic: &'static [u8; 8],
    pub version: u32,
    /// 32 or 64: a divisor of a 512-byte sector, at least a header's 32 bytes.
    pub entry_bytes: u64,
    /// Its name in messages ("NVMe block index").
    pub what: &'static str,
}

/// A slot's entry as read at start: the slot, and its bytes (not all zeros).
pub(crate) type RawEntry = (usize, Vec<u8>);

/// A file of one fixed-size entry per slot of the tier, after a header; see the module docs.
pub(crate) struct SlotFile {
    file: Box<dyn FsFile>,
    path: PathBuf,
    entry_bytes: u64,
    what: &'static str,
}

fn header(layout: &Layout, block_size: u32, slots: usize) -> Vec<u8> {
    let mut header = vec![0u8; layout.entry_bytes as usize];
    header[..8].copy_from_slice(layout.magic);
    header[8..12].copy_from_slice(&layout.version.to_le_bytes());
    header[12..16].copy_from_slice(&block_size.to_le_bytes());
    header[16..24].copy_from_slice(&(slots as u64).to_le_bytes());
    let crc = crc32c::crc32c(&header[..24]);
    header[24..28].copy_from_slice(&crc.to_le_bytes());
    header
}

impl SlotFile {
    /// Opens (or creates) the file at `path` for a tier of `slots` slots of `block_size`, and
    /// returns the entries that are not all zeros, by slot. A file made for another block size,
    /// slot count or kind is refused: its slots would not be the tier's.
    pub(crate) fn open_in(
        fs: Arc<dyn Fs>,
        path: &Path,
        layout: &Layout,
        block_size: u32,
        slots: usize,
    ) -> anyhow::Result<(SlotFile, Vec<RawEntry>)> {
        let what = layout.what;
        let opening = || format!("opening the {what} {}", path.display());
        let file = fs.open(path, Open::Create).with_context(opening)?;
        let entry_bytes = layout.entry_bytes;
        let slot_file = SlotFile { file, path: path.to_path_buf(), entry_bytes, what };
        let expected = header(layout, block_size, slots);
        let whole = entry_bytes * (slots as u64 + 1);
        let size = slot_file.file.size().with_context(opening)?;
        let mut found = vec![0u8; entry_bytes as usize];
        if size >= entry_bytes {
            slot_file.file.read_at(&mut found, 0).with_context(|| format!("reading {}", path.display()))?;
        }
        if size < entry_bytes || found.iter().all(|&b| b == 0) || (found == expected && size < whole) {
            // New, or a crash came before its first sync (the header or size did not reach the
            // disk): nothing was ever recorded in it.
            if size > 0 {
                tracing::warn!("{}: a {what} left unfinished by a crash; made again", path.display());
            }
            slot_file.file.set_len(0)?;
            slot_file.file.write_at(&expected, 0)?;
            slot_file.file.set_len(whole)?;
            slot_file.file.sync_all().with_context(|| format!("syncing {}", path.display()))?;
            // Its name too: records synced into a file whose name a crash takes away are lost.
            let dir = parent_dir(path);
            fs.sync_dir(dir).with_context(|| format!("syncing directory {}", dir.display()))?;
            return Ok((slot_file, Vec::new()));
        }
        if found != expected {
            bail!(
                "the {what} {} was made for another tier (block size or size differ, or it is not one); remove it \
                 and the tier's data to start empty",
                path.display()
            );
        }
        let mut bytes = vec![0u8; (entry_bytes * slots as u64) as usize];
        slot_file.file.read_at(&mut bytes, entry_bytes).with_context(|| format!("reading {}", path.display()))?;
        let entries = (bytes.chunks_exact(entry_bytes as usize).enumerate())
            .filter(|(_, entry)| entry.iter().any(|&b| b != 0))
            .map(|(slot, entry)| (slot, entry.to_vec()))
            .collect();
        Ok((slot_file, entries))
    }

    /// Writes `slot`'s entry (not synced: see [`SlotFile::sync`]).
    pub(crate) fn write(&self, slot: usize, entry: &[u8]) -> std::io::Result<()> {
        assert_eq!(entry.len() as u64, self.entry_bytes, "an entry of {}", self.what);
        self.file.write_at(entry, self.entry_bytes * (slot as u64 + 1))
    }

    /// Makes the entries written so far durable.
    pub(crate) fn sync(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }

    /// Records that `slots` hold nothing, durably (one sync for all).
    pub(crate) fn clear(&self, slots: &[usize]) -> std::io::Result<()> {
        let zeros = vec![0u8; self.entry_bytes as usize];
        for &slot in slots {
            self.write(slot, &zeros)?;
        }
        if slots.is_empty() {
            return Ok(());
        }
        self.sync()
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Test hook: writes raw bytes at `offset` of the file, as damage would.
    #[cfg(test)]
    pub(crate) fn damage(&self, bytes: &[u8], offset: u64) {
        self.file.write_at(bytes, offset).unwrap();
    }
}

const LAYOUT: Layout = Layout { magic: b"TERNNVIX", version: 1, entry_bytes: 32, what: "NVMe block index" };

/// A block found in the index at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub slot: usize,
    pub block_id: BlockId,
    pub len: u32,
}

pub struct BlockIndex {
    file: SlotFile,
}

fn encode(block_id: BlockId, len: u32) -> [u8; LAYOUT.entry_bytes as usize] {
    let mut entry = [0u8; LAYOUT.entry_bytes as usize];
    entry[..8].copy_from_slice(&block_id.get().to_le_bytes());
    entry[8..12].copy_from_slice(&len.to_le_bytes());
    let crc = crc32c::crc32c(&entry[..12]);
    entry[12..16].copy_from_slice(&crc.to_le_bytes());
    entry
}

impl BlockIndex {
    /// The index file beside the tier at `nvme`.
    pub fn path_for(nvme: &Path) -> PathBuf {
        let mut name = nvme.as_os_str().to_owned();
        name.push(".index");
        PathBuf::from(name)
    }

    /// Opens (or creates) the index at `path` for a tier of `slots` blocks of `block_size`, and
    /// returns the blocks it lists. An index made for another block size or slot count is refused:
    /// its slots would not be the tier's.
    pub fn open(path: &Path, block_size: u32, slots: usize) -> anyhow::Result<(BlockIndex, Vec<Entry>)> {
        BlockIndex::open_in(Arc::new(RealFs), path, block_size, slots)
    }

    /// [`BlockIndex::open`] on the filesystem `fs`.
    pub fn open_in(
        fs: Arc<dyn Fs>,
        path: &Path,
        block_size: u32,
        slots: usize,
    ) -> anyhow::Result<(BlockIndex, Vec<Entry>)> {
        let (file, found) = SlotFile::open_in(fs, path, &LAYOUT, block_size, slots)?;
        let mut entries = Vec::new();
        for (slot, entry) in found {
            let block_id = u64::from_le_bytes(entry[..8].try_into().expect("8 bytes"));
            let len = u32::from_le_bytes(entry[8..12].try_into().expect("4 bytes"));
            let crc = u32::from_le_bytes(entry[12..16].try_into().expect("4 bytes"));
            if crc != crc32c::crc32c(&entry[..12]) || block_id == 0 || len > block_size {
                tracing::warn!(
                    "{}: slot {slot}'s entry is damaged (a write cut off by a crash?); the slot is taken as free",
                    path.display()
                );
                continue;
            }
            entries.push(Entry { slot, block_id: BlockId::from_wire(block_id), len });
        }
        Ok((BlockIndex { file }, entries))
    }

    /// Records that `slot` holds `block_id` with `len` bytes, durably.
    pub fn record(&self, slot: usize, block_id: BlockId, len: u32) -> std::io::Result<()> {
        self.file.write(slot, &encode(block_id, len))?;
        self.file.sync()
    }

    /// Records that `slots` are free, durably (one sync for all).
    pub fn clear(&self, slots: &[usize]) -> std::io::Result<()> {
        self.file.clear(slots)
    }

    pub fn path(&self) -> &Path {
        self.file.path()
    }
}

#[cfg(test)]
pub(crate) mod power_loss;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_survive_reopening_and_damage_is_dropped() {
        let temp = tempfile::tempdir().unwrap();
        let path = temp.path().join("t.index");
        let (index, entries) = BlockIndex::open(&path, 4096, 8).unwrap();
        assert!(entries.is_empty());
        index.record(3, BlockId::from_wire(77), 100).unwrap();
        index.record(5, BlockId::from_wire(78), 4096).unwrap();
        index.record(6, BlockId::from_wire(79), 1).unwrap();
        index.clear(&[6]).unwrap();
        drop(index);
        let (index, entries) = BlockIndex::open(&path, 4096, 8).unwrap();
        let expected = [
            Entry { slot: 3, block_id: BlockId::from_wire(77), len: 100 },
            Entry { slot: 5, block_id: BlockId::from_wire(78), len: 4096 },
        ];
        assert_eq!(entries, expected);
        // A torn entry (its crc does not match: slot 3's length) is dropped.
        index.file.damage(&[0xff], LAYOUT.entry_bytes * 4 + 9);
        drop(index);
        assert_eq!(BlockIndex::open(&path, 4096, 8).unwrap().1, expected[1..]);
        // Another geometry is refused.
        let err = format!("{:#}", BlockIndex::open(&path, 8192, 8).err().unwrap());
        assert!(err.contains("made for another tier"), "{err}");
    }
}
