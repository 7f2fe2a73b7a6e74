//! The block service: block frames over any [`Listener`] of `tern_transport` (TCP, QUIC), one
//! code path and one connection limit for all of them.
//!
//! Each connection has a reader task and a writer task joined by a bounded queue of replies. The
//! reader handles DRAM requests in order (they are memcpy-fast) and queues each reply; when the
//! queue is full it stops reading, which pushes back on a client that pipelines faster than it
//! reads replies. A small reply with nothing queued ahead of it is written by the reader itself
//! (see `Replies`), which takes a task hop off the latency of small reads. NVMe reads and writes (block ids with `NVME_BLOCK_BIT`) wait on the disk, so
//! they do not hold the connection up: the reader reads a write's payload into an aligned buffer,
//! then spawns the op, which queues its own reply; a per-connection semaphore of
//! `max_in_flight_per_connection` permits bounds the ops under way. Their replies may overtake
//! earlier ones: clients match replies by request id. Write payloads are read from the socket straight into the arena and read replies
//! are views of the arena, so block data is never copied on the server. Shuffle ops copy once each
//! way: a Push's payload is read into a buffer and copied into its segment (the segment's lock is
//! not held while a slow client sends), and a Fetch reply gathers whole batches into one payload.
//!
//! Bad input never takes the server down: a frame the server cannot make sense of is answered
//! with an error frame; if the byte stream can no longer be trusted to be at a frame boundary,
//! that connection alone is closed after the error reply.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use tern_proto::frame::{self, Frame, FrameError, Header, Op, MAX_FREE_IDS};
use tern_proto::shuffle::{FetchRequest, PushHeader, MAX_FETCH_MAPS};
use tern_proto::{ErrorKind, Tier};
use tern_transport::{BoxRead, BoxWrite, Listener, Stream};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use crate::auth::{self, Denied, Slots};
use crate::metrics::Metrics;
use crate::shuffle::{SegmentId, ShuffleError};
use crate::store::{BlockStore, StoreError};

/// Replies are gathered into this much buffer before a write to the socket; payloads at least this
/// large go to the socket directly.
const WRITE_BUFFER_BYTES: usize = 64 << 10;
/// After a fatal frame error the server reads (and discards) what the peer already sent, for at
/// most this long and this many bytes, so that closing does not reset the connection and destroy
/// the error reply before the peer reads it.
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: u64 = 4 << 20;
/// Pause after a failed accept (e.g. out of file descriptors), so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// Refusals of connections over the limit being written at once, and how long each may take;
/// past either, a refused connection is closed without a word.
const MAX_REFUSALS: usize = 64;
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(1);
/// The largest Fetch request: its cursor, page size and the most `(map, attempt)` pairs one may
/// list. It may exceed the block size, the limit of every other op's payload.
const MAX_FETCH_REQUEST_BYTES: u32 = 8 + 8 * MAX_FETCH_MAPS as u32;

/// Bounds on the block service's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most open connections; further ones get an Unavailable error frame and are closed.
    pub max_connections: usize,
    /// Most replies queued per connection before the server stops reading its requests.
    pub max_in_flight_per_connection: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        let config = crate::Config::default();
        Limits::from(&config)
    }
}

impl From<&crate::Config> for Limits {
    fn from(config: &crate::Config) -> Limits {
        Limits {
            max_connections: config.max_connections,
            max_in_flight_per_connection: config.max_in_flight_per_connection,
        }
    }
}

/// Serves block frames on `listener` from `store` until the returned future is dropped (which
/// closes every connection it serves).
pub async fn serve_blocks(listener: impl Listener, store: Arc<BlockStore>, limits: Limits, metrics: Arc<Metrics>) {
    serve_block_listeners(vec![Box::new(listener)], store, limits, metrics).await
}

/// Serves block frames on every listener (e.g. TCP and QUIC) from `store`; `max_connections`
/// counts the connections of all of them together.
pub async fn serve_block_listeners(
    listeners: Vec<Box<dyn Listener>>,
    store: Arc<BlockStore>,
    limits: Limits,
    metrics: Arc<Metrics>,
) {
    assert!(limits.max_connections > 0 && limits.max_in_flight_per_connection > 0, "limits must be positive");
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let refusals = Arc::new(Semaphore::new(MAX_REFUSALS));
    let mut accepted = futures::stream::select_all(listeners.into_iter().map(|listener| {
        let name = listener.name();
        futures::stream::unfold(listener, move |mut listener| async move {
            let next = listener.accept().await;
            Some(((name, next), listener))
        })
        .boxed()
    }));
    // Two tasks per connection (and one per refusal); dropping the set (with this future) aborts them all.
    let mut tasks = JoinSet::new();
    loop {
        tokio::select! {
            Some((transport, next)) = accepted.next() => {
                let stream = match next {
                    Ok(stream) => stream,
                    Err(e) => {
                        tracing::warn!("block service: {transport} accept failed: {e}");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                        continue;
                    }
                };
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    if let Ok(slot) = refusals.clone().try_acquire_owned() {
                        let metrics = metrics.clone();
                        tasks.spawn(async move {
                            let _slot = slot;
                            refuse_connection(stream, limits.max_connections, &metrics).await;
                        });
                    }
                    continue;
                };
                metrics.connection_opened();
                let guard = Arc::new(ConnectionGuard { _permit: permit, metrics: metrics.clone() });
                let Stream { reader, writer, peer } = stream;
                let (tx, rx) = mpsc::channel(limits.max_in_flight_per_connection);
                let out = Arc::new(tokio::sync::Mutex::new(BufWriter::with_capacity(WRITE_BUFFER_BYTES, writer)));
                tasks.spawn(write_replies(out.clone(), rx, guard.clone(), peer));
                let nvme_ops = Arc::new(Semaphore::new(limits.max_in_flight_per_connection));
                let replies = Replies { tx, out };
                tasks.spawn(read_requests(reader, replies, store.clone(), metrics.clone(), guard, peer, nvme_ops));
            }
            Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                if let Err(e) = joined {
                    if e.is_panic() {
                        tracing::error!("block service: a connection task panicked: {e}");
                    }
                }
            }
        }
    }
}

/// Held by both tasks of a connection: the connection counts against the limit until both end.
struct ConnectionGuard {
    _permit: OwnedSemaphorePermit,
    metrics: Arc<Metrics>,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.metrics.connection_closed();
    }
}

/// Tells a connection over the limit why it is refused, waiting on it at most
/// [`REFUSAL_TIMEOUT`], and closes it.
async fn refuse_connection(stream: Stream, limit: usize, metrics: &Metrics) {
    let message = format!("storage server is at its limit of {limit} connections; retry later");
    let frame = Frame::error(0, Op::Malformed, 0, ErrorKind::Unavailable, &message);
    let Stream { reader, mut writer, peer } = stream;
    let sent = tokio::time::timeout(REFUSAL_TIMEOUT, async {
        frame::write_frame(&mut writer, &frame).await?;
        writer.shutdown().await
    })
    .await;
    drop(reader);
    metrics.record(Op::Malformed, Duration::ZERO, 0, Some(ErrorKind::Unavailable));
    tracing::debug!("block service: refused {peer}: {message} (told: {})", matches!(sent, Ok(Ok(()))));
}

/// A connection's socket writer, shared by its writer task and (for small replies) its reader.
type ReplyWriter = Arc<tokio::sync::Mutex<BufWriter<BoxWrite>>>;

/// How a connection's replies leave: queued for the writer task, or, when nothing is queued and
/// the reply is small, written by the reader itself, which saves a task hop on the latency path
/// of small reads.
struct Replies {
    tx: mpsc::Sender<Frame>,
    out: ReplyWriter,
}

impl Replies {
    /// Sends `reply`; false when the connection is gone.
    async fn send(&self, reply: Frame) -> bool {
        let idle = self.tx.capacity() == self.tx.max_capacity();
        if idle && reply.payload.len() <= DIRECT_REPLY_BYTES {
            if let Ok(mut out) = self.out.try_lock() {
                let written = match frame::write_frame(&mut *out, &reply).await {
                    Ok(()) => out.flush().await,
                    Err(e) => Err(e),
                };
                return written.is_ok();
            }
        }
        self.tx.send(reply).await.is_ok()
    }
}

/// Replies up to this size may be written by the connection's reader (see [`Replies`]); larger
/// ones always go through the writer task, so the reader parses the next request meanwhile.
const DIRECT_REPLY_BYTES: usize = WRITE_BUFFER_BYTES;

/// Writes queued replies, batching them while more are queued.
async fn write_replies(
    out: ReplyWriter,
    mut rx: mpsc::Receiver<Frame>,
    _guard: Arc<ConnectionGuard>,
    peer: SocketAddr,
) {
    while let Some(reply) = rx.recv().await {
        let mut out = out.lock().await;
        let mut written = frame::write_frame(&mut *out, &reply).await;
        while written.is_ok() {
            match rx.try_recv() {
                Ok(reply) => written = frame::write_frame(&mut *out, &reply).await,
                Err(_) => break,
            }
        }
        if let Err(e) = written.and(out.flush().await) {
            // Dropping `rx` stops the reader at its next reply.
            tracing::debug!("block service: writing to {peer}: {e}");
            return;
        }
    }
    // The reader is done: flush what is left and send FIN.
    if let Err(e) = out.lock().await.shutdown().await {
        tracing::debug!("block service: closing {peer}: {e}");
    }
}

/// Reads and handles requests in order, queueing one reply per request.
async fn read_requests(
    mut rd: BoxRead,
    replies: Replies,
    store: Arc<BlockStore>,
    metrics: Arc<Metrics>,
    _guard: Arc<ConnectionGuard>,
    peer: SocketAddr,
    nvme_ops: Arc<Semaphore>,
) {
    let block_size = store.block_size();
    // The job tokens this connection bound (Auth frames), by slot.
    let mut slots = Slots::default();
    loop {
        let header = frame::read_header(&mut rd, block_size.max(MAX_FETCH_REQUEST_BYTES)).await;
        let header = match header {
            Ok(Some(h)) if h.op != Op::Fetch && h.payload_len > block_size => {
                // Every payload but a Fetch's fits a block; refused before a byte of it is read.
                Err(FrameError::PayloadTooLarge { len: h.payload_len, max: block_size })
            }
            other => other,
        };
        let (reply, fatal) = match header {
            Ok(None) => return,
            Ok(Some(header)) if !header.response && header.op == Op::Auth => {
                let started = Instant::now();
                let (reply, fatal) = match serve_auth(&mut rd, &store, &mut slots, &header).await {
                    Ok(reply) => (reply, false),
                    Err(e) => {
                        let message = format!("{header}: {e}");
                        (Frame::error(header.request_id, header.op, header.block_id, e.kind(), &message), true)
                    }
                };
                metrics.record(header.op, started.elapsed(), 0, error_kind(&reply));
                (reply, fatal)
            }
            Ok(Some(header)) if !header.response && admit(&store, &slots, &header).is_err() => {
                let started = Instant::now();
                let denied = admit(&store, &slots, &header).expect_err("refused just now");
                let (reply, fatal) = match frame::skip_payload(&mut rd, header.payload_len).await {
                    Ok(()) => (denied_reply(&header, &denied), false),
                    // The stream broke: that is what the peer needs to hear.
                    Err(e) => {
                        let message = format!("{header}: {e}");
                        (Frame::error(header.request_id, header.op, header.block_id, e.kind(), &message), true)
                    }
                };
                metrics.record(header.op, started.elapsed(), 0, error_kind(&reply));
                (reply, fatal)
            }
            Ok(Some(header)) if is_nvme_op(&header) => {
                let started = Instant::now();
                let nvme = NvmeOp { store: &store, tx: &replies.tx, metrics: &metrics, permits: &nvme_ops, started };
                match serve_nvme(&mut rd, nvme, header).await {
                    // Spawned: it queues its own reply.
                    Ok(None) => continue,
                    Ok(Some(reply)) => {
                        metrics.record(header.op, started.elapsed(), 0, error_kind(&reply));
                        (reply, false)
                    }
                    Err(e) => {
                        let message = format!("{header}: {e}");
                        let reply = Frame::error(header.request_id, header.op, header.block_id, e.kind(), &message);
                        metrics.record(header.op, started.elapsed(), 0, error_kind(&reply));
                        (reply, true)
                    }
                }
            }
            Ok(Some(header)) => {
                let started = Instant::now();
                let (reply, bytes, fatal) = match serve_request(&mut rd, &store, &slots, &header).await {
                    Ok((reply, bytes)) => (reply, bytes, false),
                    Err(e) => {
                        let message = format!("{header}: {e}");
                        let reply = Frame::error(header.request_id, header.op, header.block_id, e.kind(), &message);
                        (reply, 0, true)
                    }
                };
                metrics.record(header.op, started.elapsed(), bytes, error_kind(&reply));
                if reply.header.status == 0 && matches!(header.op, Op::Write | Op::Free | Op::Push) {
                    metrics.observe_store(&store);
                }
                (reply, fatal)
            }
            Err(e) => {
                let started = Instant::now();
                let (reply, fatal) = reply_to_bad_header(&mut rd, e).await;
                metrics.record(Op::Malformed, started.elapsed(), 0, error_kind(&reply));
                (reply, fatal)
            }
        };
        if !fatal {
            if !replies.send(reply).await {
                return;
            }
            continue;
        }
        tracing::debug!(
            "block service: closing {peer} after a frame error: {}",
            String::from_utf8_lossy(&reply.payload)
        );
        // The writer sends the error reply, then FIN, once `tx` is gone.
        let _ = replies.tx.send(reply).await;
        drop(replies);
        linger(&mut rd).await;
        return;
    }
}

/// Ok when the request may go ahead: its slot's token is good and, for ops on one block or
/// shuffle, its grant proves that block or shuffle belongs to the slot's job. (A Free's grants
/// are in its payload: `serve_free` checks them.) Ping needs nothing.
fn admit(store: &BlockStore, slots: &Slots, h: &Header) -> Result<(), Denied> {
    if matches!(h.op, Op::Ping | Op::Malformed | Op::Auth) {
        return Ok(());
    }
    let Some(principal) = slots.principal(store.authority(), h, tern_common::unix_ms())? else {
        return Ok(());
    };
    match auth::covered(h) {
        Some((kind, id)) => principal.check(h.op, kind, id, &h.grant),
        None => Ok(()),
    }
}

fn denied_reply(h: &Header, denied: &Denied) -> Frame {
    Frame::error(h.request_id, h.op, h.block_id, denied.kind, &denied.message)
}

/// Binds the token an Auth frame carries to its slot; the reply is empty.
async fn serve_auth(rd: &mut BoxRead, store: &BlockStore, slots: &mut Slots, h: &Header) -> Result<Frame, FrameError> {
    if h.payload_len as usize > tern_proto::token::MAX_TOKEN_BYTES {
        let message = format!("{h}: a token is at most {} bytes", tern_proto::token::MAX_TOKEN_BYTES);
        return Ok(refuse(rd, h, ErrorKind::Invalid, &message).await?.0);
    }
    let payload = match read_request_payload(rd, h).await? {
        Ok(payload) => payload,
        Err(reply) => return Ok(reply),
    };
    Ok(match slots.bind(store.authority(), h, &payload, tern_common::unix_ms()) {
        Ok(()) => Frame::reply(h, 0, Bytes::new()),
        Err(denied) => denied_reply(h, &denied),
    })
}

/// A Read or Write of an NVMe block: served off the reader task.
fn is_nvme_op(h: &Header) -> bool {
    !h.response
        && Tier::of_block(h.block_id) == Tier::Nvme
        && (h.op == Op::Write || (h.op == Op::Read && h.payload_len == 0))
}

/// What an NVMe op needs from its connection.
struct NvmeOp<'a> {
    store: &'a Arc<BlockStore>,
    tx: &'a mpsc::Sender<Frame>,
    metrics: &'a Arc<Metrics>,
    permits: &'a Arc<Semaphore>,
    started: Instant,
}

/// Starts an NVMe Read or Write: validates it, reads a write's payload into its aligned buffer,
/// and spawns the disk op, which queues the reply (`Ok(None)`). `Ok(Some(reply))` when it was
/// refused before reaching the disk; `Err` is a stream error after which the connection closes.
async fn serve_nvme(rd: &mut BoxRead, op: NvmeOp<'_>, h: Header) -> Result<Option<Frame>, FrameError> {
    let nvme = match op.store.nvme_for(h.block_id) {
        Ok(nvme) => nvme.clone(),
        Err(e) => {
            frame::skip_payload(rd, h.payload_len).await?;
            return Ok(Some(store_error(&h, &e)));
        }
    };
    let (store, tx, metrics, started) = (op.store.clone(), op.tx.clone(), op.metrics.clone(), op.started);
    if h.op == Op::Read {
        // Never closed, so acquiring only waits.
        let Ok(permit) = op.permits.clone().acquire_owned().await else {
            return Ok(Some(Frame::error(h.request_id, h.op, h.block_id, ErrorKind::Internal, "connection closing")));
        };
        tokio::spawn(async move {
            let (reply, bytes) = match nvme.read(h.block_id, h.offset, h.length, store.server_id()).await {
                Ok((data, held)) => {
                    let bytes = data.len() as u64;
                    (Frame::reply(&h, held, data), bytes)
                }
                Err(e) => (store_error(&h, &e), 0),
            };
            metrics.record(h.op, started.elapsed(), bytes, error_kind(&reply));
            let _ = tx.send(reply).await;
            drop(permit);
        });
        return Ok(None);
    }
    let mut pending = match nvme.begin_write(h.block_id, h.offset, h.payload_len) {
        Ok(pending) => pending,
        Err(e) => {
            frame::skip_payload(rd, h.payload_len).await?;
            return Ok(Some(store_error(&h, &e)));
        }
    };
    let Ok(permit) = op.permits.clone().acquire_owned().await else {
        return Ok(Some(Frame::error(h.request_id, h.op, h.block_id, ErrorKind::Internal, "connection closing")));
    };
    // On a stream error `pending` is dropped unpublished: nothing of this payload becomes visible.
    read_exactly(rd, pending.payload()).await?;
    tokio::spawn(async move {
        let (reply, bytes) = match pending.commit(h.payload_crc).await {
            Ok(len) => (Frame::reply(&h, len, Bytes::new()), u64::from(h.payload_len)),
            Err(e) => (store_error(&h, &e), 0),
        };
        metrics.record(h.op, started.elapsed(), bytes, error_kind(&reply));
        if reply.header.status == 0 {
            metrics.observe_store(&store);
        }
        let _ = tx.send(reply).await;
        drop(permit);
    });
    Ok(None)
}

/// The kind an error reply carries; `None` for a successful reply.
fn error_kind(reply: &Frame) -> Option<ErrorKind> {
    match reply.header.status {
        0 => None,
        code => Some(ErrorKind::from_code(code).unwrap_or(ErrorKind::Internal)),
    }
}

/// The reply to a header that could not be decoded, and whether the connection must close.
async fn reply_to_bad_header(rd: &mut BoxRead, err: FrameError) -> (Frame, bool) {
    if let FrameError::UnknownOp { request_id, payload_len, .. } = err {
        let message = format!("request {request_id}: {err} (requests are Ping, Write, Read, Free, Push, Fetch, Auth)");
        // The header was sound, so skipping the payload brings the stream to the next frame.
        return match frame::skip_payload(rd, payload_len).await {
            Ok(()) => (Frame::error(request_id, Op::Malformed, 0, err.kind(), &message), false),
            Err(skip) => (Frame::error(request_id, Op::Malformed, 0, skip.kind(), &format!("{message}; {skip}")), true),
        };
    }
    (Frame::error(0, Op::Malformed, 0, err.kind(), &err.to_string()), err.is_fatal())
}

/// Discards what the peer still sends, bounded in time and bytes (see [`LINGER`]).
async fn linger(rd: &mut BoxRead) {
    let mut rest = rd.take(LINGER_BYTES);
    let _ = tokio::time::timeout(LINGER, tokio::io::copy(&mut rest, &mut tokio::io::sink())).await;
}

/// Handles one request whose header decoded. `Ok` carries the reply (which may be an error
/// reply) and the payload bytes moved; `Err` is a stream error after which the connection closes.
async fn serve_request(
    rd: &mut BoxRead,
    store: &BlockStore,
    slots: &Slots,
    h: &Header,
) -> Result<(Frame, u64), FrameError> {
    if h.response {
        let message = format!("{h}: a reply frame sent to a storage server, which takes requests only");
        return refuse(rd, h, ErrorKind::Invalid, &message).await;
    }
    match h.op {
        Op::Ping | Op::Read if h.payload_len > 0 => {
            let message = format!("{h}: {:?} requests carry no payload", h.op);
            refuse(rd, h, ErrorKind::Invalid, &message).await
        }
        Op::Ping => Ok((Frame::reply(h, 0, Bytes::new()), 0)),
        Op::Read => match store.read(h.block_id, h.offset, h.length) {
            Ok((data, held)) => {
                let bytes = data.len() as u64;
                Ok((Frame::reply(h, held, data), bytes))
            }
            Err(e) => Ok((store_error(h, &e), 0)),
        },
        Op::Write => serve_write(rd, store, h).await,
        Op::Free => serve_free(rd, store, slots, h).await,
        Op::Push => serve_push(rd, store, h).await,
        Op::Fetch => serve_fetch(rd, store, h).await,
        Op::Auth => {
            // Served by the connection's reader before it gets here.
            let message = format!("{h}: Auth is handled by the connection");
            refuse(rd, h, ErrorKind::Internal, &message).await
        }
        Op::Malformed => {
            let message = format!("{h}: op Malformed only appears in error replies");
            refuse(rd, h, ErrorKind::Invalid, &message).await
        }
    }
}

/// Appends a Write's payload to its block, reading it from the socket straight into the arena.
async fn serve_write(rd: &mut BoxRead, store: &BlockStore, h: &Header) -> Result<(Frame, u64), FrameError> {
    let mut pending = match store.begin_write(h.block_id, h.offset, h.payload_len) {
        Ok(pending) => pending,
        Err(e) => {
            frame::skip_payload(rd, h.payload_len).await?;
            return Ok((store_error(h, &e), 0));
        }
    };
    // On a stream error `pending` is dropped unpublished: nothing of this payload becomes visible.
    read_exactly(rd, pending.buf()).await?;
    match pending.commit(h.payload_crc) {
        Ok(len) => Ok((Frame::reply(h, len, Bytes::new()), u64::from(h.payload_len))),
        Err(e) => Ok((store_error(h, &e), 0)),
    }
}

/// Frees the blocks a Free frame lists; the reply's length is the number freed.
async fn serve_free(
    rd: &mut BoxRead,
    store: &BlockStore,
    slots: &Slots,
    h: &Header,
) -> Result<(Frame, u64), FrameError> {
    if h.payload_len as usize > MAX_FREE_IDS * frame::FREE_ENTRY_LEN {
        let err = FrameError::BadFreeList { bytes: h.payload_len as usize };
        return refuse(rd, h, err.kind(), &format!("{h}: {err}")).await;
    }
    let payload = match read_request_payload(rd, h).await? {
        Ok(payload) => payload,
        Err(reply) => return Ok((reply, 0)),
    };
    let request = Frame { header: *h, payload };
    match request.free_entries() {
        Ok(entries) => {
            // Every block must be the slot's job's, else nothing is freed.
            let principal = match slots.principal(store.authority(), h, tern_common::unix_ms()) {
                Ok(principal) => principal,
                Err(denied) => return Ok((denied_reply(h, &denied), 0)),
            };
            if let Some(principal) = principal {
                for (id, grant) in &entries {
                    if let Err(denied) = principal.check(Op::Free, tern_proto::token::GrantKind::Block, *id, grant) {
                        return Ok((denied_reply(h, &denied), 0));
                    }
                }
            }
            let ids: Vec<u64> = entries.into_iter().map(|(id, _)| id).collect();
            let freed = store.free(&ids);
            Ok((Frame::reply(h, freed as u32, Bytes::new()), 0))
        }
        Err(e) => Ok((frame_error(h, &e), 0)),
    }
}

/// Reads a request's whole payload. `Ok(Err(reply))` when it is unusable but the stream is still
/// at a frame boundary (a bad checksum): the error reply to send.
async fn read_request_payload(rd: &mut BoxRead, h: &Header) -> Result<Result<Bytes, Frame>, FrameError> {
    match frame::read_payload(rd, h).await {
        Ok(payload) => Ok(Ok(payload)),
        Err(e) if !e.is_fatal() => Ok(Err(frame_error(h, &e))),
        Err(e) => Err(e),
    }
}

/// Appends a Push's batch to its segment; the reply's length is the segment's size afterwards
/// (saturating at `u32::MAX`).
async fn serve_push(rd: &mut BoxRead, store: &BlockStore, h: &Header) -> Result<(Frame, u64), FrameError> {
    let payload = match read_request_payload(rd, h).await? {
        Ok(payload) => payload,
        Err(reply) => return Ok((reply, 0)),
    };
    let (from, batch) = match PushHeader::decode(&payload) {
        Ok(decoded) => decoded,
        Err(e) => return Ok((frame_error(h, &e), 0)),
    };
    match store.push(segment_of(h), from, batch) {
        Ok(bytes) => {
            let length = u32::try_from(bytes).unwrap_or(u32::MAX);
            Ok((Frame::reply(h, length, Bytes::new()), batch.len() as u64))
        }
        Err(e) => Ok((shuffle_error(h, &e), 0)),
    }
}

/// Answers a Fetch with a page of committed batches; the reply's length is the next cursor.
async fn serve_fetch(rd: &mut BoxRead, store: &BlockStore, h: &Header) -> Result<(Frame, u64), FrameError> {
    let payload = match read_request_payload(rd, h).await? {
        Ok(payload) => payload,
        Err(reply) => return Ok((reply, 0)),
    };
    let request = match FetchRequest::decode(&payload) {
        Ok(request) => request,
        Err(e) => return Ok((frame_error(h, &e), 0)),
    };
    match store.fetch(segment_of(h), &request) {
        Ok(page) => {
            let bytes = page.payload.len() as u64;
            Ok((Frame::reply_with_crc(h, page.next_cursor, page.payload, page.crc), bytes))
        }
        Err(e) => Ok((shuffle_error(h, &e), 0)),
    }
}

/// Push and Fetch address a segment with the header's block id, offset and length.
fn segment_of(h: &Header) -> SegmentId {
    SegmentId { shuffle: h.block_id, partition: h.offset, index: h.length }
}

/// Skips the request's payload (keeping the stream at a frame boundary) and answers with an error.
async fn refuse(rd: &mut BoxRead, h: &Header, kind: ErrorKind, message: &str) -> Result<(Frame, u64), FrameError> {
    frame::skip_payload(rd, h.payload_len).await?;
    Ok((Frame::error(h.request_id, h.op, h.block_id, kind, message), 0))
}

fn store_error(h: &Header, e: &StoreError) -> Frame {
    Frame::error(h.request_id, h.op, h.block_id, e.kind(), &e.to_string())
}

fn shuffle_error(h: &Header, e: &ShuffleError) -> Frame {
    Frame::error(h.request_id, h.op, h.block_id, e.kind(), &e.to_string())
}

/// An error reply for a payload that could not be used, naming the request.
fn frame_error(h: &Header, e: &FrameError) -> Frame {
    Frame::error(h.request_id, h.op, h.block_id, e.kind(), &format!("{h}: {e}"))
}

/// Fills `buf` from the stream; `Truncated` if the stream ends first.
async fn read_exactly<R: AsyncRead + Unpin>(rd: &mut R, buf: &mut [u8]) -> Result<(), FrameError> {
    let mut got = 0;
    while got < buf.len() {
        match rd.read(&mut buf[got..]).await? {
            0 => return Err(FrameError::Truncated { expected: buf.len(), got }),
            n => got += n,
        }
    }
    Ok(())
}
