//! Where a daemon runs: a named host with its own address, on which its commands are started.
//!
//! A host is this machine's loopback ([`Host::local`]: commands run directly, daemons serve on
//! 127.0.0.1), or a network namespace on a bridge that a [`crate::netns::Network`] made: commands
//! run through `ip netns exec NAME`, daemons serve on the namespace's own address. A daemon's spec
//! names its host rather than an address, so callers start daemons the same way on either.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Command;

/// A host daemons can be placed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    name: String,
    ip: IpAddr,
    /// The network namespace commands run in (`None`: this machine's own).
    netns: Option<String>,
    /// The host's link on the bridge, as the root namespace names it (what a cut takes down).
    link: Option<String>,
}

impl Host {
    /// This machine, on loopback.
    pub fn local() -> Host {
        Host { name: "local".to_string(), ip: IpAddr::V4(Ipv4Addr::LOCALHOST), netns: None, link: None }
    }

    /// The host `name` at `ip` inside namespace `netns`, whose bridge-side link is `link`.
    pub(crate) fn in_netns(name: &str, ip: IpAddr, netns: &str, link: &str) -> Host {
        Host { name: name.to_string(), ip, netns: Some(netns.to_string()), link: Some(link.to_string()) }
    }

    /// Its network namespace, when it is one.
    pub fn netns(&self) -> Option<&str> {
        self.netns.as_deref()
    }

    /// Its link on the bridge, when it is a namespace.
    pub fn link(&self) -> Option<&str> {
        self.link.as_deref()
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

    /// A command that runs `program` on this host. In a namespace, `ip netns exec` execs the
    /// program in place, so the child's pid (and its parent-death signal) is the program's own.
    pub fn command(&self, program: &Path) -> Command {
        match &self.netns {
            None => Command::new(program),
            Some(netns) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", netns]).arg(program);
                command
            }
        }
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
