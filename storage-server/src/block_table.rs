//! The block table: one tier's slots, the blocks that hold them, and the rules every block of
//! every tier follows, written once for the DRAM tier ([`crate::dram`]), the NVMe tier
//! ([`crate::nvme`]) and anything else that takes a tier's slots (shuffle segments).
//!
//! The table does not know how a slot's bytes are stored: that is the medium `M` the slots are cut
//! from (the DRAM arena, the NVMe device), which each tier reads and writes itself. What the table
//! owns is who may write where and when a byte becomes readable:
//! - blocks are write-once and append-only: a write lands in `[len, len + n)` of its block, beyond
//!   every byte a reader may touch, and never past the block size;
//! - one write at a time per block: a per-slot writer flag, taken and released with the map lock
//!   held, so that a failed first write can withdraw the block it created before any other writer
//!   sees it;
//! - the new length is published (Release) only once the bytes are in place and their crc32c
//!   checked; readers load it (Acquire) and only ever read below it, so no byte is read while it
//!   is being written, and a published byte never changes while its slot is held;
//! - a block keeps the crc32c of each [`CRC_CHUNK`] of its bytes, taken in the pass that checks
//!   each write's crc, so a read replies with the crcs its bytes had when they arrived, combined,
//!   instead of taking them again: only the parts of chunks a read cuts through are checksummed
//!   as they are sent. A byte that rots at rest is then caught by the reader's check rather than
//!   covered by a fresh crc. The crc of the last, partial chunk is published with the length in
//!   one store, so a reader sees a length and the crc of exactly those bytes;
//! - a slot returns to the free list only when its last `Arc` drops: a Free (or a
//!   re-registration) racing a read removes the block from the map, but the bytes being sent stay
//!   intact until the read is done with them.
//!
//! A slot may also be held by an [`Appender`] (a shuffle segment's slots): exactly one appender
//! and no block id, so no writer flag, but the same publication.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tern_proto::crc::{combine, Shift};
use tern_proto::{BlockId, ErrorKind, ServerId, Tier};

/// The bytes each kept crc32c covers. A read aligned to it replies with kept crcs alone; one that
/// cuts through a chunk checksums the part it sends (at most two parts of 64 KiB). Kept crcs take
/// 4 bytes per chunk: 64 KiB of them per 1 GiB of tier.
pub(crate) const CRC_CHUNK: u32 = 64 << 10;

/// Joins a whole chunk's crc onto the crc of the bytes before it.
const CHUNK_SHIFT: Shift = Shift::new(CRC_CHUNK as u64);

/// Why a block operation was refused. Messages name the op, block, range and limit involved; a
/// block is named by its id as the wire carries it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("block {} is not held by storage server {server}", .block.get())]
    NotHeld { block: BlockId, server: ServerId },
    #[error("{tier} tier full: {in_use} of {total} blocks in use")]
    Full { tier: Tier, in_use: usize, total: usize },
    #[error("block {} is an NVMe block, but storage server {server} has no NVMe tier", .block.get())]
    NoNvmeTier { block: BlockId, server: ServerId },
    #[error("{op} of block {} range {offset}+{len} failed on the NVMe device: {error}", .block.get())]
    Io { block: BlockId, offset: u32, len: u32, op: &'static str, error: String },
    #[error(
        "write at offset {offset} to block {} refused: block holds {held} bytes; blocks are append-only",
        .block.get()
    )]
    NotAppend { block: BlockId, offset: u32, held: u32 },
    #[error(
        "write of block {} range {offset}+{len} refused: it ends past the block size of {block_size} bytes",
        .block.get()
    )]
    PastBlockEnd { block: BlockId, offset: u32, len: u32, block_size: u32 },
    #[error(
        "write to block {} refused: another write to it is in progress; write a block from one writer, in order",
        .block.get()
    )]
    WriteInProgress { block: BlockId },
    #[error(
        "write of block {} range {offset}+{len} refused: payload checksum mismatch (header says {expected:#010x}, \
         bytes give {actual:#010x}); nothing was stored",
        .block.get()
    )]
    Corrupt { block: BlockId, offset: u32, len: u32, expected: u32, actual: u32 },
    #[error("read of block {} range {offset}+{len} is outside the block (it holds {held} bytes)", .block.get())]
    ReadOutOfRange { block: BlockId, offset: u32, len: u32, held: u32 },
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

/// Capacity and use of a tier, as reported to the metadata server and in metrics.
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

/// A tier's slots, cut from its medium `M`: slot `i` is bytes `[i * block_size, (i + 1) *
/// block_size)` of it. Shared by every slot taken, so that the medium outlives them.
pub(crate) struct Slots<M> {
    medium: M,
    tier: Tier,
    block_size: u32,
    count: usize,
    /// Indices of unused slots; used as a stack so recently freed (cache-warm) slots go first.
    free: Mutex<Vec<usize>>,
    used_bytes: AtomicU64,
    /// The crc32c of every whole chunk of every slot, `chunks_per_slot` per slot: set by the
    /// slot's one writer before it publishes a length past the chunk, and never changed while the
    /// slot is held after that.
    chunk_crcs: Box<[AtomicU32]>,
    chunks_per_slot: usize,
}

impl<M> Slots<M> {
    /// `count` slots of `block_size` bytes of `medium`, all free; slot 0 is handed out first.
    pub(crate) fn new(medium: M, tier: Tier, block_size: u32, count: usize) -> Arc<Slots<M>> {
        let free = Mutex::new((0..count).rev().collect());
        let chunks_per_slot = block_size.div_ceil(CRC_CHUNK) as usize;
        let chunk_crcs = (0..count * chunks_per_slot).map(|_| AtomicU32::new(0)).collect();
        let used_bytes = AtomicU64::new(0);
        Arc::new(Slots { medium, tier, block_size, count, free, used_bytes, chunk_crcs, chunks_per_slot })
    }

    pub(crate) fn medium(&self) -> &M {
        &self.medium
    }

    pub(crate) fn block_size(&self) -> u32 {
        self.block_size
    }

    pub(crate) fn count(&self) -> usize {
        self.count
    }

    pub(crate) fn usage(&self) -> Usage {
        let free = self.free.lock().len();
        Usage {
            capacity_bytes: self.count as u64 * u64::from(self.block_size),
            used_bytes: self.used_bytes.load(Ordering::Relaxed),
            capacity_blocks: self.count as u64,
            used_blocks: (self.count - free) as u64,
        }
    }

    /// An empty slot off the free list, or `None` when every slot is in use. A block's slot
    /// (`for_block`) is taken by its first writer and keeps its crc; an appender's does not.
    fn take(self: &Arc<Slots<M>>, for_block: bool) -> Option<Arc<Slot<M>>> {
        let index = self.free.lock().pop()?;
        Some(Arc::new(Slot::new(self.clone(), index, 0, for_block, for_block)))
    }

    /// The listed slots (index, published length) as found at start, off the free list; `None`,
    /// taking nothing, if any of them is not free.
    fn take_listed(self: &Arc<Slots<M>>, listed: &[(usize, u32)]) -> Option<Vec<Arc<Slot<M>>>> {
        let mut free = self.free.lock();
        let wanted: std::collections::HashSet<usize> = listed.iter().map(|&(index, _)| index).collect();
        if wanted.len() != listed.len() || free.iter().filter(|index| wanted.contains(index)).count() != wanted.len() {
            return None;
        }
        free.retain(|index| !wanted.contains(index));
        drop(free);
        let slots = listed.iter().map(|&(index, len)| {
            self.used_bytes.fetch_add(u64::from(len), Ordering::Relaxed);
            Arc::new(Slot::new(self.clone(), index, len, false, false))
        });
        Some(slots.collect())
    }

    fn full(&self) -> StoreError {
        StoreError::Full { tier: self.tier, in_use: self.count, total: self.count }
    }
}

/// One slot, held by a block or an appender; back on the free list when the last holder drops it.
pub(crate) struct Slot<M> {
    slots: Arc<Slots<M>>,
    index: usize,
    /// The published length (low half: every byte below it is written, checked and immutable)
    /// and the crc32c of its last, partial chunk (high half), in one word so that a reader's one
    /// load sees a length and the crc of exactly those bytes.
    published: AtomicU64,
    /// Whether crcs are kept: only for a block written through this table from empty. A slot
    /// restored from a durable index has no crcs of its bytes to start from, and an appender's
    /// extent keeps a checksum per batch instead.
    crc_kept: bool,
    /// Held by the one write in progress (see [`Writer`]); never taken for an appender's slot.
    writing: AtomicBool,
}

/// A read of a block: the bytes, the block's published length, and the bytes' crc32c (from the
/// crcs kept since they were written, as far as [`Slot::crc_of`] can).
#[derive(Debug, Clone)]
pub struct BlockRead {
    pub data: bytes::Bytes,
    pub held: u32,
    pub crc: u32,
}

/// What a reader may read of a slot, from one load: the published length, and the crc32c of
/// the last chunk's published bytes (see [`Slot::crc_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Published {
    pub len: u32,
    tail_crc: u32,
}

impl Published {
    fn unpack(word: u64) -> Published {
        Published { len: word as u32, tail_crc: (word >> 32) as u32 }
    }

    fn pack(self) -> u64 {
        u64::from(self.tail_crc) << 32 | u64::from(self.len)
    }
}

impl<M> Slot<M> {
    fn new(slots: Arc<Slots<M>>, index: usize, len: u32, crc_kept: bool, writing: bool) -> Slot<M> {
        // crc32c of no bytes is 0; a slot restored with bytes keeps no crc.
        debug_assert!(!crc_kept || len == 0);
        Slot { slots, index, published: AtomicU64::new(u64::from(len)), crc_kept, writing: AtomicBool::new(writing) }
    }

    /// Which slot of the medium it is.
    pub(crate) fn index(&self) -> usize {
        self.index
    }

    pub(crate) fn medium(&self) -> &M {
        &self.slots.medium
    }

    pub(crate) fn block_size(&self) -> u32 {
        self.slots.block_size
    }

    /// The published length (Acquire): every byte below it may be read, and the bytes' writes
    /// happen-before this load.
    pub(crate) fn published(&self) -> u32 {
        self.state().len
    }

    /// What is published (Acquire), as [`Slot::published`]; the chunk crcs below its length were
    /// stored before it.
    pub(crate) fn state(&self) -> Published {
        Published::unpack(self.published.load(Ordering::Acquire))
    }

    /// Publishes `added` bytes written right above the published length, the last chunk's crc32c
    /// now being `tail_crc`; only the slot's one writer calls it (a [`Writer`] holding the flag,
    /// or the [`Appender`]), so nothing changes between the load and the store. Returns the new
    /// length.
    fn publish(&self, added: u32, tail_crc: u32) -> u32 {
        let len = Published::unpack(self.published.load(Ordering::Relaxed)).len + added;
        self.slots.used_bytes.fetch_add(u64::from(added), Ordering::Relaxed);
        // Release: the bytes (and chunk crcs) stored before this happen-before any reader's
        // Acquire load of it.
        self.published.store(Published { len, tail_crc }.pack(), Ordering::Release);
        len
    }

    fn chunk_crc(&self, chunk: usize) -> &AtomicU32 {
        &self.slots.chunk_crcs[self.index * self.slots.chunks_per_slot + chunk]
    }

    /// The crc32c of `bytes`, this slot's published bytes from `offset` (read under `published`):
    /// the kept crcs of the chunks they cover whole, combined with crcs taken of the parts of
    /// chunks they cut through (what a slot keeping no crcs takes of all of them).
    pub(crate) fn crc_of(&self, published: Published, offset: u32, bytes: &[u8]) -> u32 {
        if !self.crc_kept {
            return crc32c::crc32c(bytes);
        }
        let (chunk, start, end) = (CRC_CHUNK as usize, offset as usize, offset as usize + bytes.len());
        debug_assert!(end <= published.len as usize, "{start}..{end} read of {} published bytes", published.len);
        let (mut crc, mut at) = (0, start);
        while at < end {
            let (index, within) = (at / chunk, at % chunk);
            let piece_end = ((index + 1) * chunk).min(end);
            crc = if within == 0 && piece_end - at == chunk {
                // Acquire of `published` ordered the store of a whole chunk's crc before it.
                CHUNK_SHIFT.combine(crc, self.chunk_crc(index).load(Ordering::Relaxed))
            } else if within == 0 && piece_end == published.len as usize {
                combine(crc, published.tail_crc, piece_end - at)
            } else {
                combine(crc, crc32c::crc32c(&bytes[at - start..piece_end - start]), piece_end - at)
            };
            at = piece_end;
        }
        crc
    }
}

impl<M> Slot<M> {
    /// Counts `added` bytes published in a piece of this slot (see `dram::pieces`), which keeps
    /// its own length; the tier's used bytes stay the bytes held.
    pub(crate) fn count_piece_bytes(&self, added: u32) {
        self.slots.used_bytes.fetch_add(u64::from(added), Ordering::Relaxed);
    }

    /// Uncounts a freed piece's `len` bytes.
    pub(crate) fn uncount_piece_bytes(&self, len: u32) {
        self.slots.used_bytes.fetch_sub(u64::from(len), Ordering::Relaxed);
    }
}

impl<M> Drop for Slot<M> {
    fn drop(&mut self) {
        // The last reference is gone: no reader or writer can touch these bytes any more.
        self.slots.used_bytes.fetch_sub(u64::from(*self.published.get_mut() as u32), Ordering::Relaxed);
        self.slots.free.lock().push(self.index);
    }
}

/// The blocks of one tier: which slot each holds.
pub(crate) struct BlockTable<M> {
    slots: Arc<Slots<M>>,
    blocks: Mutex<HashMap<BlockId, Arc<Slot<M>>>>,
}

/// A block a tier found at start (from its durable index): its slot and published length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Restored {
    pub block: BlockId,
    pub slot: usize,
    pub len: u32,
}

impl<M> BlockTable<M> {
    /// An empty table over `slots`.
    pub(crate) fn new(slots: Arc<Slots<M>>) -> BlockTable<M> {
        let blocks = Mutex::new(HashMap::with_capacity(slots.count));
        BlockTable { slots, blocks }
    }

    pub(crate) fn slots(&self) -> &Arc<Slots<M>> {
        &self.slots
    }

    pub(crate) fn usage(&self) -> Usage {
        self.slots.usage()
    }

    /// Takes back blocks found at start, before any op: their slots leave the free list. `Err`
    /// names a block listed twice.
    pub(crate) fn restore(&self, found: &[Restored]) -> Result<(), BlockId> {
        let mut blocks = self.blocks.lock();
        let mut free = self.slots.free.lock();
        let taken: std::collections::HashSet<usize> = found.iter().map(|r| r.slot).collect();
        free.retain(|slot| !taken.contains(slot));
        drop(free);
        for r in found {
            let slot = Arc::new(Slot::new(self.slots.clone(), r.slot, r.len, false, false));
            self.slots.used_bytes.fetch_add(u64::from(r.len), Ordering::Relaxed);
            if blocks.insert(r.block, slot).is_some() {
                return Err(r.block);
            }
        }
        Ok(())
    }

    /// Validates an append of `len` bytes at `offset` to `block` (creating the block on its first
    /// write) and reserves it for this writer. `table` is how the writer reaches the table again
    /// (a borrow, or an `Arc` for a write that outlives its caller).
    pub(crate) fn begin_write<T>(table: T, block: BlockId, offset: u32, len: u32) -> Result<Writer<M, T>, StoreError>
    where
        T: Deref<Target = BlockTable<M>>,
    {
        let block_size = table.slots.block_size;
        let check = |held: u32| {
            if offset != held {
                return Err(StoreError::NotAppend { block, offset, held });
            }
            if u64::from(offset) + u64::from(len) > u64::from(block_size) {
                return Err(StoreError::PastBlockEnd { block, offset, len, block_size });
            }
            Ok(())
        };
        let (slot, created) = {
            let mut blocks = table.blocks.lock();
            match blocks.get(&block) {
                Some(slot) => {
                    if slot.writing.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
                        return Err(StoreError::WriteInProgress { block });
                    }
                    // Only writers change the length, and this one now holds the writer flag.
                    if let Err(e) = check(slot.published()) {
                        slot.writing.store(false, Ordering::Release);
                        return Err(e);
                    }
                    (slot.clone(), false)
                }
                None => {
                    check(0)?;
                    let slot = table.slots.take(true).ok_or_else(|| table.slots.full())?;
                    blocks.insert(block, slot.clone());
                    (slot, true)
                }
            }
        };
        Ok(Writer { table, block, slot, offset, len, created, verified: None, published: false })
    }

    /// The slot holding `block` and what is published of it, once the range `offset+len` is
    /// checked to lie below its length. The slot is held (not reusable) while the caller keeps it.
    pub(crate) fn read(
        &self,
        block: BlockId,
        offset: u32,
        len: u32,
        server: ServerId,
    ) -> Result<(Arc<Slot<M>>, Published), StoreError> {
        let slot = self.blocks.lock().get(&block).cloned();
        let Some(slot) = slot else {
            return Err(StoreError::NotHeld { block, server });
        };
        let published = slot.state();
        if u64::from(offset) + u64::from(len) > u64::from(published.len) {
            return Err(StoreError::ReadOutOfRange { block, offset, len, held: published.len });
        }
        Ok((slot, published))
    }

    /// Removes the listed blocks (ids not held are skipped) and hands back their slots; each goes
    /// back to the free list as the caller drops it, outside the map lock (unless a read still
    /// holds it).
    pub(crate) fn free(&self, ids: &[BlockId]) -> Vec<Arc<Slot<M>>> {
        let mut blocks = self.blocks.lock();
        ids.iter().filter_map(|id| blocks.remove(id)).collect()
    }

    /// The blocks it holds.
    pub(crate) fn ids(&self) -> Vec<BlockId> {
        self.blocks.lock().keys().copied().collect()
    }

    /// Drops every block; returns how many were held.
    pub(crate) fn clear(&self) -> usize {
        let removed = std::mem::take(&mut *self.blocks.lock());
        removed.len()
    }
}

/// A write under way: its block is reserved for it (the writer flag) and its range checked. The
/// tier puts the payload in place, then [`Writer::verify`]s and [`Writer::publish`]es it.
/// Dropped unpublished, nothing becomes visible, and a block it created is withdrawn.
pub(crate) struct Writer<M, T: Deref<Target = BlockTable<M>>> {
    table: T,
    block: BlockId,
    slot: Arc<Slot<M>>,
    offset: u32,
    len: u32,
    created: bool,
    /// The last chunk's crc32c with the payload, once [`Writer::verify`] found the payload's crc
    /// to be the frame's.
    verified: Option<u32>,
    published: bool,
}

impl<M, T: Deref<Target = BlockTable<M>>> Writer<M, T> {
    pub(crate) fn block(&self) -> BlockId {
        self.block
    }

    /// The slot written; nothing at or above `offset` in it is read until published.
    pub(crate) fn slot(&self) -> &Arc<Slot<M>> {
        &self.slot
    }

    pub(crate) fn offset(&self) -> u32 {
        self.offset
    }

    pub(crate) fn len(&self) -> u32 {
        self.len
    }

    /// Checks the crc32c of the `payload` as it lies in place against the frame's (`expected`),
    /// keeping the crcs of the chunks it fills on the way: one pass over the bytes for both.
    pub(crate) fn verify(&mut self, payload: &[u8], expected: u32) -> Result<(), StoreError> {
        debug_assert_eq!(payload.len(), self.len as usize);
        let chunk = CRC_CHUNK as usize;
        // This write holds the writer flag: the published word is its own to read Relaxed.
        let mut tail = Published::unpack(self.slot.published.load(Ordering::Relaxed)).tail_crc;
        let (mut actual, mut at, mut rest) = (0, self.offset as usize, payload);
        while !rest.is_empty() {
            let (piece, more) = rest.split_at((chunk - at % chunk).min(rest.len()));
            let crc = crc32c::crc32c(piece);
            actual = combine(actual, crc, piece.len());
            tail = combine(tail, crc, piece.len());
            at += piece.len();
            if at % chunk == 0 && self.slot.crc_kept {
                // A chunk at or above the published length: no reader loads its crc before the
                // publication of a length past it, and a write that fails its check leaves a
                // value the next write to it replaces.
                self.slot.chunk_crc(at / chunk - 1).store(tail, Ordering::Relaxed);
                tail = 0;
            }
            rest = more;
        }
        if actual != expected {
            return Err(StoreError::Corrupt {
                block: self.block,
                offset: self.offset,
                len: self.len,
                expected,
                actual,
            });
        }
        self.verified = Some(if at % chunk == 0 { 0 } else { tail });
        Ok(())
    }

    /// Publishes the payload, which must be in place and verified; returns the block's new length.
    pub(crate) fn publish(&mut self) -> u32 {
        let tail_crc = self.verified.expect("a write is verified before it is published");
        let new_len = self.slot.publish(self.len, tail_crc);
        self.published = true;
        new_len
    }

    /// An I/O error of this write, for tiers whose medium can fail.
    pub(crate) fn io_error(&self, op: &'static str, error: impl ToString) -> StoreError {
        StoreError::Io { block: self.block, offset: self.offset, len: self.len, op, error: error.to_string() }
    }
}

impl<M, T: Deref<Target = BlockTable<M>>> Drop for Writer<M, T> {
    fn drop(&mut self) {
        if self.published || !self.created {
            self.slot.writing.store(false, Ordering::Release);
            return;
        }
        // The block's first write failed: withdraw the empty block (if it is still ours),
        // atomically with releasing the writer flag so that no other writer can have put bytes in
        // it meanwhile. The block is dropped outside the map lock.
        let withdrawn = {
            let mut blocks = self.table.blocks.lock();
            let ours = blocks.get(&self.block).is_some_and(|held| Arc::ptr_eq(held, &self.slot));
            let withdrawn = if ours { blocks.remove(&self.block) } else { None };
            self.slot.writing.store(false, Ordering::Release);
            withdrawn
        };
        drop(withdrawn);
    }
}

/// A slot with exactly one appender and no block id: how a shuffle segment holds its slots. Only
/// the holder of `&mut Appender` writes (the segment's lock serialises its pushes), always above
/// the published length, so no writer flag is needed. Not `Clone`: there is never a second one.
pub(crate) struct Appender<M> {
    slot: Arc<Slot<M>>,
}

impl<M> Appender<M> {
    /// An empty slot off the free list, or `None` when the tier is full.
    pub(crate) fn take(slots: &Arc<Slots<M>>) -> Option<Appender<M>> {
        slots.take(false).map(|slot| Appender { slot })
    }

    /// The listed slots (index, length) found at start, each with its appender; `None`, taking
    /// nothing, if any of them is not free.
    pub(crate) fn take_listed(slots: &Arc<Slots<M>>, listed: &[(usize, u32)]) -> Option<Vec<Appender<M>>> {
        Some(slots.take_listed(listed)?.into_iter().map(|slot| Appender { slot }).collect())
    }

    /// The slot; bytes at or above [`Appender::len`] are this appender's alone.
    pub(crate) fn slot(&self) -> &Arc<Slot<M>> {
        &self.slot
    }

    /// Bytes appended so far.
    pub(crate) fn len(&self) -> u32 {
        // Only this appender stores the length.
        self.slot.published.load(Ordering::Relaxed) as u32
    }

    /// Bytes still free at the end of the slot.
    pub(crate) fn room(&self) -> u32 {
        self.slot.block_size() - self.len()
    }

    /// Publishes `added` bytes written at [`Appender::len`]; returns the new length.
    pub(crate) fn publish(&mut self, added: u32) -> u32 {
        assert!(added <= self.room(), "publishing {added} bytes of a slot with {} bytes of room", self.room());
        // An appender's slot keeps no crcs (its batches carry theirs).
        self.slot.publish(added, 0)
    }
}
