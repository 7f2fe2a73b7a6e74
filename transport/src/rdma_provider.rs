//! Where RDMA comes from. The verbs code lives in the `tern-rdma` crate, which the `tern` binary
//! built with its cargo feature `rdma` installs here at start-up ([`install`]). This crate stays
//! free of FFI and of libibverbs, everything above it builds anywhere, and turning RDMA on
//! rebuilds only `tern-rdma` and the binary, not every crate that uses a transport.

use std::io;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;

use crate::{Listener, Stream};

/// What every "no RDMA" answer says in a build without it.
pub const NOT_BUILT: &str = "built without RDMA support (the `tern` binary's cargo feature `rdma`)";

/// An RDMA implementation: a device probe, a listener and a connector.
pub trait RdmaProvider: Send + Sync + 'static {
    /// The RDMA devices of this host (`rxe0`, `mlx5_0`); empty when there is none.
    fn devices(&self) -> io::Result<Vec<String>>;
    /// Serves block connections over RDMA on `addr` (the block service's bound address); with
    /// `lendable`, its connections may lend views of that memory ([`OneSided::lend`]).
    fn bind(&self, addr: SocketAddr, lendable: Option<Lendable>) -> io::Result<Box<dyn Listener>>;
    /// Dials a storage server's block address over RDMA.
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Stream>>;
}

static PROVIDER: OnceLock<Box<dyn RdmaProvider>> = OnceLock::new();

/// Installs the process's RDMA implementation; the first one installed stays.
pub fn install(provider: Box<dyn RdmaProvider>) {
    let _ = PROVIDER.set(provider);
}

/// The installed RDMA implementation, if this build has one.
pub fn provider() -> Option<&'static dyn RdmaProvider> {
    PROVIDER.get().map(|p| p.as_ref())
}

/// Memory a storage server's RDMA connections may lend parts of (its DRAM arena): registered once
/// per RDMA device with no access of its own but the right to bind memory windows over it, so a
/// peer reads only what a window lends, never the rest.
#[derive(Debug, Clone, Copy)]
pub struct Lendable {
    /// The first byte's address.
    pub base: usize,
    pub len: usize,
}

/// Where a peer may READ lent bytes: a memory window's start address and remote key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub addr: u64,
    pub rkey: u32,
}

/// The one-sided half of an RDMA connection (`Stream::one_sided`), served by its pump thread.
pub trait OneSided: Send + Sync {
    /// Server: binds a remote-read memory window over exactly `pin`'s bytes (a view of the
    /// [`Lendable`] memory), answering its id and [`Window`]. The connection holds `pin` until the
    /// window is invalidated (by [`OneSided::revoke`], after `ttl`, or with the connection) and
    /// that invalidation completed, so the bytes are never reused while readable.
    fn lend(&self, pin: Bytes, ttl: Duration) -> BoxFuture<'_, io::Result<(u64, Window)>>;
    /// Server: invalidates window `id` and waits for that; `false` if it was not held (ended
    /// already).
    fn revoke(&self, id: u64) -> BoxFuture<'_, io::Result<bool>>;
    /// Client: READs `len` bytes of the peer's `window` into memory of this connection's own.
    /// A READ the peer refuses (a key no longer valid) fails, and with it the connection.
    fn read(&self, window: Window, len: usize) -> BoxFuture<'_, io::Result<Bytes>>;
}
