//! The DRAM tier's blocks: the arena cut into fixed-size slots, a free list, and the map from
//! block id to slot.
//!
//! Blocks are write-once and append-only, which is what lets reads run without locks on the data:
//! - one write at a time per block (a per-slot writer flag, taken with the map lock held);
//! - a write lands in `[len, len + n)`, beyond every byte a reader may touch, and the new length
//!   is published (Release) only once the bytes are in place and their crc32c checked;
//! - readers load the length (Acquire) and only ever read below it, so no byte is read while it is
//!   being written, and a published byte never changes while its slot is held;
//! - a slot returns to the free list only when its last `Arc` drops: a Free (or a re-registration)
//!   racing a read removes the block from the map, but the bytes being sent stay intact until the
//!   read's view is dropped.
//!
//! Shuffle segments ([`crate::shuffle`]) take their slots from the same pool through
//! [`AppendSlot`], so file blocks and shuffle data share one arena and one capacity count.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::bail;
use bytes::Bytes;
use parking_lot::Mutex;
use tern_proto::shuffle::{FetchRequest, PushHeader};
use tern_proto::{ErrorKind, Tier};

use crate::arena::Arena;
use crate::nvme::NvmeStore;
use crate::shuffle::{FetchPage, SegmentId, ShuffleError, Shuffles};

/// The tier's name in registrations, heartbeats and metrics.
pub const DRAM_TIER: &str = tern_proto::Tier::Dram.name();

/// Why a block operation was refused. Messages name the op, block, range and limit involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("block {block} is not held by storage server {server}")]
    NotHeld { block: u64, server: u64 },
    #[error("{tier} tier full: {in_use} of {total} blocks in use")]
    Full { tier: &'static str, in_use: usize, total: usize },
    #[error("block {block} is an NVMe block, but storage server {server} has no NVMe tier")]
    NoNvmeTier { block: u64, server: u64 },
    #[error("{op} of block {block} range {offset}+{len} failed on the NVMe device: {error}")]
    Io { block: u64, offset: u32, len: u32, op: &'static str, error: String },
    #[error("write at offset {offset} to block {block} refused: block holds {held} bytes; blocks are append-only")]
    NotAppend { block: u64, offset: u32, held: u32 },
    #[error("write of block {block} range {offset}+{len} refused: it ends past the block size of {block_size} bytes")]
    PastBlockEnd { block: u64, offset: u32, len: u32, block_size: u32 },
    #[error(
        "write to block {block} refused: another write to it is in progress; write a block from one writer, in order"
    )]
    WriteInProgress { block: u64 },
    #[error(
        "write of block {block} range {offset}+{len} refused: payload checksum mismatch (header says {expected:#010x}, \
         bytes give {actual:#010x}); nothing was stored"
    )]
    Corrupt { block: u64, offset: u32, len: u32, expected: u32, actual: u32 },
    #[error("read of block {block} range {offset}+{len} is outside the block (it holds {held} bytes)")]
    ReadOutOfRange { block: u64, offset: u32, len: u32, held: u32 },
}

impl StoreError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            StoreError::NotHeld { .. } => ErrorKind::NotFound,
            StoreError::Full { .. } => ErrorKind::OutOfSpace,
            StoreError::NoNvmeTier { .. } => ErrorKind::NotFound,
            StoreError::Io { .. } => ErrorKind::Internal,
            StoreError::Corrupt { .. } => ErrorKind::Corrupt,
            StoreError::NotAppend { .. }
            | StoreError::PastBlockEnd { .. }
            | StoreError::WriteInProgress { .. }
            | StoreError::ReadOutOfRange { .. } => ErrorKind::Invalid,
        }
    }
}

/// Capacity and use of the tier, as reported to the metadata server and in metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Bytes the tier can hold: slots times block size.
    pub capacity_bytes: u64,
    /// Bytes written into slots not yet returned to the free list.
    pub used_bytes: u64,
    pub capacity_blocks: u64,
    /// Slots not on the free list (held blocks, plus freed ones a read is still sending).
    pub used_blocks: u64,
}

/// The arena and its slot bookkeeping; shared by every slot so that the memory outlives them.
pub(crate) struct Pool {
    arena: Arena,
    block_size: u32,
    slots: usize,
    /// Indices of unused slots; used as a stack so recently freed (cache-warm) slots go first.
    free: Mutex<Vec<usize>>,
    used_bytes: AtomicU64,
}

/// One block's slot of the arena.
struct Slot {
    pool: Arc<Pool>,
    index: usize,
    /// Published length: every byte below it is written, checked and immutable.
    len: AtomicU32,
    /// Held by the one write in progress; taken and released with the map lock held, so that a
    /// failed first write can withdraw the block it created before any other writer sees it.
    writing: AtomicBool,
}

impl Pool {
    /// An empty slot off the free list, or `None` when every slot is in use.
    fn take_slot(self: &Arc<Pool>, writing: bool) -> Option<Arc<Slot>> {
        let index = self.free.lock().pop()?;
        Some(Arc::new(Slot { pool: self.clone(), index, len: AtomicU32::new(0), writing: AtomicBool::new(writing) }))
    }

    pub(crate) fn block_size(&self) -> u32 {
        self.block_size
    }

    pub(crate) fn slots(&self) -> usize {
        self.slots
    }
}

impl Slot {
    /// Pointer to byte `offset` of this slot.
    fn ptr(&self, offset: u32) -> *mut u8 {
        assert!(offset <= self.pool.block_size, "offset {offset} past block size {}", self.pool.block_size);
        let at = self.index * self.pool.block_size as usize + offset as usize;
        debug_assert!(at <= self.pool.arena.len());
        // SAFETY: index < slots and slots * block_size <= arena length (checked when the pool was
        // cut), and offset <= block_size, so `at` is within the mapping or one past its end.
        unsafe { self.pool.arena.base().add(at) }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The last reference is gone: no reader or writer can touch these bytes any more.
        self.pool.used_bytes.fetch_sub(u64::from(*self.len.get_mut()), Ordering::Relaxed);
        self.pool.free.lock().push(self.index);
    }
}

/// Published bytes of a block, kept alive (and its slot out of the free list) while referenced.
struct BlockView {
    slot: Arc<Slot>,
    offset: u32,
    len: u32,
}

impl AsRef<[u8]> for BlockView {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the range lies below the slot's published length (checked in `BlockStore::read`
        // and `AppendSlot::view`), so its bytes were fully written before the Release store that
        // published them, which our Acquire load observed; published bytes are never written again
        // while the slot lives, and `self.slot` keeps it alive. Readers only ever form shared
        // slices, so this aliases nothing mutable.
        unsafe { std::slice::from_raw_parts(self.slot.ptr(self.offset), self.len as usize) }
    }
}

/// A slot with exactly one appender: how a shuffle segment holds its slots. Only the holder of
/// `&mut AppendSlot` writes (the segment's lock serialises its pushes), always above the published
/// length, so the block path's writer flag is not needed; views of published bytes may be taken
/// and outlive it, like block reads. Not `Clone`: there is never a second appender.
pub(crate) struct AppendSlot {
    slot: Arc<Slot>,
}

impl AppendSlot {
    /// An empty slot off the pool's free list, or `None` when the tier is full.
    pub(crate) fn take(pool: &Arc<Pool>) -> Option<AppendSlot> {
        pool.take_slot(false).map(|slot| AppendSlot { slot })
    }

    /// Bytes appended so far.
    pub(crate) fn len(&self) -> u32 {
        // Only this appender stores the length.
        self.slot.len.load(Ordering::Relaxed)
    }

    /// Bytes still free at the end of the slot.
    pub(crate) fn room(&self) -> u32 {
        self.slot.pool.block_size - self.len()
    }

    /// Appends a batch as it is served, `[header | data]` with `header = head(crc of data)`, and
    /// publishes both at once; returns the data's offset in the slot and its crc32c as stored.
    /// One pass over the data, and a Fetch of the batch can send the stored bytes as they are.
    /// Panics if it does not fit (callers check `room`).
    pub(crate) fn append_with_header<const H: usize>(
        &mut self,
        data: &[u8],
        head: impl FnOnce(u32) -> [u8; H],
    ) -> (u32, u32) {
        let offset = self.len();
        let total = u32::try_from(H + data.len()).ok().filter(|total| *total <= self.room());
        let Some(total) = total else {
            panic!("append of {H}+{} bytes to a slot with {} bytes of room", data.len(), self.room());
        };
        // SAFETY: `[offset, offset + total)` lies within the slot (`total <= room`) and at or above
        // its published length, so no view covers it, and `&mut self` makes this the only writer.
        // `data` cannot overlap it: any slice of arena bytes is of published bytes. `dst` is last
        // used before the bytes are published.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.slot.ptr(offset), total as usize) };
        let (header, body) = dst.split_at_mut(H);
        body.copy_from_slice(data);
        // Taken over the arena bytes, so reads can check the bytes at rest, not only in flight.
        let crc = crc32c::crc32c(body);
        header.copy_from_slice(&head(crc));
        self.slot.pool.used_bytes.fetch_add(u64::from(total), Ordering::Relaxed);
        // Release: the bytes written above happen-before any view's creation that observes it.
        self.slot.len.store(offset + total, Ordering::Release);
        (offset + H as u32, crc)
    }

    /// The published bytes `[offset, offset + len)`, without copying; they keep the slot from
    /// reuse until dropped.
    pub(crate) fn view(&self, offset: u32, len: u32) -> Bytes {
        let held = self.slot.len.load(Ordering::Acquire);
        assert!(
            u64::from(offset) + u64::from(len) <= u64::from(held),
            "view {offset}+{len} of a slot holding {held} bytes"
        );
        Bytes::from_owner(BlockView { slot: self.slot.clone(), offset, len })
    }

    /// Test hook: flips one published byte, as a fault in DRAM would.
    #[cfg(test)]
    pub(crate) fn flip_byte(&mut self, offset: u32) {
        assert!(offset < self.len(), "offset {offset} is not a published byte");
        assert!(Arc::get_mut(&mut self.slot).is_some(), "a view of this slot is still alive");
        // SAFETY: the byte is within the slot; this `AppendSlot` holds the only reference to it
        // (checked above, and `&mut self` stops a view being taken meanwhile), so no slice of it
        // exists anywhere.
        unsafe { *self.slot.ptr(offset) ^= 0xff };
    }
}

/// A write under way: the block is validated and reserved for one writer; the payload goes
/// straight into [`PendingWrite::buf`], then [`PendingWrite::commit`] checks and publishes it.
/// Dropped without a successful commit, nothing is published (and a block it created is removed).
pub struct PendingWrite<'a> {
    store: &'a BlockStore,
    block_id: u64,
    slot: Arc<Slot>,
    offset: u32,
    len: u32,
    created: bool,
    published: bool,
}

impl PendingWrite<'_> {
    /// The arena bytes the payload goes into.
    pub fn buf(&mut self) -> &mut [u8] {
        // SAFETY: `[offset, offset + len)` lies within the slot (checked in `begin_write`) and at
        // or above its published length, so no reader touches it; this write holds the slot's
        // writer flag, so no other writer does; `&mut self` makes this the only slice of it.
        unsafe { std::slice::from_raw_parts_mut(self.slot.ptr(self.offset), self.len as usize) }
    }

    /// Checks the written bytes against the frame's crc32c and publishes them; returns the block's
    /// new length.
    pub fn commit(mut self, payload_crc: u32) -> Result<u32, StoreError> {
        let actual = crc32c::crc32c(self.buf());
        if actual != payload_crc {
            return Err(StoreError::Corrupt {
                block: self.block_id,
                offset: self.offset,
                len: self.len,
                expected: payload_crc,
                actual,
            });
        }
        let new_len = self.offset + self.len;
        self.slot.pool.used_bytes.fetch_add(u64::from(self.len), Ordering::Relaxed);
        // Release: the bytes written above happen-before any reader's Acquire load of the length.
        self.slot.len.store(new_len, Ordering::Release);
        self.published = true;
        Ok(new_len)
    }
}

impl Drop for PendingWrite<'_> {
    fn drop(&mut self) {
        if self.published || !self.created {
            self.slot.writing.store(false, Ordering::Release);
            return;
        }
        withdraw_failed_first_write(&self.store.blocks, self.block_id, &self.slot, &self.slot.writing);
    }
}

/// A block's first write failed: withdraws the empty block from `blocks` (if it is still `ours`),
/// atomically with releasing its writer flag so that no other writer can have put bytes in it
/// meanwhile. Shared by the DRAM and NVMe tiers. The block is dropped outside the map lock.
pub(crate) fn withdraw_failed_first_write<T>(
    blocks: &Mutex<HashMap<u64, Arc<T>>>,
    block_id: u64,
    ours: &Arc<T>,
    writing: &AtomicBool,
) {
    let withdrawn = {
        let mut blocks = blocks.lock();
        let is_ours = blocks.get(&block_id).is_some_and(|held| Arc::ptr_eq(held, ours));
        let withdrawn = if is_ours { blocks.remove(&block_id) } else { None };
        writing.store(false, Ordering::Release);
        withdrawn
    };
    drop(withdrawn);
}

/// The DRAM tier: blocks of one fixed size in one arena, and the shuffle segments stored in the
/// same slots.
pub struct BlockStore {
    pool: Arc<Pool>,
    /// The NVMe tier, if the server has one: blocks whose ids carry `NVME_BLOCK_BIT`.
    nvme: Option<Arc<NvmeStore>>,
    blocks: Mutex<HashMap<u64, Arc<Slot>>>,
    shuffles: Shuffles,
    /// The id the metadata server gave this server, named in not-held errors.
    server_id: AtomicU64,
    /// Job tokens and grants: how data frames are checked.
    authority: crate::auth::Authority,
}

impl BlockStore {
    /// A store of `floor(dram / block_size)` blocks in a fresh arena (not prefaulted, small
    /// pages): for tests and tools. Servers map their arena at start-up and cut it once
    /// registered.
    pub fn new(block_size: u32, dram: u64) -> anyhow::Result<BlockStore> {
        BlockStore::with_arena(Arena::map(dram, false, false)?, block_size)
    }

    /// Cuts `arena` into blocks of `block_size`.
    pub(crate) fn with_arena(arena: Arena, block_size: u32) -> anyhow::Result<BlockStore> {
        if !(tern_proto::MIN_BLOCK_SIZE..=tern_proto::MAX_BLOCK_SIZE).contains(&block_size) {
            bail!(
                "block size {block_size} is outside the supported range {}..={} bytes",
                tern_proto::MIN_BLOCK_SIZE,
                tern_proto::MAX_BLOCK_SIZE
            );
        }
        let slots = arena.len() / block_size as usize;
        if slots == 0 {
            bail!(
                "dram tier of {} is smaller than one block of {}; give it at least one block",
                tern_common::ByteSize(arena.len() as u64),
                tern_common::ByteSize(u64::from(block_size))
            );
        }
        // Reversed so that slot 0 is handed out first.
        let free = (0..slots).rev().collect();
        let pool = Arc::new(Pool { arena, block_size, slots, free: Mutex::new(free), used_bytes: AtomicU64::new(0) });
        Ok(BlockStore {
            pool,
            nvme: None,
            blocks: Mutex::new(HashMap::with_capacity(slots)),
            shuffles: Shuffles::default(),
            server_id: AtomicU64::new(0),
            authority: crate::auth::Authority::default(),
        })
    }

    pub fn block_size(&self) -> u32 {
        self.pool.block_size
    }

    /// Adds an NVMe tier (cut into this store's block size).
    pub fn with_nvme(mut self, nvme: NvmeStore) -> BlockStore {
        self.nvme = Some(Arc::new(nvme));
        self
    }

    /// The NVMe tier, if any.
    pub fn nvme(&self) -> Option<&Arc<NvmeStore>> {
        self.nvme.as_ref()
    }

    /// The NVMe tier for an op on `block_id`, or why there is none.
    pub fn nvme_for(&self, block_id: u64) -> Result<&Arc<NvmeStore>, StoreError> {
        self.nvme.as_ref().ok_or(StoreError::NoNvmeTier { block: block_id, server: self.server_id() })
    }

    pub fn server_id(&self) -> u64 {
        self.server_id.load(Ordering::Relaxed)
    }

    /// How data frames are checked: nothing for a store served on its own (tests, tools); a
    /// daemon requires tokens from the start and gets the key when it registers.
    pub fn authority(&self) -> &crate::auth::Authority {
        &self.authority
    }

    pub fn set_server_id(&self, id: u64) {
        self.server_id.store(id, Ordering::Relaxed);
    }

    pub fn usage(&self) -> Usage {
        let free = self.pool.free.lock().len();
        let block_size = u64::from(self.pool.block_size);
        Usage {
            capacity_bytes: self.pool.slots as u64 * block_size,
            used_bytes: self.pool.used_bytes.load(Ordering::Relaxed),
            capacity_blocks: self.pool.slots as u64,
            used_blocks: (self.pool.slots - free) as u64,
        }
    }

    /// Validates an append of `len` bytes at `offset` to `block_id` (creating the block on its
    /// first write) and reserves it for this writer.
    pub fn begin_write(&self, block_id: u64, offset: u32, len: u32) -> Result<PendingWrite<'_>, StoreError> {
        let block_size = self.pool.block_size;
        let check = |held: u32| {
            if offset != held {
                return Err(StoreError::NotAppend { block: block_id, offset, held });
            }
            if u64::from(offset) + u64::from(len) > u64::from(block_size) {
                return Err(StoreError::PastBlockEnd { block: block_id, offset, len, block_size });
            }
            Ok(())
        };
        let mut blocks = self.blocks.lock();
        let (slot, created) = match blocks.get(&block_id) {
            Some(slot) => {
                if slot.writing.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
                    return Err(StoreError::WriteInProgress { block: block_id });
                }
                // Only writers change the length, and this one now holds the writer flag.
                if let Err(e) = check(slot.len.load(Ordering::Acquire)) {
                    slot.writing.store(false, Ordering::Release);
                    return Err(e);
                }
                (slot.clone(), false)
            }
            None => {
                check(0)?;
                let Some(slot) = self.pool.take_slot(true) else {
                    return Err(StoreError::Full { tier: DRAM_TIER, in_use: self.pool.slots, total: self.pool.slots });
                };
                blocks.insert(block_id, slot.clone());
                (slot, true)
            }
        };
        Ok(PendingWrite { store: self, block_id, slot, offset, len, created, published: false })
    }

    /// `len` bytes of `block_id` from `offset`, without copying, and the block's length. The
    /// returned bytes keep the slot from reuse until dropped.
    pub fn read(&self, block_id: u64, offset: u32, len: u32) -> Result<(Bytes, u32), StoreError> {
        let slot = self.blocks.lock().get(&block_id).cloned();
        let Some(slot) = slot else {
            return Err(StoreError::NotHeld { block: block_id, server: self.server_id() });
        };
        let held = slot.len.load(Ordering::Acquire);
        if u64::from(offset) + u64::from(len) > u64::from(held) {
            return Err(StoreError::ReadOutOfRange { block: block_id, offset, len, held });
        }
        if len == 0 {
            return Ok((Bytes::new(), held));
        }
        Ok((Bytes::from_owner(BlockView { slot, offset, len }), held))
    }

    /// Drops the listed blocks of either tier (ids not held are skipped); returns how many were
    /// held.
    pub fn free(&self, block_ids: &[u64]) -> usize {
        let (nvme, dram): (Vec<u64>, Vec<u64>) = block_ids.iter().partition(|id| Tier::of_block(**id) == Tier::Nvme);
        let nvme_freed = self.nvme.as_ref().map_or(0, |tier| tier.free(&nvme));
        nvme_freed + self.free_dram(&dram)
    }

    fn free_dram(&self, block_ids: &[u64]) -> usize {
        let removed: Vec<Arc<Slot>> = {
            let mut blocks = self.blocks.lock();
            block_ids.iter().filter_map(|id| blocks.remove(id)).collect()
        };
        // Slots go back to the free list as these drop, outside the map lock (unless a read still
        // holds one).
        removed.len()
    }

    /// What this server holds, for its inventory: block ids of both tiers, and shuffle ids.
    pub fn inventory(&self) -> (Vec<u64>, Vec<u64>) {
        let mut blocks: Vec<u64> = self.blocks.lock().keys().copied().collect();
        if let Some(nvme) = &self.nvme {
            blocks.extend(nvme.block_ids());
        }
        (blocks, self.shuffles.ids())
    }

    /// Drops every block and shuffle segment: the cluster no longer counts them, so they must
    /// never be served again. Returns how many blocks and how many segments were held.
    pub fn clear(&self) -> (usize, usize) {
        let removed = std::mem::take(&mut *self.blocks.lock());
        let nvme = self.nvme.as_ref().map_or(0, |tier| tier.clear());
        (removed.len() + nvme, self.shuffles.clear())
    }

    /// Appends a pushed batch to a shuffle segment, creating the segment on its first push;
    /// returns the segment's size in bytes afterwards. See [`crate::shuffle`].
    pub fn push(&self, segment: SegmentId, from: PushHeader, batch: &[u8]) -> Result<u64, ShuffleError> {
        self.shuffles.push(&self.pool, self.server_id(), segment, from, batch)
    }

    /// A page of a segment's batches from the committed attempts `request` lists.
    pub fn fetch(&self, segment: SegmentId, request: &FetchRequest) -> Result<FetchPage, ShuffleError> {
        self.shuffles.fetch(self.server_id(), segment, request)
    }

    /// Drops every segment of the listed shuffles (ids not held are skipped), and refuses later
    /// pushes to them; returns how many segments were held.
    pub fn free_shuffles(&self, shuffle_ids: &[u64]) -> usize {
        self.shuffles.free(shuffle_ids)
    }

    /// Shuffle segments held.
    pub fn shuffle_segments(&self) -> usize {
        self.shuffles.segments()
    }

    #[cfg(test)]
    pub(crate) fn shuffles(&self) -> &Shuffles {
        &self.shuffles
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: u32 = 4096;

    fn write(store: &BlockStore, block: u64, offset: u32, data: &[u8]) -> Result<u32, StoreError> {
        let mut pending = store.begin_write(block, offset, data.len() as u32)?;
        pending.buf().copy_from_slice(data);
        pending.commit(crc32c::crc32c(data))
    }

    fn read(store: &BlockStore, block: u64, offset: u32, len: u32) -> Result<Vec<u8>, StoreError> {
        store.read(block, offset, len).map(|(bytes, _)| bytes.to_vec())
    }

    #[test]
    fn appends_and_reads_back() {
        let store = BlockStore::new(BS, 4 * BS as u64).unwrap();
        assert_eq!(write(&store, 7, 0, b"hello ").unwrap(), 6);
        assert_eq!(write(&store, 7, 6, b"world").unwrap(), 11);
        assert_eq!(read(&store, 7, 0, 11).unwrap(), b"hello world");
        assert_eq!(read(&store, 7, 6, 5).unwrap(), b"world");
        assert_eq!(store.read(7, 11, 0).unwrap(), (Bytes::new(), 11));
        let usage = store.usage();
        assert_eq!(usage, Usage { capacity_bytes: 4 * BS as u64, used_bytes: 11, capacity_blocks: 4, used_blocks: 1 });
        // A full block.
        let full = vec![0xabu8; BS as usize];
        assert_eq!(write(&store, 8, 0, &full).unwrap(), BS);
        assert_eq!(read(&store, 8, 0, BS).unwrap(), full);
    }

    #[test]
    fn writes_must_append_within_the_block() {
        let store = BlockStore::new(BS, 4 * BS as u64).unwrap();
        write(&store, 1, 0, b"abc").unwrap();
        let err = write(&store, 1, 0, b"x").unwrap_err();
        assert_eq!(err, StoreError::NotAppend { block: 1, offset: 0, held: 3 });
        assert!(err.to_string().contains("append-only"), "{err}");
        assert_eq!(write(&store, 1, 5, b"x").unwrap_err(), StoreError::NotAppend { block: 1, offset: 5, held: 3 });
        let err = write(&store, 1, 3, &vec![0u8; BS as usize]).unwrap_err();
        assert_eq!(err, StoreError::PastBlockEnd { block: 1, offset: 3, len: BS, block_size: BS });
        assert_eq!(err.kind(), ErrorKind::Invalid);
        // A first write at a non-zero offset creates nothing.
        assert!(matches!(write(&store, 2, 10, b"x"), Err(StoreError::NotAppend { held: 0, .. })));
        assert!(matches!(store.read(2, 0, 0), Err(StoreError::NotHeld { .. })));
        assert_eq!(read(&store, 1, 0, 3).unwrap(), b"abc");
    }

    #[test]
    fn reads_stay_inside_published_bytes() {
        let store = BlockStore::new(BS, BS as u64).unwrap();
        store.set_server_id(42);
        let err = store.read(9, 0, 1).unwrap_err();
        assert_eq!(err.to_string(), "block 9 is not held by storage server 42");
        assert_eq!(err.kind(), ErrorKind::NotFound);
        write(&store, 9, 0, b"0123456789").unwrap();
        let err = store.read(9, 8, 3).unwrap_err();
        assert_eq!(err, StoreError::ReadOutOfRange { block: 9, offset: 8, len: 3, held: 10 });
        assert_eq!(err.to_string(), "read of block 9 range 8+3 is outside the block (it holds 10 bytes)");
        // Offsets near u32::MAX must not wrap around.
        assert!(matches!(store.read(9, u32::MAX, 2), Err(StoreError::ReadOutOfRange { .. })));
        assert!(matches!(write(&store, 9, 10, b""), Ok(10)));
        assert!(matches!(store.begin_write(9, 10, u32::MAX).map(|_| ()), Err(StoreError::PastBlockEnd { .. })));
    }

    #[test]
    fn a_full_tier_says_so() {
        let store = BlockStore::new(BS, 2 * BS as u64 + 100).unwrap();
        write(&store, 1, 0, b"a").unwrap();
        write(&store, 2, 0, b"b").unwrap();
        let err = write(&store, 3, 0, b"c").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfSpace);
        assert_eq!(err.to_string(), "dram tier full: 2 of 2 blocks in use");
        // Appending to a held block still works, and freeing makes room.
        write(&store, 1, 1, b"a").unwrap();
        assert_eq!(store.free(&[1, 99]), 1);
        write(&store, 3, 0, b"c").unwrap();
        assert_eq!(store.usage().used_blocks, 2);
        assert_eq!(store.usage().used_bytes, 2);
    }

    #[test]
    fn freed_blocks_stay_intact_while_a_read_holds_them() {
        let store = BlockStore::new(BS, BS as u64).unwrap();
        let data: Vec<u8> = (0..BS).map(|i| i as u8).collect();
        write(&store, 1, 0, &data).unwrap();
        let (view, held) = store.read(1, 0, BS).unwrap();
        assert_eq!(held, BS);
        assert_eq!(store.free(&[1]), 1);
        assert!(matches!(store.read(1, 0, 1), Err(StoreError::NotHeld { .. })));
        // The only slot is still sending the freed block's bytes: it must not be reused.
        assert!(matches!(write(&store, 2, 0, &[0xff; 16]), Err(StoreError::Full { .. })));
        assert_eq!(store.usage().used_blocks, 1);
        assert_eq!(&view[..], &data[..]);
        let clone = view.slice(10..20);
        drop(view);
        assert!(matches!(write(&store, 2, 0, &[0xff; 16]), Err(StoreError::Full { .. })));
        assert_eq!(&clone[..], &data[10..20]);
        drop(clone);
        write(&store, 2, 0, &[0xff; 16]).unwrap();
        assert_eq!(read(&store, 2, 0, 16).unwrap(), vec![0xff; 16]);
    }

    #[test]
    fn clear_drops_every_block() {
        let store = BlockStore::new(BS, 4 * BS as u64).unwrap();
        for id in 0..4 {
            write(&store, id, 0, b"x").unwrap();
        }
        assert_eq!(store.clear(), (4, 0));
        assert_eq!(store.usage().used_blocks, 0);
        assert_eq!(store.usage().used_bytes, 0);
        assert!(matches!(store.read(0, 0, 1), Err(StoreError::NotHeld { .. })));
    }

    #[test]
    fn bad_checksums_publish_nothing() {
        let store = BlockStore::new(BS, BS as u64).unwrap();
        // A failed first write leaves no block behind.
        let mut pending = store.begin_write(5, 0, 4).unwrap();
        pending.buf().copy_from_slice(b"abcd");
        let err = pending.commit(crc32c::crc32c(b"abcx")).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
        assert!(err.to_string().contains("block 5 range 0+4"), "{err}");
        assert!(matches!(store.read(5, 0, 0), Err(StoreError::NotHeld { .. })));
        assert_eq!(store.usage().used_blocks, 0);
        // A failed append leaves the block as it was, ready for a retry at the same offset.
        write(&store, 5, 0, b"abcd").unwrap();
        let mut pending = store.begin_write(5, 4, 2).unwrap();
        pending.buf().copy_from_slice(b"ef");
        assert!(pending.commit(0).is_err());
        assert_eq!(store.read(5, 0, 4).unwrap().1, 4);
        assert!(matches!(store.read(5, 0, 5), Err(StoreError::ReadOutOfRange { held: 4, .. })));
        assert_eq!(store.usage().used_bytes, 4);
        assert_eq!(write(&store, 5, 4, b"ef").unwrap(), 6);
        assert_eq!(read(&store, 5, 0, 6).unwrap(), b"abcdef");
    }

    #[test]
    fn one_writer_per_block() {
        let store = BlockStore::new(BS, 2 * BS as u64).unwrap();
        let first = store.begin_write(1, 0, 2).unwrap();
        assert_eq!(store.begin_write(1, 0, 2).map(|_| ()).unwrap_err(), StoreError::WriteInProgress { block: 1 });
        // Abandoned (the connection died mid-payload): the block it created is withdrawn.
        drop(first);
        assert!(matches!(store.read(1, 0, 0), Err(StoreError::NotHeld { .. })));
        assert_eq!(write(&store, 1, 0, b"ok").unwrap(), 2);
        // A refused append releases the writer flag.
        assert!(store.begin_write(1, 0, 1).is_err());
        assert_eq!(write(&store, 1, 2, b"!").unwrap(), 3);
    }

    #[test]
    fn concurrent_readers_see_only_published_bytes() {
        let store = Arc::new(BlockStore::new(BS, BS as u64).unwrap());
        let chunk = 64u32;
        let writer = {
            let store = store.clone();
            std::thread::spawn(move || {
                for i in 0..BS / chunk {
                    write(&store, 1, i * chunk, &vec![(i % 251) as u8 + 1; chunk as usize]).unwrap();
                }
            })
        };
        let mut last = 0;
        while last < BS {
            if let Ok((bytes, held)) = store.read(1, 0, 0) {
                assert!(bytes.is_empty());
                let (data, _) = store.read(1, 0, held).unwrap();
                for (i, byte) in data.iter().enumerate() {
                    assert_eq!(*byte, ((i as u32 / chunk) % 251) as u8 + 1, "byte {i} of {held}");
                }
                last = held;
            }
        }
        writer.join().unwrap();
    }

    #[test]
    fn block_sizes_and_tier_sizes_are_checked() {
        assert!(BlockStore::new(100, 1 << 20).is_err());
        let err = BlockStore::new(BS, BS as u64 - 1).err().unwrap().to_string();
        assert!(err.contains("smaller than one block"), "{err}");
    }
}
