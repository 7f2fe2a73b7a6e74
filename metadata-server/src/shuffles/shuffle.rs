//! One shuffle as the registry keeps it: its partitions' chains of segments (the servers of each
//! copy), the winning commit of each map, the servers holding its segments, and the copies lost
//! although their server lives on.

use std::collections::{BTreeMap, BTreeSet};

use tern_proto::{MapAttempt, MapIndex, ServerId, StorageClass};

use super::SegmentChanges;
use crate::planner::Copies;

/// A partition's segments, by index: the servers holding each. Most partitions never split, so
/// the first segment is kept inline and only later ones allocate.
#[derive(Debug)]
pub(super) struct Partition {
    pub(super) first: Copies,
    pub(super) later: Vec<Copies>,
}

impl Partition {
    pub(super) fn len(&self) -> u32 {
        1 + self.later.len() as u32
    }

    /// The last segment's index and servers.
    pub(super) fn last(&self) -> (u32, Copies) {
        (self.later.len() as u32, self.later.last().copied().unwrap_or(self.first))
    }

    /// The servers of its segments, by index.
    pub(super) fn servers(&self) -> impl Iterator<Item = Copies> + '_ {
        std::iter::once(self.first).chain(self.later.iter().copied())
    }

    /// The servers of segment `index`, to change.
    pub(super) fn copies_mut(&mut self, index: u32) -> Option<&mut Copies> {
        match index {
            0 => Some(&mut self.first),
            i => self.later.get_mut(i as usize - 1),
        }
    }
}

/// The winning attempt of one map and what it wrote.
#[derive(Debug)]
pub(super) struct MapCommit {
    pub(super) attempt: MapAttempt,
    /// One entry per partition.
    pub(super) partition_bytes: Vec<u64>,
    /// One entry per partition, or empty when every entry is 0 (the map never pushed past a
    /// partition's first segment: the common case, kept small).
    pub(super) first_segment: Vec<u32>,
    pub(super) last_segment: Vec<u32>,
}

#[derive(Debug)]
pub(super) struct Shuffle {
    pub(super) job: String,
    /// Declared map tasks, 0 when unknown.
    pub(super) maps: u32,
    /// Where its segments may live on their servers; every Push carries it.
    pub(super) storage_class: StorageClass,
    /// Bytes after which writers move a partition to its next segment.
    pub(super) split_size_bytes: u64,
    /// Copies of each segment (1 or 2).
    pub(super) replicas: u32,
    pub(super) partitions: Vec<Partition>,
    /// Segments per server, so an unregistration reaches exactly the servers holding some.
    pub(super) holders: BTreeMap<ServerId, u64>,
    pub(super) commits: BTreeMap<MapIndex, MapCommit>,
    /// (partition, index, server) of segment copies whose data is gone although their server
    /// lives on: the server restarted and lost its DRAM. Few, so kept aside from the partitions.
    pub(super) lost: BTreeSet<(u32, u32, ServerId)>,
}

impl Shuffle {
    /// Counts a new segment's copies among its holders and in `changes`; returns how many.
    pub(super) fn hold(&mut self, copies: Copies, changes: &mut SegmentChanges) -> u64 {
        let mut held = 0;
        for server_id in copies.servers() {
            *self.holders.entry(server_id).or_default() += 1;
            changes.placed.push(server_id);
            held += 1;
        }
        held
    }

    /// Lengths held by its commits.
    pub(super) fn committed_lengths(&self) -> u64 {
        self.commits.len() as u64 * self.partitions.len() as u64
    }
}
