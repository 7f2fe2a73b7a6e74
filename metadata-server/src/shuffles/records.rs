//! The log records of shuffle changes, and the records that rebuild the registry in a snapshot.

use tern_proto::v1::log_record::Change;
use tern_proto::v1::{CommitMapRequest, LogLostSegments, LogSegment, LogShuffle, RegisterShuffleRequest};
use tern_proto::ShuffleId;

use super::Shuffles;
use crate::planner::Copies;

impl Shuffles {
    /// The records that rebuild the registry (for a snapshot).
    pub fn snapshot(&self, out: &mut Vec<Change>) {
        for (&shuffle_id, shuffle) in &self.shuffles {
            let request = RegisterShuffleRequest {
                job_id: shuffle.job.clone(),
                partitions: shuffle.partitions.len() as u32,
                maps: shuffle.maps,
                storage_class: shuffle.storage_class.to_string(),
                split_size_bytes: shuffle.split_size_bytes,
                replicas: shuffle.replicas,
            };
            let firsts: Vec<Copies> = shuffle.partitions.iter().map(|p| p.first).collect();
            out.push(Change::RegisterShuffle(registration_record(
                shuffle_id,
                request,
                shuffle.split_size_bytes,
                &firsts,
            )));
            for (partition, p) in (0..).zip(&shuffle.partitions) {
                for &copies in &p.later {
                    out.push(Change::AddSegment(segment_record(shuffle_id, partition, copies)));
                }
            }
            if !shuffle.lost.is_empty() {
                out.push(Change::LostSegments(LogLostSegments {
                    shuffle_id: shuffle_id.get(),
                    partitions: shuffle.lost.iter().map(|&(p, _, _)| p).collect(),
                    indexes: shuffle.lost.iter().map(|&(_, i, _)| i).collect(),
                    server_ids: shuffle.lost.iter().map(|&(_, _, server)| server.get()).collect(),
                }));
            }
            for (&map_index, commit) in &shuffle.commits {
                out.push(Change::CommitMap(CommitMapRequest {
                    shuffle_id: shuffle_id.get(),
                    map_index: map_index.get(),
                    attempt: commit.attempt.get(),
                    partition_bytes: commit.partition_bytes.clone(),
                    first_segment: commit.first_segment.clone(),
                    last_segment: commit.last_segment.clone(),
                }));
            }
        }
    }
}

/// The log record of a registration whose partitions' first segments are on `firsts` (second
/// copies listed only for a replicated shuffle, as logs from before replication have none).
pub fn registration_record(
    shuffle_id: ShuffleId,
    request: RegisterShuffleRequest,
    split_size_bytes: u64,
    firsts: &[Copies],
) -> LogShuffle {
    let replicated = request.replicas > 1;
    LogShuffle {
        request: Some(request),
        shuffle_id: shuffle_id.get(),
        first_servers: firsts.iter().map(|c| c.first.get()).collect(),
        split_size_bytes,
        first_replicas: if replicated { firsts.iter().map(|c| c.second_on_wire()).collect() } else { Vec::new() },
    }
}

/// The log record of a segment added to a partition.
pub fn segment_record(shuffle_id: ShuffleId, partition: u32, copies: Copies) -> LogSegment {
    LogSegment {
        shuffle_id: shuffle_id.get(),
        partition,
        server_id: copies.first.get(),
        replica_server_id: copies.second_on_wire(),
    }
}
