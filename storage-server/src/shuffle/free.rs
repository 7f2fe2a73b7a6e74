//! Free: dropping segments (a freed shuffle's, a copy's, or all at a re-registration), taking
//! their bytes off the per-tier counts, and remembering freed shuffles so a straggler's push
//! cannot bring one back.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tern_proto::{PartitionIndex, ShuffleId};

use super::segment::Segment;
use super::{SegmentId, SegmentMap, ShuffleBytes, Shuffles};

/// Most freed shuffle ids remembered. A push to a remembered one is refused, so a straggling map
/// task cannot re-create a segment of a freed shuffle, which nobody would ever free again.
pub(super) const FREED_REMEMBERED: usize = 1 << 16;

impl SegmentMap {
    /// Remembers `shuffle` as freed, forgetting the oldest past [`FREED_REMEMBERED`].
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

impl Shuffles {
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

    /// Drops every segment of the listed shuffles and remembers them as freed; returns how many
    /// segments were held.
    pub(crate) fn free(&self, shuffle_ids: impl IntoIterator<Item = ShuffleId>) -> usize {
        let removed: Vec<HashMap<(PartitionIndex, u32), Arc<Segment>>> = {
            let mut map = self.map.lock();
            let removed: Vec<_> = shuffle_ids
                .into_iter()
                .filter_map(|id| {
                    map.remember_freed(id);
                    map.shuffles.remove(&id)
                })
                .collect();
            let SegmentMap { freed, closed_unheld, .. } = &mut *map;
            closed_unheld.retain(|segment| !freed.contains(&segment.shuffle));
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

    /// Drops every segment and forgets which shuffles were freed (a new registration may see ids
    /// reused); returns how many segments were held.
    pub(crate) fn clear(&self) -> usize {
        let removed = std::mem::take(&mut *self.map.lock());
        self.uncount(removed.shuffles.values().flat_map(HashMap::values));
        removed.segments
    }
}
