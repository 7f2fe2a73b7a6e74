//! The one way to start Tern's daemons on this machine, for `tern up`, the benchmarks' embedded
//! clusters, the black-box test harness and the executor pool alike.
//!
//! - [`ports`]: the port layout of a local cluster, and free loopback ports to put it on;
//! - [`host`]: where a daemon runs and which address it serves on;
//! - [`process`]: a daemon process with its log file, parent-death signal, graceful stop and kill;
//! - [`ready`]: waiting with a deadline and a bounded backoff, never a fixed sleep;
//! - [`probe`]: the readiness checks a cluster's daemons answer;
//! - [`netns`]: hosts as network namespaces on a bridge, with links to cut, heal and slow;
//! - [`supervise`]: keeping daemons running: restarts with a backoff and a limit (`tern up`);
//! - [`cluster`]: a throwaway `tern up` cluster in a temp dir, for benchmarks and `tern terasort`.

pub mod cluster;
pub mod host;
// setns(2) to run a thread on a namespace host.
#[allow(unsafe_code)]
pub mod netns;
pub mod ports;
pub mod probe;
// prctl(2) for the parent-death signal, kill(2) for graceful stops.
#[allow(unsafe_code)]
pub mod process;
pub mod ready;
pub mod supervise;

pub use host::Host;
pub use netns::Network;
pub use ports::{free_port, free_port_range, PortLayout};
pub use probe::{cluster_ready, metadata_answers, storage_registered};
pub use process::{first_exit, first_exited, stop_together, Daemon, DaemonSpec, Stopped};
pub use ready::{poll_until, wait_ready, Deadline};
pub use supervise::{DaemonReport, DaemonState, Event, RestartLimits, Supervisor};
