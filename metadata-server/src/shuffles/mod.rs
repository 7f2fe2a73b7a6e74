//! The shuffle registry: shuffles, where their partitions' segments live, and map commits.
//!
//! A shuffle belongs to a job and has R reduce partitions. Each partition is a chain of segments,
//! indexed from 0, each on one storage server; map writers push batches into a partition's last
//! segment, and ask for the next one (AdvanceSegment) when it passes the split size, its server is
//! full, or it is lost. A map attempt that finished pushing commits: the metadata server records
//! its exact bytes per partition and the segments it pushed to. Readers locate a range of
//! partitions and maps and fetch exactly the committed attempts from the segments' servers.
//!
//! The metadata stays small whatever the data: per partition the list of its segments' servers,
//! per committed map one record (its attempt, one length per partition, and the segment range per
//! partition only when the map pushed past a partition's first segment). Every count is bounded:
//! shuffles, segments (per partition and in all), committed lengths in all, and what one reply
//! carries.
//!
//! A shuffle registered with 2 replicas keeps each segment on two servers (the same segment id on
//! both): writers push every batch to both copies, readers read either, and a segment is lost
//! only when both copies are. When one copy's server dies, partitions whose last segment had a
//! copy there move on to a new segment with two live copies, so new pushes stay replicated.
//!
//! Storage servers never learn which job a shuffle belongs to: when a shuffle is unregistered, or
//! its job ends, each live server holding its segments is told to drop the shuffle on its next
//! heartbeat (through the same free queue as blocks, see `servers`).
//!
//! Where each decision lives:
//! - this file: the registry ([`Shuffles`]), its bounds, and lookups by shuffle and job;
//! - `shuffle`: one shuffle as kept here (its partitions' segment chains, commits, holders, lost
//!   copies);
//! - `registration`: registering a shuffle (checks, its first segments' reply), unregistering
//!   it, and ending a job's shuffles;
//! - `advance`: a writer moving a partition on to its next segment;
//! - `commits`: map commits (exactly one attempt wins) and their invalidation;
//! - `locate`: what readers are told (segments as clients see them, LocateShuffle);
//! - `losses`: storage servers dying or restarting (lost copies, partitions needing a new tail);
//! - `copying`: closed segments with a copy to make (re-replication, drains) and moved copies;
//! - `records`: the log records a change or a snapshot writes.

use std::collections::{BTreeMap, BTreeSet};

use tern_proto::{ErrorKind, ServerId, ShuffleId};
use tracing::debug;

use crate::error::{invalid, not_found, Refusal};

mod advance;
mod commits;
mod copying;
mod locate;
mod losses;
mod records;
mod registration;
mod shuffle;

pub use records::{registration_record, segment_record};
use shuffle::Shuffle;

/// A segment a storage server says it holds: shuffle, partition, and index in the partition's
/// chain of segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SegmentCopy {
    pub shuffle_id: ShuffleId,
    pub partition: u32,
    pub index: u32,
}

/// Most reduce partitions of one shuffle.
pub const MAX_PARTITIONS: u32 = 1_000_000;
/// Most map tasks a shuffle may declare, and the bound on map indexes when it declares none.
pub const MAX_MAPS: u32 = 10_000_000;
/// The split size of a shuffle registered without one.
pub const DEFAULT_SPLIT_SIZE_BYTES: u64 = 256 << 20;
/// Most segments of one partition: 1 TiB at the default split size. A partition that needs more
/// should be registered with a larger split size.
pub const MAX_SEGMENTS_PER_PARTITION: u32 = 4096;
/// Most shuffles registered at once.
pub const MAX_SHUFFLES: usize = 1 << 16;
/// Most segments of all shuffles together (each costs about 16 bytes here).
pub const MAX_SEGMENTS: u64 = 1 << 24;
/// Most committed (map, partition) lengths of all shuffles together (8 bytes each: 1 GiB).
pub const MAX_COMMITTED_LENGTHS: u64 = 1 << 27;
/// Most (map, partition) entries one LocateShuffle reply may carry; with the segments it must
/// also fit in one gRPC message.
pub const MAX_LOCATE_ENTRIES: u64 = 1 << 20;
/// Most segments one LocateShuffle reply may carry.
pub const MAX_LOCATE_SEGMENTS: u64 = 1 << 20;

/// What a change to the registry asks of the storage-server registry, which the caller applies:
/// segment copies placed (each counts in its server's load) and shuffles freed (each queued on
/// the servers holding its segments).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SegmentChanges {
    /// The server of each segment copy placed.
    pub placed: Vec<ServerId>,
    pub freed: Vec<FreedShuffle>,
}

/// A shuffle taken out of the registry, and where its segments were.
#[derive(Debug, PartialEq, Eq)]
pub struct FreedShuffle {
    pub shuffle_id: ShuffleId,
    /// Segments per server.
    pub holders: BTreeMap<ServerId, u64>,
}

#[derive(Debug)]
pub struct Shuffles {
    shuffles: BTreeMap<ShuffleId, Shuffle>,
    /// The shuffles of each job, so ending a job frees them all.
    by_job: BTreeMap<String, BTreeSet<ShuffleId>>,
    next_shuffle_id: ShuffleId,
    /// Segments of all shuffles, bounded by MAX_SEGMENTS.
    segments: u64,
    /// Committed lengths of all shuffles, bounded by MAX_COMMITTED_LENGTHS.
    committed_lengths: u64,
}

impl Shuffles {
    /// An empty registry whose ids start at `first_shuffle_id`.
    pub fn new(first_shuffle_id: ShuffleId) -> Shuffles {
        Shuffles {
            shuffles: BTreeMap::new(),
            by_job: BTreeMap::new(),
            next_shuffle_id: first_shuffle_id,
            segments: 0,
            committed_lengths: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.shuffles.len()
    }

    /// A registered shuffle, or the refusal that says it is not.
    fn shuffle(&self, shuffle_id: ShuffleId) -> Result<&Shuffle, Refusal> {
        self.shuffles.get(&shuffle_id).ok_or_else(|| unknown(shuffle_id))
    }

    /// Whether `shuffle_id` is registered.
    pub fn is_registered(&self, shuffle_id: ShuffleId) -> bool {
        self.shuffles.contains_key(&shuffle_id)
    }

    /// Ok when `shuffle_id` is registered, else the refusal that says it is not.
    pub fn check_registered(&self, shuffle_id: ShuffleId) -> Result<(), Refusal> {
        self.shuffle(shuffle_id).map(drop)
    }

    /// The job a registered shuffle belongs to.
    pub fn job_of(&self, shuffle_id: ShuffleId) -> Option<&str> {
        self.shuffles.get(&shuffle_id).map(|shuffle| shuffle.job.as_str())
    }

    /// The shuffles of a job, in order.
    pub fn of_job(&self, job: &str) -> impl Iterator<Item = ShuffleId> + '_ {
        self.by_job.get(job).into_iter().flatten().copied()
    }

    /// The registered shuffles' ids, in order.
    pub fn ids(&self) -> Vec<ShuffleId> {
        self.shuffles.keys().copied().collect()
    }

    pub fn next_shuffle_id(&self) -> ShuffleId {
        self.next_shuffle_id
    }

    pub fn raise_next_shuffle_id(&mut self, next: ShuffleId) {
        self.next_shuffle_id = self.next_shuffle_id.max(next);
    }

    /// Frees a shuffle already taken out of the registry.
    fn release(&mut self, shuffle_id: ShuffleId, shuffle: Shuffle) -> FreedShuffle {
        let segments: u64 = shuffle.holders.values().sum();
        self.segments -= segments;
        self.committed_lengths -= shuffle.committed_lengths();
        debug!(
            "shuffle {shuffle_id} of job {} ({:?} class, {} partitions, {segments} segments, {} maps committed) freed",
            shuffle.job,
            shuffle.storage_class,
            shuffle.partitions.len(),
            shuffle.commits.len()
        );
        FreedShuffle { shuffle_id, holders: shuffle.holders }
    }

    fn check_room_for_segments(&self, count: u64) -> Result<(), Refusal> {
        if self.segments + count > MAX_SEGMENTS {
            return Err(Refusal::new(
                ErrorKind::OutOfSpace,
                format!(
                    "the shuffles hold {} segments, and {count} more would pass the limit of {MAX_SEGMENTS}; \
                     unregister finished shuffles",
                    self.segments
                ),
            ));
        }
        Ok(())
    }
}

fn no_partition(partition: u32, partitions: usize) -> Refusal {
    invalid(format!("partition {partition} is out of range: the shuffle has {partitions}"))
}

fn unknown(shuffle_id: ShuffleId) -> Refusal {
    not_found(format!("shuffle {shuffle_id} is not registered (unregistered, or its job ended)"))
}
