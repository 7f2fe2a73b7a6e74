//! The block service: block frames over any [`Listener`] of `tern_transport` (TCP, QUIC), one
//! code path and one connection limit for all of them.
//!
//! Each connection has a reader task and a writer task joined by a bounded queue of replies. The
//! reader handles DRAM requests in order (they are memcpy-fast) and queues each reply; when the
//! queue is full it stops reading, which pushes back on a client that pipelines faster than it
//! reads replies. A small reply with nothing queued ahead of it is written by the reader itself
//! (see `Replies`), which takes a task hop off the latency of small reads. NVMe reads and writes
//! wait on the disk, so they do not hold the connection up: the reader reads a write's payload
//! into an aligned buffer, then spawns the op, which queues its own reply; a per-connection
//! semaphore of `max_in_flight_per_connection` permits bounds the ops under way. Their replies may
//! overtake earlier ones: clients match replies by request id. Write payloads are read from the
//! socket straight into the arena and read replies are views of the arena, so block data is never
//! copied on the server. Shuffle ops copy once each way: a Push's payload is read into a buffer and
//! copied into its segment (the segment's lock is not held while a slow client sends), and a Fetch
//! reply gathers whole batches into one payload.
//!
//! The ops are served by family: [`blocks`] (Read, Write, Free), [`shuffles`] (Push, Fetch),
//! [`leases`] (Lease, Release: same-host and RDMA connections only) and [`control`] (Auth, Ping,
//! admission, frames that make no sense). Each hands back a reply (or
//! the news that a task will send it); this module sends it and records it, in one place.
//!
//! Bad input never takes the server down: a frame the server cannot make sense of is answered
//! with an error frame; if the byte stream can no longer be trusted to be at a frame boundary,
//! that connection alone is closed after the error reply.

mod blocks;
mod control;
mod leases;
mod shuffles;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use tern_proto::frame::{self, Frame, FrameError, Header, Op};
use tern_proto::ErrorKind;
use tern_transport::{BoxRead, BoxWrite, Listener, Stream};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use crate::auth::Slots;
use crate::metrics::Metrics;
use crate::store::BlockStore;

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
    let leases = leases::LeaseBook::default();
    let mut expiry = tokio::time::interval(leases::EXPIRY_TICK);
    expiry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = expiry.tick() => {
                leases.expire(Instant::now());
            }
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
                metrics.connection_opened(transport);
                let guard = Arc::new(ConnectionGuard { _permit: permit, metrics: metrics.clone() });
                let Stream { reader, writer, peer, local, one_sided } = stream;
                let (tx, rx) = mpsc::channel(limits.max_in_flight_per_connection);
                let out = Arc::new(tokio::sync::Mutex::new(BufWriter::with_capacity(WRITE_BUFFER_BYTES, writer)));
                tasks.spawn(write_replies(out.clone(), rx, guard.clone(), peer));
                let conn = Connection {
                    store: store.clone(),
                    metrics: metrics.clone(),
                    replies: Replies { tx, out },
                    nvme_ops: Arc::new(Semaphore::new(limits.max_in_flight_per_connection)),
                    slots: Slots::default(),
                    leases: local.as_ref().map(|local| leases.open(local.arena.clone())),
                    staging: local.map(|local| local.staging),
                    one_sided,
                };
                tasks.spawn(read_requests(reader, conn, guard, peer));
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
    let Stream { reader, mut writer, peer, .. } = stream;
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

/// One connection's request side: what serving its requests needs.
struct Connection {
    store: Arc<BlockStore>,
    metrics: Arc<Metrics>,
    replies: Replies,
    /// Bounds the NVMe ops under way (see the module doc).
    nvme_ops: Arc<Semaphore>,
    /// The job tokens this connection bound (Auth frames), by slot.
    slots: Slots,
    /// On a same-host connection, the blocks it leased.
    leases: Option<Arc<parking_lot::Mutex<leases::Leases>>>,
    /// On a same-host connection, its staging area (WriteStaged).
    staging: Option<Arc<tern_transport::local::Staging>>,
    /// On an RDMA connection, the memory windows it lends blocks through (see `leases`).
    one_sided: Option<Arc<dyn tern_transport::rdma_provider::OneSided>>,
}

/// What serving one request came to, short of a stream error.
enum Served {
    /// The reply, and the payload bytes the op moved.
    Reply(Frame, u64),
    /// Handed to a task, which sends its own reply and [`record`]s it (an NVMe op).
    Spawned,
}

/// Reads and handles requests in order, sending one reply per request.
async fn read_requests(mut rd: BoxRead, mut conn: Connection, _guard: Arc<ConnectionGuard>, peer: SocketAddr) {
    let block_size = conn.store.block_size();
    loop {
        let header = frame::read_header(&mut rd, block_size.max(shuffles::MAX_FETCH_REQUEST_BYTES)).await;
        let header = match header {
            Ok(Some(h)) if h.op != Op::Fetch && h.payload_len > block_size => {
                // Every payload but a Fetch's fits a block; refused before a byte of it is read.
                Err(FrameError::PayloadTooLarge { len: h.payload_len, max: block_size })
            }
            other => other,
        };
        let started = Instant::now();
        // `Err` is the reply to a stream error, after which the connection closes.
        let (op, served) = match header {
            Ok(None) => return,
            Ok(Some(h)) => (h.op, serve(&mut rd, &mut conn, &h, started).await.map_err(|e| frame_error(&h, &e))),
            Err(e) => (Op::Malformed, control::bad_header(&mut rd, e).await),
        };
        let (reply, fatal) = match served {
            Ok(Served::Spawned) => continue,
            Ok(Served::Reply(reply, bytes)) => {
                record(&conn.metrics, &conn.store, op, started, &reply, bytes);
                (reply, false)
            }
            Err(reply) => {
                record(&conn.metrics, &conn.store, op, started, &reply, 0);
                (reply, true)
            }
        };
        if !fatal {
            if !conn.replies.send(reply).await {
                return;
            }
            continue;
        }
        tracing::debug!(
            "block service: closing {peer} after a frame error: {}",
            String::from_utf8_lossy(&reply.payload)
        );
        // The writer sends the error reply, then FIN, once `tx` is gone.
        let _ = conn.replies.tx.send(reply).await;
        drop(conn);
        linger(&mut rd).await;
        return;
    }
}

/// Serves one request whose header decoded (at `started`), by op family. `Err` is a stream error
/// after which the connection closes.
async fn serve(rd: &mut BoxRead, conn: &mut Connection, h: &Header, started: Instant) -> Result<Served, FrameError> {
    if h.response {
        let message = format!("{h}: a reply frame sent to a storage server, which takes requests only");
        return refuse(rd, h, ErrorKind::Invalid, &message).await;
    }
    if let Err(denied) = control::admit(&conn.store, &conn.slots, h) {
        frame::skip_payload(rd, h.payload_len).await?;
        return Ok(Served::Reply(error_reply(h, denied.kind, &denied.message), 0));
    }
    match h.op {
        Op::Auth => control::auth(rd, conn, h).await,
        Op::Ping => control::ping(rd, h).await,
        Op::Read => blocks::read(rd, conn, h, started).await,
        Op::Write => blocks::write(rd, conn, h, started).await,
        Op::WriteStaged => blocks::write_staged(rd, conn, h, started).await,
        Op::Free => blocks::free(rd, conn, h).await,
        Op::Push => shuffles::push(rd, conn, h).await,
        Op::Fetch => shuffles::fetch(rd, conn, h).await,
        Op::Lease => leases::lease(rd, conn, h).await,
        Op::Release => leases::release(rd, conn, h).await,
        Op::Malformed => {
            let message = format!("{h}: op Malformed only appears in error replies");
            refuse(rd, h, ErrorKind::Invalid, &message).await
        }
    }
}

/// Records a request's reply in the metrics, and the store's use after a change to it.
fn record(metrics: &Metrics, store: &BlockStore, op: Op, started: Instant, reply: &Frame, bytes: u64) {
    let error = match reply.header.status {
        0 => None,
        code => Some(ErrorKind::from_code(code).unwrap_or(ErrorKind::Internal)),
    };
    metrics.record(op, started.elapsed(), bytes, error);
    if error.is_none() && matches!(op, Op::Write | Op::WriteStaged | Op::Free | Op::Push) {
        metrics.observe_store(store);
    }
}

/// Discards what the peer still sends, bounded in time and bytes (see [`LINGER`]).
async fn linger(rd: &mut BoxRead) {
    let mut rest = rd.take(LINGER_BYTES);
    let _ = tokio::time::timeout(LINGER, tokio::io::copy(&mut rest, &mut tokio::io::sink())).await;
}

/// Reads a request's whole payload. `Ok(Err(reply))` when it is unusable but the stream is still
/// at a frame boundary (a bad checksum): the error reply to send.
async fn read_request_payload(rd: &mut BoxRead, h: &Header) -> Result<Result<Bytes, Frame>, FrameError> {
    let read = tokio::time::timeout(PAYLOAD_DEADLINE, frame::read_payload(rd, h)).await;
    match read.unwrap_or_else(|_| Err(payload_late())) {
        Ok(payload) => Ok(Ok(payload)),
        Err(e) if !e.is_fatal() => Ok(Err(frame_error(h, &e))),
        Err(e) => Err(e),
    }
}

/// Skips the request's payload (keeping the stream at a frame boundary) and answers with an error.
async fn refuse(rd: &mut BoxRead, h: &Header, kind: ErrorKind, message: &str) -> Result<Served, FrameError> {
    frame::skip_payload(rd, h.payload_len).await?;
    Ok(Served::Reply(error_reply(h, kind, message), 0))
}

/// Refuses a request with a payload whose op carries none (Ping, Read).
async fn refuse_payload(rd: &mut BoxRead, h: &Header) -> Result<Served, FrameError> {
    let message = format!("{h}: {:?} requests carry no payload", h.op);
    refuse(rd, h, ErrorKind::Invalid, &message).await
}

/// An error reply to request `h`.
fn error_reply(h: &Header, kind: ErrorKind, message: &str) -> Frame {
    Frame::error(h.request_id, h.op, h.block_id, kind, message)
}

/// An error reply for a frame error (a payload that could not be used, or a broken stream),
/// naming the request.
fn frame_error(h: &Header, e: &FrameError) -> Frame {
    error_reply(h, e.kind(), &format!("{h}: {e}"))
}

/// How long a request's payload may take to follow its header. A client cut off mid-frame (its
/// link down: nothing arrives, nothing is refused) would otherwise hold what the request began
/// (a block's write, a segment's append) and its connection until TCP gives up, long after the
/// metadata server freed the block with the client's job. A 1 MiB payload takes 80 ms at
/// 100 Mbit/s; the client's own deadline for the whole request is 10 s by default.
const PAYLOAD_DEADLINE: Duration = Duration::from_secs(30);

/// The stream error of a payload that missed [`PAYLOAD_DEADLINE`]: the connection closes.
fn payload_late() -> FrameError {
    let why = format!("the payload did not follow its header within {PAYLOAD_DEADLINE:?}");
    FrameError::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, why))
}

/// Fills `buf` from the stream within [`PAYLOAD_DEADLINE`]; `Truncated` if the stream ends first.
async fn read_exactly<R: AsyncRead + Unpin>(rd: &mut R, buf: &mut [u8]) -> Result<(), FrameError> {
    tokio::time::timeout(PAYLOAD_DEADLINE, read_exactly_now(rd, buf)).await.unwrap_or_else(|_| Err(payload_late()))
}

async fn read_exactly_now<R: AsyncRead + Unpin>(rd: &mut R, buf: &mut [u8]) -> Result<(), FrameError> {
    let mut got = 0;
    while got < buf.len() {
        match rd.read(&mut buf[got..]).await? {
            0 => return Err(FrameError::Truncated { expected: buf.len(), got }),
            n => got += n,
        }
    }
    Ok(())
}
