//! A registered server's inventory: gathered over its pages, then reconciled with what the
//! namespace and the shuffles reference there (unreferenced data freed, missing blocks lost).
//! Only a reconciled server takes placements.

use std::collections::{HashMap, HashSet, VecDeque};

use tern_proto::{BlockId, ErrorKind, ServerId, ShuffleId};

use super::frees::Free;
use super::Servers;
use crate::error::{invalid, Refusal};
use crate::shuffles::SegmentCopy;

/// What a storage server reported holding, gathered over its inventory pages.
#[derive(Debug, Default)]
pub(super) struct Inventory {
    pub(super) blocks: HashSet<BlockId>,
    pub(super) shuffles: HashSet<ShuffleId>,
    pub(super) segments: HashSet<SegmentCopy>,
}

/// What reconciling an inventory did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reconciled {
    pub unreferenced: u64,
    pub lost: u64,
    pub unknown_shuffles: u64,
    /// Segments of registered shuffles the chains do not name there (copies never logged).
    pub unreferenced_segments: u64,
}

impl Servers {
    /// Whether the server's last registration came from a new process.
    pub fn restarted_since_log(&self, server_id: ServerId) -> bool {
        self.servers.get(&server_id).is_none_or(|s| s.restarted)
    }

    /// Takes one page of a server's inventory; `Ok(true)` when the server awaits its
    /// reconciliation (the caller runs it on the last page).
    pub fn inventory_page(
        &mut self,
        server_id: ServerId,
        blocks: &[BlockId],
        shuffles: &[ShuffleId],
        segments: &[SegmentCopy],
        block_size: u32,
    ) -> Result<(), Refusal> {
        let Some(mut server) = self.servers.get_mut(&server_id).filter(|s| s.alive) else {
            return Err(Refusal::new(
                ErrorKind::NotFound,
                format!("storage server {server_id} is not registered; register again"),
            ));
        };
        // One borrow of the server, so that its fields can be borrowed apart.
        let server = &mut *server;
        let Some(inventory) = server.inventory.as_mut() else {
            return Err(invalid(format!("storage server {server_id} already reported its inventory; register again")));
        };
        let entries = blocks.len() + shuffles.len() + segments.len();
        if entries > tern_proto::MAX_INVENTORY_PAGE {
            return Err(invalid(format!(
                "an inventory page of {entries} entries; at most {} per page",
                tern_proto::MAX_INVENTORY_PAGE
            )));
        }
        // No server holds more blocks than its tiers have room for (a registration at start-up
        // names bytes only: its block counts come with the first heartbeat).
        let capacity: u64 =
            server.tiers.iter().map(|t| t.capacity_blocks.max(t.capacity_bytes / u64::from(block_size.max(1)))).sum();
        if (inventory.blocks.len() + blocks.len()) as u64 > capacity {
            return Err(invalid(format!(
                "the inventory reports {} blocks, more than the {capacity} the server's tiers hold",
                inventory.blocks.len() + blocks.len()
            )));
        }
        if inventory.shuffles.len() + shuffles.len() > crate::shuffles::MAX_SHUFFLES {
            return Err(invalid(format!("the inventory reports more than {} shuffles", crate::shuffles::MAX_SHUFFLES)));
        }
        if (inventory.segments.len() + segments.len()) as u64 > crate::shuffles::MAX_SEGMENTS {
            return Err(invalid(format!("the inventory reports more than {} segments", crate::shuffles::MAX_SEGMENTS)));
        }
        inventory.blocks.extend(blocks);
        inventory.shuffles.extend(shuffles);
        inventory.segments.extend(segments);
        Ok(())
    }

    /// Settles a server's complete inventory against what the namespace and the shuffle registry
    /// reference there: `referenced` (block id → its file is sealed) and `shuffles` (registered
    /// shuffles with segments there). Blocks held but unreferenced, and unknown shuffles, are
    /// queued for freeing; referenced blocks it did not report are lost (those of unsealed files
    /// only when the server restarted: otherwise they may simply not be written yet). From now
    /// on, blocks and segments may be placed there. Returns what it did, and the segments the
    /// server reported (for the shuffle registry to settle: see `Shuffles::lost_on`).
    pub fn reconcile(
        &mut self,
        server_id: ServerId,
        referenced: &HashMap<BlockId, bool>,
        restarted: bool,
        registered_shuffle: impl Fn(ShuffleId) -> bool,
        needed_segment: impl Fn(SegmentCopy) -> bool,
    ) -> (Reconciled, HashSet<SegmentCopy>) {
        let Some(mut server) = self.servers.get_mut(&server_id) else {
            return (Reconciled::default(), HashSet::new());
        };
        let server = &mut *server;
        let inventory = server.inventory.take().unwrap_or_default();
        let mut done = Reconciled::default();
        server.frees = VecDeque::new();
        server.shuffle_frees = 0;
        server.nvme_frees = 0;
        server.allocated = 0;
        server.nvme_allocated = 0;
        server.lost_blocks.clear();
        let describe = server.describe(server_id);
        for (&block_id, &sealed) in referenced {
            if inventory.blocks.contains(&block_id) {
                *server.allocated_mut(block_id.tier()) += 1;
            } else if sealed || restarted {
                let why =
                    format!("block {} on {describe} is lost: the server registered again without it", block_id.get());
                server.lost_blocks.insert(block_id, why);
                done.lost += 1;
            } else {
                // Placed for a file still being written, and not written yet.
                *server.allocated_mut(block_id.tier()) += 1;
            }
        }
        let mut unreferenced: Vec<BlockId> =
            inventory.blocks.iter().copied().filter(|id| !referenced.contains_key(id)).collect();
        unreferenced.sort_unstable();
        for block_id in unreferenced {
            *server.allocated_mut(block_id.tier()) += 1;
            server.queue_free(Free::Block(block_id));
            done.unreferenced += 1;
        }
        let mut unknown: Vec<ShuffleId> =
            inventory.shuffles.iter().copied().filter(|&id| !registered_shuffle(id)).collect();
        unknown.sort_unstable();
        for shuffle_id in unknown {
            server.queue_free(Free::Shuffle(shuffle_id));
            done.unknown_shuffles += 1;
        }
        let mut orphans: Vec<SegmentCopy> = inventory
            .segments
            .iter()
            .copied()
            .filter(|s| registered_shuffle(s.shuffle_id) && !needed_segment(*s))
            .collect();
        orphans.sort_unstable_by_key(|s| (s.shuffle_id, s.partition, s.index));
        for segment in orphans {
            server.queue_free(Free::Segment(segment));
            done.unreferenced_segments += 1;
        }
        server.reconciled = true;
        (done, inventory.segments)
    }
}
