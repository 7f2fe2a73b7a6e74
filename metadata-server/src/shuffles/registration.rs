//! Registering a shuffle (its checks and the reply naming its first segments, whose placement is
//! the planner's), unregistering it, and ending every shuffle of a job.

use std::collections::{BTreeMap, BTreeSet};

use prost::Message;
use tern_proto::v1::{LogShuffle, RegisterShuffleRequest, RegisterShuffleResponse, Segment};
use tern_proto::{ErrorKind, ShuffleId, StorageClass};

use super::locate::segment;
use super::shuffle::{Partition, Shuffle};
use super::{unknown, SegmentChanges, Shuffles, DEFAULT_SPLIT_SIZE_BYTES, MAX_MAPS, MAX_PARTITIONS, MAX_SHUFFLES};
use crate::error::{invalid, Refusal};
use crate::planner::{parse_storage_class, Copies};
use crate::servers::Servers;

/// What a registration asks for, checked: see [`Shuffles::check_register`].
#[derive(Debug, Clone, Copy)]
pub struct Registration {
    pub shuffle_id: ShuffleId,
    /// Copies of each segment (1 or 2).
    pub replicas: u32,
    pub split_size_bytes: u64,
    pub storage_class: StorageClass,
}

impl Shuffles {
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
        Ok(Registration { shuffle_id: self.next_shuffle_id, replicas, split_size_bytes, storage_class })
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
        let shuffle_id = ShuffleId::from_wire(log.shuffle_id);
        self.next_shuffle_id = self.next_shuffle_id.max(shuffle_id.next());
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
}
