//! Which storage servers exist (their logged identities: id, address, instance) and their
//! registrations: a server registering from a known address is that server again.

use std::net::SocketAddr;
use std::time::Instant;

use tern_proto::v1::{LogServer, ServerMode, TierUsage};
use tern_proto::ServerId;

use super::inventory::Inventory;
use super::server::Server;
use super::Servers;
use crate::error::{invalid, Refusal};

impl Servers {
    /// Checks a registration from `address` (and `quic_address`, "" for none) and chooses its
    /// id: a server registering from the address of a known one (alive, dead, or restored from
    /// the log) is that server again and keeps its id, so the blocks the namespace places there
    /// stay its own. Returns the id and the instance id it had before (`None` for a new server).
    /// Changes nothing: see [`Servers::record`] and [`Servers::take_registration`].
    pub fn check_registration(&self, address: &str, quic_address: &str) -> Result<(ServerId, Option<u64>), Refusal> {
        host_of_address(address)?;
        if !quic_address.is_empty() {
            host_of_address(quic_address)?;
        }
        Ok(match self.servers.iter().find(|(_, s)| s.address == address) {
            Some((&server_id, server)) => (server_id, Some(server.instance_id)),
            None => (self.next_server_id, None),
        })
    }

    /// Records a server's identity (a registration, live or replayed). A server new to this
    /// registry comes in restored: readable, but nothing is placed there until it registers (see
    /// [`Servers::take_registration`]), and declared dead if it does not within the server
    /// timeout. A known one keeps its state and counts.
    pub fn record(&mut self, server_id: ServerId, address: &str, quic_address: &str, instance_id: u64, now: Instant) {
        let host = host_of_address(address).unwrap_or_default();
        // Another server known at this address is an older record of the same one.
        self.servers.retain(|id, s| id == server_id || s.address != address);
        if !self.servers.contains_key(&server_id) {
            let mut server = Server::new(address, host.clone(), instance_id, now);
            server.restored = true;
            self.servers.insert(server_id, server);
        }
        let mut server = self.servers.get_mut(&server_id).expect("inserted above");
        // A drained server that comes back as a new process (a restarted pod) is not drained
        // again: the drain was of the process that exited. A cordon is the operator's and stays.
        if server.instance_id != instance_id && server.mode == ServerMode::Draining {
            server.set_mode(ServerMode::Active, None);
        }
        server.address = address.to_string();
        server.host = host;
        server.quic_address = quic_address.to_string();
        server.instance_id = instance_id;
        self.next_server_id = self.next_server_id.max(server_id.next());
    }

    /// Every known server's identity, as the log records it.
    pub fn identities(&self) -> Vec<LogServer> {
        self.servers
            .iter()
            .map(|(&id, s)| LogServer {
                server_id: id.get(),
                address: s.address.clone(),
                quic_address: s.quic_address.clone(),
                instance_id: s.instance_id,
            })
            .collect()
    }

    /// A recorded server registered (not logged: liveness is rebuilt by registrations): alive
    /// with the usage it reported, and awaiting its inventory; nothing is placed there until the
    /// inventory is reconciled. `restarted`: the registration came from a new process.
    pub fn take_registration(&mut self, server_id: ServerId, tiers: Vec<TierUsage>, restarted: bool, now: Instant) {
        let Some(mut server) = self.servers.get_mut(&server_id) else {
            return;
        };
        server.alive = true;
        server.restored = false;
        server.reconciled = false;
        server.restarted = restarted;
        server.inventory = Some(Inventory::default());
        server.death.clear();
        server.last_seen = now;
        server.unreachable_until = None;
        server.take_report(tiers);
    }
}

/// The host part of a `host:port` address, or why it is not one.
pub(super) fn host_of_address(address: &str) -> Result<String, Refusal> {
    let refuse = |why: &str| invalid(format!("storage server address {address:?} is not host:port: {why}"));
    if let Ok(socket) = address.parse::<SocketAddr>() {
        if socket.port() == 0 {
            return Err(refuse("port 0"));
        }
        return Ok(socket.ip().to_string());
    }
    let (host, port) = address.rsplit_once(':').ok_or_else(|| refuse("no port"))?;
    match port.parse::<u16>() {
        Ok(0) => return Err(refuse("port 0")),
        Ok(_) => {}
        Err(_) => return Err(refuse("bad port")),
    }
    let hostname = !host.is_empty() && host.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
    if !hostname {
        return Err(refuse("bad host"));
    }
    Ok(host.to_ascii_lowercase())
}
