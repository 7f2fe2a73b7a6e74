//! Push: where a batch goes in. It is checked (size, the segment's state), then appended to the
//! segment's open DRAM extent or a new one (a piece while the segment is young, else a whole
//! slot), or straight to NVMe when DRAM is past the high watermark or the tenant's DRAM quota,
//! and refused only when no tier is left to it (see the module docs of [`super`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tern_proto::shuffle::{BatchHeader, PushHeader, BATCH_HEADER_LEN, FETCH_DONE};
use tern_proto::{ServerId, StorageClass};

use super::mover::{share_in_use, HIGH_WATERMARK};
use super::segment::{Batch, Extent, Segment, SegmentState};
use super::{max_batch_bytes, SegmentId, ShuffleError, Shuffles};
use crate::dram::{AppendSlot, DramSlots};
use crate::nvme::NvmeTier;

/// A slot takes batches while they average at least this many bytes. This bounds the index
/// (16 bytes a batch) to 1/16 of the arena whatever batch sizes clients push; tinier batches leave
/// the rest of a slot unused.
pub(super) const MIN_BYTES_PER_BATCH: u32 = 256;

/// Most batches one segment holds, so that every cursor stays below [`FETCH_DONE`].
const MAX_SEGMENT_BATCHES: u64 = FETCH_DONE as u64 - 1;

/// Times a push unseals its segment and tries again (the mover cannot seal it meanwhile: more
/// than one try happens only if the segment was freed and pushed to anew).
const UNSEAL_TRIES: usize = 3;

/// Times a push that finds both tiers full waits for a move under way, and how long each.
const MOVE_WAITS: usize = 3;
const MOVE_WAIT: Duration = Duration::from_secs(1);

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

/// The refusal of a push that found no DRAM extent to take.
fn full(pool: &DramSlots, segment: SegmentId) -> ShuffleError {
    ShuffleError::Full { segment, in_use: pool.count(), total: pool.count() }
}

impl Shuffles {
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
        if map.closed_unheld.contains(&id) {
            return Some(Err(ShuffleError::Closed { segment: id, server }));
        }
        let segment = Segment::new(id, class, first_slot()?);
        map.shuffles.entry(id.shuffle).or_default().insert((id.partition, id.index), segment.clone());
        map.segments += 1;
        Some(Ok(segment))
    }
}

impl SegmentState {
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
}
