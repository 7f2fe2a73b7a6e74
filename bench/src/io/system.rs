//! The systems `tern bench io` measures, by name, and which raw peer each Tern system is judged
//! against.

use std::fmt;
use std::str::FromStr;

use anyhow::Context;

/// A system under test. To add one: a variant here, its name in [`System::name`] and
/// [`System::ALL`], and an arm in `Target::start` (`target.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum System {
    /// Tern's DRAM tier over plain TCP.
    TernTcp,
    /// Tern's DRAM tier over TLS 1.3 on TCP.
    TernTls,
    /// Tern's DRAM tier over QUIC.
    TernQuic,
    /// Tern's NVMe tier over plain TCP.
    TernNvme,
    /// Tern's DRAM tier from a client on the server's host: the same-host socket, and reads of
    /// leased blocks straight from the shared arena (`tern_transport::local`).
    TernLocal,
    /// Tern's DRAM tier over RDMA; measured only where this host has an RDMA device (else left
    /// out of the run, said in its notes).
    TernRdma,
    /// The raw peers: the same transports with nothing but a request and its bytes (`raw.rs`).
    TcpRaw,
    TlsRaw,
    QuicRaw,
    Redis,
    File,
    FileDirect,
}

impl System {
    pub const ALL: [System; 12] = [
        System::TernTcp,
        System::TernTls,
        System::TernQuic,
        System::TernNvme,
        System::TernLocal,
        System::TernRdma,
        System::TcpRaw,
        System::TlsRaw,
        System::QuicRaw,
        System::Redis,
        System::File,
        System::FileDirect,
    ];

    pub fn name(self) -> &'static str {
        match self {
            System::TernTcp => "tern-tcp",
            System::TernTls => "tern-tls",
            System::TernQuic => "tern-quic",
            System::TernNvme => "tern-nvme",
            System::TernLocal => "tern-local",
            System::TernRdma => "tern-rdma",
            System::TcpRaw => "tcp-raw",
            System::TlsRaw => "tls-raw",
            System::QuicRaw => "quic-raw",
            System::Redis => "redis",
            System::File => "file",
            System::FileDirect => "file-direct",
        }
    }

    pub fn is_tern(self) -> bool {
        matches!(
            self,
            System::TernTcp
                | System::TernTls
                | System::TernQuic
                | System::TernNvme
                | System::TernLocal
                | System::TernRdma
        )
    }

    /// The raw peer over the same transport: the limit this Tern system is measured against.
    pub fn raw_peer(self) -> Option<System> {
        match self {
            // A same-host reader's bar is the fastest way to move bytes between two processes
            // here that this bench has: TCP on loopback.
            System::TernTcp | System::TernNvme | System::TernLocal | System::TernRdma => Some(System::TcpRaw),
            System::TernTls => Some(System::TlsRaw),
            System::TernQuic => Some(System::QuicRaw),
            _ => None,
        }
    }
}

impl fmt::Display for System {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for System {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<System> {
        System::ALL.into_iter().find(|system| system.name() == s.trim()).with_context(|| {
            let names: Vec<&str> = System::ALL.iter().map(|s| s.name()).collect();
            format!("unknown system {s:?}; the systems are {}", names.join(", "))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn systems_parse_by_name() {
        for system in System::ALL {
            assert_eq!(system.name().parse::<System>().unwrap(), system);
        }
        assert!("memcached".parse::<System>().unwrap_err().to_string().contains(
            "tern-tcp, tern-tls, tern-quic, tern-nvme, tern-local, tern-rdma, tcp-raw, tls-raw, quic-raw, redis, file, file-direct"
        ));
        assert!(System::TernTcp.is_tern() && !System::Redis.is_tern() && !System::TcpRaw.is_tern());
        assert_eq!(System::TernNvme.raw_peer(), Some(System::TcpRaw));
        assert_eq!(System::TernQuic.raw_peer(), Some(System::QuicRaw));
        assert_eq!(System::TernRdma.raw_peer(), Some(System::TcpRaw));
        assert_eq!(System::Redis.raw_peer(), None);
    }
}
