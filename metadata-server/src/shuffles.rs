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
    AdvanceSegmentRequest, CommitMapRequest, CommitMapResponse, InvalidateMapsRequest, InvalidateMapsResponse,
    LocateShuffleRequest, LocateShuffleResponse, LogLostSegments, LogMoveSegment, LogSegment, LogShuffle, MapOutput,
    RegisterShuffleRequest, RegisterShuffleResponse, Segment,
};
use tern_proto::{ErrorKind, ServerId, ShuffleId};
use tracing::debug;

use crate::error::{invalid, not_found, Refusal};
use crate::planner::{parse_storage_class, Copies};
use crate::servers::Servers;

/// A segment a storage server says it holds: shuffle, partition, and index in the partition's
/// chain of segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SegmentCopy {
    pub shuffle_id: ShuffleId,
    pub partition: u32,
    pub index: u32,
}
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

/// What a registration asks for, checked: see [`Shuffles::check_register`].
#[derive(Debug, Clone, Copy)]
pub struct Registration {
    pub shuffle_id: ShuffleId,
    /// Copies of each segment (1 or 2).
    pub replicas: u32,
    pub split_size_bytes: u64,
    pub storage_class: StorageClass,
}

/// What placing a partition's next segment needs: see [`Shuffles::check_advance`].
#[derive(Debug)]
pub struct NextSegment {
    /// The servers of the full (or failed) segment's copies.
    pub avoid: Vec<ServerId>,
    pub replicas: u32,
    pub storage_class: StorageClass,
}

/// Partitions whose last segment has a copy on a dead server: see [`Shuffles::tails_on`].
#[derive(Debug)]
pub struct Tails {
    pub partitions: Vec<u32>,
    pub replicas: u32,
    pub storage_class: StorageClass,
}

/// A closed segment with a copy to make (see [`Shuffles::segments_to_copy`]): one of a 2-copy
/// shuffle with one copy gone and one readable (re-replication), or one on a draining server
/// that no copy elsewhere backs (a drain).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentToCopy {
    pub segment: SegmentCopy,
    /// The server of the copy replaced: gone (dead, or restarted without it), or draining.
    pub lost: ServerId,
    /// The server of the readable copy, which copies it (the draining server itself for a drain).
    pub live: ServerId,
    pub class: StorageClass,
    /// Committed bytes there as far as the commits tell (a map spanning several segments counts
    /// evenly in each): what the rate limit is charged until the source reports the bytes.
    pub bytes: u64,
    /// Copied off a draining server (else re-replicated).
    pub drain: bool,
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

    /// The servers of segment `index`, to change.
    fn copies_mut(&mut self, index: u32) -> Option<&mut Copies> {
        match index {
            0 => Some(&mut self.first),
            i => self.later.get_mut(i as usize - 1),
        }
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
    /// Where its segments may live on their servers; every Push carries it.
    storage_class: StorageClass,
    /// Bytes after which writers move a partition to its next segment.
    split_size_bytes: u64,
    /// Copies of each segment (1 or 2).
    replicas: u32,
    partitions: Vec<Partition>,
    /// Segments per server, so an unregistration reaches exactly the servers holding some.
    holders: BTreeMap<ServerId, u64>,
    commits: BTreeMap<u32, MapCommit>,
    /// (partition, index, server) of segment copies whose data is gone although their server
    /// lives on: the server restarted and lost its DRAM. Few, so kept aside from the partitions.
    lost: BTreeSet<(u32, u32, ServerId)>,
}

impl Shuffle {
    /// Counts a new segment's copies among its holders and in `changes`; returns how many.
    fn hold(&mut self, copies: Copies, changes: &mut SegmentChanges) -> u64 {
        let mut held = 0;
        for server_id in copies.servers() {
            *self.holders.entry(server_id).or_default() += 1;
            changes.placed.push(server_id);
            held += 1;
        }
        held
    }

    /// Lengths held by its commits.
    fn committed_lengths(&self) -> u64 {
        self.commits.len() as u64 * self.partitions.len() as u64
    }
}

#[derive(Debug)]
pub struct Shuffles {
    shuffles: BTreeMap<ShuffleId, Shuffle>,
    /// The shuffles of each job, so ending a job frees them all.
    by_job: BTreeMap<String, BTreeSet<ShuffleId>>,
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

    /// Checks a registration for job `req.job_id` (the caller checked that it is live) and
    /// chooses its id; changes nothing. The caller places the first segments, checks the reply
    /// with [`Shuffles::first_segments`], and applies the logged record ([`Shuffles::register`]).
    pub fn check_register(&self, req: &RegisterShuffleRequest, block_size: u32) -> Result<Registration, Refusal> {
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
        Ok(Registration { shuffle_id: ShuffleId(self.next_shuffle_id), replicas, split_size_bytes, storage_class })
    }

    /// The reply to a registration whose partitions' first segments go to `firsts`. The reply
    /// lists them all, so a shuffle has at most as many partitions as one gRPC message can name
    /// (some 700,000 with addresses like 10.0.0.1:7000): refused when it cannot travel.
    pub fn first_segments(
        registration: Registration,
        firsts: &[Copies],
        servers: &Servers,
    ) -> Result<RegisterShuffleResponse, Refusal> {
        let no_loss = BTreeSet::new();
        let segments: Vec<Segment> =
            (0..).zip(firsts).map(|(partition, &copies)| segment(servers, &no_loss, partition, 0, copies)).collect();
        let response = RegisterShuffleResponse {
            shuffle_id: registration.shuffle_id.get(),
            segments,
            split_size_bytes: registration.split_size_bytes,
            grant: Vec::new(),
        };
        let reply_bytes = response.encoded_len();
        if reply_bytes > tern_proto::MAX_GRPC_MESSAGE_BYTES {
            return Err(invalid(format!(
                "the first segments of {} partitions take {reply_bytes} bytes, more than one reply may carry \
                 ({} bytes); register fewer partitions",
                firsts.len(),
                tern_proto::MAX_GRPC_MESSAGE_BYTES
            )));
        }
        Ok(response)
    }

    /// Registers a shuffle as logged, its first segments given.
    pub fn register(&mut self, log: &LogShuffle) -> Result<SegmentChanges, Refusal> {
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
            log.first_servers.iter().map(|&first| Copies::from_wire(first, 0)).collect()
        } else if log.first_replicas.len() == log.first_servers.len() {
            log.first_servers
                .iter()
                .zip(&log.first_replicas)
                .map(|(&first, &second)| Copies::from_wire(first, second))
                .collect()
        } else {
            return Err(invalid(format!(
                "logged shuffle {} has {} second copies for {} first segments",
                log.shuffle_id,
                log.first_replicas.len(),
                log.first_servers.len()
            )));
        };
        let shuffle_id = ShuffleId(log.shuffle_id);
        self.next_shuffle_id = self.next_shuffle_id.max(log.shuffle_id + 1);
        let mut shuffle = Shuffle {
            job: req.job_id.clone(),
            maps: req.maps,
            storage_class,
            split_size_bytes: log.split_size_bytes,
            replicas: req.replicas.max(1),
            partitions: Vec::with_capacity(plan.len()),
            holders: BTreeMap::new(),
            commits: BTreeMap::new(),
            lost: BTreeSet::new(),
        };
        let mut changes = SegmentChanges::default();
        for first in plan {
            shuffle.partitions.push(Partition { first, later: Vec::new() });
            self.segments += shuffle.hold(first, &mut changes);
        }
        self.shuffles.insert(shuffle_id, shuffle);
        self.by_job.entry(req.job_id).or_default().insert(shuffle_id);
        Ok(changes)
    }

    /// Adds a segment to the end of a partition (AdvanceSegment or a server's death, live or
    /// logged), its copies on `copies`.
    pub fn push_segment(
        &mut self,
        shuffle_id: ShuffleId,
        partition: u32,
        copies: Copies,
    ) -> Result<SegmentChanges, Refusal> {
        let shuffle = self.shuffles.get_mut(&shuffle_id).ok_or_else(|| unknown(shuffle_id))?;
        let partitions = shuffle.partitions.len();
        let p = shuffle.partitions.get_mut(partition as usize).ok_or_else(|| no_partition(partition, partitions))?;
        p.later.push(copies);
        let mut changes = SegmentChanges::default();
        self.segments += shuffle.hold(copies, &mut changes);
        Ok(changes)
    }

    /// The records that mark lost every segment copy on `server_id` that is not `held` (the
    /// server restarted: its DRAM is gone, and it reported what it took back from NVMe), one per
    /// shuffle with such copies not yet marked; changes nothing.
    pub fn lost_on(&self, server_id: ServerId, held: &std::collections::HashSet<SegmentCopy>) -> Vec<LogLostSegments> {
        let mut records = Vec::new();
        for (&shuffle_id, shuffle) in &self.shuffles {
            if !shuffle.holders.contains_key(&server_id) {
                continue;
            }
            let mut record = LogLostSegments { shuffle_id: shuffle_id.get(), ..LogLostSegments::default() };
            for (p, partition) in (0..).zip(&shuffle.partitions) {
                for (index, copies) in (0..).zip(partition.servers()) {
                    let copy = SegmentCopy { shuffle_id, partition: p, index };
                    if copies.on(server_id) && !shuffle.lost.contains(&(p, index, server_id)) && !held.contains(&copy) {
                        record.partitions.push(p);
                        record.indexes.push(index);
                        record.server_ids.push(server_id.get());
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
    pub fn mark_lost(&mut self, log: &LogLostSegments) {
        if let Some(shuffle) = self.shuffles.get_mut(&ShuffleId(log.shuffle_id)) {
            for (i, (&p, &index)) in log.partitions.iter().zip(&log.indexes).enumerate() {
                let first = || shuffle.partitions.get(p as usize)?.servers().nth(index as usize).map(|c| c.first);
                if let Some(server_id) = log.server_ids.get(i).map(|&id| ServerId(id)).or_else(first) {
                    shuffle.lost.insert((p, index, server_id));
                }
            }
        }
    }

    /// Closed segments (not their partition's last: no writer pushes there any more) with a copy
    /// to make, by shuffle, partition and index, at most `limit`, those `skip` says are taken left
    /// out: a 2-copy shuffle's with exactly one readable copy, and any shuffle's with a copy on a
    /// server `draining` names that no readable copy on a server not draining backs. A copy is
    /// readable when `alive` says its server is and it is not marked lost. The last segment of a
    /// partition is left alone: writers may still push to it (with a copy lost they move on, and
    /// it is closed then; a draining server's are waited out).
    pub fn segments_to_copy(
        &self,
        alive: impl Fn(ServerId) -> bool,
        draining: impl Fn(ServerId) -> bool,
        skip: impl Fn(SegmentCopy) -> bool,
        limit: usize,
    ) -> Vec<SegmentToCopy> {
        let mut out = Vec::new();
        for (&shuffle_id, shuffle) in &self.shuffles {
            let first = out.len();
            for (p, partition) in (0..).zip(&shuffle.partitions) {
                let last = partition.len() - 1;
                for (index, copies) in (0..last).zip(partition.servers()) {
                    let readable = |server: ServerId| alive(server) && !shuffle.lost.contains(&(p, index, server));
                    let (lost, live, drain) = match copies.second {
                        Some(second) if readable(copies.first) != readable(second) => match readable(second) {
                            true => (copies.first, second, false),
                            false => (second, copies.first, false),
                        },
                        _ => {
                            let backed = copies.servers().any(|s| readable(s) && !draining(s));
                            match copies.servers().find(|&s| readable(s) && draining(s)) {
                                Some(off) if !backed => (off, off, true),
                                _ => continue,
                            }
                        }
                    };
                    let segment = SegmentCopy { shuffle_id, partition: p, index };
                    if skip(segment) {
                        continue;
                    }
                    let class = shuffle.storage_class;
                    out.push(SegmentToCopy { segment, lost, live, class, bytes: 0, drain });
                    if out.len() == limit {
                        break;
                    }
                }
                if out.len() == limit {
                    break;
                }
            }
            estimate_bytes(shuffle, &mut out[first..]);
            if out.len() == limit {
                break;
            }
        }
        out
    }

    /// Whether the chain names `server` as holding a copy of `segment` (of a registered shuffle).
    pub fn holds(&self, segment: SegmentCopy, server: ServerId) -> bool {
        self.shuffles
            .get(&segment.shuffle_id)
            .and_then(|shuffle| shuffle.partitions.get(segment.partition as usize))
            .and_then(|partition| partition.servers().nth(segment.index as usize))
            .is_some_and(|copies| copies.on(server))
    }

    /// Replaces a segment's copy on `log.old_server_id` by the one stored on `log.new_server_id`
    /// (as logged); the servers' counts are the caller's.
    pub fn move_segment(&mut self, log: &LogMoveSegment) -> Result<(), Refusal> {
        let shuffle_id = ShuffleId(log.shuffle_id);
        let (old, new) = (ServerId(log.old_server_id), ServerId(log.new_server_id));
        let shuffle = self.shuffles.get_mut(&shuffle_id).ok_or_else(|| unknown(shuffle_id))?;
        let partitions = shuffle.partitions.len();
        let partition = shuffle
            .partitions
            .get_mut(log.partition as usize)
            .ok_or_else(|| no_partition(log.partition, partitions))?;
        let what = format!("segment {} of partition {} of shuffle {shuffle_id}", log.index, log.partition);
        let copies = partition.copies_mut(log.index).ok_or_else(|| invalid(format!("{what} does not exist")))?;
        if !copies.on(old) || copies.on(new) {
            return Err(invalid(format!(
                "{what} is on servers {:?}: a copy cannot move from server {old} to server {new}",
                copies.servers().collect::<Vec<_>>()
            )));
        }
        if copies.first == old {
            copies.first = new;
        } else {
            copies.second = Some(new);
        }
        shuffle.lost.remove(&(log.partition, log.index, old));
        if let Some(held) = shuffle.holders.get_mut(&old) {
            *held -= 1;
            if *held == 0 {
                shuffle.holders.remove(&old);
            }
        }
        *shuffle.holders.entry(new).or_default() += 1;
        Ok(())
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
                    map_index,
                    attempt: commit.attempt,
                    partition_bytes: commit.partition_bytes.clone(),
                    first_segment: commit.first_segment.clone(),
                    last_segment: commit.last_segment.clone(),
                }));
            }
        }
    }

    /// Checks an advance past `req.full_segment`; changes nothing. `None` when the partition's
    /// last segment is already later (many writers report the same full segment at once, and all
    /// get the one successor: [`Shuffles::last_segment`]), else what placing the successor needs:
    /// it goes to other live servers when there are enough (with 2 replicas, two).
    pub fn check_advance(&self, req: &AdvanceSegmentRequest) -> Result<Option<NextSegment>, Refusal> {
        let shuffle = self.shuffle(ShuffleId(req.shuffle_id))?;
        let partition = shuffle
            .partitions
            .get(req.partition as usize)
            .ok_or_else(|| no_partition(req.partition, shuffle.partitions.len()))?;
        let (last, last_copies) = partition.last();
        if last > req.full_segment {
            return Ok(None);
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
        // Every copy of the new segment counts against the bound.
        self.check_room_for_segments(u64::from(shuffle.replicas))?;
        // The last segment is the full one (or a copy of it failed): its successor goes elsewhere.
        Ok(Some(NextSegment {
            avoid: last_copies.servers().collect(),
            replicas: shuffle.replicas,
            storage_class: shuffle.storage_class,
        }))
    }

    /// A partition's last segment, as clients see it.
    pub fn last_segment(&self, shuffle_id: ShuffleId, partition: u32, servers: &Servers) -> Result<Segment, Refusal> {
        let shuffle = self.shuffle(shuffle_id)?;
        let p = shuffle
            .partitions
            .get(partition as usize)
            .ok_or_else(|| no_partition(partition, shuffle.partitions.len()))?;
        let (index, copies) = p.last();
        Ok(segment(servers, &shuffle.lost, partition, index, copies))
    }

    /// Checks a map attempt's commit; changes nothing. The answer when the map is committed
    /// already, `None` when this commit would record it (see [`Shuffles::commit`]).
    pub fn check_commit(&self, req: &CommitMapRequest) -> Result<Option<CommitMapResponse>, Refusal> {
        let shuffle = self.shuffle(ShuffleId(req.shuffle_id))?;
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
            return Ok(Some(commit_answer(winner.attempt, req.attempt)));
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
        let shuffle =
            self.shuffles.get_mut(&ShuffleId(req.shuffle_id)).ok_or_else(|| unknown(ShuffleId(req.shuffle_id)))?;
        let commit = MapCommit {
            attempt: req.attempt,
            partition_bytes: req.partition_bytes.clone(),
            first_segment: unless_all_zero(&req.first_segment),
            last_segment: unless_all_zero(&req.last_segment),
        };
        shuffle.commits.insert(req.map_index, commit);
        self.committed_lengths += shuffle.partitions.len() as u64;
        Ok(commit_answer(req.attempt, req.attempt))
    }

    /// The segments of a partition range and the committed outputs of a map range.
    pub fn locate(&self, req: &LocateShuffleRequest, servers: &Servers) -> Result<LocateShuffleResponse, Refusal> {
        let shuffle = self.shuffle(ShuffleId(req.shuffle_id))?;
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

    /// How many of `req.map_indexes` have a commit to forget; changes nothing.
    pub fn check_invalidate(&self, req: &InvalidateMapsRequest) -> Result<u32, Refusal> {
        let shuffle = self.shuffle(ShuffleId(req.shuffle_id))?;
        let maps: BTreeSet<u32> =
            req.map_indexes.iter().copied().filter(|map| shuffle.commits.contains_key(map)).collect();
        Ok(maps.len() as u32)
    }

    /// Forgets the commits of `req.map_indexes` (their data was lost), so new attempts can commit.
    pub fn invalidate(&mut self, req: &InvalidateMapsRequest) -> Result<InvalidateMapsResponse, Refusal> {
        let shuffle =
            self.shuffles.get_mut(&ShuffleId(req.shuffle_id)).ok_or_else(|| unknown(ShuffleId(req.shuffle_id)))?;
        let mut invalidated = 0u32;
        for map in &req.map_indexes {
            if shuffle.commits.remove(map).is_some() {
                invalidated += 1;
            }
        }
        self.committed_lengths -= u64::from(invalidated) * shuffle.partitions.len() as u64;
        Ok(InvalidateMapsResponse { invalidated })
    }

    /// Forgets a shuffle; its servers are to drop it.
    pub fn unregister(&mut self, shuffle_id: ShuffleId) -> Result<SegmentChanges, Refusal> {
        let shuffle = self.shuffles.remove(&shuffle_id).ok_or_else(|| unknown(shuffle_id))?;
        if let Some(ids) = self.by_job.get_mut(&shuffle.job) {
            ids.remove(&shuffle_id);
            if ids.is_empty() {
                self.by_job.remove(&shuffle.job);
            }
        }
        let mut changes = SegmentChanges::default();
        changes.freed.push(self.release(shuffle_id, shuffle));
        Ok(changes)
    }

    /// Unregisters every shuffle of `job` (ended, or its lease lapsed).
    pub fn end_job(&mut self, job: &str) -> SegmentChanges {
        let ids = self.by_job.remove(job).unwrap_or_default();
        let mut changes = SegmentChanges::default();
        for id in ids {
            if let Some(shuffle) = self.shuffles.remove(&id) {
                changes.freed.push(self.release(id, shuffle));
            }
        }
        changes
    }

    /// After storage server `dead` died: the partitions of `shuffle_id` whose last segment had a
    /// copy there, as many as the bounds let have a new last segment (none when there are none,
    /// or no room), so map attempts can push again; changes nothing.
    pub fn tails_on(&self, shuffle_id: ShuffleId, dead: ServerId) -> Option<Tails> {
        let shuffle = self.shuffles.get(&shuffle_id)?;
        let room = (MAX_SEGMENTS.saturating_sub(self.segments) / u64::from(shuffle.replicas)) as usize;
        let partitions: Vec<u32> = (0..)
            .zip(&shuffle.partitions)
            .filter(|(_, p)| p.last().1.on(dead) && p.len() < MAX_SEGMENTS_PER_PARTITION)
            .map(|(index, _)| index)
            .take(room)
            .collect();
        (!partitions.is_empty()).then_some(Tails {
            partitions,
            replicas: shuffle.replicas,
            storage_class: shuffle.storage_class,
        })
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

/// The answer to a commit of `attempt` when `winner` holds the map.
fn commit_answer(winner: u32, attempt: u32) -> CommitMapResponse {
    CommitMapResponse { committed: winner == attempt, winning_attempt: winner }
}

/// A segment as clients see it. A copy is lost when its server is dead or no longer known, or
/// restarted since (`lost`); the segment is lost when every copy is. A live copy comes first.
fn segment(
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

fn no_partition(partition: u32, partitions: usize) -> Refusal {
    invalid(format!("partition {partition} is out of range: the shuffle has {partitions}"))
}

fn unknown(shuffle_id: ShuffleId) -> Refusal {
    not_found(format!("shuffle {shuffle_id} is not registered (unregistered, or its job ended)"))
}

/// Fills in the committed bytes of `needs` (segments of `shuffle`): each commit's bytes of a
/// partition count evenly in each segment of its range there. One pass over the commits.
fn estimate_bytes(shuffle: &Shuffle, needs: &mut [SegmentToCopy]) {
    if needs.is_empty() {
        return;
    }
    for commit in shuffle.commits.values() {
        for need in needs.iter_mut() {
            let p = need.segment.partition as usize;
            let first = commit.first_segment.get(p).copied().unwrap_or(0);
            let last = commit.last_segment.get(p).copied().unwrap_or(0);
            if (first..=last).contains(&need.segment.index) {
                need.bytes += commit.partition_bytes[p] / u64::from(last - first + 1);
            }
        }
    }
}

/// Segment indexes as stored: empty when all are 0.
fn unless_all_zero(indexes: &[u32]) -> Vec<u32> {
    if indexes.iter().all(|&i| i == 0) {
        Vec::new()
    } else {
        indexes.to_vec()
    }
}
