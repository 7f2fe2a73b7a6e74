//! Shuffle segments: the push-merge side of the store, DRAM first, NVMe beneath.
//!
//! A shuffle partition is a chain of segments; this server holds some of them. A segment is named
//! by (shuffle id, partition, segment index) and created by the first Push to it, whose storage
//! class it keeps. Map writers push batches; each batch is stored whole, in arrival order, in
//! slots taken from the DRAM tier's (so shuffle data and file blocks share one arena and one
//! capacity count), and indexed with the map index and attempt that wrote it and a crc32c of its
//! bytes as stored. A young segment's first extents are pieces of slots (1/64, then 1/8 of one;
//! see [`crate::dram::pieces`]), so a shuffle of many small partitions takes slots in proportion
//! to its bytes, not to its partitions; pieces stay in DRAM and never move down.
//!
//! Tiering (write-behind): a segment's slots are extents, each in DRAM or on NVMe. Pushes always
//! land in DRAM; the mover ([`Shuffles::move_down`], run by the server in the background) writes
//! whole DRAM slots to NVMe slots in one aligned write each, byte for byte, so the index stays
//! valid, then drops the DRAM slot. It moves
//! - every full slot of an `nvme` segment at once (DRAM is only their write buffer);
//! - full slots of `any` segments, oldest first, while DRAM is past [`HIGH_WATERMARK`] of its
//!   slots, until it is back under [`LOW_WATERMARK`]; with no full slot left, the fullest slots
//!   still taking batches are closed and moved (a segment then continues in a new slot);
//! - never those of `dram` segments.
//!
//! A push that needs a new slot while DRAM is past the high watermark (or full, with blocks or
//! `dram` segments) goes straight to NVMe when its class allows: appended to the segment's open
//! NVMe extent (the aligned unit holding its end read back and written again), or to a new one.
//! Only when both tiers are full is it refused OutOfSpace, at once: a full server answers, and
//! never takes memory it does not have.
//!
//! Tenant quotas: the metadata server names, on each heartbeat reply, the shuffles whose tenant
//! is at a tier's quota ([`Shuffles::set_quota_stops`]). Their new batches stay off that tier:
//! past the DRAM quota they go straight to NVMe where the class allows, and a push with no tier
//! left is refused QuotaExceeded with the tenant's reason. The heartbeat reports each shuffle's
//! bytes per tier ([`Shuffles::usage`]) for the metadata server to count.
//!
//! A Fetch names the committed attempt of each map it wants and gets the matching batches ordered
//! by map index, then arrival, a page at a time; a cursor counts the matching batches already
//! returned. The order is fixed by the index's layout (by `(map, attempt)`, each in arrival order),
//! so later pushes (of other attempts) never shift what a cursor points at.
//!
//! Restarts: a segment wholly on NVMe is sealed in the shuffle index ([`durable`]) once it took
//! no batch for a tick of the mover (which also moves down the open DRAM slot of an idle `nvme`
//! segment first), and comes back when the server restarts on the same `--nvme` path; a push to a
//! sealed segment unseals it (durably) before the batch goes in. Segments with any part in DRAM
//! are lost with the process, and the metadata server, told which segments came back, marks the
//! rest lost.
//!
//! Concurrency: a short map lock finds or creates a segment; each segment has its own lock,
//! held while a push copies its batch in, so pushes to one segment serialise and pushes to
//! different segments do not contend. A Fetch picks its page under the segment's lock as views of
//! the arena (and of the NVMe extents it covers, read outside the lock, one read per extent and
//! all at once), then copies and checks the bytes outside it.
//!
//! The folder, one decision a file:
//! - `mod.rs` (here): the public types ([`SegmentId`], [`FetchPage`], [`PageLayout`],
//!   [`ShuffleError`], [`ShuffleBytes`]), [`Shuffles`] and its map of segments, the inventory.
//! - [`segment`]: a segment's extents and index of batches, and what they say (bytes per tier,
//!   the open DRAM slot).
//! - [`push`]: whether a batch is taken, and where it goes (a piece, a DRAM slot, NVMe), or why
//!   it is refused.
//! - [`mover`]: which DRAM slots move down to NVMe, and when (the watermarks, the storage class).
//! - [`quota`]: the tenants' quota stops, and each shuffle's bytes per tier.
//! - [`pages`]: which batches make a Fetch page, whether the page is one view of the arena, and
//!   the crc check at rest.
//! - [`readahead`]: which NVMe spans are read ahead for a reader's next page, within a bound.
//! - [`seal`]: when a segment is recorded for restarts, unsealed by a push, and restored at start;
//!   [`durable`]: the shuffle index's format on disk.
//! - [`copy`]: closing a segment and paging through it whole for a copy to another server.
//! - [`free`]: dropping segments and remembering freed shuffles.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tern_proto::frame::MAX_PAYLOAD_BYTES;
use tern_proto::shuffle::{SegmentAddress, BATCH_HEADER_LEN};
use tern_proto::v1::QuotaStop;
use tern_proto::{ErrorKind, MapAttempt, MapIndex, PartitionIndex, ServerId, ShuffleId};
use tokio::sync::Notify;

use crate::dram::{DramSlots, Pieces};
use durable::ShuffleIndex;
use mover::MoveQueue;
use segment::Segment;

mod copy;
pub(crate) mod durable;
mod free;
mod mover;
mod pages;
mod push;
mod quota;
mod readahead;
mod seal;
mod segment;

pub use mover::{HIGH_WATERMARK, LOW_WATERMARK};
pub use pages::MAX_FETCH_PAGE_BYTES;

/// Which segment: shuffle, reduce partition, and index in the partition's chain of segments;
/// the address a Push or Fetch frame carries.
pub type SegmentId = SegmentAddress;

/// One page of a Fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchPage {
    /// Whole batches, each a [`BatchHeader`](tern_proto::shuffle::BatchHeader) and its bytes (what
    /// the Fetch reply carries).
    pub payload: Bytes,
    /// The cursor to ask with next, or [`FETCH_DONE`](tern_proto::shuffle::FETCH_DONE) when no
    /// matching batch remains.
    pub next_cursor: u32,
    /// Batches in `payload`.
    pub batches: u32,
    /// crc32c of `payload`, combined from the batches' checked crcs without another pass.
    pub crc: u32,
    /// Where `payload`'s bytes are: whether the page can be lent rather than copied.
    pub layout: PageLayout,
}

/// Where a Fetch page's bytes are, which decides whether a same-host or RDMA connection may lend
/// the page (a view of the DRAM arena) instead of carrying it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageLayout {
    /// One view of the DRAM arena: its batches lie back to back in one extent (or it is one
    /// batch). Lendable.
    Arena,
    /// Gathered into a new buffer from batches in several DRAM extents (or not back to back).
    Gathered,
    /// Read, in part or whole, from NVMe.
    Disk,
}

/// Why a Push or Fetch was refused. Messages name the segment and, for corruption, the map to
/// recompute.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShuffleError {
    #[error("{segment} is not held by storage server {server}")]
    NotHeld { segment: SegmentId, server: ServerId },
    #[error("push to {segment} refused: the shuffle was freed on storage server {server} and takes no more pushes")]
    Freed { segment: SegmentId, server: ServerId },
    #[error(
        "push to {segment} refused: the segment is closed on storage server {server} (it is being copied to \
         another server; the partition has moved on to a later segment)"
    )]
    Closed { segment: SegmentId, server: ServerId },
    #[error("push to {segment} refused: dram tier full: {in_use} of {total} blocks in use")]
    Full { segment: SegmentId, in_use: usize, total: usize },
    #[error(
        "push to {segment} refused: both tiers are full: dram {dram_in_use} of {dram_total} blocks in use, \
         nvme {nvme_in_use} of {nvme_total}"
    )]
    TiersFull { segment: SegmentId, dram_in_use: u64, dram_total: u64, nvme_in_use: u64, nvme_total: u64 },
    #[error("push to {segment} refused: {reason}")]
    QuotaExceeded { segment: SegmentId, reason: String },
    #[error("push to {segment} refused: the segment holds the most batches one may ({max}); push to the next segment")]
    SegmentFull { segment: SegmentId, max: u64 },
    #[error("push to {segment} refused: a batch of {len} bytes; batches hold 1 to {max} bytes")]
    BatchSize { segment: SegmentId, len: usize, max: u32 },
    #[error("fetch of {segment} refused: cursor {cursor} is past the {held} batches it holds for the maps asked for")]
    CursorPastEnd { segment: SegmentId, cursor: u32, held: u64 },
    #[error("{op} of {segment}: its NVMe extent failed: {error}")]
    Io { segment: SegmentId, op: &'static str, error: String },
    #[error(
        "fetch of {segment}: a batch of map {map} (attempt {attempt}) is corrupt at rest (stored crc32c \
         {expected:#010x}, bytes give {actual:#010x}); recompute map {map}"
    )]
    Corrupt { segment: SegmentId, map: MapIndex, attempt: MapAttempt, expected: u32, actual: u32 },
}

impl ShuffleError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            ShuffleError::NotHeld { .. } | ShuffleError::Freed { .. } => ErrorKind::NotFound,
            // A closed segment takes no more, as a full one: writers move on to the next segment
            // (a writer that has not yet seen its partition move on is not failed).
            ShuffleError::Full { .. }
            | ShuffleError::TiersFull { .. }
            | ShuffleError::SegmentFull { .. }
            | ShuffleError::Closed { .. } => ErrorKind::OutOfSpace,
            ShuffleError::QuotaExceeded { .. } => ErrorKind::QuotaExceeded,
            ShuffleError::BatchSize { .. } | ShuffleError::CursorPastEnd { .. } => ErrorKind::Invalid,
            ShuffleError::Corrupt { .. } => ErrorKind::Corrupt,
            ShuffleError::Io { .. } => ErrorKind::Internal,
        }
    }
}

/// The largest batch a slot of `block_size` takes: one slot, and small enough that a Fetch reply
/// carrying it alone stays within the frame payload limit.
pub fn max_batch_bytes(block_size: u32) -> u32 {
    // Each batch is stored behind its BatchHeader, as a Fetch reply carries it.
    block_size.min(MAX_PAYLOAD_BYTES) - BATCH_HEADER_LEN as u32
}

/// Shuffle bytes (batches with their headers) held in each tier.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ShuffleBytes {
    pub dram: u64,
    pub nvme: u64,
}

impl std::ops::AddAssign for ShuffleBytes {
    fn add_assign(&mut self, other: ShuffleBytes) {
        self.dram += other.dram;
        self.nvme += other.nvme;
    }
}

/// Every segment this server holds, and the shuffles freed lately.
#[derive(Default)]
struct SegmentMap {
    /// Per shuffle, its segments here by (partition, segment index).
    shuffles: HashMap<ShuffleId, HashMap<(PartitionIndex, u32), Arc<Segment>>>,
    segments: usize,
    freed: HashSet<ShuffleId>,
    /// `freed` in the order remembered, oldest first, to forget past [`free::FREED_REMEMBERED`].
    freed_order: VecDeque<ShuffleId>,
    /// Segments closed for a copy before any push reached them (see [`copy`]): a late push is
    /// refused as by a closed segment. Kept until their shuffle is freed; there are no more of
    /// them than the metadata server has segments to copy.
    closed_unheld: HashSet<SegmentId>,
}

impl SegmentMap {
    fn get(&self, id: SegmentId) -> Option<Arc<Segment>> {
        self.shuffles.get(&id.shuffle)?.get(&(id.partition, id.index)).cloned()
    }
}

/// The shuffle segments of one storage server (their slots come from its tiers').
#[derive(Default)]
pub(crate) struct Shuffles {
    map: Mutex<SegmentMap>,
    moves: Mutex<MoveQueue>,
    /// Set past the high watermark, cleared under the low one.
    draining: AtomicBool,
    /// Wakes the mover (DRAM past the high watermark, a full `nvme` slot).
    wake_mover: Notify,
    /// Moves written to NVMe whose DRAM slot is not yet given back, and their end: a push that
    /// finds both tiers full while one is under way waits for it.
    moves_in_flight: AtomicUsize,
    moved: Notify,
    dram_bytes: AtomicU64,
    nvme_bytes: AtomicU64,
    /// Shuffles whose tenant is at a tier's quota, as the last heartbeat reply listed them.
    quota_stops: Mutex<HashMap<ShuffleId, QuotaStop>>,
    /// Bytes of NVMe spans read ahead and not yet taken, bounded by `READ_AHEAD_BYTES` (see
    /// [`readahead`]).
    read_ahead_bytes: Arc<AtomicUsize>,
    /// The NVMe shuffle index, once [`Shuffles::restore`] opened it; without it nothing is
    /// sealed (and a restart loses every segment).
    index: std::sync::OnceLock<Arc<ShuffleIndex>>,
    /// The next seal's generation: above every one found at start.
    next_generation: AtomicU64,
    /// Pieces of the DRAM tier's slots for segments' first extents, one set per size.
    pieces: Vec<Arc<Pieces>>,
}

impl Shuffles {
    /// The segments of a server whose DRAM tier is `pool` (pieces are cut from its slots).
    pub(crate) fn new(pool: &Arc<DramSlots>) -> Shuffles {
        Shuffles { pieces: Pieces::for_tier(pool), ..Shuffles::default() }
    }

    /// How many segments it holds.
    pub(crate) fn segments(&self) -> usize {
        self.map.lock().segments
    }

    /// Shuffle bytes held in each tier.
    pub(crate) fn bytes(&self) -> ShuffleBytes {
        ShuffleBytes { dram: self.dram_bytes.load(Ordering::Relaxed), nvme: self.nvme_bytes.load(Ordering::Relaxed) }
    }

    /// The shuffles it holds segments of (its inventory).
    pub(crate) fn ids(&self) -> Vec<ShuffleId> {
        self.map.lock().shuffles.keys().copied().collect()
    }

    /// The segments it holds (its inventory).
    pub(crate) fn held(&self) -> Vec<SegmentId> {
        let map = self.map.lock();
        let segments = map.shuffles.iter().flat_map(|(&shuffle, segments)| {
            segments.keys().map(move |&(partition, index)| SegmentId { shuffle, partition, index })
        });
        segments.collect()
    }

    /// Every segment held, to look at outside the map lock.
    fn all_segments(&self) -> Vec<Arc<Segment>> {
        self.map.lock().shuffles.values().flat_map(HashMap::values).cloned().collect()
    }

    /// Test hook: how many slots each size of pieces has cut.
    #[cfg(test)]
    fn slots_cut(&self) -> Vec<usize> {
        self.pieces.iter().map(|p| p.slots_cut()).collect()
    }

    /// Test hook: flips the first byte of the first stored batch of `map`, as a fault in DRAM would.
    #[cfg(test)]
    fn corrupt(&self, id: SegmentId, map: MapIndex) {
        let segment = self.map.lock().get(id).expect("segment held");
        let mut state = segment.state.lock();
        let batch = state.index.iter().find(|((m, _), _)| *m == map).map(|(_, batches)| batches[0]).expect("map held");
        let segment::Extent::Dram(slot) = &mut state.slots[batch.slot as usize] else {
            panic!("the batch is not in DRAM")
        };
        slot.flip_byte(batch.offset);
    }
}

#[cfg(test)]
mod durable_tests;
#[cfg(test)]
pub(crate) mod test_wire;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tiering_tests;
