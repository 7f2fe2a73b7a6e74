//! Tern's metadata server: the namespace (directories and write-once files), jobs and their
//! leases, the storage-server registry, block placement, and the shuffle registry.
//!
//! Clients call the `Metadata` gRPC service; storage servers register and heartbeat on the
//! `Registry` service, and learn on each heartbeat which blocks and shuffles to free. All state is
//! in memory, behind one mutex (see `state` for the rules, and the modules it draws on for the
//! details); every change is logged and synced before it is acknowledged (see `wal`). Time is
//! passed in: the state and everything under it take a `tern_common::Now` from the edge (the
//! gRPC service reads the clock once per call, the server's loops once per pass), so a replayed
//! log record never depends on the replaying host's clock; `clippy.toml` forbids reading it
//! anywhere else.
//!
//! Modules: `config` (the typed configuration), `path` (path normalisation and the `/jobs` tree),
//! `namespace` (the directory tree), `servers` (the storage-server registry, liveness and frees),
//! `planner` (where new blocks and segments go: pure), `jobs` (jobs and leases), `shuffles`
//! (shuffles, their segments and map commits), `state` (one method per RPC over all of them, each
//! change committed through one apply that log replay runs too), `service` (the gRPC services), `metrics`, `server` (start, run, shutdown),
//! `conn_limit` (the bound on gRPC connections), `dirlock` (one server per directory), `fuzzing`
//! (request validation under arbitrary input, for fuzzing and tests), `error` (refusals and their
//! context), `wal` (the write-ahead log and snapshots in `--dir` that make the state survive
//! restarts).

mod authz;
mod config;
mod conn_limit;
mod copies;
mod dirlock;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod jobs;
mod keyfile;
mod metrics;
mod namespace;
mod path;
mod planner;
mod raft;
mod server;
mod servers;
mod service;
mod shuffles;
mod state;
mod wal;

pub use config::{Config, TenantQuota};
pub use server::{run, start, MetadataServer};
