//! Tern's black-box tests, one binary with a module per area (it links once): each starts the
//! real `tern` binary as separate processes through [`common`], the harness on `tern-local`.
//! Run one area with `cargo nextest run --test integration -E 'test(/^files::/)'`.

#![allow(clippy::unwrap_used, reason = "test support: helpers outside #[test] fns unwrap as the tests do")]

mod common;

mod admin;
mod authz;
mod bench_failover;
mod bench_io;
mod bench_scale;
mod cli;
mod durability;
mod failures;
mod files;
mod jobs;
mod monitoring;
mod multihost;
mod ops;
mod quic;
mod replicated_metadata;
mod replication;
mod same_host;
mod scheduler;
mod scheduler_authz;
mod security;
mod shuffle;
mod soak;
mod spark;
mod terasort;
mod tiers;
mod up;
