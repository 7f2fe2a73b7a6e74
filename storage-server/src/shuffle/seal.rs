//! Sealing: when a segment is recorded in the NVMe shuffle index (its every extent on NVMe, idle
//! for a tick of the mover), when a push clears that record first, and how sealed segments come
//! back at start. The index's format is [`super::durable`]'s.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tern_proto::shuffle::{BatchHeader, BATCH_HEADER_LEN};
use tern_proto::{MapAttempt, MapIndex, StorageClass};

use super::durable::{self, ExtentRecord, Sealed, ShuffleIndex};
use super::segment::{Batch, Extent, Segment, SegmentState};
use super::{max_batch_bytes, ShuffleError, Shuffles};
use crate::dram::DramSlots;
use crate::nvme::{NvmeExtent, NvmeTier};

impl Shuffles {
    /// Clears the seal of `segment` durably, so that a crash from now on drops it rather than
    /// serve it without the batch about to go in; returns the guard that keeps the mover from
    /// sealing it again meanwhile.
    pub(super) async fn unseal(
        &self,
        segment: &Arc<Segment>,
    ) -> Result<tokio::sync::OwnedMutexGuard<()>, ShuffleError> {
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

    /// Clears the shuffle index's entries of `slots` (of freed segments).
    pub(super) fn forget(&self, slots: &[usize]) {
        if let Some(index) = self.index.get() {
            if let Err(e) = index.clear(slots) {
                durable::log_clear_failure(index, e);
            }
        }
    }
}

impl Segment {
    /// Rebuilds a sealed segment from its extents, found at start: its index from the batch
    /// headers the extents hold. `Err` says why it cannot be (the caller drops its extents).
    async fn restore(seal: &Sealed, extents: Vec<NvmeExtent>, max_batch: u32) -> Result<Arc<Segment>, String> {
        let mut index: BTreeMap<(MapIndex, MapAttempt), Vec<Batch>> = BTreeMap::new();
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
