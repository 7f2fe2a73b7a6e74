//! The block protocol's byte stream over a reliable-connected queue pair.
//!
//! Connections are set up with rdma_cm on the block service's own host and port number (rdma_cm's
//! TCP port space is apart from the kernel's TCP ports), so a storage server needs no second
//! registered address and a client finds the RDMA service where it finds TCP. Each connection
//! carries the same byte stream of block frames as TCP, as two-sided SENDs of at most
//! [`verbs::SLOT_BYTES`] into receives the peer posted beforehand: auth, grants and checksums are
//! exactly those of every other transport. ARCHITECTURE.md ("RDMA") says why. One-sided work
//! (memory windows a server lends, READs a client makes: [`crate::one_sided`]) goes through the
//! same pump thread, which alone owns the queue pair.
//!
//! Bounds: [`verbs::SLOTS`] sends and receives in flight each way (the queue depths), 2 MiB of
//! registered buffers per connection, [`MAX_CONNECTIONS`] connections per listener (more are
//! rejected by rdma_cm before anything is registered for them). Flow control is the hardware's:
//! a receiver that has no receive posted (its reader is behind) answers "receiver not ready",
//! and the sender retries until it has one.
//!
//! Each connection is driven by one thread of its own ([`pump`]) that polls its completion
//! queues, backing off to short sleeps when idle; the async side talks to it through channels.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_util::sync::PollSender;

use tern_transport::{Connector, Listener, Stream};

use crate::one_sided;
use crate::verbs;

/// Most connections one listener serves at once (each holds 2 MiB of registered memory and a
/// thread); requests past it are rejected.
pub const MAX_CONNECTIONS: usize = 256;
/// Most RDMA connects of this process waiting on rdma_cm at once (each a thread).
const MAX_CONNECTING: usize = 64;
static CONNECTING: AtomicUsize = AtomicUsize::new(0);
/// Connection requests rdma_cm queues for the listener.
const BACKLOG: i32 = 64;
/// How long a closed connection waits for its last sends (the end-of-stream marker) to complete
/// before it is torn down anyway (a peer that stopped reading).
const CLOSE_DEADLINE: Duration = Duration::from_secs(5);

/// The verbs-backed RDMA of this build, installed into `tern_transport` by [`crate::install`].
pub(crate) struct Verbs;

impl tern_transport::rdma_provider::RdmaProvider for Verbs {
    fn devices(&self) -> io::Result<Vec<String>> {
        verbs::device_names()
    }

    fn bind(
        &self,
        addr: SocketAddr,
        lendable: Option<tern_transport::rdma_provider::Lendable>,
    ) -> io::Result<Box<dyn Listener>> {
        Ok(Box::new(RdmaListener::bind(addr, lendable)?))
    }

    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Stream>> {
        RdmaConnector.connect(addr)
    }
}

/// Dials storage servers over RDMA (rdma_cm on the server's block address).
#[derive(Debug, Default, Clone, Copy)]
pub struct RdmaConnector;

impl Connector for RdmaConnector {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Stream>> {
        async move {
            let peer = tokio::net::lookup_host(addr)
                .await?
                .next()
                .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to no address")))?;
            // rdma_connect blocks until the peer accepts or rdma_cm gives up (its own timeouts);
            // the caller's deadline stops waiting for it sooner. A thread of its own, not
            // spawn_blocking: a runtime shutting down waits for its blocking tasks, and must not
            // wait on rdma_cm's retries to a dead peer.
            // rdma_cm gives up on a peer that never answers only after its own retries (about a
            // minute): the threads still waiting are bounded.
            if CONNECTING.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTING {
                CONNECTING.fetch_sub(1, Ordering::AcqRel);
                let why = format!("RDMA connect to {addr}: {MAX_CONNECTING} RDMA connects already waiting");
                return Err(io::Error::new(io::ErrorKind::WouldBlock, why));
            }
            let (tx, rx) = tokio::sync::oneshot::channel();
            let spawned = std::thread::Builder::new().name("tern-rdma-connect".into()).spawn(move || {
                let _ = tx.send(verbs::connect(peer));
                CONNECTING.fetch_sub(1, Ordering::AcqRel);
            });
            if let Err(e) = spawned {
                CONNECTING.fetch_sub(1, Ordering::AcqRel);
                return Err(io::Error::other(format!("RDMA connect to {addr}: no thread: {e}")));
            }
            let endpoint =
                rx.await.map_err(|_| io::Error::other(format!("RDMA connect to {addr}: its thread ended")))??;
            Ok(into_stream(endpoint, peer, None))
        }
        .boxed()
    }
}

/// Accepts block connections over RDMA.
pub struct RdmaListener {
    streams: mpsc::Receiver<Stream>,
    addr: SocketAddr,
}

impl RdmaListener {
    /// Listens with rdma_cm on `addr` (an address of an RDMA-capable netdev; a port of 0 is not
    /// taken: give the block service's bound port). With `lendable`, its connections lend views
    /// of that memory for one-sided READs (see [`crate::one_sided`]).
    pub fn bind(
        addr: SocketAddr,
        lendable: Option<tern_transport::rdma_provider::Lendable>,
    ) -> io::Result<RdmaListener> {
        if addr.port() == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "an RDMA listener needs a port number"));
        }
        let listener = verbs::CmListener::bind(addr, BACKLOG)?;
        let lendable = lendable.map(|l| Arc::new(verbs::Lendable::new(l.base, l.len)));
        let (tx, streams) = mpsc::channel(BACKLOG as usize);
        std::thread::Builder::new()
            .name("tern-rdma-accept".into())
            .spawn(move || accept_loop(listener, tx, addr, lendable))
            .map_err(|e| io::Error::other(format!("starting the RDMA accept thread: {e}")))?;
        Ok(RdmaListener { streams, addr })
    }
}

impl Listener for RdmaListener {
    fn accept(&mut self) -> BoxFuture<'_, io::Result<Stream>> {
        tern_transport::next_handed_over(&mut self.streams).boxed()
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn name(&self) -> &'static str {
        "rdma"
    }
}

/// Takes connection requests (blocking in rdma_get_request) and accepts each in a thread of its
/// own, so a client that stalls its handshake holds up nobody else. Ends once the listener is
/// dropped (at the next request).
fn accept_loop(
    listener: verbs::CmListener,
    streams: mpsc::Sender<Stream>,
    addr: SocketAddr,
    lendable: Option<Arc<verbs::Lendable>>,
) {
    let live = Arc::new(AtomicUsize::new(0));
    while !streams.is_closed() {
        let request = match listener.get_request() {
            Ok(request) => request,
            Err(e) => {
                tracing::warn!("RDMA listener on {addr}: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if live.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            live.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("RDMA listener on {addr}: at its limit of {MAX_CONNECTIONS} connections; rejecting one");
            request.reject();
            continue;
        }
        let (streams, live, lendable) = (streams.clone(), live.clone(), lendable.clone());
        let spawned = std::thread::Builder::new().name("tern-rdma-conn".into()).spawn(move || {
            let counted = Counted(live);
            match request.accept(lendable.as_deref()) {
                Ok(endpoint) => {
                    let peer = endpoint.peer().unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
                    tracing::debug!("RDMA connection from {peer} on {addr}");
                    let _ = streams.blocking_send(into_stream(endpoint, peer, Some(counted)));
                }
                Err(e) => tracing::debug!("RDMA listener on {addr}: {e}"),
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("RDMA listener on {addr}: no thread for a connection: {e}");
        }
    }
}

/// Counts a connection against its listener's limit until dropped.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Starts the pump thread of a connected endpoint and hands back its stream.
fn into_stream(endpoint: verbs::Endpoint, peer: SocketAddr, counted: Option<Counted>) -> Stream {
    let (out_tx, out_rx) = mpsc::channel::<Vec<u8>>(verbs::SLOTS);
    let (in_tx, in_rx) = mpsc::channel::<io::Result<Vec<u8>>>(verbs::SLOTS * 2);
    let (cmd_tx, cmd_rx) = mpsc::channel(one_sided::MAX_QUEUED);
    let started = std::thread::Builder::new().name("tern-rdma-pump".into()).spawn(move || {
        let _counted = counted;
        pump(endpoint, out_rx, in_tx, one_sided::State::new(cmd_rx));
    });
    if let Err(e) = started {
        // The channels' other ends are gone with the closure: the stream reads as reset.
        tracing::warn!("RDMA connection to {peer}: no thread to drive it: {e}");
    }
    let reader = RdmaRead { rx: in_rx, chunk: Vec::new(), pos: 0 };
    let writer = RdmaWrite { tx: PollSender::new(out_tx) };
    let one_sided: Arc<dyn tern_transport::rdma_provider::OneSided> = Arc::new(one_sided::Handle { cmds: cmd_tx });
    Stream { reader: Box::new(reader), writer: Box::new(writer), peer, local: None, one_sided: Some(one_sided) }
}

/// Drives one connection: posts what the writer queued as SENDs (an empty one is the end of the
/// stream), hands what arrives to the reader, does its one-sided work (`one`), and ends when
/// both directions are done or the queue pair fails (the peer gone: its error goes to the reader
/// and to whoever waits on one-sided work).
fn pump(
    mut ep: verbs::Endpoint,
    mut outbound: mpsc::Receiver<Vec<u8>>,
    inbound: mpsc::Sender<io::Result<Vec<u8>>>,
    mut one: one_sided::State,
) {
    let mut inbound = Some(inbound);
    let mut free: Vec<usize> = (0..verbs::SLOTS).collect();
    let mut held: VecDeque<Vec<u8>> = VecDeque::new();
    let mut completions = Vec::with_capacity(verbs::SLOTS);
    let (mut fin_sent, mut fin_received) = (false, false);
    let mut closing_since: Option<Instant> = None;
    let mut idle = 0u32;
    let failure = 'run: loop {
        let mut busy = false;
        // What arrived, to the reader, in order; a reader that is gone no longer wants it.
        while let Some(chunk) = held.pop_front() {
            let Some(tx) = &inbound else { break };
            match tx.try_send(Ok(chunk)) {
                Ok(()) => busy = true,
                Err(mpsc::error::TrySendError::Full(Ok(chunk))) => {
                    held.push_front(chunk);
                    break;
                }
                Err(_) => held.clear(),
            }
        }
        // Receives are taken only once everything before them is delivered: a slow reader
        // leaves the peer's sends waiting (receiver not ready) instead of filling memory.
        if held.is_empty() && !fin_received {
            completions.clear();
            if let Err(e) = ep.poll(false, &mut completions) {
                break Some(ep.cause(e));
            }
            for c in completions.drain(..) {
                busy = true;
                if c.bytes == 0 {
                    fin_received = true;
                    continue;
                }
                held.push_back(ep.received(c.slot, c.bytes).to_vec());
                if let Err(e) = ep.post_receive(c.slot) {
                    break 'run Some(e);
                }
            }
        }
        if fin_received && held.is_empty() {
            // End of stream for the reader.
            inbound = None;
        }
        completions.clear();
        if let Err(e) = ep.poll(true, &mut completions) {
            break Some(e);
        }
        for c in completions.drain(..) {
            if one_sided::is_one_sided(c.slot as u64) {
                one.complete(&mut ep, c.slot as u64);
            } else {
                free.push(c.slot);
            }
            busy = true;
        }
        match one.step(&mut ep) {
            Ok(stepped) => busy |= stepped,
            Err(e) => break Some(e),
        }
        while !fin_sent {
            let Some(slot) = free.pop() else { break };
            let chunk = match outbound.try_recv() {
                Ok(chunk) => chunk,
                Err(mpsc::error::TryRecvError::Empty) => {
                    free.push(slot);
                    break;
                }
                // The writer shut down or was dropped: the end of the stream.
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    fin_sent = true;
                    Vec::new()
                }
            };
            busy = true;
            if let Err(e) = ep.post_send(slot, &chunk) {
                break 'run Some(e);
            }
        }
        let sends_done = fin_sent && free.len() == verbs::SLOTS;
        let reader_done = inbound.as_ref().is_none_or(|tx| tx.is_closed());
        if sends_done && reader_done {
            break None;
        }
        if fin_sent && reader_done {
            let since = *closing_since.get_or_insert_with(Instant::now);
            if since.elapsed() > CLOSE_DEADLINE {
                break None;
            }
        }
        if ep.disconnected() {
            // What the peer sent before it left (its last reply, its end of stream) completed
            // before its disconnect arrived: hand that over before the stream ends.
            while !fin_received {
                completions.clear();
                if ep.poll(false, &mut completions).is_err() || completions.is_empty() {
                    break;
                }
                for c in completions.drain(..) {
                    if c.bytes == 0 {
                        fin_received = true;
                    } else if !fin_received {
                        held.push_back(ep.received(c.slot, c.bytes).to_vec());
                    }
                }
            }
            if let Some(tx) = &inbound {
                for chunk in held.drain(..) {
                    // The reader is there (the channel is open) and reads until the end.
                    if tx.blocking_send(Ok(chunk)).is_err() {
                        break;
                    }
                }
            }
            if fin_received {
                break None;
            }
            break Some(io::Error::new(io::ErrorKind::ConnectionReset, "the RDMA peer disconnected"));
        }
        idle = if busy { 0 } else { idle.saturating_add(1) };
        backoff(idle);
    };
    let why = failure.as_ref().map_or_else(|| "the RDMA connection closed".to_string(), |e| e.to_string());
    one.fail_all(&why);
    if let (Some(e), Some(tx)) = (failure, &inbound) {
        let _ = tx.try_send(Err(e));
    }
    // The queue pair and its windows go first (deallocating a window invalidates it); only
    // then the pins of what they lent, so no freed slot is readable through a stale key.
    drop(ep);
    drop(one);
}

/// Waits a little between idle polls: a few yields first (a reply is usually microseconds
/// away), then sleeps growing to 1 ms, so an idle connection costs next to no CPU.
fn backoff(idle: u32) {
    match idle {
        0 => {}
        1..=16 => std::thread::yield_now(),
        17..=200 => std::thread::sleep(Duration::from_micros(50)),
        _ => std::thread::sleep(Duration::from_millis(1)),
    }
}

/// The reading half: chunks from the pump thread.
struct RdmaRead {
    rx: mpsc::Receiver<io::Result<Vec<u8>>>,
    chunk: Vec<u8>,
    pos: usize,
}

impl AsyncRead for RdmaRead {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.pos == this.chunk.len() {
            match ready!(this.rx.poll_recv(cx)) {
                Some(Ok(chunk)) => (this.chunk, this.pos) = (chunk, 0),
                Some(Err(e)) => return Poll::Ready(Err(e)),
                None => return Poll::Ready(Ok(())),
            }
        }
        let n = buf.remaining().min(this.chunk.len() - this.pos);
        buf.put_slice(&this.chunk[this.pos..this.pos + n]);
        this.pos += n;
        Poll::Ready(Ok(()))
    }
}

/// The writing half: chunks of at most one send slot, queued for the pump thread.
struct RdmaWrite {
    tx: PollSender<Vec<u8>>,
}

impl AsyncWrite for RdmaWrite {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let closed = || io::Error::new(io::ErrorKind::BrokenPipe, "the RDMA connection is closed");
        ready!(self.tx.poll_reserve(cx)).map_err(|_| closed())?;
        let n = buf.len().min(verbs::SLOT_BYTES);
        self.tx.send_item(buf[..n].to_vec()).map_err(|_| closed())?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Every chunk is already the pump's to send.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.tx.close();
        Poll::Ready(Ok(()))
    }
}
