//! A segment: its extents (DRAM slots or pieces, NVMe extents) and its index of batches.
//!
//! Each batch lies whole in one extent behind its header, and the index lists it under the
//! `(map, attempt)` that pushed it, in arrival order (see [`SegmentState::index`]). What goes
//! into a segment is decided in [`super::push`], what moves down in [`super::mover`], what is
//! served in [`super::pages`]; this file holds the state they share and the questions more than
//! one of them asks of it (which tier its bytes are in, which DRAM slot is open).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;
use tern_proto::{MapAttempt, MapIndex, StorageClass};

use super::readahead::ReadAhead;
use super::{SegmentId, ShuffleBytes};
use crate::dram::AppendSlot;
use crate::nvme::NvmeExtent;

/// Where one batch lies.
#[derive(Debug, Clone, Copy)]
pub(super) struct Batch {
    /// Index into the segment's extents. A segment has fewer extents than batches (each holds at
    /// least one), and fewer batches than `u32::MAX`.
    pub(super) slot: u32,
    pub(super) offset: u32,
    pub(super) len: u32,
    /// crc32c of the batch's bytes as stored.
    pub(super) crc: u32,
}

/// A segment's slot: in DRAM, or moved down to NVMe with the same bytes at the same offsets.
pub(super) enum Extent {
    Dram(AppendSlot),
    /// Shared with the fetches reading it, so a freed segment's slot stays held until they end.
    Nvme(Arc<NvmeExtent>),
}

impl Extent {
    /// A whole DRAM slot, which the mover may write down to NVMe. Pieces stay: one would take a
    /// whole NVMe slot and free no DRAM until every piece of its slot is free.
    pub(super) fn is_movable(&self) -> bool {
        matches!(self, Extent::Dram(AppendSlot::Whole(_)))
    }

    /// Bytes stored in it (batches with their headers).
    pub(super) fn len(&self) -> u64 {
        match self {
            Extent::Dram(slot) => u64::from(slot.len()),
            Extent::Nvme(extent) => u64::from(extent.len()),
        }
    }
}

/// One segment's extents and index. Guarded by the segment's lock.
pub(super) struct SegmentState {
    /// Never empty: a segment is created with the slot (DRAM or NVMe) for its first batch.
    pub(super) slots: Vec<Extent>,
    /// The DRAM slot taking batches, if any (none once the mover closed it), and how many it
    /// holds.
    pub(super) dram_open: Option<u32>,
    pub(super) batches_in_dram_open: u32,
    /// The NVMe extent taking the batches that go straight to NVMe, if any, and how many it holds.
    pub(super) nvme_open: Option<u32>,
    pub(super) batches_in_nvme_open: u32,
    /// Freed (its bytes no longer counted): a racing push is refused, a racing move discarded.
    pub(super) dropped: bool,
    /// Closed for a copy ([`super::Shuffles::close_for_copy`]): pushes are refused, so the copy
    /// holds every batch the segment ever takes.
    pub(super) closed: bool,
    /// The durable record (see [`super::durable`]): a seal being written; the slot of extent 0 once
    /// sealed (a push clears its entry before adding a batch); whether the shuffle index may hold
    /// entries of its extents (cleared when it is freed).
    pub(super) sealing: bool,
    pub(super) sealed: Option<usize>,
    pub(super) recorded: bool,
    /// `batches` at the mover's last durability pass: equal again, the segment is idle.
    pub(super) batches_seen: u64,
    /// Every batch went to its last extent, so the extents' order is the arrival order, which is
    /// what a restart rebuilds; a segment whose DRAM and NVMe appends interleaved is never sealed.
    pub(super) in_extent_order: bool,
    /// By `(map, attempt)`, each in arrival order. A Fetch names one attempt per map, so walking
    /// this in key order yields its batches by map, then arrival.
    pub(super) index: BTreeMap<(MapIndex, MapAttempt), Vec<Batch>>,
    pub(super) batches: u64,
    pub(super) bytes: u64,
}

pub(super) struct Segment {
    pub(super) id: SegmentId,
    /// From its first push: which tiers it may use.
    pub(super) class: StorageClass,
    pub(super) state: Mutex<SegmentState>,
    /// Held across a push straight to NVMe (the state's lock cannot be held across I/O), so that
    /// those append to the open NVMe extent one at a time.
    pub(super) nvme_appends: tokio::sync::Mutex<()>,
    /// Held while its seal is written, and by a push from unsealing it until its batch is in, so
    /// a seal never misses a batch that was acknowledged.
    pub(super) durable: Arc<tokio::sync::Mutex<()>>,
    /// NVMe spans read ahead for the pages readers will ask for next, oldest first.
    pub(super) read_ahead: Mutex<VecDeque<ReadAhead>>,
}

impl Segment {
    pub(super) fn new(id: SegmentId, class: StorageClass, first: Extent) -> Arc<Segment> {
        let (dram_open, nvme_open) = match first {
            Extent::Dram(_) => (Some(0), None),
            Extent::Nvme(_) => (None, Some(0)),
        };
        Segment::with_state(
            id,
            class,
            SegmentState {
                slots: vec![first],
                dram_open,
                batches_in_dram_open: 0,
                nvme_open,
                batches_in_nvme_open: 0,
                dropped: false,
                closed: false,
                sealing: false,
                sealed: None,
                recorded: false,
                batches_seen: 0,
                in_extent_order: true,
                index: BTreeMap::new(),
                batches: 0,
                bytes: 0,
            },
        )
    }

    pub(super) fn with_state(id: SegmentId, class: StorageClass, state: SegmentState) -> Arc<Segment> {
        Arc::new(Segment {
            id,
            class,
            state: Mutex::new(state),
            nvme_appends: tokio::sync::Mutex::new(()),
            durable: Arc::new(tokio::sync::Mutex::new(())),
            read_ahead: Mutex::new(VecDeque::new()),
        })
    }
}

impl SegmentState {
    /// Bytes its extents hold in each tier.
    pub(super) fn bytes_by_tier(&self) -> ShuffleBytes {
        let mut bytes = ShuffleBytes::default();
        for extent in &self.slots {
            match extent {
                Extent::Dram(_) => bytes.dram += extent.len(),
                Extent::Nvme(_) => bytes.nvme += extent.len(),
            }
        }
        bytes
    }

    /// The slots of its NVMe extents.
    pub(super) fn nvme_slots(&self) -> impl Iterator<Item = usize> + '_ {
        self.slots.iter().filter_map(|extent| match extent {
            Extent::Nvme(extent) => Some(extent.slot()),
            Extent::Dram(_) => None,
        })
    }

    /// The published bytes of the open DRAM slot, if there is one, the mover may write it down,
    /// and it holds some.
    pub(super) fn open_dram_len(&self) -> Option<u32> {
        match self.dram_open.map(|at| &self.slots[at as usize]) {
            Some(extent @ Extent::Dram(slot)) if extent.is_movable() && slot.len() > 0 => Some(slot.len()),
            _ => None,
        }
    }
}
