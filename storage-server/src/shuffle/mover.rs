//! The tier mover (write-behind): which full DRAM slots go down to NVMe and when, by the
//! segments' storage class and the DRAM tier's watermarks, and the move itself (one aligned write
//! of the whole slot, then the NVMe extent takes its place in the segment).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use tern_proto::StorageClass;

use super::segment::{Extent, Segment};
use super::Shuffles;
use crate::dram::DramSlots;
use crate::nvme::NvmeTier;

/// Share of the DRAM tier's slots in use past which `any` segments move down to NVMe...
pub const HIGH_WATERMARK: f64 = 0.85;
/// ...until this share is in use again.
pub const LOW_WATERMARK: f64 = 0.70;

/// Full DRAM slots waiting to move down, oldest first: those of `nvme` segments move at once,
/// those of `any` segments under pressure. A freed segment's entries are skipped when reached.
#[derive(Default)]
pub(super) struct MoveQueue {
    now: VecDeque<(Weak<Segment>, u32)>,
    under_pressure: VecDeque<(Weak<Segment>, u32)>,
}

/// Whether the NVMe tier has a free slot.
fn has_room(nvme: &NvmeTier) -> bool {
    let usage = nvme.usage();
    usage.used_blocks < usage.capacity_blocks
}

/// Share of the DRAM tier's slots in use, what the watermarks are compared with.
pub(super) fn share_in_use(pool: &DramSlots) -> f64 {
    let usage = pool.usage();
    usage.used_blocks as f64 / usage.capacity_blocks.max(1) as f64
}

impl Shuffles {
    /// Queues a full DRAM slot of `segment` to move down, as its class says.
    pub(super) fn queue_move(&self, segment: &Arc<Segment>, slot: u32, pool: &DramSlots) {
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
}
