//! Map commits: the first attempt of a map to commit wins, whole and once; InvalidateMaps alone
//! forgets a commit (its data was lost), so a new attempt can commit.

use std::collections::BTreeSet;

use tern_proto::v1::{CommitMapRequest, CommitMapResponse, InvalidateMapsRequest, InvalidateMapsResponse};
use tern_proto::{ErrorKind, MapAttempt, MapIndex, ShuffleId};

use super::shuffle::MapCommit;
use super::{unknown, Shuffles, MAX_COMMITTED_LENGTHS, MAX_MAPS};
use crate::error::{invalid, Refusal};

impl Shuffles {
    /// Checks a map attempt's commit; changes nothing. The answer when the map is committed
    /// already, `None` when this commit would record it (see [`Shuffles::commit`]).
    pub fn check_commit(&self, req: &CommitMapRequest) -> Result<Option<CommitMapResponse>, Refusal> {
        let shuffle = self.shuffle(ShuffleId::from_wire(req.shuffle_id))?;
        let map_bound = if shuffle.maps > 0 { shuffle.maps } else { MAX_MAPS };
        if req.map_index >= map_bound {
            let what = if shuffle.maps > 0 { "the shuffle's declared maps" } else { "the most map indexes" };
            return Err(invalid(format!("map index {} is not below {map_bound}, {what}", req.map_index)));
        }
        let partitions = shuffle.partitions.len();
        if req.partition_bytes.len() != partitions {
            return Err(invalid(format!(
                "{} partition lengths given; the shuffle has {partitions} partitions",
                req.partition_bytes.len()
            )));
        }
        for (name, given) in [("first_segment", &req.first_segment), ("last_segment", &req.last_segment)] {
            if !given.is_empty() && given.len() != partitions {
                return Err(invalid(format!(
                    "{} {name} entries given; give one per partition ({partitions}) or none",
                    given.len()
                )));
            }
        }
        for (p, partition) in shuffle.partitions.iter().enumerate() {
            let first = req.first_segment.get(p).copied().unwrap_or(0);
            let last = req.last_segment.get(p).copied().unwrap_or(0);
            let (last_index, _) = partition.last();
            if first > last || last > last_index {
                return Err(invalid(format!(
                    "partition {p}: segments {first} to {last} are not a range of its segments 0 to {last_index}"
                )));
            }
        }
        if let Some(winner) = shuffle.commits.get(&MapIndex::from_wire(req.map_index)) {
            return Ok(Some(commit_answer(winner.attempt, MapAttempt::from_wire(req.attempt))));
        }
        if self.committed_lengths + partitions as u64 > MAX_COMMITTED_LENGTHS {
            return Err(Refusal::new(
                ErrorKind::OutOfSpace,
                format!(
                    "the metadata server holds {} committed map lengths, and the limit is {MAX_COMMITTED_LENGTHS}; \
                     unregister finished shuffles",
                    self.committed_lengths
                ),
            ));
        }
        Ok(None)
    }

    /// Records a map attempt's output.
    ///
    /// Exactly once: the first commit of a map to reach the metadata server wins, and is recorded
    /// whole (attempt, bytes and segment range of every partition) in one step, under the state's
    /// lock. A later commit of the same map by another attempt (a speculative duplicate, or a
    /// retry after a timeout whose first try did land) is answered `committed = false` with the
    /// winner's attempt, and changes nothing: its batches stay on the servers, unread, until the
    /// shuffle is freed. The winner committing again (a retry of a lost reply) is answered
    /// `committed = true`; the first record stands. Only InvalidateMaps forgets a commit.
    pub fn commit(&mut self, req: &CommitMapRequest) -> Result<CommitMapResponse, Refusal> {
        if let Some(answer) = self.check_commit(req)? {
            return Ok(answer);
        }
        let shuffle_id = ShuffleId::from_wire(req.shuffle_id);
        let shuffle = self.shuffles.get_mut(&shuffle_id).ok_or_else(|| unknown(shuffle_id))?;
        let attempt = MapAttempt::from_wire(req.attempt);
        let commit = MapCommit {
            attempt,
            partition_bytes: req.partition_bytes.clone(),
            first_segment: unless_all_zero(&req.first_segment),
            last_segment: unless_all_zero(&req.last_segment),
        };
        shuffle.commits.insert(MapIndex::from_wire(req.map_index), commit);
        self.committed_lengths += shuffle.partitions.len() as u64;
        Ok(commit_answer(attempt, attempt))
    }

    /// How many of `req.map_indexes` have a commit to forget; changes nothing.
    pub fn check_invalidate(&self, req: &InvalidateMapsRequest) -> Result<u32, Refusal> {
        let shuffle = self.shuffle(ShuffleId::from_wire(req.shuffle_id))?;
        let maps: BTreeSet<MapIndex> = req
            .map_indexes
            .iter()
            .map(|&map| MapIndex::from_wire(map))
            .filter(|map| shuffle.commits.contains_key(map))
            .collect();
        Ok(maps.len() as u32)
    }

    /// Forgets the commits of `req.map_indexes` (their data was lost), so new attempts can commit.
    pub fn invalidate(&mut self, req: &InvalidateMapsRequest) -> Result<InvalidateMapsResponse, Refusal> {
        let shuffle_id = ShuffleId::from_wire(req.shuffle_id);
        let shuffle = self.shuffles.get_mut(&shuffle_id).ok_or_else(|| unknown(shuffle_id))?;
        let mut invalidated = 0u32;
        for map in &req.map_indexes {
            if shuffle.commits.remove(&MapIndex::from_wire(*map)).is_some() {
                invalidated += 1;
            }
        }
        self.committed_lengths -= u64::from(invalidated) * shuffle.partitions.len() as u64;
        Ok(InvalidateMapsResponse { invalidated })
    }
}

/// The answer to a commit of `attempt` when `winner` holds the map.
fn commit_answer(winner: MapAttempt, attempt: MapAttempt) -> CommitMapResponse {
    CommitMapResponse { committed: winner == attempt, winning_attempt: winner.get() }
}

/// Segment indexes as stored: empty when all are 0.
fn unless_all_zero(indexes: &[u32]) -> Vec<u32> {
    if indexes.iter().all(|&i| i == 0) {
        Vec::new()
    } else {
        indexes.to_vec()
    }
}
