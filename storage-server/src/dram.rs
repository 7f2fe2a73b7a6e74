//! The DRAM tier: the arena cut into block-size slots, held by blocks through the
//! [`BlockTable`] (whose rules make reads lock-free on the data) and by shuffle segments through
//! [`AppendSlot`], so file blocks and shuffle data share one arena and one capacity count.
//!
//! What this tier adds to the table is the bytes: writes land straight in the arena (a Write's
//! payload is read from the socket into it) and reads are views of it, never copies.

use std::sync::Arc;

use anyhow::bail;
use bytes::Bytes;
use tern_proto::{BlockId, ServerId, Tier};

use crate::arena::Arena;
use crate::block_table::{Appender, BlockRead, BlockTable, Slot, Slots, StoreError, Usage, Writer};
use pieces::Piece;
pub(crate) use pieces::Pieces;

pub(crate) mod pieces;

/// The DRAM tier's slots: shuffle segments take theirs from the same ones as blocks.
pub(crate) type DramSlots = Slots<Arena>;

impl Slot<Arena> {
    /// Pointer to byte `offset` of this slot.
    fn ptr(&self, offset: u32) -> *mut u8 {
        let block_size = self.block_size();
        assert!(offset <= block_size, "offset {offset} past block size {block_size}");
        let at = self.index() * block_size as usize + offset as usize;
        debug_assert!(at <= self.medium().len());
        // SAFETY: index < slots and slots * block_size <= arena length (checked when the tier was
        // cut), and offset <= block_size, so `at` is within the mapping or one past its end.
        unsafe { self.medium().base().add(at) }
    }
}

/// Published bytes of a slot, kept alive (and the slot out of the free list) while referenced.
struct SlotView {
    slot: Arc<Slot<Arena>>,
    offset: u32,
    len: u32,
}

impl SlotView {
    /// The published bytes `[offset, offset + len)` of `slot` as `Bytes`, without copying.
    /// Callers have checked the range against the slot's published length (an Acquire load).
    fn bytes(slot: Arc<Slot<Arena>>, offset: u32, len: u32) -> Bytes {
        if len == 0 {
            return Bytes::new();
        }
        Bytes::from_owner(SlotView { slot, offset, len })
    }
}

impl AsRef<[u8]> for SlotView {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the range lies below the slot's published length (checked by the block table's
        // `read` and by `AppendSlot::view`), so its bytes were fully written before the Release
        // store that published them, which that Acquire load observed; published bytes are never
        // written again while the slot lives, and `self.slot` keeps it alive. Readers only ever
        // form shared slices, so this aliases nothing mutable.
        unsafe { std::slice::from_raw_parts(self.slot.ptr(self.offset), self.len as usize) }
    }
}

/// A shuffle segment's extent in the arena: a whole slot (the block table's [`Appender`]), or a
/// piece of one (see [`pieces`]). Views of published bytes may be taken and outlive it, like
/// block reads, and keep its bytes from reuse.
pub(crate) enum AppendSlot {
    Whole(Appender<Arena>),
    Piece(Arc<Piece>),
}

impl AppendSlot {
    /// An empty slot off the tier's free list, or `None` when the tier is full.
    pub(crate) fn take(slots: &Arc<DramSlots>) -> Option<AppendSlot> {
        Appender::take(slots).map(AppendSlot::Whole)
    }

    /// An empty piece, or `None` when that size has none to give.
    pub(crate) fn take_piece(pieces: &Arc<Pieces>) -> Option<AppendSlot> {
        pieces.take().map(|piece| AppendSlot::Piece(Arc::new(piece)))
    }

    /// Bytes it holds when full.
    pub(crate) fn capacity(&self) -> u32 {
        match self {
            AppendSlot::Whole(appender) => appender.slot().block_size(),
            AppendSlot::Piece(piece) => piece.capacity(),
        }
    }

    /// Bytes still free at the end of it.
    pub(crate) fn room(&self) -> u32 {
        self.capacity() - self.len()
    }

    /// Bytes appended so far.
    pub(crate) fn len(&self) -> u32 {
        match self {
            AppendSlot::Whole(appender) => appender.len(),
            AppendSlot::Piece(piece) => piece.published(),
        }
    }

    /// The slot and the offset in it of byte `offset` of this extent.
    fn at(&self, offset: u32) -> (&Arc<Slot<Arena>>, u32) {
        match self {
            AppendSlot::Whole(appender) => (appender.slot(), offset),
            AppendSlot::Piece(piece) => piece.at(offset),
        }
    }

    /// Appends a batch as it is served, `[header | data]` with `header = head(crc of data)`, and
    /// publishes both at once; returns the data's offset in the extent and its crc32c as stored.
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
            panic!("append of {H}+{} bytes to an extent with {} bytes of room", data.len(), self.room());
        };
        let (slot, at) = self.at(offset);
        // SAFETY: `[offset, offset + total)` lies within the extent (`total <= room`) and at or
        // above its published length, so no view covers it, and `&mut self` makes this the only
        // writer (a piece's bytes are its alone). `data` cannot overlap it: any slice of arena
        // bytes is of published bytes. `dst` is last used before the bytes are published.
        let dst = unsafe { std::slice::from_raw_parts_mut(slot.ptr(at), total as usize) };
        let (header, body) = dst.split_at_mut(H);
        body.copy_from_slice(data);
        // Taken over the arena bytes, so reads can check the bytes at rest, not only in flight.
        let crc = crc32c::crc32c(body);
        header.copy_from_slice(&head(crc));
        match self {
            AppendSlot::Whole(appender) => {
                appender.publish(total);
            }
            AppendSlot::Piece(piece) => piece.publish(total),
        }
        (offset + H as u32, crc)
    }

    /// The published bytes `[offset, offset + len)`, without copying; they keep the extent from
    /// reuse until dropped.
    pub(crate) fn view(&self, offset: u32, len: u32) -> Bytes {
        let held = self.len();
        assert!(
            u64::from(offset) + u64::from(len) <= u64::from(held),
            "view {offset}+{len} of an extent holding {held} bytes"
        );
        match self {
            AppendSlot::Whole(appender) => SlotView::bytes(appender.slot().clone(), offset, len),
            AppendSlot::Piece(_) if len == 0 => Bytes::new(),
            AppendSlot::Piece(piece) => Bytes::from_owner(PieceView { piece: piece.clone(), offset, len }),
        }
    }

    /// Test hook: flips one published byte, as a fault in DRAM would.
    #[cfg(test)]
    pub(crate) fn flip_byte(&mut self, offset: u32) {
        assert!(offset < self.len(), "offset {offset} is not a published byte");
        let holders = match self {
            AppendSlot::Whole(appender) => Arc::strong_count(appender.slot()),
            AppendSlot::Piece(piece) => Arc::strong_count(piece),
        };
        assert_eq!(holders, 1, "a view of this extent is still alive");
        let (slot, at) = self.at(offset);
        // SAFETY: the byte is within the extent; this `AppendSlot` holds the only reference to it
        // (checked above, and `&mut self` stops a view being taken meanwhile), so no slice of it
        // exists anywhere.
        unsafe { *slot.ptr(at) ^= 0xff };
    }
}

/// Published bytes of a piece, kept alive (and the piece out of its free list) while referenced.
struct PieceView {
    piece: Arc<Piece>,
    offset: u32,
    len: u32,
}

impl AsRef<[u8]> for PieceView {
    fn as_ref(&self) -> &[u8] {
        let (slot, at) = self.piece.at(self.offset);
        // SAFETY: as for `SlotView`: the range lies below the piece's published length (checked by
        // `AppendSlot::view` after an Acquire load), its bytes are never written again while the
        // piece lives, and `self.piece` keeps it alive.
        unsafe { std::slice::from_raw_parts(slot.ptr(at), self.len as usize) }
    }
}

/// A write under way: the block is validated and reserved for one writer; the payload goes
/// straight into [`DramWrite::buf`], then [`DramWrite::commit`] checks and publishes it.
/// Dropped without a successful commit, nothing is published (and a block it created is removed).
pub struct DramWrite<'a> {
    writer: Writer<Arena, &'a BlockTable<Arena>>,
}

impl DramWrite<'_> {
    /// The arena bytes the payload goes into.
    pub fn buf(&mut self) -> &mut [u8] {
        let (offset, len) = (self.writer.offset(), self.writer.len());
        // SAFETY: `[offset, offset + len)` lies within the slot (checked in `begin_write`) and at
        // or above its published length, so no reader touches it; this write holds the slot's
        // writer flag, so no other writer does; `&mut self` makes this the only slice of it.
        unsafe { std::slice::from_raw_parts_mut(self.writer.slot().ptr(offset), len as usize) }
    }

    /// Checks the written bytes against the frame's crc32c and publishes them; returns the block's
    /// new length.
    pub fn commit(mut self, payload_crc: u32) -> Result<u32, StoreError> {
        let (offset, len) = (self.writer.offset(), self.writer.len());
        // SAFETY: as in `buf`; the slice is shared, and the writer flag keeps every other writer out.
        let payload = unsafe { std::slice::from_raw_parts(self.writer.slot().ptr(offset), len as usize) };
        self.writer.verify(payload, payload_crc)?;
        Ok(self.writer.publish())
    }
}

/// The DRAM tier: blocks of one fixed size in one arena.
pub struct DramTier {
    table: BlockTable<Arena>,
}

impl DramTier {
    /// A tier of `floor(dram / block_size)` blocks in a fresh arena (not prefaulted, small
    /// pages): for tests and tools. Servers map their arena at start-up and cut it once
    /// registered.
    pub fn new(block_size: u32, dram: u64) -> anyhow::Result<DramTier> {
        DramTier::with_arena(Arena::map(dram, false, false)?, block_size)
    }

    /// Cuts `arena` into blocks of `block_size`.
    pub(crate) fn with_arena(arena: Arena, block_size: u32) -> anyhow::Result<DramTier> {
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
        Ok(DramTier { table: BlockTable::new(Slots::new(arena, Tier::Dram, block_size, slots)) })
    }

    pub fn block_size(&self) -> u32 {
        self.table.slots().block_size()
    }

    /// The slots, which shuffle segments take theirs from.
    pub(crate) fn slots(&self) -> &Arc<DramSlots> {
        self.table.slots()
    }

    pub fn usage(&self) -> Usage {
        self.table.usage()
    }

    /// Validates an append of `len` bytes at `offset` to `block` (creating the block on its first
    /// write) and reserves it for this writer.
    pub fn begin_write(&self, block: BlockId, offset: u32, len: u32) -> Result<DramWrite<'_>, StoreError> {
        Ok(DramWrite { writer: BlockTable::begin_write(&self.table, block, offset, len)? })
    }

    /// `len` bytes of `block` from `offset`, without copying, with the block's length and their
    /// crc32c (from the crcs kept since they were written). The returned bytes keep the slot from
    /// reuse until dropped. `server` names this server in a not-held error.
    pub fn read(&self, block: BlockId, offset: u32, len: u32, server: ServerId) -> Result<BlockRead, StoreError> {
        let (slot, published) = self.table.read(block, offset, len, server)?;
        let data = SlotView::bytes(slot.clone(), offset, len);
        let crc = slot.crc_of(published, offset, &data);
        Ok(BlockRead { data, held: published.len, crc })
    }

    /// Every published byte of `block`, without copying (what a same-host lease lends), and their
    /// crc32c; the returned bytes keep the slot from reuse until dropped.
    pub fn read_published(&self, block: BlockId, server: ServerId) -> Result<BlockRead, StoreError> {
        let (slot, published) = self.table.read(block, 0, 0, server)?;
        let data = SlotView::bytes(slot.clone(), 0, published.len);
        let crc = slot.crc_of(published, 0, &data);
        Ok(BlockRead { data, held: published.len, crc })
    }

    /// Test hook: flips a published byte of `block`, as a fault in DRAM would.
    #[cfg(test)]
    pub(crate) fn rot(&self, block: BlockId, offset: u32) {
        let (slot, published) = self.table.read(block, offset, 1, ServerId::from_wire(0)).unwrap();
        assert!(offset < published.len);
        assert_eq!(Arc::strong_count(&slot), 2, "a view of block {} is alive", block.get());
        // SAFETY: the byte lies in the slot; no view of it is alive (checked above; the table's
        // reference hands out none while the test holds the tier), so no slice of it exists.
        unsafe { *slot.ptr(offset) ^= 0xff };
    }

    /// Drops the listed blocks (ids not held are skipped); returns how many were held.
    pub fn free(&self, ids: &[BlockId]) -> usize {
        // Slots go back to the free list as these drop, outside the map lock.
        self.table.free(ids).len()
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

#[cfg(test)]
mod tests {
    use tern_proto::ErrorKind;

    use super::*;

    const BS: u32 = 4096;
    /// The server named in not-held errors.
    const SERVER: ServerId = ServerId::from_wire(42);

    fn id(block: u64) -> BlockId {
        BlockId::from_wire(block)
    }

    fn get(store: &DramTier, block: u64, offset: u32, len: u32) -> Result<(Bytes, u32), StoreError> {
        store.read(id(block), offset, len, SERVER).map(|read| (read.data, read.held))
    }

    fn write(store: &DramTier, block: u64, offset: u32, data: &[u8]) -> Result<u32, StoreError> {
        let mut pending = store.begin_write(id(block), offset, data.len() as u32)?;
        pending.buf().copy_from_slice(data);
        pending.commit(crc32c::crc32c(data))
    }

    fn read(store: &DramTier, block: u64, offset: u32, len: u32) -> Result<Vec<u8>, StoreError> {
        get(store, block, offset, len).map(|(bytes, _)| bytes.to_vec())
    }

    #[test]
    fn reads_carry_the_crcs_kept_since_the_writes_and_so_catch_rot_at_rest() {
        use crate::block_table::CRC_CHUNK;
        let chunk = CRC_CHUNK as usize;
        let store = DramTier::new(5 * CRC_CHUNK, 2 * 5 * u64::from(CRC_CHUNK)).unwrap();
        // Appends of odd sizes, across chunk boundaries, ending inside the fourth chunk.
        let data: Vec<u8> = (0..3 * chunk + 1000).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut at = 0;
        for len in [1, chunk - 1, 1000, chunk + 5, data.len() - 1 - (chunk - 1) - 1000 - (chunk + 5)] {
            write(&store, 1, at as u32, &data[at..at + len]).unwrap();
            at += len;
        }
        assert_eq!(at, data.len());
        let ranges =
            [(0, data.len()), (0, chunk), (chunk, 2 * chunk), (10, 2 * chunk), (chunk, data.len() - chunk), (5, 6)];
        let crc = |offset: usize, len: usize| store.read(id(1), offset as u32, len as u32, SERVER).unwrap().crc;
        for (offset, len) in ranges.iter().chain(&[(3 * chunk, 1000), (data.len(), 0), (3 * chunk + 1, 999)]) {
            assert_eq!(crc(*offset, *len), crc32c::crc32c(&data[*offset..offset + len]), "{offset}+{len}");
        }
        assert_eq!(store.read_published(id(1), SERVER).unwrap().crc, crc32c::crc32c(&data));
        // A write whose crc does not match changes neither the bytes nor the kept crcs.
        let mut pending = store.begin_write(id(1), data.len() as u32, chunk as u32).unwrap();
        pending.buf().fill(9);
        assert!(pending.commit(0).is_err());
        assert_eq!(crc(0, data.len()), crc32c::crc32c(&data));

        // A byte of the second chunk rots in DRAM: every read that covers that chunk whole
        // replies with the crc it was written with, which the rotted bytes no longer match; a read
        // that cuts through it is checksummed as it is sent, so it cannot tell.
        store.rot(id(1), (chunk + 100) as u32);
        let sent = |offset: usize, len: usize| {
            let read = store.read(id(1), offset as u32, len as u32, SERVER).unwrap();
            read.crc == crc32c::crc32c(&read.data)
        };
        assert!(!sent(0, data.len()) && !sent(chunk, chunk) && !sent(10, 2 * chunk));
        assert!(sent(0, chunk) && sent(2 * chunk, chunk + 1000) && sent(chunk + 50, 100));
    }

    #[test]
    fn appends_and_reads_back() {
        let store = DramTier::new(BS, 4 * BS as u64).unwrap();
        assert_eq!(write(&store, 7, 0, b"hello ").unwrap(), 6);
        assert_eq!(write(&store, 7, 6, b"world").unwrap(), 11);
        assert_eq!(read(&store, 7, 0, 11).unwrap(), b"hello world");
        assert_eq!(read(&store, 7, 6, 5).unwrap(), b"world");
        assert_eq!(get(&store, 7, 11, 0).unwrap(), (Bytes::new(), 11));
        let usage = store.usage();
        assert_eq!(usage, Usage { capacity_bytes: 4 * BS as u64, used_bytes: 11, capacity_blocks: 4, used_blocks: 1 });
        // A full block.
        let full = vec![0xabu8; BS as usize];
        assert_eq!(write(&store, 8, 0, &full).unwrap(), BS);
        assert_eq!(read(&store, 8, 0, BS).unwrap(), full);
    }

    #[test]
    fn writes_must_append_within_the_block() {
        let store = DramTier::new(BS, 4 * BS as u64).unwrap();
        write(&store, 1, 0, b"abc").unwrap();
        let err = write(&store, 1, 0, b"x").unwrap_err();
        assert_eq!(err, StoreError::NotAppend { block: id(1), offset: 0, held: 3 });
        assert!(err.to_string().contains("append-only"), "{err}");
        assert_eq!(write(&store, 1, 5, b"x").unwrap_err(), StoreError::NotAppend { block: id(1), offset: 5, held: 3 });
        let err = write(&store, 1, 3, &vec![0u8; BS as usize]).unwrap_err();
        assert_eq!(err, StoreError::PastBlockEnd { block: id(1), offset: 3, len: BS, block_size: BS });
        assert_eq!(err.kind(), ErrorKind::Invalid);
        // A first write at a non-zero offset creates nothing.
        assert!(matches!(write(&store, 2, 10, b"x"), Err(StoreError::NotAppend { held: 0, .. })));
        assert!(matches!(get(&store, 2, 0, 0), Err(StoreError::NotHeld { .. })));
        assert_eq!(read(&store, 1, 0, 3).unwrap(), b"abc");
    }

    #[test]
    fn reads_stay_inside_published_bytes() {
        let store = DramTier::new(BS, BS as u64).unwrap();
        let err = get(&store, 9, 0, 1).unwrap_err();
        assert_eq!(err.to_string(), "block 9 is not held by storage server 42");
        assert_eq!(err.kind(), ErrorKind::NotFound);
        write(&store, 9, 0, b"0123456789").unwrap();
        let err = get(&store, 9, 8, 3).unwrap_err();
        assert_eq!(err, StoreError::ReadOutOfRange { block: id(9), offset: 8, len: 3, held: 10 });
        assert_eq!(err.to_string(), "read of block 9 range 8+3 is outside the block (it holds 10 bytes)");
        // Offsets near u32::MAX must not wrap around.
        assert!(matches!(get(&store, 9, u32::MAX, 2), Err(StoreError::ReadOutOfRange { .. })));
        assert!(matches!(write(&store, 9, 10, b""), Ok(10)));
        assert!(matches!(store.begin_write(id(9), 10, u32::MAX).map(|_| ()), Err(StoreError::PastBlockEnd { .. })));
    }

    #[test]
    fn a_full_tier_says_so() {
        let store = DramTier::new(BS, 2 * BS as u64 + 100).unwrap();
        write(&store, 1, 0, b"a").unwrap();
        write(&store, 2, 0, b"b").unwrap();
        let err = write(&store, 3, 0, b"c").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfSpace);
        assert_eq!(err.to_string(), "dram tier full: 2 of 2 blocks in use");
        // Appending to a held block still works, and freeing makes room.
        write(&store, 1, 1, b"a").unwrap();
        assert_eq!(store.free(&[id(1), id(99)]), 1);
        write(&store, 3, 0, b"c").unwrap();
        assert_eq!(store.usage().used_blocks, 2);
        assert_eq!(store.usage().used_bytes, 2);
    }

    #[test]
    fn freed_blocks_stay_intact_while_a_read_holds_them() {
        let store = DramTier::new(BS, BS as u64).unwrap();
        let data: Vec<u8> = (0..BS).map(|i| i as u8).collect();
        write(&store, 1, 0, &data).unwrap();
        let (view, held) = get(&store, 1, 0, BS).unwrap();
        assert_eq!(held, BS);
        assert_eq!(store.free(&[id(1)]), 1);
        assert!(matches!(get(&store, 1, 0, 1), Err(StoreError::NotHeld { .. })));
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
    fn bad_checksums_publish_nothing() {
        let store = DramTier::new(BS, BS as u64).unwrap();
        // A failed first write leaves no block behind.
        let mut pending = store.begin_write(id(5), 0, 4).unwrap();
        pending.buf().copy_from_slice(b"abcd");
        let err = pending.commit(crc32c::crc32c(b"abcx")).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
        assert!(err.to_string().contains("block 5 range 0+4"), "{err}");
        assert!(matches!(get(&store, 5, 0, 0), Err(StoreError::NotHeld { .. })));
        assert_eq!(store.usage().used_blocks, 0);
        // A failed append leaves the block as it was, ready for a retry at the same offset.
        write(&store, 5, 0, b"abcd").unwrap();
        let mut pending = store.begin_write(id(5), 4, 2).unwrap();
        pending.buf().copy_from_slice(b"ef");
        assert!(pending.commit(0).is_err());
        assert_eq!(get(&store, 5, 0, 4).unwrap().1, 4);
        assert!(matches!(get(&store, 5, 0, 5), Err(StoreError::ReadOutOfRange { held: 4, .. })));
        assert_eq!(store.usage().used_bytes, 4);
        assert_eq!(write(&store, 5, 4, b"ef").unwrap(), 6);
        assert_eq!(read(&store, 5, 0, 6).unwrap(), b"abcdef");
    }

    #[test]
    fn one_writer_per_block() {
        let store = DramTier::new(BS, 2 * BS as u64).unwrap();
        let first = store.begin_write(id(1), 0, 2).unwrap();
        assert_eq!(
            store.begin_write(id(1), 0, 2).map(|_| ()).unwrap_err(),
            StoreError::WriteInProgress { block: id(1) }
        );
        // Abandoned (the connection died mid-payload): the block it created is withdrawn.
        drop(first);
        assert!(matches!(get(&store, 1, 0, 0), Err(StoreError::NotHeld { .. })));
        assert_eq!(write(&store, 1, 0, b"ok").unwrap(), 2);
        // A refused append releases the writer flag.
        assert!(store.begin_write(id(1), 0, 1).is_err());
        assert_eq!(write(&store, 1, 2, b"!").unwrap(), 3);
    }

    #[test]
    fn concurrent_readers_see_only_published_bytes() {
        let store = Arc::new(DramTier::new(BS, BS as u64).unwrap());
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
            if let Ok((bytes, held)) = get(&store, 1, 0, 0) {
                assert!(bytes.is_empty());
                let (data, _) = get(&store, 1, 0, held).unwrap();
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
        assert!(DramTier::new(100, 1 << 20).is_err());
        let err = DramTier::new(BS, BS as u64 - 1).err().unwrap().to_string();
        assert!(err.contains("smaller than one block"), "{err}");
    }
}
