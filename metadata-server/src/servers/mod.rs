//! The storage-server registry: registrations, heartbeats and liveness, inventory
//! reconciliation, and the queues of blocks and shuffles waiting to be freed. Where new blocks and
//! segments go is the planner's choice (`planner`), over the view of room this registry gives.
//!
//! Storage servers register, then heartbeat. A server whose heartbeats stop is declared dead: the
//! blocks on it are lost (files keep them, and reading them reports DataLost) and nothing more is
//! placed there. Dead servers are remembered, up to a bound, so that messages can say why a block
//! was lost.
//!
//! Which servers exist (id, address, instance) is logged state, changed through
//! [`Servers::record`]; liveness, reports and free queues are rebuilt by registrations and
//! heartbeats, and are not logged.
//!
//! Frees travel on heartbeat replies: each server has one queue of (seq, block or shuffle) with
//! its own increasing sequence numbers; a reply carries a prefix of the queue, and the next
//! heartbeat acknowledges it with `freed_through_seq`. Unacknowledged frees are sent again, so a
//! lost reply costs nothing but a repeat (frees are idempotent on the storage server).
//!
//! Each server has a DRAM tier and may have an NVMe tier; the registry counts capacity and blocks
//! placed per tier. Block ids name their tier ([`BlockId`]), so a storage server knows a block's
//! tier from its id.
//!
//! A server's DRAM holds file blocks and shuffle segments side by side, and the server reports
//! only the total in use. The metadata server knows the blocks it placed there; shuffle data
//! grows as maps push, so it is known only through those reports (see `Server::used_blocks`).
//!
//! Where each decision lives:
//! - this file: the registry ([`Servers`]), its bounds, its id counters, and what it answers
//!   about a server or a block (alive, readable, lost and why, where);
//! - `server`: one server as kept here (liveness flags, tiers and what is used of them);
//! - `registration`: which servers exist (logged identities) and their registrations;
//! - `liveness`: heartbeats, silence and death, clients' reports of unreachable servers;
//! - `inventory`: a (re)registered server's inventory, reconciled with what is referenced there;
//! - `placement`: the room the planner places blocks and segments by, and counting what it
//!   placed;
//! - `index`: the servers, kept with the index of room and load that placement reads in order;
//! - `frees`: each server's queue of frees, carried on heartbeat replies until acknowledged;
//! - `modes`: operators' cordons and drains;
//! - `status`: servers as `tern admin servers` shows them.

use tern_proto::v1::BlockLocation;
use tern_proto::{ErrorKind, ServerId, Tier};

use crate::error::Refusal;
use crate::namespace::BlockRef;

mod frees;
mod index;
mod inventory;
mod liveness;
mod modes;
mod placement;
mod registration;
mod server;
mod status;

use index::Indexed;

/// Most frees one heartbeat reply carries (8 bytes each: 512 KiB, well under a gRPC message).
pub const MAX_FREES_PER_HEARTBEAT: usize = 65536;
/// Dead servers remembered for status and DataLost messages; the oldest beyond this are forgotten.
pub const MAX_DEAD_SERVERS: usize = 1024;
/// The DRAM tier's name in usage reports.
pub const DRAM_TIER: &str = Tier::Dram.name();

#[derive(Debug)]
pub struct Servers {
    servers: Indexed,
    next_server_id: ServerId,
    next_block_id: u64,
}

impl Default for Servers {
    fn default() -> Servers {
        // Ids start at 1 so that 0 can never name a server or block by accident.
        Servers { servers: Indexed::default(), next_server_id: ServerId::FIRST, next_block_id: 1 }
    }
}

impl Servers {
    /// The id counters (next server id, next block id), for snapshots.
    pub fn counters(&self) -> (ServerId, u64) {
        (self.next_server_id, self.next_block_id)
    }

    /// Raises the id counters to at least the given values.
    pub fn raise_counters(&mut self, next_server_id: ServerId, next_block_id: u64) {
        self.next_server_id = self.next_server_id.max(next_server_id);
        self.next_block_id = self.next_block_id.max(next_block_id);
    }

    /// The server `name` names: its id ("7") or its block-service address ("host:port").
    pub fn find(&self, name: &str) -> Result<ServerId, Refusal> {
        let name = name.trim();
        let found = match name.parse::<u64>() {
            // An operator's number names a server as the wire's would.
            Ok(id) => Some(ServerId::from_wire(id)).filter(|id| self.servers.contains_key(id)),
            Err(_) => self.servers.iter().find(|(_, s)| s.address == name).map(|(&id, _)| id),
        };
        found.ok_or_else(|| {
            Refusal::new(
                ErrorKind::NotFound,
                format!("no storage server {name:?} (give its id or its address host:port, as `tern admin servers` lists them)"),
            )
        })
    }

    /// Whether blocks and segments there can be read: the server is alive, or restored from the
    /// log and not yet declared dead.
    pub fn is_alive(&self, server_id: ServerId) -> bool {
        self.servers.get(&server_id).is_some_and(|s| s.readable())
    }

    /// Whether the block can be read (its server readable, the block not reported missing).
    pub fn block_readable(&self, block: &BlockRef) -> bool {
        self.servers.get(&block.server_id).is_some_and(|s| s.readable() && !s.lost_blocks.contains_key(&block.block_id))
    }

    /// Whether every block can be read: every server ever given an id is still known (none was
    /// forgotten long dead) and readable, and none reported a block missing. Then no file has a
    /// lost block, and nothing needs to look.
    pub fn all_blocks_readable(&self) -> bool {
        self.servers.len() as u64 == self.next_server_id.get() - 1
            && self.servers.values().all(|s| s.readable() && s.lost_blocks.is_empty())
    }

    /// Why `block` cannot be read, or `None` when its server is alive.
    pub fn lost(&self, block: &BlockRef) -> Option<String> {
        match self.servers.get(&block.server_id) {
            Some(server) if server.readable() => server.lost_blocks.get(&block.block_id).cloned(),
            Some(server) => Some(format!(
                "block {} on {} is lost: {}",
                block.block_id.get(),
                server.describe(block.server_id),
                server.death
            )),
            None => Some(format!(
                "block {} on storage server {} is lost: the server is no longer known (long dead)",
                block.block_id.get(),
                block.server_id
            )),
        }
    }

    /// A server's block-service address; empty for a server no longer known.
    pub fn address(&self, server_id: ServerId) -> String {
        self.servers.get(&server_id).map(|s| s.address.clone()).unwrap_or_default()
    }

    /// A server's QUIC address; empty for a server without one or no longer known.
    pub fn quic_address(&self, server_id: ServerId) -> String {
        self.servers.get(&server_id).map(|s| s.quic_address.clone()).unwrap_or_default()
    }

    /// Where a block lives, for clients.
    pub fn location(&self, block: &BlockRef, length: u32) -> BlockLocation {
        let (address, quic_address) =
            self.servers.get(&block.server_id).map(|s| (s.address.clone(), s.quic_address.clone())).unwrap_or_default();
        BlockLocation {
            block_id: block.block_id.get(),
            server_id: block.server_id.get(),
            address,
            length,
            quic_address,
            grant: Vec::new(),
        }
    }

    /// Servers that take new blocks and segments.
    pub fn live_count(&self) -> u64 {
        self.servers.values().filter(|s| s.placeable()).count() as u64
    }

    pub fn dead_count(&self) -> u64 {
        self.servers.values().filter(|s| !s.readable()).count() as u64
    }

    /// Blocks placed on live servers (all tiers) and not yet acknowledged as freed.
    pub fn allocated_blocks(&self) -> u64 {
        self.servers.values().filter(|s| s.alive).map(|s| s.allocated + s.nvme_allocated).sum()
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods, reason = "tests may read the clock")]
mod tests;
