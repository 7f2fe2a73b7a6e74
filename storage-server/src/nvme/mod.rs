//! The NVMe tier: a file or block device opened with O_DIRECT, cut into blocks of the cluster
//! block size (slot `i` at offset `i * block_size`), behind an [`engine::IoEngine`].
//!
//! Blocks follow the DRAM tier's rules ([`crate::store`]): write-once, append-only, one writer at
//! a time, the payload's crc32c checked before anything is stored, the new length published only
//! once the bytes are on disk, and a slot reused only when the last op holding it is done. The
//! errors are the same [`StoreError`]s.
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

pub mod aligned;
pub mod device;
pub mod engine;
pub mod index;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

use crate::store::{StoreError, Usage};
use aligned::{round_down, round_up, AlignedBuf, AlignedSlice};
use engine::IoEngine;

/// The tier's name in registrations, heartbeats and metrics.
pub const NVME_TIER: &str = tern_proto::Tier::Nvme.name();

struct Slots {
    free: Mutex<Vec<usize>>,
    used_bytes: AtomicU64,
}

/// One block's slot on disk; back on the free list when the last holder drops it.
struct NvmeBlock {
    slots: Arc<Slots>,
    index: usize,
    /// Published length: every byte below it is on disk and checked.
    len: AtomicU32,
    /// Held by the one write in progress (taken and released under the map lock, as in DRAM).
    writing: AtomicBool,
}

impl Drop for NvmeBlock {
    fn drop(&mut self) {
        self.slots.used_bytes.fetch_sub(u64::from(*self.len.get_mut()), Ordering::Relaxed);
        self.slots.free.lock().push(self.index);
    }
}

/// The NVMe tier of one storage server.
pub struct NvmeStore {
    engine: Arc<dyn IoEngine>,
    block_size: u32,
    /// Direct-I/O alignment of the device: offsets, lengths and buffer addresses.
    align: u64,
    slot_count: usize,
    slots: Arc<Slots>,
    blocks: Mutex<HashMap<u64, Arc<NvmeBlock>>>,
    /// The durable index of blocks, when the tier keeps its blocks across restarts.
    index: Option<Arc<index::BlockIndex>>,
}

impl NvmeStore {
    /// Cuts `capacity_bytes` of the device behind `engine` into blocks of `block_size`.
    pub fn new(
        engine: Arc<dyn IoEngine>,
        capacity_bytes: u64,
        align: u64,
        block_size: u32,
    ) -> anyhow::Result<NvmeStore> {
        if !u64::from(block_size).is_multiple_of(align) {
            anyhow::bail!(
                "the cluster block size {block_size} is not a multiple of the NVMe device's direct-I/O alignment {align}"
            );
        }
        let slot_count = usize::try_from(capacity_bytes / u64::from(block_size))?;
        if slot_count == 0 {
            anyhow::bail!(
                "nvme tier of {} is smaller than one block of {}",
                tern_common::ByteSize(capacity_bytes),
                tern_common::ByteSize(u64::from(block_size))
            );
        }
        let free = (0..slot_count).rev().collect();
        Ok(NvmeStore {
            engine,
            block_size,
            align,
            slot_count,
            slots: Arc::new(Slots { free: Mutex::new(free), used_bytes: AtomicU64::new(0) }),
            blocks: Mutex::new(HashMap::with_capacity(slot_count)),
            index: None,
        })
    }

    /// Keeps a durable index at `path` (see [`index`]) and takes back the blocks it lists.
    pub fn with_index(mut self, path: &std::path::Path) -> anyhow::Result<NvmeStore> {
        let (index, entries) = index::BlockIndex::open(path, self.block_size, self.slot_count)?;
        {
            let mut blocks = self.blocks.lock();
            let mut free = self.slots.free.lock();
            let taken: std::collections::HashSet<usize> = entries.iter().map(|e| e.slot).collect();
            free.retain(|slot| !taken.contains(slot));
            for entry in &entries {
                let block = Arc::new(NvmeBlock {
                    slots: self.slots.clone(),
                    index: entry.slot,
                    len: AtomicU32::new(entry.len),
                    writing: AtomicBool::new(false),
                });
                self.slots.used_bytes.fetch_add(u64::from(entry.len), Ordering::Relaxed);
                if blocks.insert(entry.block_id, block).is_some() {
                    anyhow::bail!("{} lists block {} twice", index.path().display(), entry.block_id);
                }
            }
        }
        if !entries.is_empty() {
            tracing::info!("NVMe tier: {} blocks taken back from {}", entries.len(), index.path().display());
        }
        self.index = Some(Arc::new(index));
        Ok(self)
    }

    /// The io engine in use: "uring" or "psync".
    pub fn engine(&self) -> &'static str {
        self.engine.name()
    }

    pub fn usage(&self) -> Usage {
        let free = self.slots.free.lock().len();
        Usage {
            capacity_bytes: self.slot_count as u64 * u64::from(self.block_size),
            used_bytes: self.slots.used_bytes.load(Ordering::Relaxed),
            capacity_blocks: self.slot_count as u64,
            used_blocks: (self.slot_count - free) as u64,
        }
    }

    /// Validates an append of `len` bytes at `offset` to `block_id` (creating the block on its
    /// first write) and reserves it for this writer; the payload goes into
    /// [`NvmePendingWrite::payload`], then [`NvmePendingWrite::commit`] stores it.
    pub fn begin_write(self: &Arc<Self>, block_id: u64, offset: u32, len: u32) -> Result<NvmePendingWrite, StoreError> {
        let block_size = self.block_size;
        let check = |held: u32| {
            if offset != held {
                return Err(StoreError::NotAppend { block: block_id, offset, held });
            }
            if u64::from(offset) + u64::from(len) > u64::from(block_size) {
                return Err(StoreError::PastBlockEnd { block: block_id, offset, len, block_size });
            }
            Ok(())
        };
        let (block, created) = {
            let mut blocks = self.blocks.lock();
            match blocks.get(&block_id) {
                Some(block) => {
                    if block.writing.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
                        return Err(StoreError::WriteInProgress { block: block_id });
                    }
                    if let Err(e) = check(block.len.load(Ordering::Acquire)) {
                        block.writing.store(false, Ordering::Release);
                        return Err(e);
                    }
                    (block.clone(), false)
                }
                None => {
                    check(0)?;
                    let Some(index) = self.slots.free.lock().pop() else {
                        return Err(StoreError::Full {
                            tier: NVME_TIER,
                            in_use: self.slot_count,
                            total: self.slot_count,
                        });
                    };
                    let block = Arc::new(NvmeBlock {
                        slots: self.slots.clone(),
                        index,
                        len: AtomicU32::new(0),
                        writing: AtomicBool::new(true),
                    });
                    blocks.insert(block_id, block.clone());
                    (block, true)
                }
            }
        };
        let start = round_down(u64::from(offset), self.align);
        let end = round_up(u64::from(offset) + u64::from(len), self.align).max(start + self.align);
        let buf = AlignedBuf::zeroed((end - start) as usize, self.align as usize);
        Ok(NvmePendingWrite {
            store: self.clone(),
            block_id,
            block,
            offset,
            len,
            start,
            buf,
            created,
            published: false,
        })
    }

    /// `len` bytes of `block_id` from `offset` and the block's length; the bytes are a view of
    /// the aligned buffer the disk filled.
    pub async fn read(&self, block_id: u64, offset: u32, len: u32, server: u64) -> Result<(Bytes, u32), StoreError> {
        let block = self.blocks.lock().get(&block_id).cloned();
        let Some(block) = block else {
            return Err(StoreError::NotHeld { block: block_id, server });
        };
        let held = block.len.load(Ordering::Acquire);
        if u64::from(offset) + u64::from(len) > u64::from(held) {
            return Err(StoreError::ReadOutOfRange { block: block_id, offset, len, held });
        }
        if len == 0 {
            return Ok((Bytes::new(), held));
        }
        let start = round_down(u64::from(offset), self.align);
        let end = round_up(u64::from(offset) + u64::from(len), self.align);
        let buf = AlignedBuf::zeroed((end - start) as usize, self.align as usize);
        let at = self.slot_offset(&block) + start;
        // `block` is held across the read, so its slot cannot be reused (and overwritten) meanwhile.
        let buf = self.engine.read_at(buf, at).await.map_err(|e| StoreError::Io {
            block: block_id,
            offset,
            len,
            op: "read",
            error: e.to_string(),
        })?;
        drop(block);
        let slice = AlignedSlice { buf, start: (u64::from(offset) - start) as usize, len: len as usize };
        Ok((Bytes::from_owner(slice), held))
    }

    /// Drops the listed blocks (ids not held are skipped); returns how many were held.
    pub fn free(&self, block_ids: &[u64]) -> usize {
        let removed: Vec<Arc<NvmeBlock>> = {
            let mut blocks = self.blocks.lock();
            block_ids.iter().filter_map(|id| blocks.remove(id)).collect()
        };
        // The index forgets them while `removed` still holds their slots, so a slot is never
        // reused while the index names its old block.
        if let Some(index) = &self.index {
            let slots: Vec<usize> = removed.iter().map(|b| b.index).collect();
            if let Err(e) = index.clear(&slots) {
                // Harmless for data (a block listed but not referenced is freed at the next
                // registration), but worth knowing.
                tracing::error!("NVMe block index {}: clearing freed slots failed: {e}", index.path().display());
            }
        }
        removed.len()
    }

    /// The ids of the blocks it holds.
    pub fn block_ids(&self) -> Vec<u64> {
        self.blocks.lock().keys().copied().collect()
    }

    /// Drops every block; returns how many were held.
    pub fn clear(&self) -> usize {
        let removed = std::mem::take(&mut *self.blocks.lock());
        removed.len()
    }

    fn slot_offset(&self, block: &NvmeBlock) -> u64 {
        block.index as u64 * u64::from(self.block_size)
    }
}

/// A write under way on the NVMe tier. Dropped without a successful commit, nothing is published
/// (and a block it created is withdrawn).
pub struct NvmePendingWrite {
    store: Arc<NvmeStore>,
    block_id: u64,
    block: Arc<NvmeBlock>,
    offset: u32,
    len: u32,
    /// The aligned block offset `buf` starts at.
    start: u64,
    buf: AlignedBuf,
    created: bool,
    published: bool,
}

impl NvmePendingWrite {
    /// Where the payload goes: its bytes inside the aligned buffer.
    pub fn payload(&mut self) -> &mut [u8] {
        let head = (u64::from(self.offset) - self.start) as usize;
        &mut self.buf[head..head + self.len as usize]
    }

    /// Checks the payload against the frame's crc32c, writes the aligned units it touches (the
    /// published head of the first one read back from disk), and publishes the new length.
    pub async fn commit(mut self, payload_crc: u32) -> Result<u32, StoreError> {
        let actual = crc32c::crc32c(self.payload());
        if actual != payload_crc {
            return Err(StoreError::Corrupt {
                block: self.block_id,
                offset: self.offset,
                len: self.len,
                expected: payload_crc,
                actual,
            });
        }
        let slot = self.store.slot_offset(&self.block);
        let head = (u64::from(self.offset) - self.start) as usize;
        let io_error = |op: &'static str, e: std::io::Error| StoreError::Io {
            block: self.block_id,
            offset: self.offset,
            len: self.len,
            op,
            error: e.to_string(),
        };
        if head > 0 {
            // The unit holds published bytes below `offset`: written whole before, so it reads back.
            let unit = AlignedBuf::zeroed(self.store.align as usize, self.store.align as usize);
            let unit = self.store.engine.read_at(unit, slot + self.start).await.map_err(|e| io_error("read", e))?;
            self.buf[..head].copy_from_slice(&unit[..head]);
        }
        let buf =
            std::mem::replace(&mut self.buf, AlignedBuf::zeroed(self.store.align as usize, self.store.align as usize));
        let keep: engine::KeepAlive = Some(self.block.clone());
        self.store.engine.write_at(buf, slot + self.start, keep).await.map_err(|e| io_error("write", e))?;
        let new_len = self.offset + self.len;
        if let Some(index) = self.store.index.clone() {
            // Durable in the index before it is published and acknowledged.
            let (slot, block_id) = (self.block.index, self.block_id);
            tokio::task::spawn_blocking(move || index.record(slot, block_id, new_len))
                .await
                .map_err(|e| io_error("index", std::io::Error::other(e)))?
                .map_err(|e| io_error("index", e))?;
        }
        self.store.slots.used_bytes.fetch_add(u64::from(self.len), Ordering::Relaxed);
        // Release: the bytes are on disk before any reader's Acquire load sees the new length.
        self.block.len.store(new_len, Ordering::Release);
        self.published = true;
        Ok(new_len)
    }
}

impl Drop for NvmePendingWrite {
    fn drop(&mut self) {
        if self.published || !self.created {
            self.block.writing.store(false, Ordering::Release);
            return;
        }
        crate::store::withdraw_failed_first_write(&self.store.blocks, self.block_id, &self.block, &self.block.writing);
    }
}

#[cfg(test)]
mod tests;
