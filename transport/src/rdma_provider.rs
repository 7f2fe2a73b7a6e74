//! Where RDMA comes from. The verbs code lives in the `tern-rdma` crate, which the `tern` binary
//! built with its cargo feature `rdma` installs here at start-up ([`install`]). This crate stays
//! free of FFI and of libibverbs, everything above it builds anywhere, and turning RDMA on
//! rebuilds only `tern-rdma` and the binary, not every crate that uses a transport.

use std::io;
use std::net::SocketAddr;
use std::sync::OnceLock;

use futures::future::BoxFuture;

use crate::{Listener, Stream};

/// What every "no RDMA" answer says in a build without it.
pub const NOT_BUILT: &str = "built without RDMA support (the `tern` binary's cargo feature `rdma`)";

/// An RDMA implementation: a device probe, a listener and a connector.
pub trait RdmaProvider: Send + Sync + 'static {
    /// The RDMA devices of this host (`rxe0`, `mlx5_0`); empty when there is none.
    fn devices(&self) -> io::Result<Vec<String>>;
    /// Serves block connections over RDMA on `addr` (the block service's bound address).
    fn bind(&self, addr: SocketAddr) -> io::Result<Box<dyn Listener>>;
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
