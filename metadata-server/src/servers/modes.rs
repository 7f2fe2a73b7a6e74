//! Operators' modes: a cordoned server takes no new placements; a draining one also has what it
//! holds copied off, and is told to exit once nothing there is needed or its deadline passed.
//! Modes are logged (a drain's deadline as wall-clock time).

use std::time::Instant;

use tern_common::Now;
use tern_proto::v1::{LogServerMode, ServerMode};
use tern_proto::ServerId;

use super::Servers;

/// A storage server's drain as the registry sees it, for the state to check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drain {
    pub server_id: ServerId,
    pub deadline: Instant,
}

impl Servers {
    /// The servers not active (cordoned or draining), as the log records them at `now` (a
    /// drain's deadline as wall-clock time, so a replay at any later time counts it down).
    pub fn modes(&self, now: Now) -> Vec<LogServerMode> {
        self.servers
            .iter()
            .filter(|(_, s)| s.mode != ServerMode::Active)
            .map(|(&id, s)| LogServerMode {
                server_id: id.get(),
                mode: s.mode as i32,
                drain_deadline_unix_ms: s.drain_deadline.map_or(0, |deadline| {
                    let left = deadline.saturating_duration_since(now.instant);
                    now.unix_ms.saturating_add(left.as_millis() as u64)
                }),
            })
            .collect()
    }

    /// Sets a server's mode (a logged change, live or replayed). A server no longer known (long
    /// dead, forgotten) is left alone.
    pub fn set_mode(&mut self, server_id: ServerId, mode: ServerMode, drain_deadline: Option<Instant>) {
        if let Some(mut server) = self.servers.get_mut(&server_id) {
            server.set_mode(mode, drain_deadline);
        }
    }

    /// Servers draining and still up.
    pub fn draining(&self) -> Vec<ServerId> {
        self.servers
            .iter()
            .filter(|(_, s)| s.mode == ServerMode::Draining && s.readable())
            .map(|(&server_id, _)| server_id)
            .collect()
    }

    /// Servers draining and still up, with their deadlines (`now` for a drain without one: it
    /// is due).
    pub fn drains(&self, now: Instant) -> Vec<Drain> {
        self.servers
            .iter()
            .filter(|(_, s)| s.mode == ServerMode::Draining && s.readable())
            .map(|(&server_id, s)| Drain { server_id, deadline: s.drain_deadline.unwrap_or(now) })
            .collect()
    }

    /// Records how a drain stands: what it still waits for ("" = nothing), and whether the
    /// server is to exit now. Returns true when the server was newly told to exit.
    pub fn settle_drain(&mut self, server_id: ServerId, waiting_for: String, exit: bool) -> bool {
        let Some(mut server) = self.servers.get_mut(&server_id) else {
            return false;
        };
        server.drain_waiting_for = waiting_for;
        let newly = exit && !server.drained;
        server.drained = exit;
        newly
    }

    /// Records how many blocks on the server no other readable copy backs.
    pub fn set_sole_copy_blocks(&mut self, server_id: ServerId, blocks: u64) {
        if let Some(mut server) = self.servers.get_mut(&server_id) {
            server.sole_copy_blocks = blocks;
        }
    }
}
