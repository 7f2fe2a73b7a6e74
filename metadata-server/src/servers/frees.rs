//! Each server's free queue: blocks and shuffles (or single segment copies) its owner no longer
//! needs, sent on heartbeat replies until a heartbeat acknowledges them. Blocks on dead servers
//! are gone already and are not queued.

use std::collections::{BTreeMap, HashSet};

use tern_proto::v1::{HeartbeatResponse, HeldSegment};
use tern_proto::{BlockId, ServerId, ShuffleId, Tier};

use super::server::Server;
use super::{Servers, MAX_FREES_PER_HEARTBEAT};
use crate::namespace::BlockRef;
use crate::shuffles::SegmentCopy;

/// One entry of a server's free queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Free {
    Block(BlockId),
    /// Every segment the server holds of this shuffle.
    Shuffle(ShuffleId),
    /// One segment copy the chain does not name there (a copy not stored whole, or moved off).
    Segment(SegmentCopy),
}

impl Server {
    pub(super) fn queue_free(&mut self, free: Free) {
        self.frees.push_back((self.next_free_seq, free));
        self.next_free_seq += 1;
        match free {
            Free::Shuffle(_) => self.shuffle_frees += 1,
            Free::Block(id) if id.tier() == Tier::Nvme => self.nvme_frees += 1,
            Free::Block(_) | Free::Segment(_) => {}
        }
    }

    /// Drops the frees a heartbeat acknowledges (those through `freed_through_seq`), giving back
    /// the blocks they counted.
    pub(super) fn acknowledge_frees(&mut self, freed_through_seq: u64) {
        while let Some(&(seq, free)) = self.frees.front() {
            if seq > freed_through_seq {
                break;
            }
            self.frees.pop_front();
            // A freed shuffle gives its space back through the server's usage reports instead.
            match free {
                Free::Block(id) => {
                    let tier = id.tier();
                    if tier == Tier::Nvme {
                        self.nvme_frees -= 1;
                    }
                    let allocated = self.allocated_mut(tier);
                    *allocated = allocated.saturating_sub(1);
                }
                Free::Shuffle(_) => self.shuffle_frees -= 1,
                Free::Segment(_) => {}
            }
        }
    }

    /// Adds to a heartbeat reply the frees still due, oldest first, at most
    /// [`MAX_FREES_PER_HEARTBEAT`], and the sequence number of the last one carried.
    pub(super) fn add_frees_due(&self, reply: &mut HeartbeatResponse) {
        for &(seq, free) in self.frees.iter().take(MAX_FREES_PER_HEARTBEAT) {
            match free {
                Free::Block(block_id) => reply.free_block_ids.push(block_id.get()),
                Free::Shuffle(shuffle_id) => reply.free_shuffle_ids.push(shuffle_id.get()),
                Free::Segment(s) => reply.free_segments.push(HeldSegment {
                    shuffle_id: s.shuffle_id.get(),
                    partition: s.partition,
                    index: s.index,
                }),
            }
            reply.free_seq = seq;
        }
    }
}

impl Servers {
    /// Queues blocks the namespace no longer references for freeing on their servers. Blocks on
    /// dead or forgotten servers are gone already and are simply dropped.
    pub fn free(&mut self, blocks: &[BlockRef]) {
        for block in blocks {
            let Some(mut server) = self.servers.get_mut(&block.server_id) else {
                continue;
            };
            if server.lost_blocks.remove(&block.block_id).is_some() {
                // Not there to free, and not counted.
                continue;
            }
            if server.alive {
                server.queue_free(Free::Block(block.block_id));
            } else {
                let allocated = server.allocated_mut(block.block_id.tier());
                *allocated = allocated.saturating_sub(1);
            }
        }
    }

    /// Queues a shuffle free on each live server holding segments of it (`holders`: server id →
    /// segments there), and takes those segments out of the servers' load.
    pub fn free_shuffle(&mut self, shuffle_id: ShuffleId, holders: &BTreeMap<ServerId, u64>) {
        for (id, &segments) in holders {
            let Some(mut server) = self.servers.get_mut(id) else {
                continue;
            };
            server.segments = server.segments.saturating_sub(segments);
            // On a dead server the segments are gone already.
            if server.alive {
                server.queue_free(Free::Shuffle(shuffle_id));
            }
        }
    }

    /// Queues a single segment copy's free on its server, if it is alive (a dead one's is gone).
    pub fn free_segment(&mut self, server_id: ServerId, segment: SegmentCopy) {
        if let Some(mut server) = self.servers.get_mut(&server_id).filter(|s| s.alive) {
            server.queue_free(Free::Segment(segment));
        }
    }

    /// Segment frees queued and not yet acknowledged, by server: such a server takes no new copy
    /// of that segment until its free is done (it would drop the new copy).
    pub fn pending_segment_frees(&self) -> HashSet<(ServerId, SegmentCopy)> {
        let mut out = HashSet::new();
        for (&id, server) in &self.servers {
            for (_, free) in &server.frees {
                if let Free::Segment(segment) = free {
                    out.insert((id, *segment));
                }
            }
        }
        out
    }
}
