//! Copies of this server's blocks and shuffle segments to other storage servers, as the metadata
//! server directs in heartbeat replies (re-replication after another server died, or this
//! server's drain; why server to server: see `metadata-server/src/copies.rs`).
//!
//! A block copy reads the block here and writes it whole to its target in one Write frame, under
//! the grant and job token the metadata server gave, so the target checks it as it checks a
//! client's write (crc, write-once, grant). A segment copy first closes the segment here to
//! pushes (its partition has moved on; a writer that has not seen that yet is refused as by a
//! full segment and moves on too), so the copy holds everything the segment ever will; a segment
//! no push ever reached is closed the same way and copied as what it is, empty. Then it reads the segment a page
//! ([`SEGMENT_PAGE_BYTES`]) at a time, every batch of every map and attempt in the order a Fetch
//! serves them, each checked against its stored crc, and pushes each batch to the target as a
//! Push frame with its map and attempt, one at a time (the target appends in arrival order, so
//! its index comes out the same, and a fetch cursor means the same on either copy). The segment
//! size each Push reply reports must be the bytes pushed so far: a target that already held some
//! of the segment fails the copy rather than serve a mix. Outcomes go back in the next heartbeat; when the last
//! running copy ends the heartbeater is woken to send it at once, so copying runs at the rate the
//! metadata server hands copies out, not one batch per heartbeat interval.
//!
//! Bounds: at most [`PARALLEL`] copies at once, blocks and segments together (each holds one
//! block, or one page of a segment, in memory and one connection), each within [`COPY_TIMEOUT`]
//! (a block) or [`SEGMENT_COPY_TIMEOUT`] (a segment); at most [`MAX_RUNNING`] accepted (more are
//! left for the metadata server to hand out again); connections are kept per target, at most
//! [`PARALLEL`] idle each.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use bytes::{BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use tern_proto::frame::{self, Frame, MAX_SLOT};
use tern_proto::shuffle::{PushHeader, FETCH_DONE, PUSH_HEADER_LEN};
use tern_proto::token::Grant;
use tern_proto::v1::{CopyBlock, CopyDone, CopySegment};
use tern_proto::{BlockId, PartitionIndex, ShuffleId, StorageClass};
use tern_transport::{BoxRead, BoxWrite, Connector};
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::sync::{Notify, Semaphore};

use crate::shuffle::SegmentId;
use crate::store::{BlockStore, TierRef};

/// Copies running at once.
pub const PARALLEL: usize = 8;
/// Copies accepted and not yet reported, at most.
pub const MAX_RUNNING: usize = 1024;
/// Connect, bind and write of one block copy, at most.
pub const COPY_TIMEOUT: Duration = Duration::from_secs(30);
/// One segment copy (a segment is at most its shuffle's split size, 256 MiB by default: 21 s at
/// 100 Mbit/s), at most.
pub const SEGMENT_COPY_TIMEOUT: Duration = Duration::from_secs(120);
/// Bytes of a segment read per page for its copy: what one segment copy holds in memory.
pub const SEGMENT_PAGE_BYTES: u32 = 4 << 20;
/// Job tokens bound on one connection before it is replaced (slots are never reused).
const SLOTS_PER_CONNECTION: u16 = 64;

/// One pooled connection to a target, used by one copy at a time.
struct Conn {
    reader: BoxRead,
    writer: BufWriter<BoxWrite>,
    next_id: u64,
    /// Token bytes → the slot they are bound to.
    slots: HashMap<Vec<u8>, u16>,
}

impl Conn {
    async fn call(&mut self, frame: Frame, max_payload: u32) -> anyhow::Result<Frame> {
        let id = frame.header.request_id;
        frame::write_frame(&mut self.writer, &frame).await.context("sending")?;
        self.writer.flush().await.context("sending")?;
        let reply = frame::read_frame(&mut self.reader, max_payload)
            .await
            .map_err(|e| anyhow!("reading the reply: {e}"))?
            .ok_or_else(|| anyhow!("the connection closed before the reply"))?;
        if reply.header.request_id != id {
            bail!("a reply to request {} where {id} was awaited", reply.header.request_id);
        }
        reply.into_result().map_err(|(kind, message)| anyhow!("{message} ({kind:?})"))
    }

    fn take_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// The slot `token` is bound to on this connection, binding it first (Auth) when new.
    async fn slot_for(&mut self, token: &[u8], max_payload: u32) -> anyhow::Result<u16> {
        if token.is_empty() {
            return Ok(0);
        }
        if let Some(&slot) = self.slots.get(token) {
            return Ok(slot);
        }
        let slot = self.slots.len() as u16 + 1;
        debug_assert!(slot <= MAX_SLOT);
        let id = self.take_id();
        self.call(Frame::auth(id, slot, Bytes::copy_from_slice(token)), max_payload)
            .await
            .context("binding the job token")?;
        self.slots.insert(token.to_vec(), slot);
        Ok(slot)
    }
}

/// Runs the copies heartbeat replies bring; see the module docs.
pub struct Copier {
    store: Arc<BlockStore>,
    connector: Box<dyn Connector>,
    running: Mutex<HashSet<u64>>,
    done: Mutex<Vec<CopyDone>>,
    permits: Semaphore,
    idle: Mutex<HashMap<String, Vec<Conn>>>,
    /// Notified when the last running copy ends: the heartbeater reports at once.
    settled: Notify,
}

impl Copier {
    pub fn new(store: Arc<BlockStore>, connector: Box<dyn Connector>) -> Arc<Copier> {
        Arc::new(Copier {
            store,
            connector,
            running: Mutex::default(),
            done: Mutex::default(),
            permits: Semaphore::new(PARALLEL),
            idle: Mutex::default(),
            settled: Notify::new(),
        })
    }

    /// Starts the copies not already running (a copy handed out again is ignored while it runs).
    pub fn start(self: &Arc<Copier>, blocks: &[CopyBlock], segments: &[CopySegment]) {
        for task in blocks {
            if self.accept(task.copy_id) {
                let copier = self.clone();
                let task = task.clone();
                let what = format!("block {} to {}", task.block_id, task.target_address);
                tokio::spawn(async move {
                    let copy = copier.copy(&task);
                    copier.run(task.copy_id, what, COPY_TIMEOUT, copy).await
                });
            }
        }
        for task in segments {
            if self.accept(task.copy_id) {
                let copier = self.clone();
                let task = task.clone();
                let what = format!(
                    "segment {} of partition {} of shuffle {} to {}",
                    task.index, task.partition, task.shuffle_id, task.target_address
                );
                tokio::spawn(async move {
                    let copy = copier.copy_segment(&task);
                    copier.run(task.copy_id, what, SEGMENT_COPY_TIMEOUT, copy).await
                });
            }
        }
    }

    /// Takes `copy_id` as running, unless it is already or the bound is reached.
    fn accept(&self, copy_id: u64) -> bool {
        let mut running = self.running.lock();
        running.len() < MAX_RUNNING && running.insert(copy_id)
    }

    /// Outcomes to report; give them back with [`Copier::give_back`] if the report fails.
    pub fn take_done(&self) -> Vec<CopyDone> {
        std::mem::take(&mut *self.done.lock())
    }

    pub fn give_back(&self, mut done: Vec<CopyDone>) {
        self.done.lock().append(&mut done);
    }

    /// Resolves when the last running copy has ended and its outcome waits to be reported.
    pub async fn settled(&self) {
        self.settled.notified().await
    }

    /// Runs one copy under a permit and `timeout`, and queues its outcome (bytes copied, or why
    /// it failed) for the next heartbeat.
    async fn run(
        &self,
        copy_id: u64,
        what: String,
        timeout: Duration,
        copy: impl std::future::Future<Output = anyhow::Result<u64>>,
    ) {
        let outcome = match self.permits.acquire().await {
            Ok(_permit) => match tokio::time::timeout(timeout, copy).await {
                Ok(result) => result,
                Err(_) => Err(anyhow!("not done within {timeout:?}")),
            },
            Err(_) => Err(anyhow!("the copier is closed")),
        };
        let (error, bytes) = match outcome {
            Ok(bytes) => (String::new(), bytes),
            Err(e) => (format!("{what}: {e:#}"), 0),
        };
        self.done.lock().push(CopyDone { copy_id, error, bytes });
        let mut running = self.running.lock();
        running.remove(&copy_id);
        if running.is_empty() {
            self.settled.notify_one();
        }
    }

    async fn copy(&self, task: &CopyBlock) -> anyhow::Result<u64> {
        let block = BlockId::from_wire(task.block_id);
        let server = self.store.server_id();
        let read = match self.store.tier(block)? {
            TierRef::Dram(tier) => tier.read(block, 0, task.length, server)?,
            TierRef::Nvme(tier) => tier.read(block, 0, task.length, server).await?,
        };
        let grant: Grant =
            task.grant.as_slice().try_into().map_err(|_| anyhow!("a grant of {} bytes", task.grant.len()))?;
        let max_payload = self.store.block_size();
        let mut conn = self.checkout(&task.target_address).await?;
        let slot = conn.slot_for(&task.token, max_payload).await?;
        let id = conn.take_id();
        // The crc the bytes were written with goes with them, so the target checks the copy
        // against the original, not against a crc taken from what this server now holds.
        let write = Frame::write_with_crc(id, task.target_block_id, 0, read.data, read.crc);
        conn.call(write.authorized(slot, grant), max_payload).await?;
        self.give_back_conn(&task.target_address, conn);
        Ok(u64::from(task.length))
    }

    /// Copies a segment whole (see the module docs); returns the bytes of its batches.
    async fn copy_segment(&self, task: &CopySegment) -> anyhow::Result<u64> {
        let partition = PartitionIndex::from_wire(task.partition);
        let id = SegmentId { shuffle: ShuffleId::from_wire(task.shuffle_id), partition, index: task.index };
        let class: StorageClass = task.storage_class.parse().map_err(|e| anyhow!("{e}"))?;
        let grant: Grant =
            task.grant.as_slice().try_into().map_err(|_| anyhow!("a grant of {} bytes", task.grant.len()))?;
        if !self.store.close_segment_for_copy(id).await? {
            // Never pushed to: the target holding nothing of it is the same segment.
            return Ok(0);
        }
        let max_payload = self.store.block_size();
        let mut conn = self.checkout(&task.target_address).await?;
        let slot = conn.slot_for(&task.token, max_payload).await?;
        let (mut cursor, mut copied) = (0u32, 0u64);
        loop {
            let page = self.store.copy_page(id, cursor, SEGMENT_PAGE_BYTES).await?;
            for batch in tern_proto::shuffle::batches(page.payload.clone()) {
                let (header, bytes) = batch?;
                let mut payload = BytesMut::with_capacity(PUSH_HEADER_LEN + bytes.len());
                payload.put_slice(&PushHeader { map: header.map, attempt: header.attempt, class }.encode());
                payload.put_slice(&bytes);
                let request = conn.take_id();
                let push = Frame::push(request, id, payload.freeze());
                let reply = conn.call(push.authorized(slot, grant), max_payload).await?;
                copied += bytes.len() as u64;
                let size = u64::from(reply.header.length);
                if size != copied.min(u64::from(u32::MAX)) {
                    bail!(
                        "the target holds {size} bytes of the segment after {copied} were pushed: it held some already"
                    );
                }
            }
            if page.next_cursor == FETCH_DONE {
                break;
            }
            cursor = page.next_cursor;
        }
        self.give_back_conn(&task.target_address, conn);
        Ok(copied)
    }

    /// Pools a connection whose last call succeeded (a failed one is dropped with its error).
    fn give_back_conn(&self, address: &str, conn: Conn) {
        if conn.slots.len() < usize::from(SLOTS_PER_CONNECTION) {
            let mut idle = self.idle.lock();
            let pool = idle.entry(address.to_string()).or_default();
            if pool.len() < PARALLEL {
                pool.push(conn);
            }
        }
    }

    async fn checkout(&self, addr: &str) -> anyhow::Result<Conn> {
        if let Some(conn) = self.idle.lock().get_mut(addr).and_then(Vec::pop) {
            return Ok(conn);
        }
        let stream = self.connector.connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
        Ok(Conn {
            reader: stream.reader,
            writer: BufWriter::with_capacity(64 << 10, stream.writer),
            next_id: 0,
            slots: HashMap::new(),
        })
    }
}
