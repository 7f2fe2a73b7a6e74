//! Shuffles: map writers push per-partition batches to the storage servers, which append them
//! into each partition's segments (push-merge); a map's commit makes exactly one attempt's
//! output visible; readers stream the committed batches of any partition and map range.
//!
//! Rules a caller can rely on:
//! - **Exactly once.** Several attempts of a map may write; the first commit to reach the
//!   metadata server wins, and only the winner's batches are ever read. A loser learns it from
//!   [`CommitOutcome`].
//! - **Whole batches.** A batch is a run of whole `write` calls of one map for one partition
//!   (a write larger than the batch limit is the one exception: it is cut). Callers that write
//!   self-contained units (records, serialized chunks) can decode every batch on its own.
//! - **Stable order.** A read yields partition by partition; within a partition, segment by
//!   segment; within a segment, by map index and then push order.
//! - **Checked.** Every batch carries a crc32c taken when it was pushed; each map's bytes per
//!   partition must add up to what its commit recorded. A lost server or a bad checksum is an
//!   error naming the shuffle, the partition and exactly the maps to recompute.
//! - **Replicated** (with `ShuffleOptions::replicas` = 2). Every segment has two copies on
//!   different servers; a batch is acknowledged only when both stored it. A push that reached one
//!   copy but not the other fails the map attempt (a new attempt keeps the output exactly-once
//!   and the copies identical); a push that reached neither moves on to a new segment with two
//!   live copies. Readers read one copy and continue on the other at the same cursor when it
//!   fails (the copies hold the same batches of every committed attempt, in the same order).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use parking_lot::Mutex;
use tern_proto::frame::Frame;
use tern_proto::shuffle::{self as wire, FetchRequest, PushHeader, SegmentAddress, FETCH_DONE, PUSH_HEADER_LEN};
use tern_proto::v1::{self as pb, LocateShuffleResponse, MapOutput, Segment};
use tern_proto::{MapAttempt, MapIndex, PartitionIndex, ShuffleId, StorageClass};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::auth::Access;
use crate::error::{Error, ErrorKind, Result};
use crate::location::{segment_holders, Holder};
use crate::Client;

/// How a shuffle is registered.
#[derive(Debug, Clone, Default)]
pub struct ShuffleOptions {
    /// Map tasks, if known (0 = unknown).
    pub maps: u32,
    /// Where segments may live on their servers: "dram", "nvme" or "any" ("" = any); see
    /// `RegisterShuffleRequest.storage_class`.
    pub storage_class: String,
    /// Bytes after which a partition continues in a new segment on another server (0 = the
    /// cluster default, 256 MiB).
    pub split_size_bytes: u64,
    /// Copies of each segment, on different storage servers: 1 or 2 (0 = 1). With 2, losing one
    /// storage server loses no map output.
    pub replicas: u32,
}

/// Bounds of one map writer.
#[derive(Debug, Clone)]
pub struct MapWriterOptions {
    /// Bytes buffered across all partitions before the fullest buffers are pushed.
    pub buffer_bytes: usize,
    /// Largest batch pushed (capped by the cluster's block size).
    pub batch_bytes: usize,
    /// Pushes in flight at once.
    pub pushes_in_flight: usize,
}

impl Default for MapWriterOptions {
    fn default() -> MapWriterOptions {
        MapWriterOptions { buffer_bytes: 64 << 20, batch_bytes: 1 << 20, pushes_in_flight: 16 }
    }
}

/// What a map writer does when no segment takes a batch for space: by default it fails at once
/// (OutOfSpace); with a `limit`, each such push waits for room, retrying with backoff, and fails
/// only when the limit has passed. Space comes back when something frees a shuffle, which a
/// caller can prompt through `on_wait` (Spark's plugin has its driver collect garbage so that
/// Spark's ContextCleaner unregisters the shuffles nothing references).
#[derive(Clone, Default)]
pub struct SpaceWait {
    /// The longest one push waits for space (zero: it does not wait).
    pub limit: Duration,
    /// Called, on a runtime thread, each time a push refused for space starts a pause, with the
    /// refusal (which says which segment and tiers are full). It must not block.
    pub on_wait: Option<SpaceWaitHook>,
}

/// What [`SpaceWait::on_wait`] calls: given the refusal, on a runtime thread.
pub type SpaceWaitHook = Arc<dyn Fn(&Error) + Send + Sync>;

impl std::fmt::Debug for SpaceWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpaceWait").field("limit", &self.limit).field("on_wait", &self.on_wait.is_some()).finish()
    }
}

/// The first pause of a push waiting for space; each next one doubles, up to [`SPACE_PAUSE_MAX`].
const SPACE_PAUSE_FIRST: Duration = Duration::from_millis(100);
const SPACE_PAUSE_MAX: Duration = Duration::from_secs(2);

/// Bytes a Fetch page may carry.
const FETCH_PAGE_BYTES: u32 = 1 << 20;
/// Fetch streams a reader runs at once. A stream is one segment and a run of its maps; streams
/// are independent cursors, so several keep the connections busy while each waits for a page.
const FETCHES_IN_FLIGHT: usize = 16;
/// Times a push refused for space moves on to a new segment before the map fails.
const PUSH_ADVANCES: u32 = 4;

/// A registered shuffle. Cheap to clone; clones share what they learn about segments.
#[derive(Clone)]
pub struct Shuffle {
    client: Client,
    id: ShuffleId,
    /// The owning job and the shuffle's grant: what Push and Fetch frames act under.
    job: String,
    grant: Vec<u8>,
    partitions: u32,
    split_size: u64,
    block_size: u32,
    /// Where its segments may live on their servers: every Push carries it.
    class: StorageClass,
    /// The segment each partition's pushes currently go to.
    current: Arc<Mutex<Vec<Segment>>>,
}

/// What a map's commit decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitOutcome {
    /// This attempt's output is the map's output.
    pub committed: bool,
    /// The attempt whose output is the map's output.
    pub winning_attempt: u32,
}

/// One batch read back.
#[derive(Debug, Clone)]
pub struct ShuffleBatch {
    pub partition: u32,
    pub map: u32,
    pub data: Bytes,
}

impl Client {
    /// Registers a shuffle of `partitions` reduce partitions under a live job.
    pub async fn register_shuffle(&self, job_id: &str, partitions: u32, options: ShuffleOptions) -> Result<Shuffle> {
        let class = parse_class(&options.storage_class)?;
        let reply = self
            .metadata()
            .register_shuffle(pb::RegisterShuffleRequest {
                job_id: job_id.into(),
                partitions,
                maps: options.maps,
                storage_class: options.storage_class,
                split_size_bytes: options.split_size_bytes,
                replicas: options.replicas,
            })
            .await
            .map_err(|s| Error::from(s).context(format_args!("register shuffle under job {job_id}")))?
            .into_inner();
        if reply.segments.len() != partitions as usize {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("register shuffle: {} segments for {partitions} partitions", reply.segments.len()),
            ));
        }
        let block_size = self.block_size().await?;
        Ok(Shuffle {
            client: self.clone(),
            id: ShuffleId::from_wire(reply.shuffle_id),
            job: job_id.to_string(),
            grant: reply.grant,
            partitions,
            split_size: reply.split_size_bytes,
            block_size,
            class,
            current: Arc::new(Mutex::new(reply.segments)),
        })
    }

    /// A shuffle registered elsewhere (by another process), by id.
    pub async fn open_shuffle(&self, shuffle_id: ShuffleId) -> Result<Shuffle> {
        let located = self.locate(shuffle_id, 0..u32::MAX, 0..0).await?;
        let mut current: Vec<Segment> = Vec::with_capacity(located.partitions as usize);
        for segment in located.segments {
            match current.last_mut() {
                Some(last) if last.partition == segment.partition => *last = segment,
                _ => current.push(segment),
            }
        }
        if current.len() != located.partitions as usize {
            return Err(Error::new(ErrorKind::Internal, format!("open shuffle {shuffle_id}: segments missing")));
        }
        let block_size = self.block_size().await?;
        Ok(Shuffle {
            client: self.clone(),
            id: shuffle_id,
            job: located.job_id,
            grant: located.grant,
            partitions: located.partitions,
            split_size: located.split_size_bytes,
            block_size,
            class: parse_class(&located.storage_class)?,
            current: Arc::new(Mutex::new(current)),
        })
    }

    async fn locate(
        &self,
        shuffle_id: ShuffleId,
        partitions: Range<u32>,
        maps: Range<u32>,
    ) -> Result<LocateShuffleResponse> {
        Ok(self
            .metadata()
            .locate_shuffle(pb::LocateShuffleRequest {
                shuffle_id: shuffle_id.get(),
                start_partition: partitions.start,
                end_partition: partitions.end,
                start_map: maps.start,
                end_map: maps.end,
            })
            .await
            .map_err(|s| Error::from(s).context(format_args!("locate shuffle {shuffle_id}")))?
            .into_inner())
    }
}

fn parse_class(name: &str) -> Result<StorageClass> {
    name.parse().map_err(|e: tern_proto::tier::BadStorageClass| Error::invalid(e.to_string()))
}

impl Shuffle {
    pub fn id(&self) -> ShuffleId {
        self.id
    }

    pub fn partitions(&self) -> u32 {
        self.partitions
    }

    /// The block-service address (host:port) of each partition's current segment, in partition
    /// order: where a reader of the partition will fetch from (a scheduler's locality hint).
    pub fn segment_addresses(&self) -> Vec<String> {
        self.current.lock().iter().map(|s| s.address.clone()).collect()
    }

    /// Every segment of `partitions` as the metadata server places it now: each one's copies,
    /// and which are lost (for tools and tests that look at placement; readers locate by
    /// themselves).
    pub async fn segments(&self, partitions: Range<u32>) -> Result<Vec<pb::Segment>> {
        Ok(self.client.locate(self.id, partitions, 0..0).await?.segments)
    }

    /// A writer for attempt `attempt` of map `map`.
    pub fn writer(&self, map: u32, attempt: u32) -> MapWriter {
        self.writer_with(map, attempt, MapWriterOptions::default())
    }

    pub fn writer_with(&self, map: u32, attempt: u32, options: MapWriterOptions) -> MapWriter {
        let partitions = self.partitions as usize;
        // A server stores each batch behind its 16-byte header, in one block.
        let batch_bytes = options.batch_bytes.clamp(1, self.block_size as usize - wire::BATCH_HEADER_LEN);
        MapWriter {
            shuffle: self.clone(),
            map: MapIndex::from_wire(map),
            attempt: MapAttempt::from_wire(attempt),
            buffer_limit: options.buffer_bytes.max(batch_bytes),
            batch_bytes,
            max_in_flight: options.pushes_in_flight.max(1),
            buffers: vec![BytesMut::new(); partitions],
            buffered: 0,
            bytes: vec![0; partitions],
            segments: vec![None; partitions],
            pushing: vec![false; partitions],
            in_flight: FuturesUnordered::new(),
            space_wait: SpaceWait::default(),
        }
    }

    /// Streams the committed batches of `partitions` x `maps` (half-open; ends past the
    /// shuffle's size mean "to the end"). Fails at once with `DataLost`, naming the maps, if any
    /// of them has data on a lost server.
    pub async fn reader(&self, partitions: Range<u32>, maps: Range<u32>) -> Result<ShuffleReader> {
        let located = self.client.locate(self.id, partitions, maps).await?;
        let lost = lost_maps(&located);
        if !lost.is_empty() {
            return Err(Error::new(ErrorKind::DataLost, describe_lost(self.id, &lost)));
        }
        Ok(ShuffleReader::new(self.client.clone(), self.id, located))
    }

    /// Exact committed bytes per (map, partition) for the ranges, without reading data:
    /// `(map index, bytes per partition of the range)`, by map index.
    pub async fn lengths(&self, partitions: Range<u32>, maps: Range<u32>) -> Result<Vec<(u32, Vec<u64>)>> {
        let located = self.client.locate(self.id, partitions, maps).await?;
        Ok(located.outputs.into_iter().map(|o| (o.map_index, o.partition_bytes)).collect())
    }

    /// Maps in range whose committed output has bytes on a lost server: the ones to recompute.
    pub async fn lost_maps(&self, partitions: Range<u32>, maps: Range<u32>) -> Result<Vec<u32>> {
        let located = self.client.locate(self.id, partitions, maps).await?;
        let all: BTreeSet<u32> = lost_maps(&located).into_values().flatten().collect();
        Ok(all.into_iter().collect())
    }

    /// Forgets the commits of `maps` (after their data was lost) so new attempts can commit.
    pub async fn invalidate_maps(&self, maps: &[u32]) -> Result<u32> {
        let request = pb::InvalidateMapsRequest { shuffle_id: self.id.get(), map_indexes: maps.to_vec() };
        let reply = self.client.metadata().invalidate_maps(request).await.map_err(|s| self.error(s))?;
        Ok(reply.into_inner().invalidated)
    }

    /// Frees every segment of the shuffle.
    pub async fn unregister(&self) -> Result<()> {
        let request = pb::UnregisterShuffleRequest { shuffle_id: self.id.get() };
        self.client.metadata().unregister_shuffle(request).await.map_err(|s| self.error(s))?;
        Ok(())
    }

    fn error(&self, status: tonic::Status) -> Error {
        Error::from(status).context(format_args!("shuffle {}", self.id))
    }

    fn current_segment(&self, partition: u32) -> Segment {
        self.current.lock()[partition as usize].clone()
    }

    /// Asks the metadata server for `partition`'s segments and takes its newest as the current
    /// one: after its server failed a push, the segment may have been declared lost and placed
    /// anew (its server dead), and pushes must follow.
    async fn follow_placement(&self, partition: u32) -> Result<()> {
        let located = self.client.locate(self.id, partition..partition + 1, 0..0).await?;
        let newest = located.segments.into_iter().filter(|s| s.partition == partition).max_by_key(|s| s.index);
        if let Some(newest) = newest {
            let mut current = self.current.lock();
            let slot = &mut current[partition as usize];
            // The same index too: its `lost` flags may have changed.
            if slot.index <= newest.index {
                *slot = newest;
            }
        }
        Ok(())
    }

    /// Moves `partition` past segment `full` (idempotent across writers) and returns the new one.
    async fn advance(&self, partition: u32, full: u32) -> Result<Segment> {
        let request = pb::AdvanceSegmentRequest { shuffle_id: self.id.get(), partition, full_segment: full };
        let reply = self.client.metadata().advance_segment(request).await.map_err(|s| self.error(s))?.into_inner();
        let segment = reply.segment.ok_or_else(|| {
            Error::new(ErrorKind::Internal, format!("shuffle {}: advance without a segment", self.id))
        })?;
        let mut current = self.current.lock();
        if current[partition as usize].index < segment.index {
            current[partition as usize] = segment.clone();
        }
        Ok(segment)
    }
}

/// Writes one map attempt's output. [`MapWriter::commit`] makes it the map's output (unless
/// another attempt committed first); a writer dropped uncommitted leaves data no reader sees,
/// freed with the shuffle.
pub struct MapWriter {
    shuffle: Shuffle,
    map: MapIndex,
    attempt: MapAttempt,
    buffer_limit: usize,
    batch_bytes: usize,
    max_in_flight: usize,
    /// Per partition: a PushHeader's room, then the batch being gathered.
    buffers: Vec<BytesMut>,
    buffered: usize,
    /// Per partition: bytes written.
    bytes: Vec<u64>,
    /// Per partition: lowest and highest segment index pushed to.
    segments: Vec<Option<(u32, u32)>>,
    /// Per partition: a push is in flight. One at a time per partition keeps a map's batches in
    /// push order, within a segment and across segments; pushes to different partitions overlap.
    pushing: Vec<bool>,
    in_flight: FuturesUnordered<JoinHandle<Result<(u32, u32)>>>,
    space_wait: SpaceWait,
}

impl MapWriter {
    /// Has pushes refused for space wait for room as `wait` says, instead of failing at once.
    pub fn wait_for_space(mut self, wait: SpaceWait) -> MapWriter {
        self.space_wait = wait;
        self
    }

    /// Appends `data` to `partition`'s output.
    pub async fn write(&mut self, partition: u32, mut data: &[u8]) -> Result<()> {
        if partition >= self.shuffle.partitions {
            return Err(Error::invalid(format!(
                "shuffle {} map {}: partition {partition} is out of range (the shuffle has {})",
                self.shuffle.id, self.map, self.shuffle.partitions
            )));
        }
        let p = partition as usize;
        while !data.is_empty() {
            let held = self.buffers[p].len().saturating_sub(PUSH_HEADER_LEN);
            // Keep whole writes in one batch: push what is gathered before it would overflow.
            if held > 0 && held + data.len() > self.batch_bytes {
                self.push(partition).await?;
            }
            if self.buffers[p].is_empty() {
                self.buffers[p].reserve(PUSH_HEADER_LEN + data.len().min(self.batch_bytes));
                self.buffers[p].extend_from_slice(&[0; PUSH_HEADER_LEN]);
            }
            let take = data.len().min(self.batch_bytes - (self.buffers[p].len() - PUSH_HEADER_LEN));
            self.buffers[p].extend_from_slice(&data[..take]);
            self.buffered += take;
            self.bytes[p] += take as u64;
            data = &data[take..];
            if self.buffers[p].len() - PUSH_HEADER_LEN == self.batch_bytes {
                self.push(partition).await?;
            }
        }
        // Over the bound: push the fullest buffers first, so each push carries the most.
        while self.buffered > self.buffer_limit {
            let fullest = (0..self.buffers.len()).max_by_key(|&i| self.buffers[i].len()).unwrap_or(0);
            self.push(fullest as u32).await?;
        }
        Ok(())
    }

    /// Sends `partition`'s gathered batch, keeping at most `max_in_flight` pushes outstanding.
    async fn push(&mut self, partition: u32) -> Result<()> {
        let mut batch = std::mem::take(&mut self.buffers[partition as usize]);
        if batch.len() <= PUSH_HEADER_LEN {
            return Ok(());
        }
        self.buffered -= batch.len() - PUSH_HEADER_LEN;
        batch[..PUSH_HEADER_LEN]
            .copy_from_slice(&PushHeader { map: self.map, attempt: self.attempt, class: self.shuffle.class }.encode());
        while self.in_flight.len() >= self.max_in_flight || self.pushing[partition as usize] {
            self.finish_one().await?;
        }
        self.pushing[partition as usize] = true;
        let shuffle = self.shuffle.clone();
        let (map, attempt) = (self.map, self.attempt);
        let wait = self.space_wait.clone();
        self.in_flight.push(tokio::spawn(async move {
            push_batch(&shuffle, partition, batch.freeze(), &wait).await.map(|segment| (partition, segment)).map_err(
                |e| e.context(format_args!("shuffle {} partition {partition} map {map} attempt {attempt}", shuffle.id)),
            )
        }));
        Ok(())
    }

    async fn finish_one(&mut self) -> Result<()> {
        let Some(joined) = self.in_flight.next().await else {
            return Ok(());
        };
        let (partition, segment) = joined
            .map_err(|e| Error::new(ErrorKind::Internal, format!("shuffle {}: push task: {e}", self.shuffle.id)))??;
        self.pushing[partition as usize] = false;
        let range = &mut self.segments[partition as usize];
        *range = Some(match *range {
            Some((first, last)) => (first.min(segment), last.max(segment)),
            None => (segment, segment),
        });
        Ok(())
    }

    /// Pushes everything buffered, waits for every push, and commits this attempt. The first
    /// commit of a map wins; see [`CommitOutcome`].
    pub async fn commit(mut self) -> Result<CommitOutcome> {
        for partition in 0..self.shuffle.partitions {
            self.push(partition).await?;
        }
        while !self.in_flight.is_empty() {
            self.finish_one().await?;
        }
        let (first_segment, last_segment) = self.segments.iter().map(|r| r.unwrap_or((0, 0))).unzip();
        let request = pb::CommitMapRequest {
            shuffle_id: self.shuffle.id.get(),
            map_index: self.map.get(),
            attempt: self.attempt.get(),
            partition_bytes: std::mem::take(&mut self.bytes),
            first_segment,
            last_segment,
        };
        let reply = self.shuffle.client.metadata().commit_map(request).await.map_err(|s| {
            Error::from(s)
                .context(format_args!("shuffle {} commit map {} attempt {}", self.shuffle.id, self.map, self.attempt))
        })?;
        let reply = reply.into_inner();
        Ok(CommitOutcome { committed: reply.committed, winning_attempt: reply.winning_attempt })
    }
}

/// Pushes one batch as [`push_to_segments`] does; when no segment takes it for space and `wait`
/// allows, pauses (with backoff, telling `wait.on_wait`) and tries again until its limit has
/// passed. A retry tries the current segment and at most one new one: the metadata server places
/// a new segment on the server with the most room, so one move finds space freed anywhere.
async fn push_batch(shuffle: &Shuffle, partition: u32, payload: Bytes, wait: &SpaceWait) -> Result<u32> {
    let started = Instant::now();
    let mut pause = SPACE_PAUSE_FIRST;
    let mut moves = PUSH_ADVANCES;
    loop {
        let refused = match push_to_segments(shuffle, partition, &payload, moves).await {
            Err(e) if e.kind() == ErrorKind::OutOfSpace && !wait.limit.is_zero() => e,
            done => return done,
        };
        let waited = started.elapsed();
        if waited >= wait.limit {
            return Err(refused.context(format_args!("still no room after waiting {:.1}s", waited.as_secs_f64())));
        }
        if let Some(on_wait) = &wait.on_wait {
            on_wait(&refused);
        }
        tokio::time::sleep(pause.min(wait.limit - waited)).await;
        pause = (pause * 2).min(SPACE_PAUSE_MAX);
        moves = 1;
    }
}

/// Pushes one batch to its partition's current segment (every copy of it); returns the segment
/// index it landed in. A refusal for space everywhere, or a copy's server that cannot be reached
/// at all before anything is sent (nothing stored either way), moves to a new segment and tries
/// again, at most `moves` times; any other failure fails the push, since a copy may or may not
/// have stored the batch and only a new attempt keeps the output exactly-once.
async fn push_to_segments(shuffle: &Shuffle, partition: u32, payload: &Bytes, moves: u32) -> Result<u32> {
    let mut segment = shuffle.current_segment(partition);
    // The last reason for moving on, with the kind the push fails with if no segment takes the
    // batch: full servers are OutOfSpace, lost or unreachable ones Unavailable.
    let mut why_moved = Error::unavailable(String::new());
    for _ in 0..=moves {
        // A lost segment takes no pushes; nor does one that lost a copy: its successor has all
        // its copies on live servers, so new output stays replicated.
        if segment.lost || segment.replica_lost {
            why_moved = Error::unavailable(format!("segment {} lost a copy", segment.index));
            segment = shuffle.advance(partition, segment.index).await?;
            continue;
        }
        // Connect to every copy before sending to any: a copy that cannot be reached means that
        // nothing was sent, so moving on cannot duplicate the batch. The metadata server hands
        // out the partition's next segment (re-placed already if a server is dead).
        let mut conns = Vec::with_capacity(2);
        let mut unreachable = None;
        let holders = segment_holders(&segment);
        for holder in &holders {
            match shuffle.client.block_connection(holder).await {
                Ok(conn) => conns.push(conn),
                // A server without the transport asked for: no other segment would do better.
                Err(e) if e.kind() == ErrorKind::Invalid => return Err(e),
                Err(e) => {
                    unreachable = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = unreachable {
            tracing::debug!("{e}; moving on to a new segment");
            // Reported first, so the new segment is not placed where this client cannot reach.
            shuffle.client.report_if_unreachable(&holders[conns.len()].address, &e).await;
            why_moved = Error::unavailable(e.to_string());
            segment = shuffle.advance(partition, segment.index).await?;
            continue;
        }
        let (index, address) = (segment.index, address_of(shuffle.id, &segment));
        let access = shuffle.client.access(&shuffle.job, &shuffle.grant).await?;
        let pushes = conns.iter().map(|conn| {
            let sent = payload.clone();
            conn.call_as(&access, move |id| Frame::push(id, address, sent))
        });
        let results = futures::future::join_all(pushes).await;
        if results.iter().all(|r| matches!(r, Err(e) if e.kind() == ErrorKind::OutOfSpace)) {
            tracing::debug!("segment {index} of partition {partition} is full; moving on to a new segment");
            // The server's own words, after its address: which tiers are full, and how full.
            let why = results.iter().find_map(|r| r.as_ref().err()).map(Error::message).unwrap_or_default();
            why_moved = Error::new(ErrorKind::OutOfSpace, format!("segment {index} is full: {why}"));
            segment = shuffle.advance(partition, index).await?;
            continue;
        }
        // A copy's server that missed a deadline or dropped the connection may or may not have
        // stored the batch: the attempt fails (a new one keeps the output exactly-once), but
        // first the metadata server says where the partition goes now, so the next attempt
        // never pushes to a placement it has already replaced.
        let unavailable = results.iter().zip(&holders).find_map(|(r, holder)| {
            r.as_ref().err().filter(|e| e.kind() == ErrorKind::Unavailable).map(|e| (e, holder))
        });
        if let Some((e, holder)) = unavailable {
            shuffle.client.report_if_unreachable(&holder.address, e).await;
            if let Err(asked) = shuffle.follow_placement(partition).await {
                tracing::debug!(
                    "after {e}: could not ask the metadata server where partition {partition} goes: {asked}"
                );
            }
            return Err(e.clone());
        }
        let mut size = 0u32;
        for result in results {
            size = size.max(result?.header.length);
        }
        if u64::from(size) >= shuffle.split_size {
            shuffle.advance(partition, index).await?;
        }
        return Ok(index);
    }
    let last = why_moved.message();
    Err(Error::new(why_moved.kind(), format!("no segment took the batch after {moves} move(s) (last: {last})")))
}

/// What Push and Fetch frames call `segment` (a segment as the metadata server's messages
/// describe it) of shuffle `shuffle`.
fn address_of(shuffle: ShuffleId, segment: &Segment) -> SegmentAddress {
    SegmentAddress { shuffle, partition: PartitionIndex::from_wire(segment.partition), index: segment.index }
}

/// Per partition in range, the committed maps with bytes on a lost segment.
fn lost_maps(located: &LocateShuffleResponse) -> BTreeMap<u32, Vec<u32>> {
    let mut lost: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for segment in located.segments.iter().filter(|s| s.lost) {
        let Some(offset) = segment.partition.checked_sub(located.start_partition) else { continue };
        for output in &located.outputs {
            if holds(output, offset as usize, segment.index) {
                lost.entry(segment.partition).or_default().push(output.map_index);
            }
        }
    }
    lost
}

/// Whether `output` has bytes of partition (range offset) `offset` in segment `index`.
fn holds(output: &MapOutput, offset: usize, index: u32) -> bool {
    let bytes = output.partition_bytes.get(offset).copied().unwrap_or(0);
    let first = output.first_segment.get(offset).copied().unwrap_or(0);
    let last = output.last_segment.get(offset).copied().unwrap_or(0);
    bytes > 0 && (first..=last).contains(&index)
}

fn describe_lost(shuffle: ShuffleId, lost: &BTreeMap<u32, Vec<u32>>) -> String {
    let all: BTreeSet<u32> = lost.values().flatten().copied().collect();
    let partitions: Vec<String> = lost.iter().map(|(p, maps)| format!("partition {p}: maps {maps:?}")).collect();
    format!(
        "shuffle {shuffle}: data of maps {:?} is lost with its storage server; recompute them ({})",
        all,
        partitions.join("; ")
    )
}

/// Streams committed batches, checking each against its crc and each map's total against its
/// commit. Memory is bounded: at most `FETCHES_IN_FLIGHT` streams are fetched ahead, each at
/// most `PAGES_AHEAD` pages ahead of the consumer.
pub struct ShuffleReader {
    client: Client,
    shuffle_id: ShuffleId,
    located: Arc<LocateShuffleResponse>,
    /// Streams still to start, in read order.
    pending: VecDeque<FetchStream>,
    /// Segment fetches under way, in read order; each sends its batches a page at a time.
    fetching: VecDeque<mpsc::Receiver<Result<Vec<ShuffleBatch>>>>,
    ready: VecDeque<ShuffleBatch>,
    /// Bytes seen per (partition, map) of partitions not yet checked.
    seen: BTreeMap<(u32, u32), u64>,
    /// Partitions below this one have been checked against the commits.
    next_to_check: u32,
}

/// Pages a stream may run ahead of the reader.
const PAGES_AHEAD: usize = 1;

/// A run of maps (ascending) of one segment, fetched with one cursor. Streams in read order
/// concatenate to the segment's batches by map, then push order.
struct FetchStream {
    segment: Segment,
    maps: Vec<(MapIndex, MapAttempt)>,
}

/// Cuts each segment's committed maps into streams of about one page each (by the maps'
/// expected bytes in the segment), in read order; segments nobody wrote to are skipped.
fn plan_streams(located: &LocateShuffleResponse) -> VecDeque<FetchStream> {
    let mut streams = VecDeque::new();
    for segment in &located.segments {
        let offset = (segment.partition - located.start_partition) as usize;
        let mut run = Vec::new();
        let mut run_bytes = 0u64;
        for output in located.outputs.iter().filter(|o| holds(o, offset, segment.index)) {
            let spread = u64::from(output.last_segment[offset] - output.first_segment[offset]) + 1;
            run.push((MapIndex::from_wire(output.map_index), MapAttempt::from_wire(output.attempt)));
            run_bytes += output.partition_bytes[offset] / spread;
            if run_bytes >= u64::from(FETCH_PAGE_BYTES) {
                streams.push_back(FetchStream { segment: segment.clone(), maps: std::mem::take(&mut run) });
                run_bytes = 0;
            }
        }
        if !run.is_empty() {
            streams.push_back(FetchStream { segment: segment.clone(), maps: run });
        }
    }
    streams
}

impl ShuffleReader {
    fn new(client: Client, shuffle_id: ShuffleId, located: LocateShuffleResponse) -> ShuffleReader {
        let pending = plan_streams(&located);
        let next_to_check = located.start_partition;
        ShuffleReader {
            client,
            shuffle_id,
            located: Arc::new(located),
            pending,
            fetching: VecDeque::new(),
            ready: VecDeque::new(),
            seen: BTreeMap::new(),
            next_to_check,
        }
    }

    /// The committed maps this reader covers and their bytes per partition of the range.
    pub fn outputs(&self) -> &[MapOutput] {
        &self.located.outputs
    }

    /// The shuffle's map count, as registered (0: not given). With it, a reader of every map can
    /// tell a map that has not committed (yet, or again after its output was lost) from one that
    /// wrote nothing to the range.
    pub fn map_count(&self) -> u32 {
        self.located.maps
    }

    /// The next batch, `None` when every partition in range has been read and checked.
    pub async fn next_batch(&mut self) -> Result<Option<ShuffleBatch>> {
        loop {
            if let Some(batch) = self.ready.pop_front() {
                // Batches come partition by partition: every partition before this one is complete.
                self.check_partitions_below(batch.partition)?;
                *self.seen.entry((batch.partition, batch.map)).or_default() += batch.data.len() as u64;
                return Ok(Some(batch));
            }
            while self.fetching.len() < FETCHES_IN_FLIGHT {
                let Some(stream) = self.pending.pop_front() else { break };
                let (tx, rx) = mpsc::channel(PAGES_AHEAD);
                let access = self.client.access(&self.located.job_id, &self.located.grant).await?;
                tokio::spawn(fetch_stream(self.client.clone(), access, self.shuffle_id, stream, tx));
                self.fetching.push_back(rx);
            }
            let Some(front) = self.fetching.front_mut() else {
                self.check_partitions_below(self.located.end_partition)?;
                return Ok(None);
            };
            match front.recv().await {
                Some(page) => self.ready.extend(page?),
                None => {
                    self.fetching.pop_front();
                }
            }
        }
    }

    /// Checks every partition below `partition` not yet checked: each committed map's bytes
    /// there must have arrived in full.
    fn check_partitions_below(&mut self, partition: u32) -> Result<()> {
        while self.next_to_check < partition.min(self.located.end_partition) {
            let p = self.next_to_check;
            let offset = (p - self.located.start_partition) as usize;
            let short: Vec<String> = self
                .located
                .outputs
                .iter()
                .filter_map(|o| {
                    let expected = o.partition_bytes.get(offset).copied().unwrap_or(0);
                    let got = self.seen.remove(&(p, o.map_index)).unwrap_or(0);
                    (got != expected).then(|| format!("map {} ({got} of {expected} bytes)", o.map_index))
                })
                .collect();
            if !short.is_empty() {
                return Err(Error::new(
                    ErrorKind::DataLost,
                    format!(
                        "shuffle {} partition {p}: committed output incomplete for {}",
                        self.shuffle_id,
                        short.join(", ")
                    ),
                ));
            }
            self.next_to_check += 1;
        }
        Ok(())
    }

    /// Reads everything into memory (for small ranges and tests).
    pub async fn read_to_end(mut self) -> Result<Vec<ShuffleBatch>> {
        let mut out = Vec::new();
        while let Some(batch) = self.next_batch().await? {
            out.push(batch);
        }
        Ok(out)
    }
}

/// Fetches every batch of one stream, page by page, checking crcs and attempts, and sends each
/// page's batches to the reader (waiting while it is `PAGES_AHEAD` pages behind). A copy that
/// fails (unreachable, a crc mismatch, or without the segment) hands over to the next copy at
/// the same cursor.
async fn fetch_stream(
    client: Client,
    access: Access,
    shuffle_id: ShuffleId,
    stream: FetchStream,
    pages: mpsc::Sender<Result<Vec<ShuffleBatch>>>,
) {
    let holders = segment_holders(&stream.segment);
    let mut copy = 0;
    let mut request = FetchRequest { cursor: 0, max_bytes: FETCH_PAGE_BYTES, maps: stream.maps };
    loop {
        let mut page = fetch_page(&client, &access, shuffle_id, &stream.segment, &holders[copy], &request).await;
        match &page {
            Err(e)
                if copy + 1 < holders.len()
                    && matches!(
                        e.kind(),
                        ErrorKind::DataLost | ErrorKind::Corrupt | ErrorKind::NotFound | ErrorKind::Unavailable
                    ) =>
            {
                tracing::debug!("{e}; reading the copy on {}", holders[copy + 1].address);
                copy += 1;
                continue;
            }
            // A live server that never received a push for this segment (e.g. it was full when
            // the segment was opened): nothing is there. Had committed bytes been there, the
            // per-map totals checked at the end of the partition would come up short and say so.
            Err(e) if e.kind() == ErrorKind::NotFound => page = Ok((Vec::new(), None)),
            _ => {}
        }
        let next = match &page {
            Ok((_, next)) => *next,
            Err(_) => None,
        };
        if pages.send(page.map(|(batches, _)| batches)).await.is_err() {
            return; // the reader is gone
        }
        match next {
            Some(cursor) => request.cursor = cursor,
            None => return,
        }
    }
}

/// One page of `request`'s batches from one copy of the segment, and the cursor after it
/// (`None` at the end). A copy without the segment is a `NotFound` error.
async fn fetch_page(
    client: &Client,
    access: &Access,
    shuffle_id: ShuffleId,
    segment: &Segment,
    holder: &Holder,
    request: &FetchRequest,
) -> Result<(Vec<ShuffleBatch>, Option<u32>)> {
    let address = &holder.address;
    let fetched = address_of(shuffle_id, segment);
    let place = fetched.to_string();
    let lost = |e: Error| {
        let maps: Vec<u32> = request.maps.iter().map(|(m, _)| m.get()).collect();
        Error::new(
            ErrorKind::DataLost,
            format!("{place} on {address} is unreadable; recompute maps {maps:?}: {}", e.message()),
        )
    };
    let conn = match client.block_connection(holder).await {
        Ok(conn) => conn,
        Err(e) if e.kind() == ErrorKind::Invalid => return Err(e),
        Err(e) => return Err(lost(e)),
    };
    let payload = request.encode();
    let fetch = |id| Frame::fetch(id, fetched, payload);
    let reply = match conn.call_as(access, fetch).await {
        Ok(reply) => reply,
        Err(e) if e.kind() == ErrorKind::Unavailable => return Err(lost(e)),
        Err(e) => return Err(e.context(&place)),
    };
    let next = (reply.header.length != FETCH_DONE).then_some(reply.header.length);
    let mut batches = Vec::new();
    for item in wire::batches(reply.payload) {
        let (header, data) = item.map_err(|e| Error::new(ErrorKind::Corrupt, format!("{place}: {e}")))?;
        if request.attempt_of(header.map) != Some(header.attempt) {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("{place}: server sent map {} attempt {}, which was not asked for", header.map, header.attempt),
            ));
        }
        // No second pass over the bytes here: the server checked each batch against the crc it
        // took at push time, and the reply's frame crc (checked on receipt) is built from those
        // checked crcs, so the chain from pusher to this reader is unbroken. A batch damaged at
        // rest comes back as a Corrupt error naming its map.
        batches.push(ShuffleBatch { partition: segment.partition, map: header.map.get(), data });
    }
    Ok((batches, next))
}
