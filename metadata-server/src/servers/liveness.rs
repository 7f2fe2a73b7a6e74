//! Whether storage servers are alive: heartbeats, silence past the timeout and death (dead
//! servers remembered up to a bound), and clients' reports of servers they cannot reach.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use tern_proto::v1::{HeartbeatResponse, TierUsage};
use tern_proto::ServerId;

use super::{Servers, MAX_DEAD_SERVERS};

impl Servers {
    /// Records a heartbeat, drops the frees it acknowledges, and answers with the frees still due.
    pub fn heartbeat(
        &mut self,
        server_id: ServerId,
        tiers: Vec<TierUsage>,
        freed_through_seq: u64,
        now: Instant,
    ) -> HeartbeatResponse {
        let Some(mut server) = self.servers.get_mut(&server_id).filter(|s| s.alive) else {
            return HeartbeatResponse { reregister: true, ..HeartbeatResponse::default() };
        };
        server.last_seen = now;
        server.acknowledge_frees(freed_through_seq);
        // A heartbeat without tiers says nothing about capacity; keep the last report.
        if !tiers.is_empty() {
            server.take_report(tiers);
        }
        let mut reply =
            HeartbeatResponse { free_seq: freed_through_seq, drained: server.drained, ..HeartbeatResponse::default() };
        server.add_frees_due(&mut reply);
        reply
    }

    /// Counts every server's silence from `now` (see `State::count_leases_from`); a client's
    /// report that one is unreachable stands.
    pub fn count_timeouts_from(&mut self, now: Instant) {
        self.servers.for_each_mut(|_, server| server.last_seen = now);
    }

    /// Declares dead every live server silent for longer than `timeout`; returns their ids and
    /// descriptions.
    pub fn expire(&mut self, now: Instant, timeout: Duration) -> Vec<(ServerId, String)> {
        // Reports of unreachability lapse: the server takes placements again (a client that
        // still cannot reach it reports again).
        let lapsed: Vec<ServerId> = self
            .servers
            .iter()
            .filter(|(_, s)| s.unreachable_until.is_some_and(|until| until <= now))
            .map(|(&id, _)| id)
            .collect();
        for id in lapsed {
            if let Some(mut server) = self.servers.get_mut(&id) {
                server.unreachable_until = None;
            }
        }
        let silent: Vec<(ServerId, Duration)> = self
            .servers
            .iter()
            .filter(|(_, s)| s.alive || s.restored)
            .map(|(&id, s)| (id, now.saturating_duration_since(s.last_seen)))
            .filter(|&(_, silence)| silence > timeout)
            .collect();
        silent
            .into_iter()
            .map(|(id, silence)| {
                let reason = if self.servers[&id].restored {
                    format!(
                        "server did not register again within {:.1}s of the metadata server's restart",
                        silence.as_secs_f64()
                    )
                } else {
                    format!("server missed heartbeats for {:.1}s", silence.as_secs_f64())
                };
                (id, self.mark_dead(id, reason))
            })
            .collect()
    }

    /// A client cannot reach the server at `address` (its block or QUIC address): if it is
    /// alive, nothing new is placed there until `until` (see [`Servers::expire`]). Returns
    /// whether it is alive, or `None` for an address no server has.
    pub fn report_unreachable(&mut self, address: &str, until: Instant) -> Option<(ServerId, bool)> {
        let (&id, _) = self
            .servers
            .iter()
            .find(|(_, s)| s.address == address || (!s.quic_address.is_empty() && s.quic_address == address))?;
        let mut server = self.servers.get_mut(&id).expect("found above");
        if server.alive {
            server.unreachable_until = Some(server.unreachable_until.map_or(until, |t| t.max(until)));
        }
        Some((id, server.alive))
    }

    /// Marks a server dead, drops its pending frees, and forgets the oldest dead servers beyond
    /// the bound; returns a description for the log.
    pub(super) fn mark_dead(&mut self, server_id: ServerId, reason: String) -> String {
        let mut description = String::new();
        if let Some(mut server) = self.servers.get_mut(&server_id) {
            description = format!("{}: {reason}", server.describe(server_id));
            server.alive = false;
            server.restored = false;
            server.reconciled = false;
            server.inventory = None;
            server.death = reason;
            // Its pending frees will never be carried out, and need not be: the data is gone.
            let dram_frees = server.frees.len() as u64 - server.shuffle_frees - server.nvme_frees;
            server.allocated = server.allocated.saturating_sub(dram_frees);
            server.nvme_allocated = server.nvme_allocated.saturating_sub(server.nvme_frees);
            server.frees = VecDeque::new();
            server.shuffle_frees = 0;
            server.nvme_frees = 0;
        }
        let dead: Vec<ServerId> = self.servers.iter().filter(|(_, s)| !s.readable()).map(|(&id, _)| id).collect();
        for id in dead.iter().take(dead.len().saturating_sub(MAX_DEAD_SERVERS)) {
            self.servers.remove(id);
        }
        description
    }
}
