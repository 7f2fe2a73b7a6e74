//! A writer moving a partition on: when its last segment is full (or a copy of it failed), the
//! partition gets a next segment elsewhere, once, however many writers report it.

use tern_proto::v1::{AdvanceSegmentRequest, Segment};
use tern_proto::{ErrorKind, ServerId, ShuffleId, StorageClass};

use super::locate::segment;
use super::{no_partition, unknown, SegmentChanges, Shuffles, MAX_SEGMENTS_PER_PARTITION};
use crate::error::{invalid, Refusal};
use crate::planner::Copies;
use crate::servers::Servers;

/// What placing a partition's next segment needs: see [`Shuffles::check_advance`].
#[derive(Debug)]
pub struct NextSegment {
    /// The servers of the full (or failed) segment's copies.
    pub avoid: Vec<ServerId>,
    pub replicas: u32,
    pub storage_class: StorageClass,
}

impl Shuffles {
    /// Checks an advance past `req.full_segment`; changes nothing. `None` when the partition's
    /// last segment is already later (many writers report the same full segment at once, and all
    /// get the one successor: [`Shuffles::last_segment`]), else what placing the successor needs:
    /// it goes to other live servers when there are enough (with 2 replicas, two).
    pub fn check_advance(&self, req: &AdvanceSegmentRequest) -> Result<Option<NextSegment>, Refusal> {
        let shuffle = self.shuffle(ShuffleId::from_wire(req.shuffle_id))?;
        let partition = shuffle
            .partitions
            .get(req.partition as usize)
            .ok_or_else(|| no_partition(req.partition, shuffle.partitions.len()))?;
        let (last, last_copies) = partition.last();
        if last > req.full_segment {
            return Ok(None);
        }
        if last < req.full_segment {
            return Err(invalid(format!(
                "segment {} does not exist yet: partition {}'s last segment is {last}",
                req.full_segment, req.partition
            )));
        }
        if partition.len() >= MAX_SEGMENTS_PER_PARTITION {
            return Err(Refusal::new(
                ErrorKind::OutOfSpace,
                format!(
                    "partition {} has {MAX_SEGMENTS_PER_PARTITION} segments, the most one partition may have; \
                     register the shuffle with a larger split size",
                    req.partition
                ),
            ));
        }
        // Every copy of the new segment counts against the bound.
        self.check_room_for_segments(u64::from(shuffle.replicas))?;
        // The last segment is the full one (or a copy of it failed): its successor goes elsewhere.
        Ok(Some(NextSegment {
            avoid: last_copies.servers().collect(),
            replicas: shuffle.replicas,
            storage_class: shuffle.storage_class,
        }))
    }

    /// A partition's last segment, as clients see it.
    pub fn last_segment(&self, shuffle_id: ShuffleId, partition: u32, servers: &Servers) -> Result<Segment, Refusal> {
        let shuffle = self.shuffle(shuffle_id)?;
        let p = shuffle
            .partitions
            .get(partition as usize)
            .ok_or_else(|| no_partition(partition, shuffle.partitions.len()))?;
        let (index, copies) = p.last();
        Ok(segment(servers, &shuffle.lost, partition, index, copies))
    }

    /// Adds a segment to the end of a partition (AdvanceSegment or a server's death, live or
    /// logged), its copies on `copies`.
    pub fn push_segment(
        &mut self,
        shuffle_id: ShuffleId,
        partition: u32,
        copies: Copies,
    ) -> Result<SegmentChanges, Refusal> {
        let shuffle = self.shuffles.get_mut(&shuffle_id).ok_or_else(|| unknown(shuffle_id))?;
        let partitions = shuffle.partitions.len();
        let p = shuffle.partitions.get_mut(partition as usize).ok_or_else(|| no_partition(partition, partitions))?;
        p.later.push(copies);
        let mut changes = SegmentChanges::default();
        self.segments += shuffle.hold(copies, &mut changes);
        Ok(changes)
    }
}
