//! One pipelined connection to a storage server's block service, and the pool of them.
//!
//! A connection is one byte stream of the client's transport (`tern_transport`): a TCP socket, or
//! a QUIC stream (several of them share a QUIC connection).
//!
//! A connection carries many requests at once: a writer task sends frames as they are queued (a
//! caller with a small request and nothing queued writes it itself, one task hop fewer), a
//! reader task matches replies to waiting callers by request id. A semaphore bounds the requests
//! in flight, so a fast producer waits instead of queueing without limit.
//!
//! Every request has a deadline. A connection on which one is missed is given up at once: it
//! leaves the pool, its other requests fail with it, and its reader task is stopped. A server
//! whose link is cut answers nothing and refuses nothing, so a pooled connection to it would
//! otherwise make every later request wait out the deadline again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tern_proto::buffers::BufferPool;
use tern_proto::frame::{self, Frame, Lease, LentPage, RemoteLease, Staged, LEASE_TTL, MAX_PAYLOAD_BYTES, MAX_SLOT};
use tern_proto::token::Grant;
use tern_transport::local::{SharedArena, Staging};
use tern_transport::rdma_provider::{OneSided, Window};
use tern_transport::{BoxRead, BoxWrite, Connector};
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::auth::{Access, Held};
use crate::error::{Error, Result};
use crate::liveness::{Stalls, STALLED_AFTER};

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Frame>>>>>;
/// The connection's socket writer, shared by its writer task and callers sending small frames.
type FrameWriter = Arc<tokio::sync::Mutex<BufWriter<BoxWrite>>>;

/// Frames up to this payload size are written by the caller itself when nothing is queued: one
/// task hop fewer on the latency path of small requests. Larger ones go through the writer task.
const DIRECT_SEND_BYTES: usize = 64 << 10;

/// A pipelined connection to one storage server.
pub(crate) struct BlockConnection {
    addr: String,
    outbox: mpsc::Sender<Frame>,
    out: FrameWriter,
    pending: Pending,
    next_id: AtomicU64,
    in_flight: Semaphore,
    broken: Arc<AtomicBool>,
    /// How long a request may wait for its reply before it fails as Unavailable and the
    /// connection is given up.
    request_timeout: Duration,
    /// The task reading replies: stopped with the connection (on a cut link its read would
    /// otherwise wait for TCP to give up, many minutes).
    receiver: tokio::task::AbortHandle,
    /// Where a request that waits long says so, for the client's liveness watcher.
    stalls: Arc<Stalls>,
    /// Job tokens bound on this connection: job serial -> (slot, MAC of the token bound there).
    /// A refreshed token of the same job rebinds the job's slot.
    slots: Mutex<HashMap<u64, (u16, [u8; 32])>>,
    next_slot: AtomicU16,
    /// One Auth at a time per connection.
    binding: tokio::sync::Mutex<()>,
    /// On a same-host connection, the server's DRAM arena, mapped read-only.
    arena: Option<Arc<SharedArena>>,
    /// On a same-host connection, its staging area, which writes are copied into.
    staging: Option<Shares>,
    /// On an RDMA connection, its one-sided READs of blocks the server lends through memory
    /// windows.
    one_sided: Option<Arc<dyn OneSided>>,
    /// Blocks asked for on a same-host or RDMA connection, by block and the grant that asked (a
    /// read under another job's grant does not get to use this one's lease).
    leased: Mutex<HashMap<(u64, Grant), Leased>>,
}

/// A lease: where the block lies in the server's shared arena (same-host), or the memory
/// window to READ it through (RDMA).
#[derive(Debug, Clone, Copy)]
enum Lent {
    Local(Lease),
    Remote(RemoteLease),
}

impl Lent {
    fn id(&self) -> u64 {
        match self {
            Lent::Local(lease) => lease.id,
            Lent::Remote(lease) => lease.id,
        }
    }
}

/// A block asked for on a same-host (see `tern_transport::local`) or RDMA connection: leased,
/// or refused (not in DRAM) and so read through the stream, without asking again, until `until`.
#[derive(Debug, Clone, Copy)]
struct Leased {
    lease: Option<Lent>,
    /// Bytes lent: the block's length when it was leased.
    len: u32,
    /// Until when the client reads it: [`LEASE_TTL`] after the Lease was sent, less a margin, so
    /// the server (counting from when it lent) never ends it while a copy runs.
    until: tokio::time::Instant,
    /// Reads of it under way; the lease is released when the last one that reached the end of
    /// the lent bytes is done (see [`BlockConnection::done_reading`]).
    readers: u32,
}

/// Writes one same-host connection stages at once: its staging area is cut into this many shares
/// (four of 4 MiB in the server's 16 MiB), so a block of up to a quarter of it is staged; more
/// writes at once, or larger ones, go through the socket.
const STAGED_WRITES: usize = 4;

/// A same-host connection's staging area, cut into equal shares, one per staged write.
struct Shares {
    area: Arc<Staging>,
    share: usize,
    /// Offsets of the shares no write holds.
    free: Arc<Mutex<Vec<u64>>>,
}

impl Shares {
    fn new(area: Arc<Staging>, count: usize) -> Shares {
        let share = area.len() / count;
        let free = (0..count as u64).map(|i| i * share as u64).collect();
        Shares { area, share, free: Arc::new(Mutex::new(free)) }
    }

    /// A free share that holds `len` bytes, if there is one.
    fn take(&self, len: usize) -> Option<Share> {
        if len > self.share {
            return None;
        }
        let at = self.free.lock().pop()?;
        Some(Share { area: self.area.clone(), at, free: self.free.clone() })
    }
}

/// A share of a staging area, held by one write; free again when dropped.
struct Share {
    area: Arc<Staging>,
    at: u64,
    free: Arc<Mutex<Vec<u64>>>,
}

impl Share {
    /// Copies `data` into the share; where it lies and its crc32c, for the WriteStaged.
    fn stage(&self, data: &[u8]) -> std::io::Result<Staged> {
        Ok(Staged { at: self.at, crc: self.area.stage(self.at, data)? })
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.free.lock().push(self.at);
    }
}

/// Most blocks one connection keeps leased (or remembers refused), well below the server's
/// bound per connection.
const MAX_LEASED_BLOCKS: usize = 32;
/// How much sooner than the server a client stops reading a lease.
const LEASE_MARGIN: Duration = Duration::from_secs(1);

impl BlockConnection {
    async fn connect(
        connector: &dyn Connector,
        addr: &str,
        max_in_flight: usize,
        timeout: Duration,
        request_timeout: Duration,
        stalls: Arc<Stalls>,
        buffers: Arc<BufferPool>,
    ) -> Result<BlockConnection> {
        let stream = tokio::time::timeout(timeout, connector.connect(addr))
            .await
            .map_err(|_| Error::unavailable(format!("storage server {addr}: connect timed out after {timeout:?}")))?
            .map_err(|e| Error::unavailable(format!("storage server {addr}: cannot connect: {e}")))?;
        let (read_half, write_half, local, one_sided) = (stream.reader, stream.writer, stream.local, stream.one_sided);
        let arena = local.as_ref().map(|local| local.arena.clone());
        let staging = local.map(|local| Shares::new(local.staging, STAGED_WRITES));
        let (outbox, inbox) = mpsc::channel(max_in_flight);
        let pending: Pending = Arc::default();
        let broken = Arc::new(AtomicBool::new(false));
        let out = Arc::new(tokio::sync::Mutex::new(BufWriter::with_capacity(64 << 10, write_half)));
        tokio::spawn(send_frames(inbox, out.clone(), broken.clone()));
        let receiver =
            tokio::spawn(receive_frames(read_half, pending.clone(), broken.clone(), addr.to_string(), buffers))
                .abort_handle();
        Ok(BlockConnection {
            addr: addr.to_string(),
            outbox,
            out,
            pending,
            next_id: AtomicU64::new(1),
            in_flight: Semaphore::new(max_in_flight),
            broken,
            request_timeout,
            receiver,
            stalls,
            slots: Mutex::default(),
            next_slot: AtomicU16::new(1),
            binding: tokio::sync::Mutex::new(()),
            arena,
            staging,
            one_sided,
            leased: Mutex::default(),
        })
    }

    /// Reads `len` bytes of block `block` from `offset` under `access`. On a same-host
    /// connection they are copied from the server's arena under a lease of the block (one Lease
    /// round trip per block and [`LEASE_TTL`]); on an RDMA connection READ one-sided through the
    /// lease's memory window; elsewhere, or when the block cannot be leased (on NVMe, say), they
    /// come in a Read's reply.
    pub(crate) async fn read(&self, access: &Access, block: u64, offset: u32, len: u32) -> Result<Bytes> {
        if self.arena.is_some() || self.one_sided.is_some() {
            match self.leased(access, block, offset.saturating_add(len)).await {
                Some(Lent::Local(lease)) => {
                    let arena = self.arena.as_ref().expect("same-host leases come over same-host connections");
                    let copied = arena.copy_out(lease.offset + u64::from(offset), len as usize).map_err(|e| {
                        Error::new(crate::ErrorKind::Corrupt, format!("storage server {}: {e}", self.addr))
                    });
                    self.done_reading(access, block, offset.saturating_add(len)).await;
                    return copied;
                }
                Some(Lent::Remote(lease)) => {
                    let read = self.read_remote(block, &lease, offset, len).await;
                    self.done_reading(access, block, offset.saturating_add(len)).await;
                    return read;
                }
                None => {}
            }
        }
        Ok(self.call_as(access, |id| Frame::read(id, block, offset, len)).await?.payload)
    }

    /// Appends `data` to block `block` at `offset` under `access`. On a same-host connection the
    /// bytes are copied into a share of its staging area and a WriteStaged names them (no bytes on
    /// the socket); elsewhere, or with no share free that holds them, they go in a Write's frame.
    pub(crate) async fn write(&self, access: &Access, block: u64, offset: u32, data: Bytes) -> Result<Frame> {
        let len = data.len() as u32;
        if let Some(share) = self.staging.as_ref().and_then(|shares| shares.take(data.len())) {
            let staged = share.stage(&data).map_err(|e| self.lost(&format!("staging a write: {e}")))?;
            // The share is held until the reply: the server copies from it until then.
            let reply = self.call_as(access, |id| Frame::write_staged(id, block, offset, len, staged)).await;
            drop(share);
            return reply;
        }
        self.call_as(access, |id| Frame::write(id, block, offset, data)).await
    }

    /// READs a block lent through a memory window, whole (so its crc32c, which the server took
    /// when it lent it, can be checked), and answers `len` bytes of it from `offset`.
    async fn read_remote(&self, block: u64, lease: &RemoteLease, offset: u32, len: u32) -> Result<Bytes> {
        let bytes = self.read_window(&format!("block {block}"), lease).await?;
        Ok(bytes.slice(offset as usize..(offset + len) as usize))
    }

    /// READs what `lease` lends (`what`, for errors) one-sided and checks it against the crc the
    /// server took. A READ that fails ends the connection (its queue pair is in the error
    /// state): the caller's retry goes through a new one.
    async fn read_window(&self, what: &str, lease: &RemoteLease) -> Result<Bytes> {
        let one_sided = self.one_sided.as_ref().expect("RDMA leases come over RDMA connections");
        let window = Window { addr: lease.addr, rkey: lease.rkey };
        let bytes = match tokio::time::timeout(self.request_timeout, one_sided.read(window, lease.len as usize)).await {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(e)) => {
                let lost = self.lost(&format!("RDMA READ of {what}: {e}"));
                self.give_up(&lost);
                return Err(lost);
            }
            Err(_) => {
                let lost = self.lost(&format!("RDMA READ of {what}: no completion within {:?}", self.request_timeout));
                self.give_up(&lost);
                return Err(lost);
            }
        };
        let actual = crc32c::crc32c(&bytes);
        if bytes.len() != lease.len as usize || actual != lease.crc {
            let why = format!(
                "storage server {}: {what} READ as {} bytes with crc {actual:#010x}; the server lent {} bytes with crc {:#010x}",
                self.addr,
                bytes.len(),
                lease.len,
                lease.crc
            );
            return Err(Error::new(crate::ErrorKind::Corrupt, why));
        }
        Ok(bytes)
    }

    /// A live lease of `block` covering its first `end` bytes: the one held, or a new one.
    /// `None` when the server will not lend it: the caller reads it instead, and that read's
    /// reply says why, as for any client.
    async fn leased(&self, access: &Access, block: u64, end: u32) -> Option<Lent> {
        let key = (block, access.grant);
        let now = tokio::time::Instant::now();
        let mut ended = Vec::new();
        {
            let mut leased = self.leased.lock();
            match leased.get_mut(&key) {
                Some(held) if held.until > now && (held.lease.is_none() || end <= held.len) => {
                    held.readers += u32::from(held.lease.is_some());
                    return held.lease;
                }
                // Expired, or the block grew since: ask anew.
                Some(_) => ended.extend(leased.remove(&key).and_then(|held| held.lease).map(|lease| lease.id())),
                None => {}
            }
        }
        let until = now + LEASE_TTL - LEASE_MARGIN;
        let reply = self.call_as(access, |id| Frame::lease(id, block)).await;
        let decode = |payload: &[u8]| match self.one_sided {
            Some(_) => RemoteLease::decode(payload).map(Lent::Remote),
            None => Lease::decode(payload).map(Lent::Local),
        };
        let fresh = match reply.map(|reply| (decode(&reply.payload), reply.header.length)) {
            Ok((Ok(lease), len)) => Some(Leased { lease: Some(lease), len, until, readers: u32::from(end <= len) }),
            Ok((Err(e), _)) => {
                tracing::warn!("storage server {}: a bad Lease reply ({e}); reading through the socket", self.addr);
                None
            }
            Err(e) => {
                tracing::debug!("storage server {}: block {block} not leased ({e}); reading it", self.addr);
                // Not in DRAM: remembered, so its reads do not each ask again.
                (e.kind() == crate::ErrorKind::Invalid).then_some(Leased { lease: None, len: 0, until, readers: 0 })
            }
        };
        {
            let mut leased = self.leased.lock();
            let now = tokio::time::Instant::now();
            leased.retain(|_, held| {
                let live = held.until > now;
                if !live {
                    ended.extend(held.lease.map(|lease| lease.id()));
                }
                live
            });
            if let Some(fresh) = fresh {
                if leased.len() >= MAX_LEASED_BLOCKS {
                    let oldest = leased.iter().min_by_key(|(_, held)| held.until).map(|(key, _)| *key);
                    ended
                        .extend(oldest.and_then(|key| leased.remove(&key)).and_then(|held| held.lease).map(|l| l.id()));
                }
                if let Some(replaced) = leased.insert(key, fresh) {
                    ended.extend(replaced.lease.map(|lease| lease.id()));
                }
            }
        }
        if !ended.is_empty() {
            self.post(|id| Frame::release(id, &ended)).await;
        }
        fresh.and_then(|fresh| fresh.lease.filter(|_| end <= fresh.len))
    }

    /// One read of `block`'s lease (to `end`) is done. A lease whose bytes were read to their end,
    /// with no other read of it under way, is released now: a sequential reader is done with the
    /// block, and a lease kept to its TTL holds the block's DRAM slot on the server (even once the
    /// block is freed), which filled a small DRAM tier with the slots of a deleted input while
    /// new blocks were placed there (issue 31). Reading the block again leases it again.
    async fn done_reading(&self, access: &Access, block: u64, end: u32) {
        let key = (block, access.grant);
        let ended = {
            let mut leased = self.leased.lock();
            let Some(held) = leased.get_mut(&key) else { return };
            held.readers = held.readers.saturating_sub(1);
            if held.readers > 0 || end < held.len {
                return;
            }
            leased.remove(&key).and_then(|held| held.lease).map(|lease| lease.id())
        };
        if let Some(ended) = ended {
            self.post(|id| Frame::release(id, &[ended])).await;
        }
    }

    /// Sends a frame whose reply nobody waits for (a Release): the reply is matched and dropped.
    async fn post(&self, build: impl FnOnce(u64) -> Frame) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, _) = oneshot::channel();
        self.pending.lock().insert(id, tx);
        if !self.send(build(id)).await {
            self.pending.lock().remove(&id);
        }
    }

    /// [`BlockConnection::call`] acting under `access`: the job's token bound to a slot of this
    /// connection first (one Auth round trip, once per job and token), the frame naming the slot
    /// and carrying the grant.
    pub(crate) async fn call_as(&self, access: &Access, build: impl FnOnce(u64) -> Frame) -> Result<Frame> {
        let slot = match &access.token {
            None => 0,
            Some(held) => self.slot_for(held).await?,
        };
        self.call(|id| build(id).authorized(slot, access.grant)).await
    }

    async fn slot_for(&self, held: &Held) -> Result<u16> {
        let serial = held.token.serial;
        let bound = |slots: &HashMap<u64, (u16, [u8; 32])>| match slots.get(&serial) {
            Some((slot, mac)) if *mac == held.token.mac => Some(*slot),
            _ => None,
        };
        if let Some(slot) = bound(&self.slots.lock()) {
            return Ok(slot);
        }
        let _one = self.binding.lock().await;
        let existing = {
            let slots = self.slots.lock();
            if let Some(slot) = bound(&slots) {
                return Ok(slot);
            }
            slots.get(&serial).map(|(slot, _)| *slot)
        };
        let slot = match existing {
            Some(slot) => slot,
            None => {
                let slot = self.next_slot.fetch_add(1, Ordering::Relaxed);
                if slot > MAX_SLOT {
                    // Slots are never reused (a frame in flight may still name one): a
                    // connection that carried this many jobs is replaced.
                    self.broken.store(true, Ordering::Release);
                    return Err(self.lost(&format!("all {MAX_SLOT} job slots used; reconnecting")));
                }
                slot
            }
        };
        self.call(|id| Frame::auth(id, slot, held.encoded.clone()))
            .await
            .map_err(|e| e.context(format_args!("binding job {}'s token", held.token.job)))?;
        self.slots.lock().insert(serial, (slot, held.token.mac));
        Ok(slot)
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Sends the frame `build(request_id)` and waits for its reply; an error reply becomes an
    /// `Error` of the kind the server named.
    pub(crate) async fn call(&self, build: impl FnOnce(u64) -> Frame) -> Result<Frame> {
        let _permit = self.in_flight.acquire().await.map_err(|_| self.lost("connection closed"))?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().insert(id, tx);
        // The reader may have failed every pending call before this one was registered.
        if self.is_broken() {
            self.pending.lock().remove(&id);
            return Err(self.lost("connection lost"));
        }
        if !self.send(build(id)).await {
            self.pending.lock().remove(&id);
            return Err(self.lost("connection lost"));
        }
        let reply = match self.wait_for_reply(rx).await {
            Ok(reply) => reply.map_err(|_| self.lost("connection lost"))??,
            Err(_) => {
                let missed = self.lost(&format!("no reply within {:?}", self.request_timeout));
                self.give_up(&missed);
                return Err(missed);
            }
        };
        let reply = reply
            .into_result()
            .map_err(|(kind, message)| Error::new(kind, format!("storage server {}: {message}", self.addr)))?;
        match reply.is_lent() {
            true => self.take_lent(reply).await,
            false => Ok(reply),
        }
    }

    /// A reply whose bytes were lent (a Fetch page that is one extent of the server's arena): on
    /// a same-host connection copied out of the mapping, on an RDMA connection READ through the
    /// memory window; checked against the crc the server took, and the lease released.
    async fn take_lent(&self, mut reply: Frame) -> Result<Frame> {
        let corrupt =
            |why: String| Error::new(crate::ErrorKind::Corrupt, format!("storage server {}: {why}", self.addr));
        let (bytes, crc) = if self.one_sided.is_some() {
            let lease = RemoteLease::decode(&reply.payload).map_err(|e| corrupt(e.to_string()))?;
            let read = self.read_window(&format!("a lent {:?} page", reply.header.op), &lease).await;
            if read.is_ok() {
                self.post(|id| Frame::release(id, &[lease.id])).await;
            }
            (read?, lease.crc)
        } else {
            let page = LentPage::decode(&reply.payload).map_err(|e| corrupt(e.to_string()))?;
            let arena = self
                .arena
                .as_ref()
                .ok_or_else(|| corrupt("a lent reply on a connection without a shared arena".into()))?;
            let copied = arena.copy_out(page.lease.offset, page.len as usize);
            self.post(|id| Frame::release(id, &[page.lease.id])).await;
            let bytes = copied.map_err(|e| corrupt(e.to_string()))?;
            let actual = crc32c::crc32c(&bytes);
            if actual != page.crc {
                return Err(corrupt(format!("lent bytes have crc {actual:#010x}, the server took {:#010x}", page.crc)));
            }
            (bytes, page.crc)
        };
        reply.header.slot = 0;
        reply.header.payload_len = bytes.len() as u32;
        reply.header.payload_crc = crc;
        reply.payload = bytes;
        Ok(reply)
    }

    /// Waits up to the request deadline for `rx`; past [`STALLED_AFTER`] the request counts as
    /// stalled, so the liveness watcher may give the connection up sooner (its server dead).
    async fn wait_for_reply<T>(
        &self,
        mut rx: oneshot::Receiver<T>,
    ) -> Result<Result<T, oneshot::error::RecvError>, tokio::time::error::Elapsed> {
        let first = STALLED_AFTER.min(self.request_timeout);
        match tokio::time::timeout(first, &mut rx).await {
            Ok(reply) => Ok(reply),
            Err(elapsed) if first == self.request_timeout => Err(elapsed),
            Err(_) => {
                let _stalled = self.stalls.stalled(&self.addr);
                tokio::time::timeout(self.request_timeout - first, rx).await
            }
        }
    }

    /// Writes a small frame itself when nothing is queued, else queues it for the writer task;
    /// false when the connection is gone.
    async fn send(&self, frame: Frame) -> bool {
        if frame.payload.len() <= DIRECT_SEND_BYTES && self.outbox.capacity() == self.outbox.max_capacity() {
            if let Ok(mut out) = self.out.try_lock() {
                // A caller dropped mid-write would leave half a frame on the stream: the guard
                // marks the connection broken unless the write completes.
                let guard = BreakOnDrop(&self.broken);
                let written = match frame::write_frame(&mut *out, &frame).await {
                    Ok(()) => out.flush().await,
                    Err(e) => Err(e),
                };
                if written.is_ok() {
                    std::mem::forget(guard);
                    return true;
                }
                return false;
            }
        }
        self.outbox.send(frame).await.is_ok()
    }

    /// Gives the connection up after a missed deadline: it leaves the pool (broken), the
    /// requests still waiting on it fail with `why`, and its reader stops.
    fn give_up(&self, why: &Error) {
        self.broken.store(true, Ordering::Release);
        self.receiver.abort();
        for (_, waiter) in self.pending.lock().drain() {
            let _ = waiter.send(Err(why.clone()));
        }
    }

    fn lost(&self, what: &str) -> Error {
        Error::unavailable(format!("storage server {}: {what}", self.addr))
    }
}

impl Drop for BlockConnection {
    fn drop(&mut self) {
        self.receiver.abort();
    }
}

/// Marks a connection broken when dropped (see [`BlockConnection::send`]).
struct BreakOnDrop<'a>(&'a AtomicBool);

impl Drop for BreakOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

async fn send_frames(mut inbox: mpsc::Receiver<Frame>, out: FrameWriter, broken: Arc<AtomicBool>) {
    while let Some(frame) = inbox.recv().await {
        let mut out = out.lock().await;
        let mut result = frame::write_frame(&mut *out, &frame).await;
        // Coalesce whatever else is queued, then flush once.
        while result.is_ok() {
            match inbox.try_recv() {
                Ok(frame) => result = frame::write_frame(&mut *out, &frame).await,
                Err(_) => break,
            }
        }
        if result.and(out.flush().await).is_err() {
            broken.store(true, Ordering::Release);
            return;
        }
    }
}

async fn receive_frames(
    mut read_half: BoxRead,
    pending: Pending,
    broken: Arc<AtomicBool>,
    addr: String,
    buffers: Arc<BufferPool>,
) {
    let why = loop {
        match frame::read_frame_pooled(&mut read_half, MAX_PAYLOAD_BYTES, &buffers).await {
            Ok(Some(reply)) => {
                let waiter = pending.lock().remove(&reply.header.request_id);
                match waiter {
                    Some(waiter) => {
                        let _ = waiter.send(Ok(reply));
                    }
                    // An error about the connection itself (request id 0) ends it.
                    None => {
                        break match reply.into_result() {
                            Err((kind, message)) => Error::new(kind, format!("storage server {addr}: {message}")),
                            Ok(frame) => Error::unavailable(format!(
                                "storage server {addr}: reply to unknown request {}",
                                frame.header.request_id
                            )),
                        };
                    }
                }
            }
            Ok(None) => break Error::unavailable(format!("storage server {addr}: connection closed")),
            Err(e) => break Error::unavailable(format!("storage server {addr}: connection lost: {e}")),
        }
    };
    broken.store(true, Ordering::Release);
    for (_, waiter) in pending.lock().drain() {
        let _ = waiter.send(Err(why.clone()));
    }
}

/// Connections to every storage server a client talks to, a few per server, made on first use
/// and replaced when they break.
pub(crate) struct BlockPool {
    connector: Arc<dyn Connector>,
    per_server: usize,
    max_in_flight: usize,
    connect_timeout: Duration,
    request_timeout: Duration,
    servers: Mutex<HashMap<String, Vec<Arc<BlockConnection>>>>,
    next: AtomicUsize,
    /// Requests stalled per server, watched by the client's liveness watcher.
    stalls: Arc<Stalls>,
    /// Per server, one connect at a time: a server that cannot be reached holds up only the
    /// calls to it, for at most the connect deadline, not the calls to every other server.
    connecting: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Where replies' payloads are read into, shared by every connection.
    buffers: Arc<BufferPool>,
}

/// Most bytes of idle receive buffers a client keeps for reuse (see `tern_proto::buffers`):
/// enough for a few in-flight reads of the largest blocks.
const IDLE_RECEIVE_BUFFER_BYTES: usize = 64 << 20;

impl BlockPool {
    pub(crate) fn new(
        connector: Arc<dyn Connector>,
        per_server: usize,
        max_in_flight: usize,
        connect_timeout: Duration,
        request_timeout: Duration,
    ) -> BlockPool {
        BlockPool {
            connector,
            per_server: per_server.max(1),
            max_in_flight: max_in_flight.max(1),
            connect_timeout,
            request_timeout,
            servers: Mutex::default(),
            next: AtomicUsize::new(0),
            stalls: Arc::default(),
            connecting: Mutex::default(),
            buffers: BufferPool::new(IDLE_RECEIVE_BUFFER_BYTES),
        }
    }

    /// A live connection to `addr`, spreading calls over the server's connections.
    pub(crate) async fn get(&self, addr: &str) -> Result<Arc<BlockConnection>> {
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        if let Some(conn) = self.pick(addr, turn) {
            return Ok(conn);
        }
        // One connect at a time per server, so a burst of calls does not open a burst of sockets.
        let connecting = self.connecting.lock().entry(addr.to_string()).or_default().clone();
        let _guard = connecting.lock().await;
        if let Some(conn) = self.pick(addr, turn) {
            return Ok(conn);
        }
        let conn = Arc::new(
            BlockConnection::connect(
                self.connector.as_ref(),
                addr,
                self.max_in_flight,
                self.connect_timeout,
                self.request_timeout,
                self.stalls.clone(),
                self.buffers.clone(),
            )
            .await?,
        );
        let mut servers = self.servers.lock();
        let conns = servers.entry(addr.to_string()).or_default();
        conns.retain(|c| !c.is_broken());
        conns.push(conn.clone());
        Ok(conn)
    }

    /// Requests stalled per server, for the liveness watcher.
    pub(crate) fn stalls(&self) -> &Arc<Stalls> {
        &self.stalls
    }

    /// Gives up every connection to `addr` (its server is dead): its requests fail with `why`.
    pub(crate) fn give_up_server(&self, addr: &str, why: &Error) {
        let conns = self.servers.lock().remove(addr).unwrap_or_default();
        for conn in conns {
            conn.give_up(why);
        }
    }

    fn pick(&self, addr: &str, turn: usize) -> Option<Arc<BlockConnection>> {
        let mut servers = self.servers.lock();
        let conns = servers.get_mut(addr)?;
        conns.retain(|c| !c.is_broken());
        if conns.len() < self.per_server {
            return None;
        }
        Some(conns[turn % conns.len()].clone())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// A server that accepts connections and never answers (a hung host): a request misses its
    /// deadline, the requests beside it fail with it, and the pool connects anew.
    #[tokio::test]
    async fn a_missed_deadline_gives_the_connection_up_and_the_next_call_connects_anew() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = accepted.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                held.push(socket);
            }
        });
        let deadline = Duration::from_millis(300);
        let connector = Arc::new(tern_transport::tcp::TcpConnector);
        let pool = BlockPool::new(connector, 1, 4, Duration::from_secs(5), deadline);
        let conn = pool.get(&addr).await.unwrap();
        let started = std::time::Instant::now();
        let (first, second) =
            tokio::join!(conn.call(|id| Frame::read(id, 1, 0, 1)), conn.call(|id| Frame::read(id, 2, 0, 1)));
        for failed in [first.unwrap_err(), second.unwrap_err()] {
            assert_eq!(failed.kind(), crate::ErrorKind::Unavailable, "{failed}");
            assert!(failed.message().contains("no reply within"), "{failed}");
        }
        // The second waited no longer than the first: it was failed with its connection.
        assert!(started.elapsed() < deadline * 3, "{:?}", started.elapsed());
        assert!(conn.is_broken());
        let again = pool.get(&addr).await.unwrap();
        assert!(!Arc::ptr_eq(&conn, &again), "the pool handed out the connection that missed its deadline");
        // The listener's task counts the second connection once it gets to accept it.
        for _ in 0..100 {
            if accepted.load(Ordering::SeqCst) == 2 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("{} connections accepted, not 2", accepted.load(Ordering::SeqCst));
    }
}
