//! Tern's data-plane transports and the cluster's TLS material.
//!
//! The block protocol (`tern_proto::frame`) runs over any ordered, reliable byte stream. This
//! crate gives the storage server's block service and the client's connection pool one interface
//! to such streams:
//!
//! - a [`Connector`] (client side) dials `host:port` and hands back a reader and a writer;
//! - a [`Listener`] (server side) accepts them, with the peer's address;
//!
//! implemented for plain TCP ([`tcp`]), TLS 1.3 over TCP ([`tls_tcp`], mutual, the encrypted path
//! between hosts by default), QUIC with mutual TLS ([`quic`]: one bidirectional stream per
//! block connection, spread over several endpoints so more than one core carries traffic), and a
//! Unix socket to a storage server on the client's own host ([`local`]), which also shares the
//! server's DRAM arena read-only so leased blocks are read with no request at all. [`tls`] makes and loads the certificates, which the gRPC control plane uses too,
//! and [`failover`] is the control plane's channel to a replicated metadata service: every
//! caller's, so all follow its leader the same way.
//! (The rule that keeps plain TCP on loopback unless a network is trusted is daemon config:
//! `tern_common::config::check_listen`.)

pub mod failover;
pub mod local;
pub mod quic;
pub mod rdma_or;
pub mod rdma_provider;
pub mod tcp;
pub mod tls;
pub mod tls_tcp;

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::str::FromStr;

use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncWrite};

/// The reading half of a block connection.
pub type BoxRead = Box<dyn AsyncRead + Send + Unpin>;
/// The writing half of a block connection; `shutdown` ends the stream (TCP FIN, QUIC stream FIN).
pub type BoxWrite = Box<dyn AsyncWrite + Send + Unpin>;

/// One byte stream between a client and a storage server.
pub struct Stream {
    pub reader: BoxRead,
    pub writer: BoxWrite,
    /// The other end's address.
    pub peer: SocketAddr,
    /// On a same-host connection ([`local`]), the storage server's DRAM arena, which the client
    /// reads leased blocks from directly, and the connection's staging area for writes.
    pub local: Option<local::SameHost>,
    /// On an RDMA connection, its one-sided operations (memory windows a server lends, RDMA
    /// READs a client makes): see [`rdma_provider::OneSided`].
    pub one_sided: Option<std::sync::Arc<dyn rdma_provider::OneSided>>,
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream").field("peer", &self.peer).finish_non_exhaustive()
    }
}

/// The client side: dials storage servers.
pub trait Connector: Send + Sync + 'static {
    /// Opens a new stream to `addr` (`host:port`).
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Stream>>;
}

/// The server side: accepts streams from clients.
pub trait Listener: Send + 'static {
    /// The next stream a client opened. An error is about one attempt; the listener stays usable.
    fn accept(&mut self) -> BoxFuture<'_, io::Result<Stream>>;
    /// The bound address.
    fn local_addr(&self) -> SocketAddr;
    /// A short name for logs ("tcp", "quic").
    fn name(&self) -> &'static str;
}

impl Connector for std::sync::Arc<dyn Connector> {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Stream>> {
        (**self).connect(addr)
    }
}

impl Listener for Box<dyn Listener> {
    fn accept(&mut self) -> BoxFuture<'_, io::Result<Stream>> {
        (**self).accept()
    }

    fn local_addr(&self) -> SocketAddr {
        (**self).local_addr()
    }

    fn name(&self) -> &'static str {
        (**self).name()
    }
}

/// The next stream of a listener whose accepting (and handshakes) run in tasks of their own and
/// hand streams over through `streams`. Once every sender is gone it waits forever instead of
/// spinning the caller's accept loop.
pub async fn next_handed_over(streams: &mut tokio::sync::mpsc::Receiver<Stream>) -> io::Result<Stream> {
    match streams.recv().await {
        Some(stream) => Ok(stream),
        None => {
            futures::future::pending::<()>().await;
            Err(io::Error::other("listener closed"))
        }
    }
}

/// The RDMA devices this process can use (`rxe0`, `mlx5_0`), or why there are none: "no RDMA
/// device", or a build without the `rdma` cargo feature. Cheap (reads sysfs): called at start-up.
pub fn rdma_devices() -> Result<Vec<String>, String> {
    match rdma_provider::provider().map(|rdma| rdma.devices()) {
        None => Err(rdma_provider::NOT_BUILT.to_string()),
        Some(Ok(devices)) if !devices.is_empty() => Ok(devices),
        Some(Ok(_)) => Err("no RDMA device".to_string()),
        Some(Err(e)) => Err(format!("no RDMA device ({e})")),
    }
}

/// An RDMA listener on `addr` (the block service's bound address), or why not (a build without
/// the `rdma` feature, no device on that address). With `lendable` (the DRAM arena), its
/// connections can lend parts of it for one-sided READs.
pub fn bind_rdma(addr: SocketAddr, lendable: Option<rdma_provider::Lendable>) -> io::Result<Box<dyn Listener>> {
    match rdma_provider::provider() {
        Some(rdma) => rdma.bind(addr, lendable),
        None => {
            Err(io::Error::new(io::ErrorKind::Unsupported, format!("RDMA on {addr}: {}", rdma_provider::NOT_BUILT)))
        }
    }
}

/// Which transport a client uses for block traffic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Per server: its same-host socket when it runs on this host (see [`local`]); else, with no
    /// TLS material, RDMA where both ends have it; plain TCP to one on loopback, TLS over TCP to
    /// any other when the client has TLS material, plain TCP otherwise (a trusted network). See
    /// [`local::LocalFirst`], [`rdma_or::RdmaOr`] and [`tls_tcp::AutoConnector`].
    #[default]
    Auto,
    /// Only the same-host socket: a server on another host is an error.
    Local,
    /// Plain TCP (TCP_NODELAY), the storage servers' `listen` address.
    Tcp,
    /// TLS 1.3 over TCP, mutual, on the same address as plain TCP; needs TLS material.
    Tls,
    /// QUIC with mutual TLS, the storage servers' `quic_listen` address; needs TLS material.
    Quic,
    /// RDMA (rdma_cm on the storage servers' block address) to each server that serves it, plain
    /// TCP to any other, with one log line per server ([`rdma_or::RdmaOr`]). Frames go
    /// unencrypted, as over plain TCP: for a trusted network.
    Rdma,
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportKind::Auto => "auto",
            TransportKind::Local => "local",
            TransportKind::Tcp => "tcp",
            TransportKind::Tls => "tls",
            TransportKind::Quic => "quic",
            TransportKind::Rdma => "rdma",
        })
    }
}

impl FromStr for TransportKind {
    type Err = String;

    fn from_str(s: &str) -> Result<TransportKind, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(TransportKind::Auto),
            "local" => Ok(TransportKind::Local),
            "tcp" => Ok(TransportKind::Tcp),
            "tls" => Ok(TransportKind::Tls),
            "quic" => Ok(TransportKind::Quic),
            "rdma" => Ok(TransportKind::Rdma),
            other => Err(format!("unknown transport {other:?} (expected auto, local, tcp, tls, quic or rdma)")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_kinds_parse() {
        assert_eq!("QUIC".parse::<TransportKind>().unwrap(), TransportKind::Quic);
        assert_eq!(TransportKind::Tcp.to_string(), "tcp");
        assert_eq!("tls".parse::<TransportKind>().unwrap(), TransportKind::Tls);
        assert_eq!(TransportKind::default().to_string(), "auto");
        assert_eq!("rdma".parse::<TransportKind>().unwrap(), TransportKind::Rdma);
        assert!("udp".parse::<TransportKind>().is_err());
    }
}
