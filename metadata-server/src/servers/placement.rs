//! The room the planner places blocks and segments by (servers that take placements, per tier),
//! naming placed blocks from the block-id counter, and counting what was placed on each server.

use tern_proto::{BlockId, ServerId, StorageClass, Tier};

use super::index::SegmentOrder;
use super::server::Server;
use super::Servers;
use crate::namespace::BlockRef;
use crate::planner::{BlockPlace, BlockRooms, Room, SegmentLoad, TierRoom};

impl Servers {
    /// Names the blocks of a placement plan, in order, from the next block ids. Changes nothing:
    /// [`Servers::count_placed`] does, when the allocation is applied.
    pub fn name_blocks(&self, plan: &[BlockPlace]) -> Vec<BlockRef> {
        (self.next_block_id..)
            .zip(plan)
            .map(|(index, place)| BlockRef { block_id: BlockId::new(place.tier, index), server_id: place.server_id })
            .collect()
    }

    /// Takes the next block id for a copy (re-replication, drain) without counting it anywhere:
    /// the copy is counted on its server when it is stored and logged (`count_placed`).
    pub fn take_block_id(&mut self, tier: Tier) -> BlockId {
        let id = BlockId::new(tier, self.next_block_id);
        self.next_block_id += 1;
        id
    }

    /// Whether the server heartbeats and is reconciled (copies may be made from it, or to it).
    pub fn is_placeable(&self, server_id: ServerId) -> bool {
        self.servers.get(&server_id).is_some_and(|s| s.placeable())
    }

    /// Counts placed blocks on their servers, and moves the block ids past them.
    pub fn count_placed(&mut self, blocks: &[BlockRef]) {
        for block in blocks {
            self.next_block_id = self.next_block_id.max(block.block_id.index() + 1);
            if let Some(mut server) = self.servers.get_mut(&block.server_id) {
                *server.allocated_mut(block.block_id.tier()) += 1;
            }
        }
    }

    /// What the planner places blocks by, in order (`index`).
    pub fn block_rooms(&self) -> &(impl BlockRooms + '_) {
        self.servers.block_rooms()
    }

    /// What the planner places segments of `class` by, in order (`index`).
    pub fn segment_rooms(&self, class: StorageClass) -> SegmentOrder<'_> {
        self.servers.segment_rooms(class)
    }

    /// The room of each server that takes new blocks, for a look at them all (re-replication
    /// chooses its targets by it).
    pub fn rooms(&self) -> Vec<Room> {
        let room = |server: &Server, tier| TierRoom {
            capacity_blocks: server.tier_capacity(tier),
            used_blocks: server.tier_used(tier),
            being_freed_blocks: server.tier_being_freed(tier),
        };
        self.servers
            .iter()
            .filter(|(_, s)| s.takes_placements())
            .map(|(&server_id, s)| Room {
                server_id,
                host: s.host.clone(),
                dram: room(s, Tier::Dram),
                nvme: room(s, Tier::Nvme),
            })
            .collect()
    }

    /// The load of each server that takes new segments, for a look at them all (re-replication
    /// chooses its targets by it).
    pub fn segment_loads(&self, class: StorageClass) -> Vec<SegmentLoad> {
        self.servers
            .iter()
            .filter(|(_, s)| s.takes_placements())
            .map(|(&server_id, s)| s.segment_load(server_id, class))
            .collect()
    }

    /// Counts newly placed segments in their servers' load.
    pub fn add_segments(&mut self, server_ids: &[ServerId]) {
        for id in server_ids {
            if let Some(mut server) = self.servers.get_mut(id) {
                server.segments += 1;
            }
        }
    }

    /// A segment copy moved from `old` to `new`: counts it in `new`'s load, not in `old`'s.
    pub fn move_segment(&mut self, old: ServerId, new: ServerId) {
        if let Some(mut server) = self.servers.get_mut(&old) {
            server.segments = server.segments.saturating_sub(1);
        }
        self.add_segments(&[new]);
    }

    /// Shuffle segments placed on the server (of registered shuffles).
    pub fn segments_on(&self, server_id: ServerId) -> u64 {
        self.servers.get(&server_id).map_or(0, |s| s.segments)
    }
}
