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
//! heartbeat (through the same free queue as blocks, see `placement`).

use std::collections::{BTreeMap, BTreeSet};

use prost::Message;
use tern_proto::v1::log_record::Change;
use tern_proto::v1::{
    AdvanceSegmentRequest, AdvanceSegmentResponse, CommitMapRequest, CommitMapResponse, InvalidateMapsRequest,
    InvalidateMapsResponse, LocateShuffleRequest, LocateShuffleResponse, LogLostSegments, LogSegment, LogShuffle,
    MapOutput, RegisterShuffleRequest, RegisterShuffleResponse, Segment,
};
use tern_proto::ErrorKind;
use tracing::debug;

use crate::error::{invalid, not_found, Refusal};
use crate::placement::parse_storage_class;
use crate::placement::Servers;
use tern_proto::StorageClass;

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

/// The servers of a segment's copies: the first, and the second's (0 = no second copy).
type Copies = (u64, u64);

/// Whether one of the copies is on `server_id`.
fn on(copies: Copies, server_id: u64) -> bool {
    copies.0 == server_id || (copies.1 != 0 && copies.1 == server_id)
}

/// The servers of the copies, without the absent second.
fn copy_servers(copies: Copies) -> impl Iterator<Item = u64> {
    [copies.0, copies.1].into_iter().filter(|&id| id != 0)
}

/// A partition's segments, by index: the servers holding each. Most partitions never split, so
/// the first segment is kept inline and only later ones allocate.
#[derive(Debug)]
struct Partition {
    first: Copies,
    later: Vec<Copies>,
}

impl Partition {
    fn len(&self) -> u32 {
        1 + self.later.len() as u32
    }

    /// The last segment's index and servers.
    fn last(&self) -> (u32, Copies) {
        (self.later.len() as u32, self.later.last().copied().unwrap_or(self.first))
    }

    /// The servers of its segments, by index.
    fn servers(&self) -> impl Iterator<Item = Copies> + '_ {
        std::iter::once(self.first).chain(self.later.iter().copied())
    }
}

/// The winning attempt of one map and what it wrote.
#[derive(Debug)]
struct MapCommit {
    attempt: u32,
    /// One entry per partition.
    partition_bytes: Vec<u64>,
    /// One entry per partition, or empty when every entry is 0 (the map never pushed past a
    /// partition's first segment: the common case, kept small).
    first_segment: Vec<u32>,
    last_segment: Vec<u32>,
}

#[derive(Debug)]
struct Shuffle {
    job: String,
    /// Declared map tasks, 0 when unknown.
    maps: u32,
    /// Recorded for when servers have more than one tier; today every segment goes to DRAM.
    storage_class: StorageClass,
    /// Bytes after which writers move a partition to its next segment.
    split_size_bytes: u64,
    /// Copies of each segment (1 or 2).
    replicas: u32,
    partitions: Vec<Partition>,
    /// Segments per server, so an unregistration reaches exactly the servers holding some.
    holders: BTreeMap<u64, u64>,
    commits: BTreeMap<u32, MapCommit>,
    /// (partition, index, server) of segment copies whose data is gone although their server
    /// lives on: the server restarted and lost its DRAM. Few, so kept aside from the partitions.
    lost: BTreeSet<(u32, u32, u64)>,
}

impl Shuffle {
    /// Lengths held by its commits.
    fn committed_lengths(&self) -> u64 {
        self.commits.len() as u64 * self.partitions.len() as u64
    }
}

#[derive(Debug)]
pub struct Shuffles {
    shuffles: BTreeMap<u64, Shuffle>,
    /// The shuffles of each job, so ending a job frees them all.
    by_job: BTreeMap<String, BTreeSet<u64>>,
    next_shuffle_id: u64,
    /// Segments of all shuffles, bounded by MAX_SEGMENTS.
    segments: u64,
    /// Committed lengths of all shuffles, bounded by MAX_COMMITTED_LENGTHS.
    committed_lengths: u64,
}

impl Shuffles {
    /// An empty registry whose ids start at `first_shuffle_id` (at least 1, so 0 never names a
    /// shuffle by accident).
    pub fn new(first_shuffle_id: u64) -> Shuffles {
        Shuffles {
            shuffles: BTreeMap::new(),
            by_job: BTreeMap::new(),
            next_shuffle_id: first_shuffle_id.max(1),
            segments: 0,
            committed_lengths: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.shuffles.len()
    }

    /// Registers a shuffle for job `req.job_id` (the caller checked that it is live) and places
    /// each partition's first segment. The reply lists them all, so a shuffle has at most as many
    /// partitions as one gRPC message can name (some 700,000 with addresses like 10.0.0.1:7000).
    pub fn register(
        &mut self,
        req: &RegisterShuffleRequest,
        block_size: u32,
        servers: &mut Servers,
    ) -> Result<RegisterShuffleResponse, Refusal> {
        if !(1..=MAX_PARTITIONS).contains(&req.partitions) {
            return Err(invalid(format!("partitions must be 1 to {MAX_PARTITIONS}, not {}", req.partitions)));
        }
        if req.maps > MAX_MAPS {
            return Err(invalid(format!("maps must be at most {MAX_MAPS} (or 0: unknown), not {}", req.maps)));
        }
        let storage_class = parse_storage_class(&req.storage_class)?;
        if req.replicas > tern_proto::MAX_REPLICAS {
            return Err(invalid(format!("replicas must be 1 to {}, not {}", tern_proto::MAX_REPLICAS, req.replicas)));
        }
        let replicas = req.replicas.max(1);
        let split_size_bytes = match req.split_size_bytes {
            0 => DEFAULT_SPLIT_SIZE_BYTES,
            size if size < u64::from(block_size) => {
                return Err(invalid(format!("split size {size} is below the cluster block size {block_size}")));
            }
            size => size,
        };
        if self.shuffles.len() >= MAX_SHUFFLES {
            return Err(Refusal::new(
                ErrorKind::OutOfSpace,
                format!("{MAX_SHUFFLES} shuffles are registered, the limit; unregister finished ones"),
            ));
        }
        self.check_room_for_segments(u64::from(req.partitions) * u64::from(replicas))?;
        let plan = servers.plan_segment_copies(req.partitions as usize, &[], replicas)?;
        let no_loss = BTreeSet::new();
        let segments: Vec<Segment> = plan
            .iter()
            .enumerate()
            .map(|(partition, &copies)| segment(servers, &no_loss, partition as u32, 0, copies))
            .collect();
        let shuffle_id = self.next_shuffle_id;
        let response = RegisterShuffleResponse { shuffle_id, segments, split_size_bytes, grant: Vec::new() };
        // The reply names every partition's segment: refuse before registering if it cannot travel.
        let reply_bytes = response.encoded_len();
        if reply_bytes > tern_proto::MAX_GRPC_MESSAGE_BYTES {
            return Err(invalid(format!(
                "the first segments of {} partitions take {reply_bytes} bytes, more than one reply may carry \
                 ({} bytes); register fewer partitions",
                req.partitions,
                tern_proto::MAX_GRPC_MESSAGE_BYTES
            )));
        }
        let req = RegisterShuffleRequest { replicas, ..req.clone() };
        self.insert(shuffle_id, &req, storage_class, split_size_bytes, plan, servers);
        Ok(response)
    }

    /// Registers a shuffle as logged (replaying the log): no checks, the first segments given.
    pub fn restore(&mut self, log: &LogShuffle, servers: &mut Servers) -> Result<(), Refusal> {
        let req = log.request.clone().unwrap_or_default();
        let storage_class = parse_storage_class(&req.storage_class)?;
        if log.first_servers.len() != req.partitions as usize {
            return Err(invalid(format!(
                "logged shuffle {} has {} first segments for {} partitions",
                log.shuffle_id,
                log.first_servers.len(),
                req.partitions
            )));
        }
        let plan: Vec<Copies> = if log.first_replicas.is_empty() {
            log.first_servers.iter().map(|&first| (first, 0)).collect()
        } else if log.first_replicas.len() == log.first_servers.len() {
            log.first_servers.iter().copied().zip(log.first_replicas.iter().copied()).collect()
        } else {
            return Err(invalid(format!(
                "logged shuffle {} has {} second copies for {} first segments",
                log.shuffle_id,
                log.first_replicas.len(),
                log.first_servers.len()
            )));
        };
        self.insert(log.shuffle_id, &req, storage_class, log.split_size_bytes, plan, servers);
        Ok(())
    }

    fn insert(
        &mut self,
        shuffle_id: u64,
        req: &RegisterShuffleRequest,
        storage_class: StorageClass,
        split_size_bytes: u64,
        plan: Vec<Copies>,
        servers: &mut Servers,
    ) {
        self.next_shuffle_id = self.next_shuffle_id.max(shuffle_id + 1);
        let mut holders = BTreeMap::new();
        let mut copies = 0;
        for &segment in &plan {
            for server_id in copy_servers(segment) {
                servers.add_segments(&[server_id]);
                *holders.entry(server_id).or_default() += 1;
                copies += 1;
            }
        }
        let partitions = plan.into_iter().map(|first| Partition { first, later: Vec::new() }).collect();
        let shuffle = Shuffle {
            job: req.job_id.clone(),
            maps: req.maps,
            storage_class,
            split_size_bytes,
            replicas: req.replicas.max(1),
            partitions,
            holders,
            commits: BTreeMap::new(),
            lost: BTreeSet::new(),
        };
        self.segments += copies;
        self.shuffles.insert(shuffle_id, shuffle);
        self.by_job.entry(req.job_id.clone()).or_default().insert(shuffle_id);
    }

    /// Adds a segment to the end of a partition (AdvanceSegment, a server's death, or the log),
    /// its copies on `copies` (second 0 = none).
    pub fn push_segment(
        &mut self,
        shuffle_id: u64,
        partition: u32,
        copies: Copies,
        servers: &mut Servers,
    ) -> Result<(), Refusal> {
        let shuffle = self.shuffles.get_mut(&shuffle_id).ok_or_else(|| unknown(shuffle_id))?;
        let partitions = shuffle.partitions.len();
        let p = shuffle.partitions.get_mut(partition as usize).ok_or_else(|| no_partition(partition, partitions))?;
        p.later.push(copies);
        for server_id in copy_servers(copies) {
            servers.add_segments(&[server_id]);
            *shuffle.holders.entry(server_id).or_default() += 1;
            self.segments += 1;
        }
        Ok(())
    }

    /// Marks every segment on `server_id` lost (the server restarted and lost its DRAM); returns
    /// the log records saying so.
    pub fn lose_segments_on(&mut self, server_id: u64) -> Vec<LogLostSegments> {
        let mut records = Vec::new();
        for (&shuffle_id, shuffle) in &mut self.shuffles {
            if !shuffle.holders.contains_key(&server_id) {
                continue;
            }
            let mut record = LogLostSegments { shuffle_id, ..LogLostSegments::default() };
            for (p, partition) in (0..).zip(&shuffle.partitions) {
                for (index, copies) in (0..).zip(partition.servers()) {
                    if on(copies, server_id) && shuffle.lost.insert((p, index, server_id)) {
                        record.partitions.push(p);
                        record.indexes.push(index);
                        record.server_ids.push(server_id);
                    }
                }
            }
            if !record.partitions.is_empty() {
                records.push(record);
            }
        }
        records
    }

    /// Marks segment copies lost as logged (a record without servers names each segment's first
    /// copy, as logs from before replication do).
    pub fn restore_lost(&mut self, log: &LogLostSegments) {
        if let Some(shuffle) = self.shuffles.get_mut(&log.shuffle_id) {
            for (i, (&p, &index)) in log.partitions.iter().zip(&log.indexes).enumerate() {
                let first = || shuffle.partitions.get(p as usize)?.servers().nth(index as usize).map(|c| c.0);
                if let Some(server_id) = log.server_ids.get(i).copied().or_else(first) {
                    shuffle.lost.insert((p, index, server_id));
                }
            }
        }
    }

    /// Whether `shuffle_id` is registered.
    pub fn is_registered(&self, shuffle_id: u64) -> bool {
        self.shuffles.contains_key(&shuffle_id)
    }

    pub fn next_shuffle_id(&self) -> u64 {
        self.next_shuffle_id
    }

    pub fn raise_next_shuffle_id(&mut self, next: u64) {
        self.next_shuffle_id = self.next_shuffle_id.max(next);
    }

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
            let replicated = shuffle.replicas > 1;
            out.push(Change::RegisterShuffle(LogShuffle {
                request: Some(request),
                shuffle_id,
                first_servers: shuffle.partitions.iter().map(|p| p.first.0).collect(),
                split_size_bytes: shuffle.split_size_bytes,
                first_replicas: if replicated {
                    shuffle.partitions.iter().map(|p| p.first.1).collect()
                } else {
                    Vec::new()
                },
            }));
            for (partition, p) in (0..).zip(&shuffle.partitions) {
                for &(server_id, replica_server_id) in &p.later {
                    out.push(Change::AddSegment(LogSegment { shuffle_id, partition, server_id, replica_server_id }));
                }
            }
            if !shuffle.lost.is_empty() {
                out.push(Change::LostSegments(LogLostSegments {
                    shuffle_id,
                    partitions: shuffle.lost.iter().map(|&(p, _, _)| p).collect(),
                    indexes: shuffle.lost.iter().map(|&(_, i, _)| i).collect(),
                    server_ids: shuffle.lost.iter().map(|&(_, _, server)| server).collect(),
                }));
            }
            for (&map_index, commit) in &shuffle.commits {
                out.push(Change::CommitMap(CommitMapRequest {
                    shuffle_id,
                    map_index,
                    attempt: commit.attempt,
                    partition_bytes: commit.partition_bytes.clone(),
                    first_segment: commit.first_segment.clone(),
                    last_segment: commit.last_segment.clone(),
                }));
            }
        }
    }

    /// The segment after `req.full_segment`: the partition's last segment when it is already
    /// later (many writers report the same full segment at once, and all get the one successor),
    /// else a new one, on other live servers when there are enough (with 2 replicas, two).
    /// Also returns the new segment's servers when one was placed (for the log).
    pub fn advance(
        &mut self,
        req: &AdvanceSegmentRequest,
        servers: &mut Servers,
    ) -> Result<(AdvanceSegmentResponse, Option<Copies>), Refusal> {
        // Every copy of the new segment counts against the bound.
        let replicas = self.shuffles.get(&req.shuffle_id).map_or(1, |s| s.replicas);
        let room = self.check_room_for_segments(u64::from(replicas));
        let shuffle = self.shuffles.get_mut(&req.shuffle_id).ok_or_else(|| unknown(req.shuffle_id))?;
        let partitions = shuffle.partitions.len();
        let partition = shuffle
            .partitions
            .get_mut(req.partition as usize)
            .ok_or_else(|| no_partition(req.partition, partitions))?;
        let (last, last_copies) = partition.last();
        if last > req.full_segment {
            let reply = AdvanceSegmentResponse {
                segment: Some(segment(servers, &shuffle.lost, req.partition, last, last_copies)),
            };
            return Ok((reply, None));
        }
        if last < req.full_segment {
            return Err(invalid(format!(
                "segment {} does not exist yet: partition {}'s last segment is {last}",
                req.full_segment, req.partition
            )));
        }
        if partition.len() >= MAX_SEGMENTS_PER_PARTITION {
            return Err(Refusal::new(
                ErrorKind::OutOfSpace,
                format!(
                    "partition {} has {MAX_SEGMENTS_PER_PARTITION} segments, the most one partition may have; \
                     register the shuffle with a larger split size",
                    req.partition
                ),
            ));
        }
        room?;
        // The last segment is the full one (or a copy of it failed): its successor goes elsewhere.
        let avoid: Vec<u64> = copy_servers(last_copies).collect();
        let copies = servers.plan_segment_copies(1, &avoid, shuffle.replicas)?[0];
        self.push_segment(req.shuffle_id, req.partition, copies, servers)?;
        let shuffle = self.shuffles.get(&req.shuffle_id).ok_or_else(|| unknown(req.shuffle_id))?;
        let reply =
            AdvanceSegmentResponse { segment: Some(segment(servers, &shuffle.lost, req.partition, last + 1, copies)) };
        Ok((reply, Some(copies)))
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
    pub fn commit(&mut self, req: CommitMapRequest) -> Result<CommitMapResponse, Refusal> {
        let shuffle = self.shuffles.get_mut(&req.shuffle_id).ok_or_else(|| unknown(req.shuffle_id))?;
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
        if let Some(winner) = shuffle.commits.get(&req.map_index) {
            return Ok(CommitMapResponse { committed: winner.attempt == req.attempt, winning_attempt: winner.attempt });
        }
        let lengths = partitions as u64;
        if self.committed_lengths + lengths > MAX_COMMITTED_LENGTHS {
            return Err(Refusal::new(
                ErrorKind::OutOfSpace,
                format!(
                    "the metadata server holds {} committed map lengths, and the limit is {MAX_COMMITTED_LENGTHS}; \
                     unregister finished shuffles",
                    self.committed_lengths
                ),
            ));
        }
        let commit = MapCommit {
            attempt: req.attempt,
            partition_bytes: req.partition_bytes,
            first_segment: unless_all_zero(req.first_segment),
            last_segment: unless_all_zero(req.last_segment),
        };
        shuffle.commits.insert(req.map_index, commit);
        self.committed_lengths += lengths;
        Ok(CommitMapResponse { committed: true, winning_attempt: req.attempt })
    }

    /// The segments of a partition range and the committed outputs of a map range.
    pub fn locate(&self, req: &LocateShuffleRequest, servers: &Servers) -> Result<LocateShuffleResponse, Refusal> {
        let shuffle = self.shuffles.get(&req.shuffle_id).ok_or_else(|| unknown(req.shuffle_id))?;
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
            0 => req.end_map.min(shuffle.commits.last_key_value().map_or(0, |(&map, _)| map + 1)),
            maps if req.start_map > maps => {
                return Err(invalid(format!("map {} is out of range: the shuffle has {maps} maps", req.start_map)))
            }
            maps => req.end_map.min(maps),
        };
        let start_map = req.start_map.min(end_map);
        let (part_range, map_range) = (start_partition as usize..end_partition as usize, start_map..end_map);
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
                map_index,
                attempt: commit.attempt,
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

    /// Forgets the commits of `req.map_indexes` (their data was lost), so new attempts can commit.
    pub fn invalidate(&mut self, req: &InvalidateMapsRequest) -> Result<InvalidateMapsResponse, Refusal> {
        let shuffle = self.shuffles.get_mut(&req.shuffle_id).ok_or_else(|| unknown(req.shuffle_id))?;
        let mut invalidated = 0u32;
        for map in &req.map_indexes {
            if shuffle.commits.remove(map).is_some() {
                invalidated += 1;
            }
        }
        self.committed_lengths -= u64::from(invalidated) * shuffle.partitions.len() as u64;
        Ok(InvalidateMapsResponse { invalidated })
    }

    /// Forgets a shuffle and queues its frees on the servers holding its segments.
    pub fn unregister(&mut self, shuffle_id: u64, servers: &mut Servers) -> Result<(), Refusal> {
        let shuffle = self.shuffles.remove(&shuffle_id).ok_or_else(|| unknown(shuffle_id))?;
        if let Some(ids) = self.by_job.get_mut(&shuffle.job) {
            ids.remove(&shuffle_id);
            if ids.is_empty() {
                self.by_job.remove(&shuffle.job);
            }
        }
        self.release(shuffle_id, &shuffle, servers);
        Ok(())
    }

    /// Unregisters every shuffle of `job` (ended, or its lease lapsed); returns how many.
    pub fn end_job(&mut self, job: &str, servers: &mut Servers) -> usize {
        let ids = self.by_job.remove(job).unwrap_or_default();
        for &id in &ids {
            if let Some(shuffle) = self.shuffles.remove(&id) {
                self.release(id, &shuffle, servers);
            }
        }
        ids.len()
    }

    /// After storage server `dead` died: gives every partition whose last segment had a copy there
    /// a new last segment on live servers (two for a replicated shuffle), so map attempts can push
    /// again. Returns those placed (none when too few servers are live, or a bound is reached).
    pub fn server_died(&mut self, dead: u64, servers: &mut Servers) -> Vec<LogSegment> {
        let mut placed = Vec::new();
        for (&shuffle_id, shuffle) in self.shuffles.iter_mut() {
            let tails: Vec<usize> = (0..shuffle.partitions.len())
                .filter(|&p| {
                    let partition = &shuffle.partitions[p];
                    on(partition.last().1, dead) && partition.len() < MAX_SEGMENTS_PER_PARTITION
                })
                .collect();
            let room = (MAX_SEGMENTS.saturating_sub(self.segments) / u64::from(shuffle.replicas)) as usize;
            if tails.is_empty() || room == 0 {
                continue;
            }
            let Ok(plan) = servers.plan_segment_copies(tails.len().min(room), &[dead], shuffle.replicas) else {
                continue;
            };
            for (&p, &copies) in tails.iter().zip(&plan) {
                shuffle.partitions[p].later.push(copies);
                for server_id in copy_servers(copies) {
                    servers.add_segments(&[server_id]);
                    *shuffle.holders.entry(server_id).or_default() += 1;
                    self.segments += 1;
                }
                let (server_id, replica_server_id) = copies;
                placed.push(LogSegment { shuffle_id, partition: p as u32, server_id, replica_server_id });
            }
        }
        placed
    }

    /// Frees a shuffle already taken out of the registry.
    fn release(&mut self, shuffle_id: u64, shuffle: &Shuffle, servers: &mut Servers) {
        servers.free_shuffle(shuffle_id, &shuffle.holders);
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

/// A segment as clients see it. A copy is lost when its server is dead or no longer known, or
/// restarted since (`lost`); the segment is lost when every copy is. A live copy comes first.
fn segment(servers: &Servers, lost: &BTreeSet<(u32, u32, u64)>, partition: u32, index: u32, copies: Copies) -> Segment {
    let gone = |server_id: u64| lost.contains(&(partition, index, server_id)) || !servers.is_alive(server_id);
    let (mut first, mut second) = copies;
    if second != 0 && gone(first) && !gone(second) {
        std::mem::swap(&mut first, &mut second);
    }
    let replica_lost = second != 0 && gone(second);
    Segment {
        partition,
        index,
        server_id: first,
        address: servers.address(first),
        quic_address: servers.quic_address(first),
        lost: gone(first) && (second == 0 || replica_lost),
        replica_server_id: second,
        replica_address: if second == 0 { String::new() } else { servers.address(second) },
        replica_quic_address: if second == 0 { String::new() } else { servers.quic_address(second) },
        replica_lost,
    }
}

fn no_partition(partition: u32, partitions: usize) -> Refusal {
    invalid(format!("partition {partition} is out of range: the shuffle has {partitions}"))
}

fn unknown(shuffle_id: u64) -> Refusal {
    not_found(format!("shuffle {shuffle_id} is not registered (unregistered, or its job ended)"))
}

/// Segment indexes as stored: empty when all are 0.
fn unless_all_zero(indexes: Vec<u32>) -> Vec<u32> {
    if indexes.iter().all(|&i| i == 0) {
        Vec::new()
    } else {
        indexes
    }
}
