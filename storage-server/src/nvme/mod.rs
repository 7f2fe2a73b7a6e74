//! The NVMe tier: a file or block device opened with O_DIRECT, cut into blocks of the cluster
//! block size (slot `i` at offset `i * block_size`), behind an [`engine::IoEngine`].
//!
//! Blocks follow the rules of the [`BlockTable`], as DRAM blocks do: write-once, append-only, one
//! writer at a time, the payload's crc32c checked before anything is stored, the new length
//! published only once the bytes are on disk, and a slot reused only when the last op holding it
//! is done. The errors are the same [`StoreError`]s.
//!
//! Only whole aligned units go to disk. An append at an unaligned offset rewrites the unit it
//! starts in: that unit's published head is read back from disk (it was written whole, padded
//! with zeros) and the payload follows it in the same aligned buffer. So no per-block state lives
//! in memory between writes, and a read fetches the aligned range covering what it asks for and
//! returns the asked bytes as a `Bytes` view of the buffer, without a copy.
//!
//! With an [`index::BlockIndex`], every published length and every free is also recorded (and
//! synced) in a side file before it is acknowledged, so the tier's blocks come back when the
//! storage server restarts on the same path.
//!
//! Shuffle segments also take this tier's slots, as [`NvmeExtent`]s: a DRAM slot's batches moved
//! down whole, in one aligned write (see [`crate::shuffle`]). They are not in the block index:
//! the shuffle index ([`crate::shuffle::durable`]) records the segments wholly on NVMe.

pub mod aligned;
pub mod device;
pub mod engine;
pub mod index;

use std::sync::Arc;

use bytes::Bytes;
use tern_proto::{BlockId, ServerId, Tier};

use crate::block_table::{Appender, BlockRead, BlockTable, Restored, Slot, Slots, StoreError, Usage, Writer};
use aligned::{round_down, round_up, AlignedBuf, AlignedPool, AlignedSlice};
use engine::IoEngine;

/// The medium the tier's slots are cut from: the device behind its io engine, and the durable
/// index of its blocks, if it keeps one.
struct Disk {
    engine: Arc<dyn IoEngine>,
    /// Direct-I/O alignment of the device: offsets, lengths and buffer addresses.
    align: u64,
    index: Option<index::BlockIndex>,
    /// Where reads and writes take their buffers from.
    buffers: Arc<AlignedPool>,
}

/// Most bytes of idle I/O buffers a tier keeps for reuse: a few requests' worth of the largest
/// blocks.
const IDLE_BUFFER_BYTES: usize = 64 << 20;

impl Slot<Disk> {
    /// Where the slot starts on the device.
    fn disk_offset(&self) -> u64 {
        self.index() as u64 * u64::from(self.block_size())
    }
}

/// The NVMe tier of one storage server.
pub struct NvmeTier {
    table: Arc<BlockTable<Disk>>,
}

impl NvmeTier {
    /// Cuts `capacity_bytes` of the device behind `engine` into blocks of `block_size`.
    pub fn new(
        engine: Arc<dyn IoEngine>,
        capacity_bytes: u64,
        align: u64,
        block_size: u32,
    ) -> anyhow::Result<NvmeTier> {
        let buffers = AlignedPool::new(align as usize, IDLE_BUFFER_BYTES);
        NvmeTier::cut(Disk { engine, align, index: None, buffers }, capacity_bytes, block_size)
    }

    fn cut(disk: Disk, capacity_bytes: u64, block_size: u32) -> anyhow::Result<NvmeTier> {
        let align = disk.align;
        if !u64::from(block_size).is_multiple_of(align) {
            anyhow::bail!(
                "the cluster block size {block_size} is not a multiple of the NVMe device's direct-I/O alignment {align}"
            );
        }
        let count = usize::try_from(capacity_bytes / u64::from(block_size))?;
        if count == 0 {
            anyhow::bail!(
                "nvme tier of {} is smaller than one block of {}",
                tern_common::ByteSize(capacity_bytes),
                tern_common::ByteSize(u64::from(block_size))
            );
        }
        Ok(NvmeTier { table: Arc::new(BlockTable::new(Slots::new(disk, Tier::Nvme, block_size, count))) })
    }

    fn disk(&self) -> &Disk {
        self.table.slots().medium()
    }

    /// Keeps a durable index at `path` (see [`index`]) and takes back the blocks it lists.
    pub fn with_index(self, path: &std::path::Path) -> anyhow::Result<NvmeTier> {
        self.with_index_in(tern_common::durable::RealFs::shared(), path)
    }

    /// [`NvmeTier::with_index`] with the index on the filesystem `fs`.
    pub fn with_index_in(
        self,
        fs: Arc<dyn tern_common::durable::Fs>,
        path: &std::path::Path,
    ) -> anyhow::Result<NvmeTier> {
        let slots = self.table.slots();
        let (block_size, count) = (slots.block_size(), slots.count());
        let (index, entries) = index::BlockIndex::open_in(fs, path, block_size, count)?;
        let path = index.path().to_path_buf();
        // Nothing was written yet: cut the device again, with the index this time.
        let Disk { engine, align, buffers, .. } = self.disk();
        let disk = Disk { engine: engine.clone(), align: *align, index: Some(index), buffers: buffers.clone() };
        let tier = NvmeTier::cut(disk, count as u64 * u64::from(block_size), block_size)?;
        let found: Vec<Restored> =
            entries.iter().map(|e| Restored { block: e.block_id, slot: e.slot, len: e.len }).collect();
        if let Err(block) = tier.table.restore(&found) {
            anyhow::bail!("{} lists block {} twice", path.display(), block.get());
        }
        if !found.is_empty() {
            tracing::info!("NVMe tier: {} blocks taken back from {}", found.len(), path.display());
        }
        Ok(tier)
    }

    /// The io engine in use: "uring" or "psync".
    pub fn engine(&self) -> &'static str {
        self.disk().engine.name()
    }

    pub fn usage(&self) -> Usage {
        self.table.usage()
    }

    /// Validates an append of `len` bytes at `offset` to `block` (creating the block on its first
    /// write) and reserves it for this writer; the payload goes into [`NvmeWrite::payload`], then
    /// [`NvmeWrite::commit`] stores it.
    pub fn begin_write(&self, block: BlockId, offset: u32, len: u32) -> Result<NvmeWrite, StoreError> {
        let writer = BlockTable::begin_write(self.table.clone(), block, offset, len)?;
        let Disk { align, buffers, .. } = self.disk();
        let start = round_down(u64::from(offset), *align);
        let end = round_up(u64::from(offset) + u64::from(len), *align).max(start + align);
        let mut buf = buffers.take((end - start) as usize);
        // The padding after the payload up to the unit's end goes to disk: zeroed, not stale.
        buf[(u64::from(offset) + u64::from(len) - start) as usize..].fill(0);
        Ok(NvmeWrite { writer, start, buf })
    }

    /// `len` bytes of `block` from `offset`, the block's length and the bytes' crc32c: for the
    /// chunks of a block written since the tier started, the crcs they had when written, so the
    /// reader checks what came off the disk against them. The bytes are a view of the aligned
    /// buffer the disk filled. `server` names this server in a not-held error.
    pub async fn read(&self, block: BlockId, offset: u32, len: u32, server: ServerId) -> Result<BlockRead, StoreError> {
        let (slot, published) = self.table.read(block, offset, len, server)?;
        let held = published.len;
        if len == 0 {
            return Ok(BlockRead { data: Bytes::new(), held, crc: 0 });
        }
        let Disk { engine, align, buffers, .. } = self.disk();
        let start = round_down(u64::from(offset), *align);
        let end = round_up(u64::from(offset) + u64::from(len), *align);
        let buf = buffers.take((end - start) as usize);
        // `slot` is held across the read, so it cannot be reused (and overwritten) meanwhile.
        let buf = engine.read_at(buf, slot.disk_offset() + start).await.map_err(|e| StoreError::Io {
            block,
            offset,
            len,
            op: "read",
            error: e.to_string(),
        })?;
        let slice = AlignedSlice { buf, start: (u64::from(offset) - start) as usize, len: len as usize };
        let crc = slot.crc_of(published, offset, slice.as_ref());
        Ok(BlockRead { data: Bytes::from_owner(slice), held, crc })
    }

    /// An empty slot for a shuffle segment's batches; `None` when every slot is in use.
    pub(crate) fn take_extent(&self) -> Option<NvmeExtent> {
        Appender::take(self.table.slots()).map(|appender| NvmeExtent { appender: parking_lot::Mutex::new(appender) })
    }

    /// Extents found at start by the shuffle index: the listed slots (index, length), off the
    /// free list; `None`, taking nothing, if a block (or another extent) holds any of them.
    pub(crate) fn restore_extents(&self, listed: &[(usize, u32)]) -> Option<Vec<NvmeExtent>> {
        let appenders = Appender::take_listed(self.table.slots(), listed)?;
        Some(appenders.into_iter().map(|appender| NvmeExtent { appender: parking_lot::Mutex::new(appender) }).collect())
    }

    /// fdatasync of the device: every write done so far is durable.
    pub(crate) fn sync_data(&self) -> std::io::Result<()> {
        self.disk().engine.sync_data()
    }

    pub(crate) fn block_size(&self) -> u32 {
        self.table.slots().block_size()
    }

    pub(crate) fn slot_count(&self) -> usize {
        self.table.slots().count()
    }

    /// Writes `bytes` (at most a block) to a free slot, as a shuffle segment's extent; `None`
    /// when every slot is in use.
    pub(crate) async fn write_extent(&self, bytes: &[u8]) -> std::io::Result<Option<NvmeExtent>> {
        let Some(extent) = self.take_extent() else {
            return Ok(None);
        };
        extent.append_with_header::<0>(bytes, |_| []).await?;
        Ok(Some(extent))
    }

    /// Drops the listed blocks (ids not held are skipped); returns how many were held.
    pub fn free(&self, ids: &[BlockId]) -> usize {
        let removed = self.table.free(ids);
        // The index forgets them while `removed` still holds their slots, so a slot is never
        // reused while the index names its old block.
        if let Some(index) = &self.disk().index {
            let slots: Vec<usize> = removed.iter().map(|slot| slot.index()).collect();
            if let Err(e) = index.clear(&slots) {
                // Harmless for data (a block listed but not referenced is freed at the next
                // registration), but worth knowing.
                tracing::error!("NVMe block index {}: clearing freed slots failed: {e}", index.path().display());
            }
        }
        removed.len()
    }

    /// The blocks it holds.
    pub fn ids(&self) -> Vec<BlockId> {
        self.table.ids()
    }

    /// Drops every block; returns how many were held.
    pub fn clear(&self) -> usize {
        self.table.clear()
    }
}

/// Shuffle bytes in an NVMe slot, which it holds until dropped: appended whole batches (by one
/// appender at a time: the segment serialises its NVMe appends), read by any number of fetches.
pub(crate) struct NvmeExtent {
    /// Locked only to publish or to take the slot for a read, never across I/O.
    appender: parking_lot::Mutex<Appender<Disk>>,
}

impl NvmeExtent {
    /// Bytes it holds.
    pub(crate) fn len(&self) -> u32 {
        self.appender.lock().len()
    }

    /// Which slot of the tier it is.
    pub(crate) fn slot(&self) -> usize {
        self.appender.lock().slot().index()
    }

    /// Bytes free at its end.
    pub(crate) fn room(&self) -> u32 {
        self.appender.lock().room()
    }

    /// Appends `[header | data]` with `header = head(crc of data)` and publishes it; returns the
    /// data's offset and crc32c. The aligned unit holding the current end is read back and
    /// written again with the new bytes after the published ones (which it rewrites unchanged,
    /// so a read racing it sees the same published bytes). Callers append one at a time and check
    /// `room`; panics if it does not fit.
    pub(crate) async fn append_with_header<const H: usize>(
        &self,
        data: &[u8],
        head: impl FnOnce(u32) -> [u8; H],
    ) -> std::io::Result<(u32, u32)> {
        let (slot, offset) = {
            let appender = self.appender.lock();
            assert!(H + data.len() <= appender.room() as usize, "append of {H}+{} bytes past the slot", data.len());
            (appender.slot().clone(), appender.len())
        };
        let Disk { engine, align, buffers, .. } = slot.medium();
        let start = round_down(u64::from(offset), *align);
        let keep = (u64::from(offset) - start) as usize;
        let total = keep + H + data.len();
        let mut buf = buffers.take(round_up(total as u64, *align).max(*align) as usize);
        // The padding up to the unit's end goes to disk: zeroed, not stale.
        buf[total..].fill(0);
        if keep > 0 {
            // The unit holds published bytes below `offset`: written whole before, so it reads back.
            let unit = buffers.take(*align as usize);
            let unit = engine.read_at(unit, slot.disk_offset() + start).await?;
            buf[..keep].copy_from_slice(&unit[..keep]);
        }
        buf[keep + H..total].copy_from_slice(data);
        let crc = crc32c::crc32c(data);
        buf[keep..keep + H].copy_from_slice(&head(crc));
        let at = slot.disk_offset() + start;
        let keep_alive: engine::KeepAlive = Some(slot.clone());
        engine.write_at(buf, at, keep_alive).await?;
        let added = u32::try_from(H + data.len()).expect("checked against the slot's room");
        self.appender.lock().publish(added);
        Ok((offset + H as u32, crc))
    }

    /// Bytes `[offset, offset + len)` as a view of the aligned buffer the disk filled.
    pub(crate) async fn read(&self, offset: u32, len: u32) -> std::io::Result<Bytes> {
        let slot = {
            let appender = self.appender.lock();
            assert!(offset + len <= appender.len(), "read {offset}+{len} of an extent of {} bytes", appender.len());
            appender.slot().clone()
        };
        if len == 0 {
            return Ok(Bytes::new());
        }
        let Disk { engine, align, buffers, .. } = slot.medium();
        let start = round_down(u64::from(offset), *align);
        let end = round_up(u64::from(offset) + u64::from(len), *align);
        let buf = buffers.take((end - start) as usize);
        // `slot` is held across the read, so it cannot be reused (and overwritten) meanwhile.
        let buf = engine.read_at(buf, slot.disk_offset() + start).await?;
        let slice = AlignedSlice { buf, start: (u64::from(offset) - start) as usize, len: len as usize };
        Ok(Bytes::from_owner(slice))
    }
}

/// A write under way on the NVMe tier. Dropped without a successful commit, nothing is published
/// (and a block it created is withdrawn).
pub struct NvmeWrite {
    writer: Writer<Disk, Arc<BlockTable<Disk>>>,
    /// The aligned block offset `buf` starts at.
    start: u64,
    buf: AlignedBuf,
}

impl NvmeWrite {
    /// Where the payload goes: its bytes inside the aligned buffer.
    pub fn payload(&mut self) -> &mut [u8] {
        let head = (u64::from(self.writer.offset()) - self.start) as usize;
        &mut self.buf[head..head + self.writer.len() as usize]
    }

    /// Checks the payload against the frame's crc32c, writes the aligned units it touches (the
    /// published head of the first one read back from disk), and publishes the new length.
    pub async fn commit(mut self, payload_crc: u32) -> Result<u32, StoreError> {
        let head = (u64::from(self.writer.offset()) - self.start) as usize;
        self.writer.verify(&self.buf[head..head + self.writer.len() as usize], payload_crc)?;
        let slot = self.writer.slot().clone();
        let Disk { engine, align, index, buffers } = slot.medium();
        let at = slot.disk_offset() + self.start;
        if head > 0 {
            // The unit holds published bytes below `offset`: written whole before, so it reads back.
            let unit = buffers.take(*align as usize);
            let unit = engine.read_at(unit, at).await.map_err(|e| self.writer.io_error("read", e))?;
            self.buf[..head].copy_from_slice(&unit[..head]);
        }
        let buf = std::mem::replace(&mut self.buf, buffers.take(*align as usize));
        let keep: engine::KeepAlive = Some(slot.clone());
        engine.write_at(buf, at, keep).await.map_err(|e| self.writer.io_error("write", e))?;
        if index.is_some() {
            // Durable in the index before it is published and acknowledged.
            let new_len = self.writer.offset() + self.writer.len();
            let (slot, block) = (slot.clone(), self.writer.block());
            tokio::task::spawn_blocking(move || {
                let Disk { engine, index, .. } = slot.medium();
                let index = index.as_ref().expect("the index checked above");
                // The data first: an index entry must never name bytes a power cut could take
                // back (O_DIRECT skips the page cache, not the device's cache, nor the
                // filesystem's note that preallocated space now holds data).
                engine.sync_data()?;
                index.record(slot.index(), block, new_len)
            })
            .await
            .map_err(|e| self.writer.io_error("index", e))?
            .map_err(|e| self.writer.io_error("index", e))?;
        }
        Ok(self.writer.publish())
    }
}

#[cfg(test)]
mod tests;
