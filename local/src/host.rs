//! Where a daemon runs: a named host with its own address, on which its commands are started.
//!
//! Today the only host is this machine's loopback ([`Host::local`]): commands run directly and
//! daemons serve on 127.0.0.1. A daemon's spec names its host rather than an address, so hosts that
//! are network namespaces on a bridge (commands run through `ip netns exec NAME`, each with its
//! own address; see the multi-host notes) can be added here without changing any caller.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Command;

/// A host daemons can be placed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    name: String,
    ip: IpAddr,
}

impl Host {
    /// This machine, on loopback.
    pub fn local() -> Host {
        Host { name: "local".to_string(), ip: IpAddr::V4(Ipv4Addr::LOCALHOST) }
    }

    /// The host's name, as errors and logs show it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The address its daemons serve on.
    pub fn ip(&self) -> IpAddr {
        self.ip
    }

    /// The host's address at `port`.
    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.ip, port)
    }

    /// A command that runs `program` on this host.
    pub(crate) fn command(&self, program: &Path) -> Command {
        Command::new(program)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_host_serves_on_loopback() {
        let host = Host::local();
        assert_eq!(host.addr(9060).to_string(), "127.0.0.1:9060");
        assert_eq!(host.name(), "local");
    }
}
