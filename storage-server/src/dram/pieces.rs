//! Pieces of DRAM slots, for the first extents of shuffle segments.
//!
//! Most partitions of a shuffle hold far less than a block: a Spark SQL query's shuffle has 200
//! partitions of a few KiB each. With a whole slot as a segment's smallest unit, such a shuffle
//! takes 200 MiB however little it holds, and a long application's live shuffles fill a cluster
//! many times larger than their bytes. So a segment's first extents are pieces of slots, sized
//! up as the partition grows (see [`PIECE_SHARES`]), and only then whole slots.
//!
//! A slot cut into pieces goes back to the tier when its last piece is freed; a piece is freed
//! when its last holder (the segment, or a view a fetch still reads) drops it, so no piece is
//! reused under a reader. Each size cuts at most [`MAX_CUT_SHARE`] of the tier's slots, so most
//! of DRAM stays in whole slots, the unit the mover writes down to NVMe.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::DramSlots;
use crate::arena::Arena;
use crate::block_table::{Appender, Slot};

/// A segment's extent `n` is a piece of `1 / PIECE_SHARES[n]` of a slot; later ones are whole.
pub(crate) const PIECE_SHARES: [u32; 2] = [64, 8];
/// Pieces smaller than this are not cut (a tier of small blocks uses whole slots).
const MIN_PIECE_BYTES: u32 = 4 << 10;
/// Each piece size cuts at most this share of the tier's slots.
const MAX_CUT_SHARE: usize = 8;

/// The pieces of one size: slots cut into them, and which are free.
pub(crate) struct Pieces {
    slots: Arc<DramSlots>,
    piece_bytes: u32,
    per_slot: u32,
    max_cut: usize,
    cut: Mutex<Cut>,
}

#[derive(Default)]
struct Cut {
    slots: HashMap<usize, CutSlot>,
    /// Cut slots with a free piece, by slot index: the lowest goes first, so pieces gather in
    /// few slots and emptied ones go back to the tier.
    with_free: BTreeSet<usize>,
}

struct CutSlot {
    /// Holds the slot off the tier's free list while any piece of it is in use.
    appender: Appender<Arena>,
    free: Vec<u32>,
}

impl Pieces {
    /// The pieces for each extent that [`PIECE_SHARES`] names and this tier's block size allows.
    pub(crate) fn for_tier(slots: &Arc<DramSlots>) -> Vec<Arc<Pieces>> {
        let max_cut = slots.count() / MAX_CUT_SHARE;
        PIECE_SHARES
            .iter()
            .map(|share| slots.block_size() / share)
            .take_while(|&piece_bytes| piece_bytes >= MIN_PIECE_BYTES && max_cut > 0)
            .map(|piece_bytes| {
                Arc::new(Pieces {
                    slots: slots.clone(),
                    piece_bytes,
                    per_slot: slots.block_size() / piece_bytes,
                    max_cut,
                    cut: Mutex::new(Cut::default()),
                })
            })
            .collect()
    }

    pub(crate) fn piece_bytes(&self) -> u32 {
        self.piece_bytes
    }

    /// A free piece: of a slot already cut, or of a newly cut one; `None` when this size has cut
    /// its share of slots and all their pieces are in use, or the tier is full.
    pub(crate) fn take(self: &Arc<Pieces>) -> Option<Piece> {
        let mut cut = self.cut.lock();
        let index = match cut.with_free.first() {
            Some(&index) => index,
            None if cut.slots.len() < self.max_cut => {
                let appender = Appender::take(&self.slots)?;
                let index = appender.slot().index();
                cut.slots.insert(index, CutSlot { appender, free: (0..self.per_slot).rev().collect() });
                cut.with_free.insert(index);
                index
            }
            None => return None,
        };
        let cut_slot = cut.slots.get_mut(&index).expect("listed as having a free piece");
        let piece = cut_slot.free.pop().expect("listed as having a free piece");
        let slot = cut_slot.appender.slot().clone();
        if cut_slot.free.is_empty() {
            cut.with_free.remove(&index);
        }
        Some(Piece { pieces: self.clone(), slot, base: piece * self.piece_bytes, len: AtomicU32::new(0) })
    }

    /// Slots cut into pieces of this size (test hook).
    #[cfg(test)]
    pub(crate) fn slots_cut(&self) -> usize {
        self.cut.lock().slots.len()
    }
}

/// One piece of a slot: bytes `[base, base + piece_bytes)` of it, appended to by one
/// `AppendSlot` and read through views; free again when the last holder drops it.
pub(crate) struct Piece {
    pieces: Arc<Pieces>,
    slot: Arc<Slot<Arena>>,
    base: u32,
    /// Published length: as a slot's, every byte below it is written and immutable.
    len: AtomicU32,
}

impl Piece {
    pub(crate) fn capacity(&self) -> u32 {
        self.pieces.piece_bytes
    }

    /// The published length (Acquire, as [`Slot::published`]).
    pub(crate) fn published(&self) -> u32 {
        self.len.load(Ordering::Acquire)
    }

    /// The slot and the offset in it of byte `offset` of this piece.
    pub(crate) fn at(&self, offset: u32) -> (&Arc<Slot<Arena>>, u32) {
        assert!(offset <= self.capacity(), "offset {offset} past a piece of {}", self.capacity());
        (&self.slot, self.base + offset)
    }

    /// Publishes `added` bytes written at the published length; only its one appender calls it.
    pub(crate) fn publish(&self, added: u32) {
        let new_len = self.len.load(Ordering::Relaxed) + added;
        assert!(new_len <= self.capacity(), "publishing past the end of a piece");
        self.slot.count_piece_bytes(added);
        self.len.store(new_len, Ordering::Release);
    }
}

impl Drop for Piece {
    fn drop(&mut self) {
        // The last holder is gone: no reader or writer can touch these bytes any more.
        self.slot.uncount_piece_bytes(*self.len.get_mut());
        let pieces = &self.pieces;
        let index = self.slot.index();
        let mut cut = pieces.cut.lock();
        let cut_slot = cut.slots.get_mut(&index).expect("a piece's slot stays cut while the piece lives");
        cut_slot.free.push(self.base / pieces.piece_bytes);
        if cut_slot.free.len() == pieces.per_slot as usize {
            // Every piece is free: the slot goes back to the tier (when this piece's reference,
            // the last, drops too).
            cut.slots.remove(&index);
            cut.with_free.remove(&index);
        } else {
            cut.with_free.insert(index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dram::{AppendSlot, DramTier};

    const BS: u32 = 256 << 10;

    fn tier(slots: u64) -> DramTier {
        DramTier::new(BS, slots * u64::from(BS)).unwrap()
    }

    fn used_slots(tier: &DramTier) -> u64 {
        tier.usage().used_blocks
    }

    #[test]
    fn sizes_follow_the_shares_and_small_blocks_are_not_cut() {
        let sizes = |block: u32| {
            let tier = DramTier::new(block, 64 * u64::from(block)).unwrap();
            Pieces::for_tier(tier.slots()).iter().map(|p| p.piece_bytes()).collect::<Vec<_>>()
        };
        assert_eq!(sizes(1 << 20), [16 << 10, 128 << 10]);
        assert_eq!(sizes(BS), [4 << 10, 32 << 10]);
        assert_eq!(sizes(64 << 10), Vec::<u32>::new(), "1 KiB first pieces are too small: whole slots only");
        let few = DramTier::new(BS, 7 * u64::from(BS)).unwrap();
        assert!(Pieces::for_tier(few.slots()).is_empty(), "a tier of 7 slots has no share of them to cut");
    }

    #[test]
    fn pieces_fill_few_slots_and_give_them_back_when_all_are_free() {
        let tier = tier(64);
        let small = &Pieces::for_tier(tier.slots())[0];
        let per_slot = (BS / small.piece_bytes()) as usize;
        let mut taken: Vec<AppendSlot> = (0..per_slot + 1).map(|_| AppendSlot::take_piece(small).unwrap()).collect();
        assert_eq!((used_slots(&tier), small.slots_cut()), (2, 2), "64 pieces a slot, the 65th cuts another");
        for (n, piece) in taken.iter_mut().enumerate() {
            piece.append_with_header(&[n as u8; 100], |_| [0u8; 16]);
        }
        assert_eq!(tier.usage().used_bytes, 116 * (per_slot as u64 + 1));
        let last = taken.pop().unwrap();
        drop(last);
        assert_eq!(used_slots(&tier), 1, "the second slot's only piece freed: the slot is back");
        taken.truncate(1);
        assert_eq!(used_slots(&tier), 1);
        drop(taken);
        assert_eq!((used_slots(&tier), small.slots_cut(), tier.usage().used_bytes), (0, 0, 0));
    }

    #[test]
    fn each_size_cuts_at_most_its_share_of_the_tier() {
        let tier = tier(16);
        let small = &Pieces::for_tier(tier.slots())[0];
        let per_slot = (BS / small.piece_bytes()) as usize;
        // 16 slots: each size may cut 2.
        let taken: Vec<AppendSlot> = (0..2 * per_slot).map(|_| AppendSlot::take_piece(small).unwrap()).collect();
        assert!(AppendSlot::take_piece(small).is_none(), "its share is cut and every piece in use");
        assert!(AppendSlot::take(tier.slots()).is_some(), "whole slots remain for the rest");
        drop(taken);
        assert!(AppendSlot::take_piece(small).is_some());
    }

    #[test]
    fn a_piece_a_reader_still_holds_is_not_reused() {
        // 16 slots: 2 may be cut, 128 pieces.
        let tier = tier(16);
        let small = &Pieces::for_tier(tier.slots())[0];
        let mut piece = AppendSlot::take_piece(small).unwrap();
        let (offset, _) = piece.append_with_header(&[7u8; 1000], |_| [1u8; 16]);
        let view = piece.view(offset, 1000);
        drop(piece);
        // Every other piece of the slot, written over in full: none is the one the view reads.
        let mut others: Vec<AppendSlot> = Vec::new();
        while let Some(mut other) = AppendSlot::take_piece(small) {
            let room = other.room() as usize - 16;
            other.append_with_header(&vec![9u8; room], |_| [2u8; 16]);
            others.push(other);
        }
        assert_eq!(others.len(), 2 * 64 - 1, "the viewed piece stays out of the free list");
        assert!(view.iter().all(|&b| b == 7), "the reader's bytes are intact");
        drop(view);
        assert!(AppendSlot::take_piece(small).is_some(), "free once the view is gone");
    }
}
