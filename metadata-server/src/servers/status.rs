//! Storage servers as operators see them (`tern admin servers`, the Status RPC).

use std::time::Instant;

use tern_proto::v1::ServerStatus;
use tern_proto::ServerId;

use super::Servers;

impl Servers {
    pub fn status(&self, now: Instant) -> Vec<ServerStatus> {
        self.servers.keys().filter_map(|&id| self.status_of(id, now)).collect()
    }

    /// One server's status; `None` for a server not known.
    pub fn status_of(&self, server_id: ServerId, now: Instant) -> Option<ServerStatus> {
        self.servers.get(&server_id).map(|s| ServerStatus {
            server_id: server_id.get(),
            address: s.address.clone(),
            quic_address: s.quic_address.clone(),
            alive: s.alive,
            tiers: s.tiers.clone(),
            allocated_blocks: s.allocated + s.nvme_allocated,
            last_heartbeat_ms_ago: now.saturating_duration_since(s.last_seen).as_millis() as u64,
            state: s.state_name().to_string(),
            segments: s.segments,
            drain_waiting_for: s.drain_waiting_for.clone(),
            drain_deadline_ms: s.drain_deadline.map_or(0, |d| d.saturating_duration_since(now).as_millis() as u64),
            sole_copy_blocks: s.sole_copy_blocks,
            drained: s.drained,
            // Filled in by the state, which holds the copies.
            copies_pending: 0,
        })
    }
}
