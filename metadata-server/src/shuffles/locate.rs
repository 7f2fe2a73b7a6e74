//! What readers are told: a shuffle's segments as clients see them (a live copy first, lost when
//! every copy is) and the committed outputs of a range of maps (LocateShuffle), bounded so that
//! one reply carries it.

use std::collections::BTreeSet;

use prost::Message;
use tern_proto::v1::{LocateShuffleRequest, LocateShuffleResponse, MapOutput, Segment};
use tern_proto::{MapIndex, ServerId, ShuffleId};

use super::{no_partition, Shuffles, MAX_LOCATE_ENTRIES, MAX_LOCATE_SEGMENTS};
use crate::error::{invalid, Refusal};
use crate::planner::Copies;
use crate::servers::Servers;

impl Shuffles {
    /// The segments of a partition range and the committed outputs of a map range.
    pub fn locate(&self, req: &LocateShuffleRequest, servers: &Servers) -> Result<LocateShuffleResponse, Refusal> {
        let shuffle = self.shuffle(ShuffleId::from_wire(req.shuffle_id))?;
        let partitions = shuffle.partitions.len() as u32;
        if req.start_partition > req.end_partition || req.start_map > req.end_map {
            return Err(invalid(format!(
                "partitions {}..{} or maps {}..{} is not a range (start above end)",
                req.start_partition, req.end_partition, req.start_map, req.end_map
            )));
        }
        let end_partition = req.end_partition.min(partitions);
        if req.start_partition > end_partition {
            return Err(no_partition(req.start_partition, shuffle.partitions.len()));
        }
        let start_partition = req.start_partition;
        // Maps beyond the last commit have nothing to show when the count is unknown.
        let end_map = match shuffle.maps {
            0 => req.end_map.min(shuffle.commits.last_key_value().map_or(0, |(&map, _)| map.get() + 1)),
            maps if req.start_map > maps => {
                return Err(invalid(format!("map {} is out of range: the shuffle has {maps} maps", req.start_map)))
            }
            maps => req.end_map.min(maps),
        };
        let start_map = req.start_map.min(end_map);
        let (part_range, map_range) = (
            start_partition as usize..end_partition as usize,
            MapIndex::from_wire(start_map)..MapIndex::from_wire(end_map),
        );
        let entries = u64::from(end_map - start_map) * part_range.len() as u64;
        if entries > MAX_LOCATE_ENTRIES {
            return Err(invalid(format!(
                "maps {start_map}..{end_map} of partitions {start_partition}..{end_partition} are {entries} \
                 map-partition entries, more than one reply may carry ({MAX_LOCATE_ENTRIES}); ask for fewer maps \
                 or partitions"
            )));
        }
        let in_range = &shuffle.partitions[part_range.clone()];
        let segment_count: u64 = in_range.iter().map(|p| u64::from(p.len())).sum();
        if segment_count > MAX_LOCATE_SEGMENTS {
            return Err(invalid(format!(
                "partitions {start_partition}..{end_partition} have {segment_count} segments, more than one reply \
                 may carry ({MAX_LOCATE_SEGMENTS}); ask for fewer partitions"
            )));
        }
        let mut segments = Vec::with_capacity(segment_count as usize);
        for (partition, p) in (start_partition..).zip(in_range) {
            for (index, copies) in (0..).zip(p.servers()) {
                segments.push(segment(servers, &shuffle.lost, partition, index, copies));
            }
        }
        let width = part_range.len();
        let slice_or_zeros =
            |all: &[u32]| if all.is_empty() { vec![0; width] } else { all[part_range.clone()].to_vec() };
        let outputs = shuffle
            .commits
            .range(map_range)
            .map(|(&map_index, commit)| MapOutput {
                map_index: map_index.get(),
                attempt: commit.attempt.get(),
                partition_bytes: commit.partition_bytes[part_range.clone()].to_vec(),
                first_segment: slice_or_zeros(&commit.first_segment),
                last_segment: slice_or_zeros(&commit.last_segment),
            })
            .collect();
        let response = LocateShuffleResponse {
            partitions,
            maps: shuffle.maps,
            segments,
            outputs,
            start_partition,
            end_partition,
            split_size_bytes: shuffle.split_size_bytes,
            storage_class: shuffle.storage_class.to_string(),
            job_id: shuffle.job.clone(),
            grant: Vec::new(),
        };
        let reply_bytes = response.encoded_len();
        if reply_bytes > tern_proto::MAX_GRPC_MESSAGE_BYTES {
            return Err(invalid(format!(
                "maps {start_map}..{end_map} of partitions {start_partition}..{end_partition} take {reply_bytes} \
                 bytes, more than one reply may carry ({} bytes); ask for fewer maps or partitions",
                tern_proto::MAX_GRPC_MESSAGE_BYTES
            )));
        }
        Ok(response)
    }
}

/// A segment as clients see it. A copy is lost when its server is dead or no longer known, or
/// restarted since (`lost`); the segment is lost when every copy is. A live copy comes first.
pub(super) fn segment(
    servers: &Servers,
    lost: &BTreeSet<(u32, u32, ServerId)>,
    partition: u32,
    index: u32,
    copies: Copies,
) -> Segment {
    let gone = |server_id: ServerId| lost.contains(&(partition, index, server_id)) || !servers.is_alive(server_id);
    let (mut first, mut second) = (copies.first, copies.second);
    if let Some(other) = second.filter(|&other| gone(first) && !gone(other)) {
        second = Some(first);
        first = other;
    }
    let replica_lost = second.is_some_and(gone);
    Segment {
        partition,
        index,
        server_id: first.get(),
        address: servers.address(first),
        quic_address: servers.quic_address(first),
        lost: gone(first) && (second.is_none() || replica_lost),
        replica_server_id: second.map_or(0, ServerId::get),
        replica_address: second.map(|id| servers.address(id)).unwrap_or_default(),
        replica_quic_address: second.map(|id| servers.quic_address(id)).unwrap_or_default(),
        replica_lost,
    }
}
