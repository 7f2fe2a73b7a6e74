//! Tern's wire formats, one definition for servers and clients:
//! - [`v1`]: the gRPC control plane (namespace, jobs, storage-server registry), from `proto/tern.proto`;
//! - [`sched`]: the task scheduler's service (jobs of stages, executors), from `proto/scheduler.proto`;
//! - [`frame`]: the binary block-frame codec of the data plane;
//! - [`buffers`]: receive buffers recycled from a bounded pool, so large payloads reuse warm pages;
//! - [`crc`]: crc32c of joined parts from the parts' crcs, for checksums kept instead of retaken;
//! - [`shuffle`]: what Push and Fetch frames carry inside their payloads;
//! - [`health`]: the standard gRPC health service, following a daemon's readiness;
//! - [`error`]: the error kinds both planes carry, so a caller can act on them;
//! - [`tier`]: storage tiers and storage classes, with their names;
//! - [`identity`]: roles, tenants and the credentials that prove them on the control plane;
//! - [`ids`]: typed ids of servers, shuffles and blocks (a block id names its tier);
//! - [`token`]: job tokens and grants, the data plane's capabilities;
//! - [`request_id`]: client request ids, so a retried change is answered, not done twice.

pub mod buffers;
pub mod crc;
pub mod error;
pub mod frame;
pub mod health;
pub mod identity;
pub mod ids;
pub mod request_id;
pub mod shuffle;
pub mod tier;
pub mod token;

/// Generated gRPC messages and services (package `tern.v1`).
pub mod v1 {
    tonic::include_proto!("tern.v1");
}

/// Generated scheduler messages and service (package `tern.sched.v1`).
pub mod sched {
    tonic::include_proto!("tern.sched.v1");
}

pub use error::{cut_message, ErrorKind};
pub use ids::{BlockId, FileId, ServerId, ShuffleId, NVME_BLOCK_BIT};
pub use tier::{StorageClass, Tier};

pub use ids::{MapAttempt, MapIndex, PartitionIndex};

/// Default cluster block size: 1 MiB.
pub const DEFAULT_BLOCK_SIZE: u32 = 1 << 20;
/// Largest block size a cluster may choose (and so the largest data frame).
pub const MAX_BLOCK_SIZE: u32 = 64 << 20;
/// Smallest block size a cluster may choose.
pub const MIN_BLOCK_SIZE: u32 = 4 << 10;
/// Most blocks one AllocateBlocks call may ask for.
pub const MAX_ALLOCATE_BLOCKS: u32 = 1024;
/// Largest gRPC message either side accepts.
pub const MAX_GRPC_MESSAGE_BYTES: usize = 16 << 20;
/// Most entries (block ids, shuffle ids and segments together) one ReportInventory page carries:
/// at most 1 MiB.
pub const MAX_INVENTORY_PAGE: usize = 65536;
/// Most copies of a file's block (`CreateRequest.replicas`): each copy needs its own storage server.
pub const MAX_REPLICAS: u32 = 2;
