//! Tern's benchmarks. Each measures Tern and a peer in the same run on the same machine, and
//! reports figures with their ratio to the peer, because these machines are shared and noisy and
//! only figures taken side by side compare.

pub mod core;
// kill(2) on the leader's process.
#[allow(unsafe_code)]
pub mod failover;
pub mod harness;
pub mod io;
pub mod replicas;
pub mod scale;
// kill(2) on the cold-start benchmark's executor.
#[allow(unsafe_code)]
pub mod scheduler;
pub mod shuffle;
pub mod soak;
pub mod spark;
pub mod spark_pool;
pub mod spark_small;
pub mod tiers;
pub mod tpcds;
