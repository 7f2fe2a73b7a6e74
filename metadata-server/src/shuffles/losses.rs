//! Storage servers dying or restarting: which segment copies a restarted server lost with its
//! DRAM, and which partitions' last segment was on a dead server (they get a new one, so map
//! attempts can push again).

use tern_proto::v1::LogLostSegments;
use tern_proto::{ServerId, ShuffleId, StorageClass};

use super::{SegmentCopy, Shuffles, MAX_SEGMENTS, MAX_SEGMENTS_PER_PARTITION};

/// Partitions whose last segment has a copy on a dead server: see [`Shuffles::tails_on`].
#[derive(Debug)]
pub struct Tails {
    pub partitions: Vec<u32>,
    pub replicas: u32,
    pub storage_class: StorageClass,
}

impl Shuffles {
    /// The records that mark lost every segment copy on `server_id` that is not `held` (the
    /// server restarted: its DRAM is gone, and it reported what it took back from NVMe), one per
    /// shuffle with such copies not yet marked; changes nothing.
    pub fn lost_on(&self, server_id: ServerId, held: &std::collections::HashSet<SegmentCopy>) -> Vec<LogLostSegments> {
        let mut records = Vec::new();
        for (&shuffle_id, shuffle) in &self.shuffles {
            if !shuffle.holders.contains_key(&server_id) {
                continue;
            }
            let mut record = LogLostSegments { shuffle_id: shuffle_id.get(), ..LogLostSegments::default() };
            for (p, partition) in (0..).zip(&shuffle.partitions) {
                for (index, copies) in (0..).zip(partition.servers()) {
                    let copy = SegmentCopy { shuffle_id, partition: p, index };
                    if copies.on(server_id) && !shuffle.lost.contains(&(p, index, server_id)) && !held.contains(&copy) {
                        record.partitions.push(p);
                        record.indexes.push(index);
                        record.server_ids.push(server_id.get());
                    }
                }
            }
            if !record.partitions.is_empty() {
                records.push(record);
            }
        }
        records
    }

    /// Marks segment copies lost as logged (a record without servers names each segment's first
    /// copy, as logs from before replication do).
    pub fn mark_lost(&mut self, log: &LogLostSegments) {
        if let Some(shuffle) = self.shuffles.get_mut(&ShuffleId::from_wire(log.shuffle_id)) {
            for (i, (&p, &index)) in log.partitions.iter().zip(&log.indexes).enumerate() {
                let first = || shuffle.partitions.get(p as usize)?.servers().nth(index as usize).map(|c| c.first);
                if let Some(server_id) = log.server_ids.get(i).map(|&id| ServerId::from_wire(id)).or_else(first) {
                    shuffle.lost.insert((p, index, server_id));
                }
            }
        }
    }

    /// After storage server `dead` died: the partitions of `shuffle_id` whose last segment had a
    /// copy there, as many as the bounds let have a new last segment (none when there are none,
    /// or no room), so map attempts can push again; changes nothing.
    pub fn tails_on(&self, shuffle_id: ShuffleId, dead: ServerId) -> Option<Tails> {
        let shuffle = self.shuffles.get(&shuffle_id)?;
        let room = (MAX_SEGMENTS.saturating_sub(self.segments) / u64::from(shuffle.replicas)) as usize;
        let partitions: Vec<u32> = (0..)
            .zip(&shuffle.partitions)
            .filter(|(_, p)| p.last().1.on(dead) && p.len() < MAX_SEGMENTS_PER_PARTITION)
            .map(|(index, _)| index)
            .take(room)
            .collect();
        (!partitions.is_empty()).then_some(Tails {
            partitions,
            replicas: shuffle.replicas,
            storage_class: shuffle.storage_class,
        })
    }
}
