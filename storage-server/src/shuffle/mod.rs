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

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use tern_proto::frame::MAX_PAYLOAD_BYTES;
use tern_proto::shuffle::{BatchHeader, FetchRequest, PushHeader, BATCH_HEADER_LEN, FETCH_DONE};
use tern_proto::v1::{QuotaStop, ShuffleUsage};
use tern_proto::{ErrorKind, ServerId, ShuffleId, StorageClass};
use tokio::sync::Notify;

use crate::dram::{AppendSlot, DramSlots, Pieces};
use crate::nvme::{NvmeExtent, NvmeTier};
use durable::{ExtentRecord, Sealed, ShuffleIndex};

pub(crate) mod durable;

/// Most bytes one Fetch reply carries, whatever the request asks for (a single batch may make it
/// up to [`BATCH_HEADER_LEN`] bytes more than the block size, which clients must accept).
pub const MAX_FETCH_PAGE_BYTES: u32 = 16 << 20;
/// A slot takes batches while they average at least this many bytes. This bounds the index
/// (16 bytes a batch) to 1/16 of the arena whatever batch sizes clients push; tinier batches leave
/// the rest of a slot unused.
const MIN_BYTES_PER_BATCH: u32 = 256;
/// Most batches one segment holds, so that every cursor stays below [`FETCH_DONE`].
const MAX_SEGMENT_BATCHES: u64 = FETCH_DONE as u64 - 1;
/// Most freed shuffle ids remembered. A push to a remembered one is refused, so a straggling map
/// task cannot re-create a segment of a freed shuffle, which nobody would ever free again.
const FREED_REMEMBERED: usize = 1 << 16;
/// NVMe spans one segment keeps read ahead (oldest dropped first), and bytes a server keeps read
/// ahead in all: a reducer's next pages are on their way while it takes this one, within a bound.
const READ_AHEAD_SPANS: usize = 8;
const READ_AHEAD_BYTES: usize = 256 << 20;
/// Times a push unseals its segment and tries again (the mover cannot seal it meanwhile: more
/// than one try happens only if the segment was freed and pushed to anew).
const UNSEAL_TRIES: usize = 3;
/// Times a push that finds both tiers full waits for a move under way, and how long each.
const MOVE_WAITS: usize = 3;
const MOVE_WAIT: Duration = Duration::from_secs(1);
/// Share of the DRAM tier's slots in use past which `any` segments move down to NVMe...
pub const HIGH_WATERMARK: f64 = 0.85;
/// ...until this share is in use again.
pub const LOW_WATERMARK: f64 = 0.70;

/// Which segment: shuffle, reduce partition, and index in the partition's chain of segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SegmentId {
    pub shuffle: ShuffleId,
    pub partition: u32,
    pub index: u32,
}

impl fmt::Display for SegmentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "shuffle {} partition {} segment {}", self.shuffle, self.partition, self.index)
    }
}

/// One page of a Fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchPage {
    /// Whole batches, each a [`BatchHeader`] and its bytes (what the Fetch reply carries).
    pub payload: Bytes,
    /// The cursor to ask with next, or [`FETCH_DONE`] when no matching batch remains.
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
    Corrupt { segment: SegmentId, map: u32, attempt: u32, expected: u32, actual: u32 },
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

/// Where one batch lies.
#[derive(Debug, Clone, Copy)]
struct Batch {
    /// Index into the segment's extents. A segment has fewer extents than batches (each holds at
    /// least one), and fewer batches than `u32::MAX`.
    slot: u32,
    offset: u32,
    len: u32,
    /// crc32c of the batch's bytes as stored.
    crc: u32,
}

/// A segment's slot: in DRAM, or moved down to NVMe with the same bytes at the same offsets.
enum Extent {
    Dram(AppendSlot),
    /// Shared with the fetches reading it, so a freed segment's slot stays held until they end.
    Nvme(Arc<NvmeExtent>),
}

impl Extent {
    /// A whole DRAM slot, which the mover may write down to NVMe. Pieces stay: one would take a
    /// whole NVMe slot and free no DRAM until every piece of its slot is free.
    fn is_movable(&self) -> bool {
        matches!(self, Extent::Dram(AppendSlot::Whole(_)))
    }

    /// Bytes stored in it (batches with their headers).
    fn len(&self) -> u64 {
        match self {
            Extent::Dram(slot) => u64::from(slot.len()),
            Extent::Nvme(extent) => u64::from(extent.len()),
        }
    }
}

/// Where a batch of a page is read from.
enum Stored {
    /// A view of the arena: the bytes themselves, `[offset, offset + len)` of DRAM extent
    /// `extent` of the segment.
    View { bytes: Bytes, extent: u32, offset: u32 },
    /// `[offset, offset + len)` of an NVMe extent, read outside the segment's lock.
    Disk(Arc<NvmeExtent>, u32, u32),
}

/// One segment's extents and index. Guarded by the segment's lock.
struct SegmentState {
    /// Never empty: a segment is created with the slot (DRAM or NVMe) for its first batch.
    slots: Vec<Extent>,
    /// The DRAM slot taking batches, if any (none once the mover closed it), and how many it
    /// holds.
    dram_open: Option<u32>,
    batches_in_dram_open: u32,
    /// The NVMe extent taking the batches that go straight to NVMe, if any, and how many it holds.
    nvme_open: Option<u32>,
    batches_in_nvme_open: u32,
    /// Freed (its bytes no longer counted): a racing push is refused, a racing move discarded.
    dropped: bool,
    /// Closed for a copy ([`Shuffles::close_for_copy`]): pushes are refused, so the copy holds
    /// every batch the segment ever takes.
    closed: bool,
    /// The durable record (see [`durable`]): a seal being written; the slot of extent 0 once
    /// sealed (a push clears its entry before adding a batch); whether the shuffle index may hold
    /// entries of its extents (cleared when it is freed).
    sealing: bool,
    sealed: Option<usize>,
    recorded: bool,
    /// `batches` at the mover's last durability pass: equal again, the segment is idle.
    batches_seen: u64,
    /// Every batch went to its last extent, so the extents' order is the arrival order, which is
    /// what a restart rebuilds; a segment whose DRAM and NVMe appends interleaved is never sealed.
    in_extent_order: bool,
    /// By `(map, attempt)`, each in arrival order. A Fetch names one attempt per map, so walking
    /// this in key order yields its batches by map, then arrival.
    index: BTreeMap<(u32, u32), Vec<Batch>>,
    batches: u64,
    bytes: u64,
}

struct Segment {
    id: SegmentId,
    /// From its first push: which tiers it may use.
    class: StorageClass,
    state: Mutex<SegmentState>,
    /// Held across a push straight to NVMe (the state's lock cannot be held across I/O), so that
    /// those append to the open NVMe extent one at a time.
    nvme_appends: tokio::sync::Mutex<()>,
    /// Held while its seal is written, and by a push from unsealing it until its batch is in, so
    /// a seal never misses a batch that was acknowledged.
    durable: Arc<tokio::sync::Mutex<()>>,
    /// NVMe spans read ahead for the pages readers will ask for next, oldest first.
    read_ahead: Mutex<VecDeque<ReadAhead>>,
}

/// An NVMe read under way (or done) that a fetch may take instead of reading itself.
type SharedRead = futures::future::Shared<futures::future::BoxFuture<'static, Result<Bytes, String>>>;

/// A span of an extent read ahead, its bytes counted against the server's bound until dropped.
struct ReadAhead {
    extent: Arc<NvmeExtent>,
    start: u32,
    end: u32,
    read: SharedRead,
    _counted: Counted,
}

/// Bytes counted in a shared total while this lives.
struct Counted {
    total: Arc<AtomicUsize>,
    bytes: usize,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl Segment {
    /// Takes the read-ahead of `extent` covering `[start, end)`, if there is one: where its span
    /// starts, and the read.
    fn take_read_ahead(&self, extent: &Arc<NvmeExtent>, start: u32, end: u32) -> Option<(u32, SharedRead)> {
        let mut ahead = self.read_ahead.lock();
        let at = ahead.iter().position(|r| Arc::ptr_eq(&r.extent, extent) && r.start <= start && end <= r.end)?;
        let taken = ahead.remove(at)?;
        Some((taken.start, taken.read.clone()))
    }
}

impl Segment {
    fn new(id: SegmentId, class: StorageClass, first: Extent) -> Arc<Segment> {
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

    fn with_state(id: SegmentId, class: StorageClass, state: SegmentState) -> Arc<Segment> {
        Arc::new(Segment {
            id,
            class,
            state: Mutex::new(state),
            nvme_appends: tokio::sync::Mutex::new(()),
            durable: Arc::new(tokio::sync::Mutex::new(())),
            read_ahead: Mutex::new(VecDeque::new()),
        })
    }

    /// Rebuilds a sealed segment from its extents, found at start: its index from the batch
    /// headers the extents hold. `Err` says why it cannot be (the caller drops its extents).
    async fn restore(seal: &Sealed, extents: Vec<NvmeExtent>, max_batch: u32) -> Result<Arc<Segment>, String> {
        let mut index: BTreeMap<(u32, u32), Vec<Batch>> = BTreeMap::new();
        let (mut batches, mut bytes) = (0u64, 0u64);
        for (slot, extent) in (0..).zip(&extents) {
            let (mut offset, len) = (0u32, extent.len());
            while offset < len {
                let header_len = BATCH_HEADER_LEN as u32;
                if len - offset < header_len {
                    return Err(format!("extent {slot} ends inside a batch header at byte {offset}"));
                }
                let head = extent.read(offset, header_len).await.map_err(|e| format!("reading extent {slot}: {e}"))?;
                let header = BatchHeader::decode(head[..].try_into().expect("a header's bytes"));
                if header.len == 0 || header.len > max_batch || header.len > len - offset - header_len {
                    return Err(format!("extent {slot} holds a batch header of {} bytes at byte {offset}", header.len));
                }
                let batch = Batch { slot, offset: offset + header_len, len: header.len, crc: header.crc };
                index.entry((header.map, header.attempt)).or_default().push(batch);
                batches += 1;
                bytes += u64::from(header.len);
                offset += header_len + header.len;
            }
        }
        let state = SegmentState {
            slots: extents.into_iter().map(|extent| Extent::Nvme(Arc::new(extent))).collect(),
            dram_open: None,
            batches_in_dram_open: 0,
            nvme_open: None,
            batches_in_nvme_open: 0,
            dropped: false,
            closed: false,
            sealing: false,
            sealed: Some(seal.extents[0].0),
            recorded: true,
            batches_seen: batches,
            in_extent_order: true,
            index,
            batches,
            bytes,
        };
        Ok(Segment::with_state(seal.segment, seal.class, state))
    }
}

/// Why a push did not go in: refused, or its segment is sealed and must be unsealed first.
enum PushError {
    Refused(ShuffleError),
    Sealed(Arc<Segment>),
}

impl From<ShuffleError> for PushError {
    fn from(error: ShuffleError) -> PushError {
        PushError::Refused(error)
    }
}

/// Every segment this server holds, and the shuffles freed lately.
#[derive(Default)]
struct SegmentMap {
    shuffles: HashMap<ShuffleId, HashMap<(u32, u32), Arc<Segment>>>,
    segments: usize,
    freed: HashSet<ShuffleId>,
    /// `freed` in the order remembered, oldest first, to forget past [`FREED_REMEMBERED`].
    freed_order: VecDeque<ShuffleId>,
}

impl SegmentMap {
    fn get(&self, id: SegmentId) -> Option<Arc<Segment>> {
        self.shuffles.get(&id.shuffle)?.get(&(id.partition, id.index)).cloned()
    }

    fn remember_freed(&mut self, shuffle: ShuffleId) {
        if self.freed.insert(shuffle) {
            self.freed_order.push_back(shuffle);
            if self.freed_order.len() > FREED_REMEMBERED {
                if let Some(oldest) = self.freed_order.pop_front() {
                    self.freed.remove(&oldest);
                }
            }
        }
    }
}

/// Full DRAM slots waiting to move down, oldest first: those of `nvme` segments move at once,
/// those of `any` segments under pressure. A freed segment's entries are skipped when reached.
#[derive(Default)]
struct MoveQueue {
    now: VecDeque<(Weak<Segment>, u32)>,
    under_pressure: VecDeque<(Weak<Segment>, u32)>,
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
    /// Bytes of NVMe spans read ahead and not yet taken, bounded by [`READ_AHEAD_BYTES`].
    read_ahead_bytes: Arc<AtomicUsize>,
    /// The NVMe shuffle index, once [`Shuffles::restore`] opened it; without it nothing is
    /// sealed (and a restart loses every segment).
    index: std::sync::OnceLock<Arc<ShuffleIndex>>,
    /// The next seal's generation: above every one found at start.
    next_generation: AtomicU64,
    /// Pieces of the DRAM tier's slots for segments' first extents, one set per size.
    pieces: Vec<Arc<Pieces>>,
}

fn full(pool: &DramSlots, segment: SegmentId) -> ShuffleError {
    ShuffleError::Full { segment, in_use: pool.count(), total: pool.count() }
}

/// Whether the NVMe tier has a free slot.
fn has_room(nvme: &NvmeTier) -> bool {
    let usage = nvme.usage();
    usage.used_blocks < usage.capacity_blocks
}

fn share_in_use(pool: &DramSlots) -> f64 {
    let usage = pool.usage();
    usage.used_blocks as f64 / usage.capacity_blocks.max(1) as f64
}

impl Shuffles {
    /// The segments of a server whose DRAM tier is `pool` (pieces are cut from its slots).
    pub(crate) fn new(pool: &Arc<DramSlots>) -> Shuffles {
        Shuffles { pieces: Pieces::for_tier(pool), ..Shuffles::default() }
    }

    /// Appends `batch` to the segment (created on its first push); returns the segment's size in
    /// bytes afterwards. Into DRAM, or straight to NVMe where the module docs say.
    pub(crate) async fn push(
        &self,
        pool: &Arc<DramSlots>,
        nvme: Option<&NvmeTier>,
        server: ServerId,
        id: SegmentId,
        from: PushHeader,
        batch: &[u8],
    ) -> Result<u64, ShuffleError> {
        let max = max_batch_bytes(pool.block_size());
        if batch.is_empty() || batch.len() > max as usize {
            return Err(ShuffleError::BatchSize { segment: id, len: batch.len(), max });
        }
        // Held until the batch is in, so the segment is not sealed again without it.
        let mut unsealed = Vec::new();
        for _ in 0..UNSEAL_TRIES {
            match self.push_once(pool, nvme, server, id, from, batch).await {
                Ok(bytes) => return Ok(bytes),
                Err(PushError::Refused(error)) => return Err(error),
                Err(PushError::Sealed(segment)) => unsealed.push(self.unseal(&segment).await?),
            }
        }
        Err(ShuffleError::Io { segment: id, op: "push", error: "its segment was sealed again each time".into() })
    }

    /// Clears the seal of `segment` durably, so that a crash from now on drops it rather than
    /// serve it without the batch about to go in; returns the guard that keeps the mover from
    /// sealing it again meanwhile.
    async fn unseal(&self, segment: &Arc<Segment>) -> Result<tokio::sync::OwnedMutexGuard<()>, ShuffleError> {
        let guard = segment.durable.clone().lock_owned().await;
        let sealed = segment.state.lock().sealed;
        if let (Some(slot), Some(index)) = (sealed, self.index.get()) {
            let index = index.clone();
            let cleared = tokio::task::spawn_blocking(move || index.clear(&[slot])).await;
            let error = match cleared {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(e) => Some(e.to_string()),
            };
            if let Some(error) = error {
                return Err(ShuffleError::Io { segment: segment.id, op: "push (unsealing)", error });
            }
            segment.state.lock().sealed = None;
        }
        Ok(guard)
    }

    /// One try of [`Shuffles::push`].
    async fn push_once(
        &self,
        pool: &Arc<DramSlots>,
        nvme: Option<&NvmeTier>,
        server: ServerId,
        id: SegmentId,
        from: PushHeader,
        batch: &[u8],
    ) -> Result<u64, PushError> {
        let stop = self.quota_stops.lock().get(&id.shuffle).cloned();
        let (dram_allowed, nvme_allowed) = stop.as_ref().map_or((true, true), |stop| (!stop.dram, !stop.nvme));
        let nvme = nvme.filter(|_| from.class != StorageClass::Dram && nvme_allowed);
        let nvme = match (nvme, dram_allowed) {
            (Some(nvme), true) => nvme,
            (None, true) => return self.try_push(pool, server, id, from, batch, true),
            (Some(nvme), false) => return self.push_to_nvme(pool, nvme, server, id, from, batch).await,
            (None, false) => {
                let reason = stop.map(|stop| stop.reason).unwrap_or_default();
                return Err(ShuffleError::QuotaExceeded { segment: id, reason }.into());
            }
        };
        for _ in 0..MOVE_WAITS {
            // Armed before the attempt, so a move that ends during it is not missed.
            let moved = self.moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            // Past the high watermark, new slots come from NVMe: DRAM is left to what is there.
            let may_take_dram = share_in_use(pool) < HIGH_WATERMARK;
            let full = match self.try_push(pool, server, id, from, batch, may_take_dram) {
                Err(PushError::Refused(ShuffleError::Full { .. })) => {
                    self.wake_mover.notify_one();
                    match self.push_to_nvme(pool, nvme, server, id, from, batch).await {
                        // NVMe filled meanwhile: DRAM may have room now.
                        Err(PushError::Refused(full @ ShuffleError::TiersFull { .. })) => {
                            match self.try_push(pool, server, id, from, batch, true) {
                                Err(PushError::Refused(ShuffleError::Full { .. })) => full,
                                pushed => return pushed,
                            }
                        }
                        pushed => return pushed,
                    }
                }
                pushed => return pushed,
            };
            // Both tiers full. A move under way frees a DRAM slot when it ends: worth waiting for.
            if self.moves_in_flight.load(Ordering::Acquire) == 0
                || tokio::time::timeout(MOVE_WAIT, moved).await.is_err()
            {
                return Err(full.into());
            }
        }
        let (dram, disk) = (pool.usage(), nvme.usage());
        Err(PushError::Refused(ShuffleError::TiersFull {
            segment: id,
            dram_in_use: dram.used_blocks,
            dram_total: dram.capacity_blocks,
            nvme_in_use: disk.used_blocks,
            nvme_total: disk.capacity_blocks,
        }))
    }

    fn try_push(
        &self,
        pool: &Arc<DramSlots>,
        server: ServerId,
        id: SegmentId,
        from: PushHeader,
        batch: &[u8],
        may_take_dram: bool,
    ) -> Result<u64, PushError> {
        let need = (BATCH_HEADER_LEN + batch.len()) as u32;
        let take = |nth| self.dram_extent(pool, from.class, nth, need, may_take_dram);
        let first_slot = || take(0).map(Extent::Dram);
        let segment = self.segment_for_push(server, id, from.class, first_slot).ok_or_else(|| full(pool, id))??;
        let mut state = segment.state.lock();
        if state.dropped {
            return Err(ShuffleError::Freed { segment: id, server }.into());
        }
        if state.closed {
            return Err(ShuffleError::Closed { segment: id, server }.into());
        }
        if state.sealing || state.sealed.is_some() {
            drop(state);
            return Err(PushError::Sealed(segment));
        }
        let (bytes, closed) = state.append(pool, id, from, batch, take)?;
        drop(state);
        self.dram_bytes.fetch_add((BATCH_HEADER_LEN + batch.len()) as u64, Ordering::Relaxed);
        if let Some(closed) = closed {
            self.queue_move(&segment, closed, pool);
        }
        Ok(bytes)
    }

    /// A DRAM extent for a segment's extent number `nth` that takes a batch of `need` bytes with its
    /// header: a piece while the segment is young (see [`crate::dram::pieces`]) and one is free,
    /// else a whole slot if `whole` allows. Pieces are bounded apart from the watermarks, and past
    /// the high one a small partition in a whole NVMe slot would waste far more than its piece
    /// does. `nvme` segments take whole slots, which the mover writes down whole.
    fn dram_extent(
        &self,
        pool: &Arc<DramSlots>,
        class: StorageClass,
        nth: usize,
        need: u32,
        whole: bool,
    ) -> Option<AppendSlot> {
        let piece = self.pieces.get(nth).filter(|pieces| class != StorageClass::Nvme && need <= pieces.piece_bytes());
        piece.and_then(AppendSlot::take_piece).or_else(|| whole.then(|| AppendSlot::take(pool)).flatten())
    }

    /// Appends `batch` to the segment's open NVMe extent, or to a new one; see the module docs.
    async fn push_to_nvme(
        &self,
        pool: &DramSlots,
        nvme: &NvmeTier,
        server: ServerId,
        id: SegmentId,
        from: PushHeader,
        batch: &[u8],
    ) -> Result<u64, PushError> {
        let tiers_full = || {
            let (dram, disk) = (pool.usage(), nvme.usage());
            ShuffleError::TiersFull {
                segment: id,
                dram_in_use: dram.used_blocks,
                dram_total: dram.capacity_blocks,
                nvme_in_use: disk.used_blocks,
                nvme_total: disk.capacity_blocks,
            }
        };
        let first_slot = || nvme.take_extent().map(|extent| Extent::Nvme(Arc::new(extent)));
        let segment = self.segment_for_push(server, id, from.class, first_slot).ok_or_else(tiers_full)??;
        let _turn = segment.nvme_appends.lock().await;
        let len = u32::try_from(batch.len()).expect("batches are at most a block");
        let (extent, fresh) = {
            let state = segment.state.lock();
            if state.dropped {
                return Err(ShuffleError::Freed { segment: id, server }.into());
            }
            if state.closed {
                return Err(ShuffleError::Closed { segment: id, server }.into());
            }
            if state.sealing || state.sealed.is_some() {
                drop(state);
                return Err(PushError::Sealed(segment.clone()));
            }
            if state.batches >= MAX_SEGMENT_BATCHES {
                return Err(ShuffleError::SegmentFull { segment: id, max: MAX_SEGMENT_BATCHES }.into());
            }
            let open = state.nvme_open.and_then(|at| match &state.slots[at as usize] {
                Extent::Nvme(extent)
                    if len + BATCH_HEADER_LEN as u32 <= extent.room()
                        && state.batches_in_nvme_open < pool.block_size() / MIN_BYTES_PER_BATCH =>
                {
                    Some(extent.clone())
                }
                _ => None,
            });
            match open {
                Some(extent) => (extent, false),
                None => (Arc::new(nvme.take_extent().ok_or_else(tiers_full)?), true),
            }
        };
        let header = |crc| BatchHeader { map: from.map, attempt: from.attempt, len, crc }.encode();
        let (offset, crc) = extent.append_with_header(batch, header).await.map_err(|e| ShuffleError::Io {
            segment: id,
            op: "push",
            error: e.to_string(),
        })?;
        let mut state = segment.state.lock();
        if state.dropped {
            // Freed meanwhile: the extent goes with the segment.
            return Err(ShuffleError::Freed { segment: id, server }.into());
        }
        let slot = match fresh {
            true => {
                state.slots.push(Extent::Nvme(extent));
                let at = u32::try_from(state.slots.len() - 1).expect("fewer extents than batches");
                state.nvme_open = Some(at);
                state.batches_in_nvme_open = 0;
                at
            }
            false => state.nvme_open.expect("the open extent appended to"),
        };
        state.batches_in_nvme_open += 1;
        state.in_extent_order &= slot as usize == state.slots.len() - 1;
        state.index.entry((from.map, from.attempt)).or_default().push(Batch { slot, offset, len, crc });
        state.batches += 1;
        state.bytes += u64::from(len);
        self.nvme_bytes.fetch_add((BATCH_HEADER_LEN + batch.len()) as u64, Ordering::Relaxed);
        Ok(state.bytes)
    }

    /// The segment, created with `first_slot()` if new (`None` when that has no slot to give).
    /// Creating it with its slot means every segment holds at least one, so their number is
    /// bounded by the tiers' slots.
    fn segment_for_push(
        &self,
        server: ServerId,
        id: SegmentId,
        class: StorageClass,
        first_slot: impl FnOnce() -> Option<Extent>,
    ) -> Option<Result<Arc<Segment>, ShuffleError>> {
        let mut map = self.map.lock();
        if map.freed.contains(&id.shuffle) {
            return Some(Err(ShuffleError::Freed { segment: id, server }));
        }
        if let Some(segment) = map.get(id) {
            return Some(Ok(segment));
        }
        let segment = Segment::new(id, class, first_slot()?);
        map.shuffles.entry(id.shuffle).or_default().insert((id.partition, id.index), segment.clone());
        map.segments += 1;
        Some(Ok(segment))
    }

    /// Queues a full DRAM slot of `segment` to move down, as its class says.
    fn queue_move(&self, segment: &Arc<Segment>, slot: u32, pool: &DramSlots) {
        let entry = (Arc::downgrade(segment), slot);
        match segment.class {
            StorageClass::Dram => {}
            StorageClass::Nvme => {
                self.moves.lock().now.push_back(entry);
                self.wake_mover.notify_one();
            }
            StorageClass::Any => {
                self.moves.lock().under_pressure.push_back(entry);
                if share_in_use(pool) >= HIGH_WATERMARK {
                    self.wake_mover.notify_one();
                }
            }
        }
    }

    /// Waits until the mover has work (or `tick` passed, to check the watermark anyway).
    pub(crate) async fn mover_woken(&self, tick: Duration) {
        let _ = tokio::time::timeout(tick, self.wake_mover.notified()).await;
    }

    /// Moves DRAM slots to NVMe as the policy in the module docs says, until there is nothing
    /// more to move or NVMe is full; returns how many moved.
    pub(crate) async fn move_down(&self, pool: &DramSlots, nvme: &NvmeTier) -> usize {
        let mut moved = 0;
        // Checked first, so that an open slot is not closed for a move that cannot happen.
        while has_room(nvme) {
            let Some((segment, slot, bytes)) = self.next_move(pool, false) else { break };
            if !self.move_slot(segment, slot, bytes, nvme).await {
                break;
            }
            moved += 1;
        }
        moved
    }

    /// Makes room in a full DRAM tier for a file block: moves one DRAM slot of a segment that may
    /// live on NVMe down now, whatever the watermarks (the mover may not have caught up with
    /// blocks written faster than its tick). Returns whether one moved; its DRAM slot is free once
    /// the last Fetch reading it lets go.
    pub(crate) async fn make_dram_room(&self, pool: &DramSlots, nvme: &NvmeTier) -> bool {
        if !has_room(nvme) {
            return false;
        }
        let Some((segment, slot, bytes)) = self.next_move(pool, true) else { return false };
        self.move_slot(segment, slot, bytes, nvme).await
    }

    /// Wakes the mover if DRAM is past the high watermark: file blocks written there take slots
    /// too, and only pushes wake it otherwise.
    pub(crate) fn dram_block_taken(&self, pool: &DramSlots) {
        if share_in_use(pool) >= HIGH_WATERMARK {
            self.wake_mover.notify_one();
        }
    }

    /// Writes `slot` of `segment` (closed, its bytes `bytes`) to NVMe and puts the NVMe extent
    /// in its place; whether it moved (not when NVMe is full or the write failed: it stays in
    /// DRAM).
    async fn move_slot(&self, segment: Arc<Segment>, slot: u32, bytes: Bytes, nvme: &NvmeTier) -> bool {
        self.moves_in_flight.fetch_add(1, Ordering::AcqRel);
        let written = nvme.write_extent(&bytes).await;
        let moved = match written {
            Ok(Some(extent)) => {
                let len = u64::from(extent.len());
                let mut state = segment.state.lock();
                if !state.dropped {
                    // Still the DRAM slot the bytes came from: closed slots take no more batches.
                    state.slots[slot as usize] = Extent::Nvme(Arc::new(extent));
                    self.dram_bytes.fetch_sub(len, Ordering::Relaxed);
                    self.nvme_bytes.fetch_add(len, Ordering::Relaxed);
                }
                true
            }
            Ok(None) => {
                tracing::debug!("shuffle mover: the NVMe tier is full; shuffle data stays in DRAM");
                false
            }
            Err(e) => {
                tracing::error!("shuffle mover: writing a DRAM slot to NVMe failed, it stays in DRAM: {e}");
                false
            }
        };
        // The DRAM slot is free once the last view of it goes: tell pushes waiting for it.
        drop((segment, bytes));
        self.moves_in_flight.fetch_sub(1, Ordering::AcqRel);
        self.moved.notify_waiters();
        moved
    }

    /// The next DRAM slot to move (closed, so its bytes never change again) and its bytes; with
    /// `now`, one of an `any` segment even below the watermarks.
    fn next_move(&self, pool: &DramSlots, now: bool) -> Option<(Arc<Segment>, u32, Bytes)> {
        let share = share_in_use(pool);
        if share >= HIGH_WATERMARK {
            self.draining.store(true, Ordering::Relaxed);
        } else if share < LOW_WATERMARK {
            self.draining.store(false, Ordering::Relaxed);
        }
        let draining = now || self.draining.load(Ordering::Relaxed);
        loop {
            let entry = {
                let mut moves = self.moves.lock();
                match moves.now.pop_front() {
                    Some(entry) => Some(entry),
                    None if draining => moves.under_pressure.pop_front(),
                    None => None,
                }
            };
            let Some((segment, slot)) = entry else {
                // Nothing full: under pressure, close the fullest open slot instead.
                return if draining { self.close_fullest_open() } else { None };
            };
            let Some(segment) = segment.upgrade() else { continue };
            let state = segment.state.lock();
            if let Extent::Dram(dram) = &state.slots[slot as usize] {
                let bytes = dram.view(0, dram.len());
                drop(state);
                return Some((segment, slot, bytes));
            }
        }
    }

    /// Closes the open DRAM slot holding the most bytes among segments that may use NVMe, and
    /// returns it to move.
    fn close_fullest_open(&self) -> Option<(Arc<Segment>, u32, Bytes)> {
        let segments: Vec<Arc<Segment>> = {
            let map = self.map.lock();
            map.shuffles.values().flat_map(|s| s.values()).filter(|s| s.class != StorageClass::Dram).cloned().collect()
        };
        let fullest = segments
            .into_iter()
            .filter_map(|segment| {
                let len = segment.state.lock().open_dram_len()?;
                Some((len, segment))
            })
            .max_by_key(|(len, _)| *len)?
            .1;
        let mut state = fullest.state.lock();
        let len = state.open_dram_len()?;
        let slot = state.dram_open.take().expect("open_dram_len found it");
        let Extent::Dram(dram) = &state.slots[slot as usize] else { unreachable!("the open DRAM slot is in DRAM") };
        let bytes = dram.view(0, len);
        drop(state);
        Some((fullest, slot, bytes))
    }

    /// The page of `request`'s batches that starts at its cursor.
    pub(crate) async fn fetch(
        &self,
        server: ServerId,
        id: SegmentId,
        request: &FetchRequest,
    ) -> Result<FetchPage, ShuffleError> {
        let want = |map, attempt| request.attempt_of(map) == Some(attempt);
        self.page_of(server, id, request.cursor, request.max_bytes, &want).await
    }

    /// Closes a segment to pushes, for a copy of it to another server: from now on it holds
    /// exactly what the copy will. Its partition has moved on, so only a writer that has not
    /// seen that yet pushes here, and it is refused as by a full segment (OutOfSpace), which
    /// moves it on too.
    pub(crate) async fn close_for_copy(&self, server: ServerId, id: SegmentId) -> Result<(), ShuffleError> {
        let segment = self.map.lock().get(id).ok_or(ShuffleError::NotHeld { segment: id, server })?;
        // After any append straight to NVMe under way (it indexes its batch when its write is
        // done): a closed segment's extents hold no batch its index lacks.
        let _turn = segment.nvme_appends.lock().await;
        segment.state.lock().closed = true;
        Ok(())
    }

    /// A page of every batch the segment holds, of every map and attempt, in the order a Fetch
    /// serves them (by map and attempt, each in push order), from `cursor`: what a copy of the
    /// segment pushes to its target, so the target's index is the same.
    pub(crate) async fn copy_page(
        &self,
        server: ServerId,
        id: SegmentId,
        cursor: u32,
        max_bytes: u32,
    ) -> Result<FetchPage, ShuffleError> {
        self.page_of(server, id, cursor, max_bytes, &|_, _| true).await
    }

    /// Drops single segments (a copy not stored whole, or one whose place in its chain was
    /// taken by a copy elsewhere); returns how many were held. The shuffle is not remembered as
    /// freed: its other segments stay, and a copy may come here again.
    pub(crate) fn free_segments(&self, ids: impl IntoIterator<Item = SegmentId>) -> usize {
        let removed: Vec<Arc<Segment>> = {
            let mut map = self.map.lock();
            let mut removed = Vec::new();
            for id in ids {
                let Some(segments) = map.shuffles.get_mut(&id.shuffle) else { continue };
                if let Some(segment) = segments.remove(&(id.partition, id.index)) {
                    if segments.is_empty() {
                        map.shuffles.remove(&id.shuffle);
                    }
                    removed.push(segment);
                }
            }
            map.segments -= removed.len();
            removed
        };
        self.uncount(removed.iter());
        removed.len()
    }

    /// The page of the batches `want` names that starts at `cursor`.
    async fn page_of(
        &self,
        server: ServerId,
        id: SegmentId,
        cursor: u32,
        max_bytes: u32,
        want: &(dyn Fn(u32, u32) -> bool + Sync),
    ) -> Result<FetchPage, ShuffleError> {
        let segment = self.map.lock().get(id).ok_or(ShuffleError::NotHeld { segment: id, server })?;
        let limit = max_bytes.min(MAX_FETCH_PAGE_BYTES) as usize;
        let (page, span, layout, more, next) = {
            let state = segment.state.lock();
            let (page, more) = state.page(id, want, cursor, limit)?;
            let span = state.span_of(&page);
            let on_disk = page.iter().any(|(_, stored)| matches!(stored, Stored::Disk(..)));
            let layout = match (&span, on_disk) {
                (Some(_), _) => PageLayout::Arena,
                (None, true) => PageLayout::Disk,
                (None, false) => PageLayout::Gathered,
            };
            // A reader of NVMe: the page it asks for next, as NVMe spans to read ahead. (Readers
            // of DRAM alone pay nothing for it.)
            let next = match more && on_disk {
                true => state.page(id, want, cursor + page.len() as u32, limit)?.0,
                false => Vec::new(),
            };
            (page, span, layout, more, disk_spans(&next))
        };
        self.read_ahead(&segment, next);
        // Read outside the segment's lock, so pushes to it do not wait; the views and extents
        // keep their slots intact meanwhile, even if the shuffle is freed.
        let page = read_extents(id, &segment, page).await?;
        drop(segment);
        let batches = u32::try_from(page.len()).expect("a page holds fewer batches than its segment");
        let next_cursor = if more { cursor + batches } else { FETCH_DONE };
        // Each view is a stored `[header | bytes]`, exactly as the reply carries it. Batches that
        // lie back to back in one DRAM extent (one batch, the usual page for large batches, or a
        // run of small ones) go out as one view of the arena, without a copy; others are gathered
        // into one buffer. Either way every batch is checked against the crc taken when it was
        // stored (the check at rest, which names the map to recompute), and that checked crc
        // extends the payload's crc with no second pass.
        let check = |header: &BatchHeader, bytes: &[u8]| {
            let actual = crc32c::crc32c(bytes);
            if actual != header.crc {
                return Err(ShuffleError::Corrupt {
                    segment: id,
                    map: header.map,
                    attempt: header.attempt,
                    expected: header.crc,
                    actual,
                });
            }
            Ok(actual)
        };
        if let Some(span) = span {
            let mut crc = 0;
            for (header, stored) in &page {
                let (encoded, bytes) = stored.split_at(BATCH_HEADER_LEN);
                crc = crc32c::crc32c_combine(crc32c::crc32c_append(crc, encoded), check(header, bytes)?, bytes.len());
            }
            return Ok(FetchPage { payload: span, next_cursor, batches, crc, layout });
        }
        let size = page.iter().map(|(_, stored)| stored.len()).sum();
        let mut payload = BytesMut::with_capacity(size);
        let mut crc = 0;
        for (header, stored) in &page {
            let (encoded, bytes) = stored.split_at(BATCH_HEADER_LEN);
            crc = crc32c::crc32c_append(crc, encoded);
            payload.extend_from_slice(encoded);
            let start = payload.len();
            payload.extend_from_slice(bytes);
            // Checked over the copy, so what is sent is what was pushed.
            crc = crc32c::crc32c_combine(crc, check(header, &payload[start..])?, bytes.len());
        }
        Ok(FetchPage { payload: payload.freeze(), next_cursor, batches, crc, layout })
    }

    /// Starts reading `spans` of `segment` (the page a reader asks for next), unless already read
    /// ahead or past the server's bound; they go on in the background.
    fn read_ahead(&self, segment: &Segment, spans: Vec<(Arc<NvmeExtent>, u32, u32)>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        for (extent, start, end) in spans {
            let mut ahead = segment.read_ahead.lock();
            if ahead.iter().any(|r| Arc::ptr_eq(&r.extent, &extent) && r.start <= start && end <= r.end) {
                continue;
            }
            let bytes = (end - start) as usize;
            if self.read_ahead_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes > READ_AHEAD_BYTES {
                self.read_ahead_bytes.fetch_sub(bytes, Ordering::Relaxed);
                return;
            }
            let counted = Counted { total: self.read_ahead_bytes.clone(), bytes };
            let reading = extent.clone();
            let read = futures::FutureExt::shared(futures::FutureExt::boxed(async move {
                reading.read(start, end - start).await.map_err(|e| e.to_string())
            }));
            runtime.spawn(read.clone());
            ahead.push_back(ReadAhead { extent, start, end, read, _counted: counted });
            if ahead.len() > READ_AHEAD_SPANS {
                ahead.pop_front();
            }
        }
    }

    /// Drops every segment of the listed shuffles and remembers them as freed; returns how many
    /// segments were held.
    pub(crate) fn free(&self, shuffle_ids: impl IntoIterator<Item = ShuffleId>) -> usize {
        let removed: Vec<HashMap<(u32, u32), Arc<Segment>>> = {
            let mut map = self.map.lock();
            let removed: Vec<_> = shuffle_ids
                .into_iter()
                .filter_map(|id| {
                    map.remember_freed(id);
                    map.shuffles.remove(&id)
                })
                .collect();
            map.segments -= removed.iter().map(HashMap::len).sum::<usize>();
            removed
        };
        self.uncount(removed.iter().flat_map(HashMap::values));
        // Slots go back to the free lists as these drop, outside the map lock (a push or
        // fetch under way keeps its segment, or its views, until it ends).
        removed.iter().map(HashMap::len).sum()
    }

    /// Takes the bytes of dropped segments off the per-tier counts, and their extents out of the
    /// shuffle index (while the segments still hold their slots, so no slot is reused first).
    fn uncount<'a>(&self, segments: impl Iterator<Item = &'a Arc<Segment>>) {
        let mut gone = ShuffleBytes::default();
        let mut recorded = Vec::new();
        for segment in segments {
            let mut state = segment.state.lock();
            state.dropped = true;
            gone += state.bytes_by_tier();
            if state.recorded {
                recorded.extend(state.nvme_slots());
            }
        }
        self.dram_bytes.fetch_sub(gone.dram, Ordering::Relaxed);
        self.nvme_bytes.fetch_sub(gone.nvme, Ordering::Relaxed);
        self.forget(&recorded);
    }

    /// Clears the shuffle index's entries of `slots` (of freed segments).
    fn forget(&self, slots: &[usize]) {
        if let Some(index) = self.index.get() {
            if let Err(e) = index.clear(slots) {
                durable::log_clear_failure(index, e);
            }
        }
    }

    /// Drops every segment and forgets which shuffles were freed (a new registration may see ids
    /// reused); returns how many segments were held.
    pub(crate) fn clear(&self) -> usize {
        let removed = std::mem::take(&mut *self.map.lock());
        self.uncount(removed.shuffles.values().flat_map(HashMap::values));
        removed.segments
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

    /// Opens the shuffle index and takes back the segments sealed in it (before any push or
    /// fetch); from then on idle segments wholly on NVMe are sealed. Returns how many came back.
    pub(crate) async fn restore(
        &self,
        nvme: &NvmeTier,
        fs: Arc<dyn tern_common::durable::Fs>,
        path: &std::path::Path,
    ) -> anyhow::Result<usize> {
        let (index, sealed, mut stale) = ShuffleIndex::open_in(fs, path, nvme.block_size(), nvme.slot_count())?;
        let max_batch = max_batch_bytes(nvme.block_size());
        let (mut restored, mut generation) = (0, 0);
        for seal in sealed {
            let slots = seal.extents.iter().map(|&(slot, _)| slot);
            let why = match nvme.restore_extents(&seal.extents) {
                None => "a block holds one of its NVMe slots".to_string(),
                Some(extents) => match Segment::restore(&seal, extents, max_batch).await {
                    Ok(segment) => {
                        let bytes: u64 = segment.state.lock().slots.iter().map(Extent::len).sum();
                        self.nvme_bytes.fetch_add(bytes, Ordering::Relaxed);
                        let mut map = self.map.lock();
                        let id = seal.segment;
                        map.shuffles.entry(id.shuffle).or_default().insert((id.partition, id.index), segment);
                        map.segments += 1;
                        generation = generation.max(seal.generation);
                        restored += 1;
                        continue;
                    }
                    Err(why) => why,
                },
            };
            tracing::warn!("{}: {} is not restored: {why}", path.display(), seal.segment);
            stale.extend(slots);
        }
        index.clear(&stale).map_err(|e| anyhow::anyhow!("clearing stale entries of {}: {e}", path.display()))?;
        if restored > 0 {
            tracing::info!("NVMe tier: {restored} shuffle segments taken back from {}", path.display());
        }
        self.next_generation.store(generation + 1, Ordering::Relaxed);
        if self.index.set(Arc::new(index)).is_err() {
            anyhow::bail!("the NVMe shuffle index was opened twice");
        }
        Ok(restored)
    }

    /// The mover's durability pass, each tick: the open DRAM slot of each `nvme` segment idle
    /// since the last pass is closed and moved down, then every idle segment wholly on NVMe and
    /// not sealed yet is sealed (all in one sync of the data and one of the index). Returns how
    /// many segments it sealed. Nothing without a shuffle index.
    pub(crate) async fn make_idle_durable(&self, pool: &DramSlots, nvme: &Arc<NvmeTier>) -> usize {
        let Some(index) = self.index.get().cloned() else { return 0 };
        let mut idle = Vec::new();
        for segment in self.all_segments() {
            let mut state = segment.state.lock();
            let quiet = state.batches == state.batches_seen;
            state.batches_seen = state.batches;
            if !quiet || state.dropped {
                continue;
            }
            if segment.class == StorageClass::Nvme && state.open_dram_len().is_some() {
                let slot = state.dram_open.take().expect("open_dram_len found it");
                drop(state);
                self.queue_move(&segment, slot, pool);
            } else {
                drop(state);
            }
            idle.push(segment);
        }
        if idle.is_empty() {
            return 0;
        }
        self.move_down(pool, nvme).await;
        self.seal(&idle, nvme, &index).await
    }

    /// Seals those of `segments` wholly on NVMe, with data, not sealed, and not being pushed to;
    /// returns how many.
    async fn seal(&self, segments: &[Arc<Segment>], nvme: &Arc<NvmeTier>, index: &Arc<ShuffleIndex>) -> usize {
        let mut sealing = Vec::new();
        let mut records = Vec::new();
        for segment in segments {
            // Busy: a push is unsealing it, or appending to NVMe. The next pass will do.
            let (Ok(durable), Ok(appends)) = (segment.durable.try_lock(), segment.nvme_appends.try_lock()) else {
                continue;
            };
            let mut state = segment.state.lock();
            let on_nvme = state.slots.iter().all(|extent| matches!(extent, Extent::Nvme(_)));
            if state.dropped || state.sealed.is_some() || state.batches == 0 || !on_nvme || !state.in_extent_order {
                continue;
            }
            let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
            let extents = u32::try_from(state.slots.len()).expect("fewer extents than batches");
            for (ordinal, extent) in (0..).zip(&state.slots) {
                let Extent::Nvme(extent) = extent else { unreachable!("checked above") };
                let (id, class, len) = (segment.id, segment.class, extent.len());
                let record = ExtentRecord { segment: id, class, ordinal, extents, len, generation };
                records.push((extent.slot(), record));
            }
            state.sealing = true;
            state.recorded = true;
            let first = state.nvme_slots().next().expect("a segment has an extent");
            drop(state);
            sealing.push((segment, first, durable, appends));
        }
        if sealing.is_empty() {
            return 0;
        }
        let (disk, index_for_io) = (nvme.clone(), index.clone());
        // The data first: an entry must never name bytes a power cut could take back.
        let written = tokio::task::spawn_blocking(move || {
            disk.sync_data()?;
            index_for_io.record(&records)
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        let mut freed_meanwhile = Vec::new();
        for (segment, first, _, _) in &sealing {
            let mut state = segment.state.lock();
            state.sealing = false;
            if state.dropped {
                // Freed while its seal was written: its entries go again.
                freed_meanwhile.extend(state.nvme_slots());
            } else {
                // Even if the seal failed: its entries may be on disk, so the next push must
                // clear them first, as it would a seal's.
                state.sealed = Some(*first);
            }
        }
        self.forget(&freed_meanwhile);
        match written {
            Ok(()) => sealing.len(),
            Err(e) => {
                tracing::error!("sealing {} shuffle segments in {} failed: {e}", sealing.len(), index.path().display());
                0
            }
        }
    }

    pub(crate) fn segments(&self) -> usize {
        self.map.lock().segments
    }

    /// Shuffle bytes held in each tier.
    pub(crate) fn bytes(&self) -> ShuffleBytes {
        ShuffleBytes { dram: self.dram_bytes.load(Ordering::Relaxed), nvme: self.nvme_bytes.load(Ordering::Relaxed) }
    }

    /// Each shuffle's bytes per tier, for the tenants' quotas.
    pub(crate) fn usage(&self) -> Vec<ShuffleUsage> {
        let segments: Vec<(ShuffleId, Arc<Segment>)> = {
            let map = self.map.lock();
            map.shuffles.iter().flat_map(|(&id, segments)| segments.values().map(move |s| (id, s.clone()))).collect()
        };
        let mut by_shuffle: BTreeMap<ShuffleId, ShuffleBytes> = BTreeMap::new();
        for (id, segment) in segments {
            *by_shuffle.entry(id).or_default() += segment.state.lock().bytes_by_tier();
        }
        by_shuffle
            .into_iter()
            .map(|(id, bytes)| ShuffleUsage { shuffle_id: id.get(), dram_bytes: bytes.dram, nvme_bytes: bytes.nvme })
            .collect()
    }

    /// Takes the metadata server's list of shuffles at a tier's quota in place of the last one.
    pub(crate) fn set_quota_stops(&self, stops: &[QuotaStop]) {
        *self.quota_stops.lock() = stops.iter().map(|stop| (ShuffleId(stop.shuffle_id), stop.clone())).collect();
    }

    /// Test hook: how many slots each size of pieces has cut.
    #[cfg(test)]
    pub(crate) fn slots_cut(&self) -> Vec<usize> {
        self.pieces.iter().map(|p| p.slots_cut()).collect()
    }

    /// Test hook: flips the first byte of the first stored batch of `map`, as a fault in DRAM would.
    #[cfg(test)]
    pub(crate) fn corrupt(&self, id: SegmentId, map: u32) {
        let segment = self.map.lock().get(id).expect("segment held");
        let mut state = segment.state.lock();
        let batch = state.index.iter().find(|((m, _), _)| *m == map).map(|(_, batches)| batches[0]).expect("map held");
        let Extent::Dram(slot) = &mut state.slots[batch.slot as usize] else { panic!("the batch is not in DRAM") };
        slot.flip_byte(batch.offset);
    }
}

/// Per NVMe extent (by address) a page touches, the span its batches cover.
fn disk_spans(page: &[(BatchHeader, Stored)]) -> Vec<(Arc<NvmeExtent>, u32, u32)> {
    let mut spans: Vec<(Arc<NvmeExtent>, u32, u32)> = Vec::new();
    for (_, stored) in page {
        if let Stored::Disk(extent, offset, len) = stored {
            match spans.iter_mut().find(|(e, _, _)| Arc::ptr_eq(e, extent)) {
                Some((_, start, end)) => {
                    *start = (*start).min(*offset);
                    *end = (*end).max(offset + len);
                }
                None => spans.push((extent.clone(), *offset, offset + len)),
            }
        }
    }
    spans
}

/// The page's batches as bytes: views as they are, and each NVMe extent the page covers read
/// once (the span its batches cover), all at once, or taken from what was read ahead.
async fn read_extents(
    id: SegmentId,
    segment: &Segment,
    page: Vec<(BatchHeader, Stored)>,
) -> Result<Vec<(BatchHeader, Bytes)>, ShuffleError> {
    let spans = disk_spans(&page);
    let reads = spans.iter().map(|(extent, start, end)| {
        let ahead = segment.take_read_ahead(extent, *start, *end);
        async move {
            match ahead {
                // The span read ahead starts at or before this one.
                Some((from, read)) => read.await.map(|bytes| bytes.slice((start - from) as usize..)),
                None => extent.read(*start, end - start).await.map_err(|e| e.to_string()),
            }
        }
    });
    let read = futures::future::try_join_all(reads).await.map_err(|error| ShuffleError::Io {
        segment: id,
        op: "fetch",
        error,
    })?;
    Ok(page
        .into_iter()
        .map(|(header, stored)| match stored {
            Stored::View { bytes, .. } => (header, bytes),
            Stored::Disk(extent, offset, len) => {
                let at = spans.iter().position(|(e, _, _)| Arc::ptr_eq(e, &extent)).expect("every extent was read");
                let from = (offset - spans[at].1) as usize;
                (header, read[at].slice(from..from + len as usize))
            }
        })
        .collect())
}

impl SegmentState {
    /// The page's batches as one view of the arena, when they lie back to back in one DRAM
    /// extent: what a same-host or RDMA connection can lend whole.
    fn span_of(&self, page: &[(BatchHeader, Stored)]) -> Option<Bytes> {
        let Some((_, Stored::View { extent, offset: start, .. })) = page.first() else { return None };
        let mut end = *start;
        for (_, stored) in page {
            match stored {
                Stored::View { bytes, extent: e, offset } if e == extent && *offset == end => end += bytes.len() as u32,
                _ => return None,
            }
        }
        let Extent::Dram(slot) = &self.slots[*extent as usize] else { return None };
        Some(slot.view(*start, end - start))
    }

    /// Bytes its extents hold in each tier.
    fn bytes_by_tier(&self) -> ShuffleBytes {
        let mut bytes = ShuffleBytes::default();
        for extent in &self.slots {
            match extent {
                Extent::Dram(_) => bytes.dram += extent.len(),
                Extent::Nvme(_) => bytes.nvme += extent.len(),
            }
        }
        bytes
    }

    /// Appends `batch` to the open DRAM extent, or to a new one from `take` (given the new
    /// extent's number) when it does not fit. Returns the segment's bytes and the extent it
    /// closed, if that is one the mover may write down.
    fn append(
        &mut self,
        pool: &DramSlots,
        id: SegmentId,
        from: PushHeader,
        batch: &[u8],
        take: impl FnOnce(usize) -> Option<AppendSlot>,
    ) -> Result<(u64, Option<u32>), ShuffleError> {
        if self.batches >= MAX_SEGMENT_BATCHES {
            return Err(ShuffleError::SegmentFull { segment: id, max: MAX_SEGMENT_BATCHES });
        }
        // At most `max_batch_bytes`, checked by the caller.
        let len = u32::try_from(batch.len()).expect("batches are at most a block");
        let fits = match self.dram_open.map(|at| &self.slots[at as usize]) {
            Some(Extent::Dram(open)) => {
                len + BATCH_HEADER_LEN as u32 <= open.room()
                    && self.batches_in_dram_open < open.capacity() / MIN_BYTES_PER_BATCH
            }
            _ => false,
        };
        let mut closed = None;
        if !fits {
            // Batches are stored whole, in one extent each: the rest of the open one stays unused.
            let slot = take(self.slots.len()).ok_or_else(|| full(pool, id))?;
            // The open extent closes (if the mover has not closed it already).
            closed = self.dram_open.filter(|&at| self.slots[at as usize].is_movable());
            self.slots.push(Extent::Dram(slot));
            self.dram_open = Some(u32::try_from(self.slots.len() - 1).expect("fewer extents than batches"));
            self.batches_in_dram_open = 0;
        }
        let slot = self.dram_open.expect("a DRAM slot is open");
        let Extent::Dram(open) = &mut self.slots[slot as usize] else { unreachable!("the open DRAM slot is in DRAM") };
        // Stored as served: [BatchHeader | bytes], so a page of one batch goes out without a copy.
        let (offset, crc) = open
            .append_with_header(batch, |crc| BatchHeader { map: from.map, attempt: from.attempt, len, crc }.encode());
        self.batches_in_dram_open += 1;
        self.in_extent_order &= slot as usize == self.slots.len() - 1;
        self.index.entry((from.map, from.attempt)).or_default().push(Batch { slot, offset, len, crc });
        self.batches += 1;
        self.bytes += u64::from(len);
        Ok((self.bytes, closed))
    }

    /// The slots of its NVMe extents.
    fn nvme_slots(&self) -> impl Iterator<Item = usize> + '_ {
        self.slots.iter().filter_map(|extent| match extent {
            Extent::Nvme(extent) => Some(extent.slot()),
            Extent::Dram(_) => None,
        })
    }

    /// The published bytes of the open DRAM slot, if there is one, the mover may write it down,
    /// and it holds some.
    fn open_dram_len(&self) -> Option<u32> {
        match self.dram_open.map(|at| &self.slots[at as usize]) {
            Some(extent @ Extent::Dram(slot)) if extent.is_movable() && slot.len() > 0 => Some(slot.len()),
            _ => None,
        }
    }

    /// The batches of the page `want` names from `cursor` (at most about `limit` bytes with their
    /// headers, and at least one), and whether more remain after them.
    fn page(
        &self,
        id: SegmentId,
        want: &(dyn Fn(u32, u32) -> bool + Sync),
        cursor: u32,
        limit: usize,
    ) -> Result<(Vec<(BatchHeader, Stored)>, bool), ShuffleError> {
        let mut skip = u64::from(cursor);
        let mut page = Vec::new();
        let mut size = 0;
        for (&(map, attempt), batches) in &self.index {
            if !want(map, attempt) {
                continue;
            }
            let held = batches.len() as u64;
            if skip >= held {
                skip -= held;
                continue;
            }
            // `skip < held`, so it fits a usize.
            let rest = &batches[skip as usize..];
            skip = 0;
            for batch in rest {
                let bytes = BATCH_HEADER_LEN + batch.len as usize;
                if !page.is_empty() && size + bytes > limit {
                    return Ok((page, true));
                }
                size += bytes;
                let header = BatchHeader { map, attempt, len: batch.len, crc: batch.crc };
                let (offset, len) = (batch.offset - BATCH_HEADER_LEN as u32, batch.len + BATCH_HEADER_LEN as u32);
                let stored = match &self.slots[batch.slot as usize] {
                    Extent::Dram(slot) => Stored::View { bytes: slot.view(offset, len), extent: batch.slot, offset },
                    Extent::Nvme(extent) => Stored::Disk(extent.clone(), offset, len),
                };
                page.push((header, stored));
            }
        }
        if skip > 0 {
            let held = u64::from(cursor) - skip;
            return Err(ShuffleError::CursorPastEnd { segment: id, cursor, held });
        }
        Ok((page, false))
    }
}

#[cfg(test)]
mod durable_tests;
#[cfg(test)]
mod tiering_tests;

#[cfg(test)]
mod tests {
    use super::*;
    // The shuffle rules seen through the server's router, as the service sees them.
    use crate::store::BlockStore;
    use tern_proto::shuffle::batches;

    const BS: u32 = 4096;

    fn seg(shuffle: u64, partition: u32, index: u32) -> SegmentId {
        SegmentId { shuffle: ShuffleId(shuffle), partition, index }
    }

    fn data(map: u32, attempt: u32, n: u32, len: usize) -> Vec<u8> {
        (0..len).map(|i| (map as usize * 131 + attempt as usize * 31 + n as usize * 7 + i) as u8).collect()
    }

    fn push(store: &BlockStore, id: SegmentId, map: u32, attempt: u32, batch: &[u8]) -> Result<u64, ShuffleError> {
        futures::executor::block_on(store.push(id, PushHeader { map, attempt, class: StorageClass::Any }, batch))
    }

    fn fetch(store: &BlockStore, id: SegmentId, request: &FetchRequest) -> Result<FetchPage, ShuffleError> {
        futures::executor::block_on(store.fetch(id, request))
    }

    fn request(cursor: u32, max_bytes: u32, maps: &[(u32, u32)]) -> FetchRequest {
        FetchRequest { cursor, max_bytes, maps: maps.to_vec() }
    }

    /// Every batch of a page, checked against its crc.
    fn parse(page: &FetchPage) -> Vec<(u32, u32, Vec<u8>)> {
        let parsed: Vec<_> = batches(page.payload.clone())
            .map(|batch| {
                let (header, bytes) = batch.unwrap();
                assert_eq!(header.crc, crc32c::crc32c(&bytes));
                assert_eq!(header.len as usize, bytes.len());
                (header.map, header.attempt, bytes.to_vec())
            })
            .collect();
        assert_eq!(parsed.len(), page.batches as usize);
        parsed
    }

    /// Pages through the whole of `maps`' batches, `max_bytes` at a time.
    fn fetch_all(store: &BlockStore, id: SegmentId, maps: &[(u32, u32)], max_bytes: u32) -> Vec<(u32, u32, Vec<u8>)> {
        let mut cursor = 0;
        let mut all = Vec::new();
        for _ in 0..10_000 {
            let page = fetch(store, id, &request(cursor, max_bytes, maps)).unwrap();
            let parsed = parse(&page);
            assert!(!parsed.is_empty() || page.next_cursor == FETCH_DONE, "an empty page must end the fetch");
            all.extend(parsed);
            if page.next_cursor == FETCH_DONE {
                return all;
            }
            assert_eq!(page.next_cursor, cursor + page.batches);
            cursor = page.next_cursor;
        }
        panic!("fetch never finished");
    }

    /// What a segment copy does (see `crate::copier`), in process: close, page through every
    /// batch, push each to another server's segment. The copy serves the same pages at the same
    /// cursors for any committed attempts, and freeing the original drops only that segment.
    #[test]
    fn a_closed_segment_refuses_pushes_and_its_copy_serves_the_same_pages() {
        let (source, target) =
            (BlockStore::new(BS, 8 * BS as u64).unwrap(), BlockStore::new(BS, 8 * BS as u64).unwrap());
        let (id, other) = (seg(3, 1, 0), seg(3, 2, 0));
        for (n, (map, attempt)) in [(0, 0), (1, 0), (0, 1), (0, 0), (1, 0), (0, 1)].into_iter().enumerate() {
            push(&source, id, map, attempt, &data(map, attempt, n as u32, 700 + n * 10)).unwrap();
        }
        push(&source, other, 0, 0, &data(0, 0, 9, 10)).unwrap();
        futures::executor::block_on(source.close_segment_for_copy(id)).unwrap();
        let refused = push(&source, id, 1, 0, &data(1, 0, 9, 10)).unwrap_err();
        assert!(matches!(refused, ShuffleError::Closed { .. }) && refused.kind() == ErrorKind::OutOfSpace, "{refused}");
        let mut cursor = 0;
        let mut pushed = 0;
        loop {
            let page = futures::executor::block_on(source.copy_page(id, cursor, 1500)).unwrap();
            for (map, attempt, bytes) in parse(&page) {
                pushed += bytes.len() as u64;
                assert_eq!(push(&target, id, map, attempt, &bytes).unwrap(), pushed);
            }
            if page.next_cursor == FETCH_DONE {
                break;
            }
            cursor = page.next_cursor;
        }
        assert_eq!(pushed, (0..6).map(|n| 700 + n * 10).sum::<u64>(), "every attempt's batches");
        for committed in [&[(0, 1), (1, 0)][..], &[(0, 0)][..]] {
            assert_eq!(fetch_all(&target, id, committed, 1000), fetch_all(&source, id, committed, 1000));
            let (a, b) =
                (fetch(&source, id, &request(1, 800, committed)), fetch(&target, id, &request(1, 800, committed)));
            assert_eq!(a.unwrap(), b.unwrap(), "the same cursor means the same page on either copy");
        }
        assert_eq!(source.free_segments([id, seg(3, 5, 0)]), 1);
        assert!(matches!(fetch(&source, id, &request(0, 800, &[(0, 0)])), Err(ShuffleError::NotHeld { .. })));
        assert_eq!(fetch_all(&source, other, &[(0, 0)], 1000).len(), 1, "the shuffle's other segments stay");
    }

    #[test]
    fn batches_append_across_blocks() {
        let store = BlockStore::new(BS, 4 * BS as u64).unwrap();
        let id = seg(1, 2, 0);
        let batch = |n| data(0, 0, n, 1500);
        // Two batches (each behind its 16-byte header) fit a block; the third starts the next one,
        // leaving 1064 bytes unused.
        assert_eq!(push(&store, id, 0, 0, &batch(0)).unwrap(), 1500);
        assert_eq!(push(&store, id, 0, 0, &batch(1)).unwrap(), 3000);
        assert_eq!(store.dram().usage().used_blocks, 1);
        assert_eq!(push(&store, id, 0, 0, &batch(2)).unwrap(), 4500);
        assert_eq!(store.dram().usage().used_blocks, 2);
        assert_eq!(store.dram().usage().used_bytes, 4500 + 3 * 16);
        // The largest batch, with its header, takes a block of its own.
        let whole = data(0, 0, 3, BS as usize - 16);
        assert_eq!(push(&store, id, 0, 0, &whole).unwrap(), 4500 + u64::from(BS) - 16);
        assert_eq!(store.dram().usage().used_blocks, 3);
        assert_eq!(store.shuffle_segments(), 1);

        let page = fetch(&store, id, &request(0, u32::MAX, &[(0, 0)])).unwrap();
        assert_eq!((page.batches, page.next_cursor), (4, FETCH_DONE));
        let got = parse(&page);
        let want: Vec<_> = [batch(0), batch(1), batch(2), whole].into_iter().map(|b| (0, 0, b)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn batches_come_by_map_then_arrival() {
        let store = BlockStore::new(BS, 8 * BS as u64).unwrap();
        let id = seg(1, 0, 0);
        let pushes = [(2, 0), (0, 0), (2, 1), (1, 0), (0, 0), (2, 0), (1, 0)];
        for (n, (map, attempt)) in pushes.iter().enumerate() {
            push(&store, id, *map, *attempt, &data(*map, *attempt, n as u32, 100 + n)).unwrap();
        }
        let got = fetch_all(&store, id, &[(0, 0), (1, 0), (2, 0)], u32::MAX);
        let want = vec![
            (0, 0, data(0, 0, 1, 101)),
            (0, 0, data(0, 0, 4, 104)),
            (1, 0, data(1, 0, 3, 103)),
            (1, 0, data(1, 0, 6, 106)),
            (2, 0, data(2, 0, 0, 100)),
            (2, 0, data(2, 0, 5, 105)),
        ];
        assert_eq!(got, want);
        // Later pushes of an uncommitted attempt do not move what the cursor points at.
        let first = fetch(&store, id, &request(0, 1, &[(0, 0), (1, 0), (2, 0)])).unwrap();
        push(&store, id, 0, 7, b"late attempt").unwrap();
        push(&store, id, 1, 1, b"another").unwrap();
        let mut got = parse(&first);
        got.extend(fetch_all_from(&store, id, first.next_cursor, &[(0, 0), (1, 0), (2, 0)]));
        assert_eq!(got, want);
    }

    fn fetch_all_from(store: &BlockStore, id: SegmentId, cursor: u32, maps: &[(u32, u32)]) -> Vec<(u32, u32, Vec<u8>)> {
        let page = fetch(store, id, &request(cursor, u32::MAX, maps)).unwrap();
        assert_eq!(page.next_cursor, FETCH_DONE);
        parse(&page)
    }

    #[test]
    fn only_committed_attempts_are_served() {
        let store = BlockStore::new(BS, 8 * BS as u64).unwrap();
        let id = seg(4, 1, 3);
        push(&store, id, 0, 0, b"map 0 attempt 0, lost executor").unwrap();
        push(&store, id, 0, 1, b"map 0 attempt 1").unwrap();
        push(&store, id, 1, 0, b"map 1").unwrap();
        push(&store, id, 0, 1, b"map 0 attempt 1, more").unwrap();
        push(&store, id, 5, 0, b"map 5, not committed").unwrap();
        let got = fetch_all(&store, id, &[(0, 1), (1, 0), (3, 0)], u32::MAX);
        let want = vec![
            (0, 1, b"map 0 attempt 1".to_vec()),
            (0, 1, b"map 0 attempt 1, more".to_vec()),
            (1, 0, b"map 1".to_vec()),
        ];
        assert_eq!(got, want);
        // Nothing committed: an empty page that says done.
        let page = fetch(&store, id, &request(0, u32::MAX, &[])).unwrap();
        assert_eq!((page.payload.len(), page.batches, page.next_cursor), (0, 0, FETCH_DONE));
        let page = fetch(&store, id, &request(0, u32::MAX, &[(0, 2)])).unwrap();
        assert_eq!((page.batches, page.next_cursor), (0, FETCH_DONE));
        // A cursor at the end is done; past it, refused.
        let page = fetch(&store, id, &request(3, u32::MAX, &[(0, 1), (1, 0)])).unwrap();
        assert_eq!((page.batches, page.next_cursor), (0, FETCH_DONE));
        let err = fetch(&store, id, &request(4, u32::MAX, &[(0, 1), (1, 0)])).unwrap_err();
        assert_eq!(err, ShuffleError::CursorPastEnd { segment: id, cursor: 4, held: 3 });
        assert_eq!(err.kind(), ErrorKind::Invalid);
    }

    #[test]
    fn small_pages_return_every_batch_exactly_once() {
        let store = BlockStore::new(BS, 32 * BS as u64).unwrap();
        let id = seg(9, 0, 1);
        let mut pushed = Vec::new();
        for n in 0..60u32 {
            let (map, attempt) = (n * 7 % 5, n % 2);
            let batch = data(map, attempt, n, 1 + (n as usize * 97) % 1500);
            push(&store, id, map, attempt, &batch).unwrap();
            pushed.push((map, attempt, batch));
        }
        let maps = [(0, 0), (1, 1), (2, 0), (3, 1), (4, 0)];
        let whole = fetch_all(&store, id, &maps, u32::MAX);
        // Exactly the committed ones, by map then arrival.
        let mut want: Vec<_> = pushed.iter().filter(|(m, a, _)| maps.contains(&(*m, *a))).cloned().collect();
        want.sort_by_key(|(map, _, _)| *map);
        assert_eq!(whole, want);
        for max_bytes in [0, 1, 100, 1000, 2000, 5000] {
            assert_eq!(fetch_all(&store, id, &maps, max_bytes), whole, "pages of {max_bytes} bytes");
        }
        // Pages hold whole batches up to the limit (one alone may exceed it), and stop only where
        // the next would not fit.
        let (mut cursor, mut served) = (0, 0);
        let mut pages_of_many = 0;
        while cursor != FETCH_DONE {
            let page = fetch(&store, id, &request(cursor, 2000, &maps)).unwrap();
            served += page.batches as usize;
            assert!(page.payload.len() <= 2000 || page.batches == 1, "{} bytes", page.payload.len());
            pages_of_many += usize::from(page.batches > 1);
            if page.next_cursor != FETCH_DONE {
                let next = &whole[served];
                assert!(page.payload.len() + BATCH_HEADER_LEN + next.2.len() > 2000);
            }
            cursor = page.next_cursor;
        }
        assert_eq!(served, whole.len());
        assert!(pages_of_many > 0);
    }

    #[test]
    fn a_full_tier_refuses_pushes_naming_the_segment() {
        let store = BlockStore::new(BS, 2 * BS as u64).unwrap();
        let id = seg(3, 7, 1);
        push(&store, id, 0, 0, &[1; 3000]).unwrap();
        push(&store, id, 0, 0, &[2; 3000]).unwrap();
        let err = push(&store, id, 0, 0, &[3; 3000]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfSpace);
        assert_eq!(
            err.to_string(),
            "push to shuffle 3 partition 7 segment 1 refused: dram tier full: 2 of 2 blocks in use"
        );
        // What fits in the last block still goes in; a new segment has nowhere to go.
        assert_eq!(push(&store, id, 0, 0, &[4; 1000]).unwrap(), 7000);
        let err = push(&store, seg(3, 8, 0), 0, 0, b"x").unwrap_err();
        assert!(matches!(err, ShuffleError::Full { in_use: 2, total: 2, .. }), "{err}");
        assert_eq!(store.shuffle_segments(), 1);
        // File blocks and shuffles share the arena.
        assert!(store.dram().begin_write(tern_proto::BlockId::from(1), 0, 1).is_err());
        assert_eq!(fetch_all(&store, id, &[(0, 0)], u32::MAX).len(), 3);
    }

    #[test]
    fn freeing_a_shuffle_returns_its_slots() {
        let store = BlockStore::new(BS, 5 * BS as u64).unwrap();
        store.set_server_id(ServerId(5));
        for partition in 0..2 {
            push(&store, seg(1, partition, 0), 0, 0, &[7; 3000]).unwrap();
            push(&store, seg(1, partition, 0), 1, 0, &[8; 3000]).unwrap();
        }
        push(&store, seg(2, 0, 0), 0, 0, b"other shuffle").unwrap();
        assert!(push(&store, seg(2, 0, 1), 0, 0, b"no room").is_err());
        assert_eq!(store.dram().usage().used_blocks, 5);
        assert_eq!(store.dram().usage().used_bytes, 12013 + 5 * 16);
        assert_eq!(store.shuffle_segments(), 3);
        assert_eq!(store.free_shuffles([1, 99].map(ShuffleId)), 2);
        assert_eq!(store.shuffle_segments(), 1);
        assert_eq!(store.dram().usage().used_blocks, 1);
        assert_eq!(store.dram().usage().used_bytes, 13 + 16);
        let err = fetch(&store, seg(1, 0, 0), &request(0, u32::MAX, &[(0, 0)])).unwrap_err();
        assert_eq!(err.to_string(), "shuffle 1 partition 0 segment 0 is not held by storage server 5");
        assert_eq!(err.kind(), ErrorKind::NotFound);
        // A straggler's push cannot bring a freed shuffle back.
        let err = push(&store, seg(1, 0, 0), 2, 0, b"late").unwrap_err();
        assert_eq!(err, ShuffleError::Freed { segment: seg(1, 0, 0), server: ServerId(5) });
        assert_eq!(err.kind(), ErrorKind::NotFound);
        let err = push(&store, seg(99, 0, 0), 0, 0, b"freed before its first push").unwrap_err();
        assert!(matches!(err, ShuffleError::Freed { .. }), "{err}");
        assert_eq!(fetch_all(&store, seg(2, 0, 0), &[(0, 0)], u32::MAX), vec![(0, 0, b"other shuffle".to_vec())]);
        // Freeing again is a no-op.
        assert_eq!(store.free_shuffles([ShuffleId(1)]), 0);
        // A re-registration drops everything and forgets the freed ids.
        assert_eq!(store.clear(), (0, 1));
        assert_eq!(
            (store.dram().usage().used_blocks, store.dram().usage().used_bytes, store.shuffle_segments()),
            (0, 0, 0)
        );
        push(&store, seg(1, 0, 0), 0, 0, b"a new shuffle 1").unwrap();
    }

    #[test]
    fn freed_ids_are_remembered_within_a_bound() {
        let store = BlockStore::new(BS, BS as u64).unwrap();
        let ids: Vec<ShuffleId> = (0..FREED_REMEMBERED as u64 + 1).map(ShuffleId).collect();
        store.free_shuffles(ids.iter().copied());
        store.free_shuffles(ids[1..].iter().copied());
        // Shuffle 0 was forgotten first.
        push(&store, seg(0, 0, 0), 0, 0, b"x").unwrap();
        assert!(push(&store, seg(1, 0, 0), 0, 0, b"x").is_err());
        assert!(push(&store, seg(FREED_REMEMBERED as u64, 0, 0), 0, 0, b"x").is_err());
    }

    #[test]
    fn a_page_of_batches_back_to_back_in_one_extent_is_one_view_of_the_arena() {
        let store = BlockStore::new(BS, 8 * BS as u64).unwrap();
        let id = seg(7, 0, 0);
        for map in 0..3 {
            push(&store, id, map, 0, &data(map, 0, 0, 1000)).unwrap();
        }
        // Too big for the rest of the first slot: map 3 starts a second extent.
        push(&store, id, 3, 0, &data(3, 0, 0, 2000)).unwrap();
        let layout_of = |maps: &[(u32, u32)]| {
            let page = fetch(&store, id, &request(0, u32::MAX, maps)).unwrap();
            assert_eq!(page.crc, crc32c::crc32c(&page.payload), "{maps:?}: the combined crc is the payload's");
            assert_eq!(parse(&page).len(), maps.len(), "{maps:?}");
            page.layout
        };
        assert_eq!(layout_of(&[(0, 0), (1, 0), (2, 0)]), PageLayout::Arena);
        assert_eq!(layout_of(&[(1, 0), (2, 0)]), PageLayout::Arena);
        assert_eq!(layout_of(&[(3, 0)]), PageLayout::Arena);
        assert_eq!(layout_of(&[(0, 0), (2, 0)]), PageLayout::Gathered, "not back to back");
        assert_eq!(layout_of(&[(2, 0), (3, 0)]), PageLayout::Gathered, "two extents");
    }

    #[test]
    fn corruption_at_rest_names_the_map() {
        let store = BlockStore::new(BS, 4 * BS as u64).unwrap();
        let id = seg(6, 2, 0);
        push(&store, id, 0, 0, b"map zero").unwrap();
        push(&store, id, 1, 3, b"map one").unwrap();
        push(&store, id, 2, 0, b"map two").unwrap();
        store.shuffles().corrupt(id, 1);
        let err = fetch(&store, id, &request(0, u32::MAX, &[(0, 0), (1, 3), (2, 0)])).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
        assert!(matches!(err, ShuffleError::Corrupt { map: 1, attempt: 3, .. }), "{err}");
        let message = err.to_string();
        assert!(
            message.contains("shuffle 6 partition 2 segment 0") && message.contains("recompute map 1"),
            "{message}"
        );
        // The rest of the segment is still served.
        assert_eq!(fetch_all(&store, id, &[(0, 0), (2, 0)], u32::MAX).len(), 2);
        assert!(fetch(&store, id, &request(0, 1, &[(0, 0), (1, 3)])).is_ok(), "the first page holds only map 0");
    }

    #[test]
    fn batch_sizes_and_counts_are_bounded() {
        let store = BlockStore::new(BS, 4 * BS as u64).unwrap();
        let id = seg(1, 0, 0);
        let err = push(&store, id, 0, 0, b"").unwrap_err();
        assert_eq!(err, ShuffleError::BatchSize { segment: id, len: 0, max: BS - 16 });
        let err = push(&store, id, 0, 0, &vec![0; BS as usize + 1]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Invalid);
        assert_eq!(store.shuffle_segments(), 0, "a refused first push creates nothing");
        // Tiny batches fill a slot only up to its batch budget (16 for 4 KiB blocks).
        for n in 0..BS / MIN_BYTES_PER_BATCH {
            push(&store, id, 0, 0, &[n as u8]).unwrap();
        }
        assert_eq!(store.dram().usage().used_blocks, 1);
        push(&store, id, 0, 0, b"next slot").unwrap();
        assert_eq!(store.dram().usage().used_blocks, 2);
        assert_eq!(max_batch_bytes(tern_proto::MAX_BLOCK_SIZE), MAX_PAYLOAD_BYTES - BATCH_HEADER_LEN as u32);
    }

    #[test]
    fn concurrent_pushes_lose_nothing() {
        let store = Arc::new(BlockStore::new(BS, 256 * BS as u64).unwrap());
        let threads: Vec<_> = (0..4u32)
            .map(|map| {
                let store = store.clone();
                std::thread::spawn(move || {
                    for n in 0..200u32 {
                        // Every thread pushes to the shared segment and to one of its own.
                        let batch = data(map, 0, n, 1 + (n as usize * 13) % 700);
                        push(&store, seg(1, 0, 0), map, 0, &batch).unwrap();
                        push(&store, seg(1, 1 + map, 0), map, 0, &batch).unwrap();
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let maps: Vec<_> = (0..4).map(|map| (map, 0)).collect();
        let shared = fetch_all(&store, seg(1, 0, 0), &maps, 4096);
        assert_eq!(shared.len(), 800);
        for map in 0..4u32 {
            let want: Vec<_> = (0..200u32).map(|n| (map, 0, data(map, 0, n, 1 + (n as usize * 13) % 700))).collect();
            let of_map: Vec<_> = shared.iter().filter(|(m, _, _)| *m == map).cloned().collect();
            assert_eq!(of_map, want, "map {map}, in push order");
            assert_eq!(fetch_all(&store, seg(1, 1 + map, 0), &maps, 4096), want);
        }
    }
}
