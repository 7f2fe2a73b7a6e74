//! Tern's RDMA transport (InfiniBand, RoCE, soft-RoCE), on `rdma-sys` (libibverbs and
//! librdmacm), compiled only with this crate's feature `verbs` (the `tern` binary's feature
//! `rdma`): without it this crate is empty and [`install`] does nothing, so the workspace builds
//! on machines without the RDMA headers.
//!
//! `tern_transport` holds no verbs code: this crate installs itself there
//! (`tern_transport::rdma_provider`) when the binary starts, so storage servers, clients and the
//! benches reach RDMA through `tern_transport` alone, and turning RDMA on rebuilds only this
//! crate and the binary. ARCHITECTURE.md ("RDMA") has the design.

#[cfg(feature = "verbs")]
pub mod one_sided;
#[cfg(feature = "verbs")]
mod stream;
#[cfg(feature = "verbs")]
#[allow(unsafe_code)]
mod verbs;

#[cfg(feature = "verbs")]
pub use stream::{RdmaConnector, RdmaListener, MAX_CONNECTIONS};

/// Makes this build's RDMA available to `tern_transport` (probe, listener, connector); call once
/// at start-up. Without the `verbs` feature it does nothing, and `tern_transport` says "built
/// without RDMA support" wherever RDMA is asked for.
pub fn install() {
    #[cfg(feature = "verbs")]
    tern_transport::rdma_provider::install(Box::new(stream::Verbs));
}
