//! One-sided RDMA on a connection, driven by its pump thread (which alone owns the queue pair):
//! a storage server binds memory windows over lent blocks, a client READs them.
//!
//! Server: a Lease on an RDMA connection binds a type-2 memory window (remote read only) over
//! exactly the block's bytes in the DRAM arena and hands out its key. The window holds the pin
//! (a view of the block, which keeps its slot from reuse) until it is invalidated, by a Release,
//! when its lease's time is up, or with the connection; the pin is dropped only once the
//! invalidation completed (or the queue pair and its windows are destroyed), so a slot that goes
//! back to the free list is never readable through a key handed out before.
//!
//! Client: a READ of a lent window lands in a registered buffer of the connection's own
//! ([`READ_SLOTS`] slots of [`READ_SLOT_BYTES`]), a longer one in pieces, and is
//! copied out. A key the server no longer honours fails the READ with a remote access error, and
//! that puts the queue pair in its error state: the connection ends, as RDMA has it.
//!
//! Bounds: [`MAX_QUEUED`] commands waiting for the pump, [`ONE_SIDED_WRS`] binds,
//! invalidations and READs posted at once, [`MAX_WINDOWS`] windows per connection,
//! [`MAX_READS`] READs under way of at most [`MAX_READ_BYTES`] each.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;
use tern_transport::rdma_provider::{OneSided, Window};
use tokio::sync::{mpsc, oneshot};

use crate::verbs::{Endpoint, MAX_WINDOWS, ONE_SIDED_WRS, READ_SLOTS, READ_SLOT_BYTES};

/// Commands queued for one pump at most; a caller past it waits for room.
pub(crate) const MAX_QUEUED: usize = 64;
/// READs one connection has under way at most (more wait in the queue).
const MAX_READS: usize = 8;
/// The most bytes one READ asks for (a block is at most 16 MiB).
pub(crate) const MAX_READ_BYTES: usize = 64 << 20;

/// Work request ids: SEND slots are below `verbs::SLOTS`; one-sided work carries its kind in
/// the top two bits and a window id or read slot below.
const TAG_BIND: u64 = 1 << 62;
const TAG_INVALIDATE: u64 = 2 << 62;
const TAG_READ: u64 = 3 << 62;
const TAG_MASK: u64 = 3 << 62;

/// Whether a send-queue completion's id is one-sided work (else a SEND slot).
pub(crate) fn is_one_sided(wr_id: u64) -> bool {
    wr_id & TAG_MASK != 0
}

static READS: AtomicU64 = AtomicU64::new(0);
static BINDS: AtomicU64 = AtomicU64::new(0);
static INVALIDATIONS: AtomicU64 = AtomicU64::new(0);

/// What this process's one-sided work came to, counted once each completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counters {
    /// READs a client completed (whole reads, not pieces).
    pub reads: u64,
    /// Memory windows a server bound.
    pub binds: u64,
    /// Memory windows a server invalidated (Release, expiry).
    pub invalidations: u64,
}

/// This process's one-sided counters.
pub fn counters() -> Counters {
    Counters {
        reads: READS.load(Ordering::Relaxed),
        binds: BINDS.load(Ordering::Relaxed),
        invalidations: INVALIDATIONS.load(Ordering::Relaxed),
    }
}

pub(crate) enum Cmd {
    Lend { pin: Bytes, ttl: Duration, reply: oneshot::Sender<io::Result<(u64, Window)>> },
    Revoke { id: u64, reply: oneshot::Sender<io::Result<bool>> },
    Read { window: Window, len: usize, reply: oneshot::Sender<io::Result<Bytes>> },
}

/// The handle a connection's [`tern_transport::Stream`] carries.
pub(crate) struct Handle {
    pub(crate) cmds: mpsc::Sender<Cmd>,
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, "the RDMA connection is closed")
}

impl Handle {
    async fn ask<T>(&self, cmd: impl FnOnce(oneshot::Sender<io::Result<T>>) -> Cmd) -> io::Result<T> {
        let (tx, rx) = oneshot::channel();
        self.cmds.send(cmd(tx)).await.map_err(|_| closed())?;
        rx.await.map_err(|_| closed())?
    }
}

impl OneSided for Handle {
    fn lend(&self, pin: Bytes, ttl: Duration) -> BoxFuture<'_, io::Result<(u64, Window)>> {
        self.ask(move |reply| Cmd::Lend { pin, ttl, reply }).boxed()
    }

    fn revoke(&self, id: u64) -> BoxFuture<'_, io::Result<bool>> {
        self.ask(move |reply| Cmd::Revoke { id, reply }).boxed()
    }

    fn read(&self, window: Window, len: usize) -> BoxFuture<'_, io::Result<Bytes>> {
        self.ask(move |reply| Cmd::Read { window, len, reply }).boxed()
    }
}

enum WindowState {
    /// Its bind is posted; the lender waits for `reply`.
    Binding {
        rkey: u32,
        reply: oneshot::Sender<io::Result<(u64, Window)>>,
    },
    Bound,
    /// Its invalidation is posted; these revokes wait for it.
    Invalidating {
        waiters: Vec<oneshot::Sender<io::Result<bool>>>,
    },
}

/// A lent window: which of the endpoint's windows, over what, until when.
struct Lent {
    index: usize,
    /// Keeps the lent bytes' slot from reuse; dropped only after the window is invalidated.
    pin: Bytes,
    until: Instant,
    state: WindowState,
}

struct ReadJob {
    window: Window,
    len: usize,
    /// Bytes posted so far, and the bytes arrived (in order: an RC queue pair completes its
    /// work requests in the order they were posted).
    posted: usize,
    got: Vec<u8>,
    reply: oneshot::Sender<io::Result<Bytes>>,
}

/// One connection's one-sided work, owned by its pump.
pub(crate) struct State {
    cmds: mpsc::Receiver<Cmd>,
    /// One-sided work requests posted and not yet completed.
    posted: usize,
    next_id: u64,
    lent: HashMap<u64, Lent>,
    free_windows: Vec<usize>,
    reads: HashMap<u64, ReadJob>,
    /// READs with pieces left to post, in order.
    read_queue: VecDeque<u64>,
    free_read_slots: Vec<usize>,
    /// Per read slot: the READ and bytes its posted piece is for.
    read_slots: [Option<(u64, usize)>; READ_SLOTS],
}

impl State {
    pub(crate) fn new(cmds: mpsc::Receiver<Cmd>) -> State {
        State {
            cmds,
            posted: 0,
            next_id: 1,
            lent: HashMap::new(),
            free_windows: Vec::new(),
            reads: HashMap::new(),
            read_queue: VecDeque::new(),
            free_read_slots: (0..READ_SLOTS).rev().collect(),
            read_slots: [None; READ_SLOTS],
        }
    }

    /// Does what can be done without waiting: invalidates expired windows, takes commands, posts
    /// READ pieces. Whether anything happened. `Err`: the queue pair failed.
    pub(crate) fn step(&mut self, ep: &mut Endpoint) -> io::Result<bool> {
        let mut busy = false;
        let now = Instant::now();
        let expired: Vec<u64> = self
            .lent
            .iter()
            .filter(|(_, lent)| matches!(lent.state, WindowState::Bound) && lent.until <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            if self.posted >= ONE_SIDED_WRS {
                break;
            }
            self.invalidate(ep, id, Vec::new())?;
            busy = true;
        }
        while self.posted < ONE_SIDED_WRS && self.reads.len() < MAX_READS {
            let Ok(cmd) = self.cmds.try_recv() else { break };
            busy = true;
            match cmd {
                Cmd::Lend { pin, ttl, reply } => self.lend(ep, pin, ttl, reply),
                Cmd::Revoke { id, reply } => match self.lent.get_mut(&id) {
                    Some(Lent { state: WindowState::Bound, .. }) => self.invalidate(ep, id, vec![reply])?,
                    Some(Lent { state: WindowState::Invalidating { waiters }, .. }) => waiters.push(reply),
                    // Not handed out yet (its bind under way), or not held: nothing to end.
                    _ => drop(reply.send(Ok(false))),
                },
                Cmd::Read { window, len, reply } => {
                    if len == 0 {
                        let _ = reply.send(Ok(Bytes::new()));
                    } else if len > MAX_READ_BYTES {
                        let why = format!("an RDMA READ of {len} bytes is over the {MAX_READ_BYTES}-byte limit");
                        let _ = reply.send(Err(io::Error::new(io::ErrorKind::InvalidInput, why)));
                    } else {
                        let id = self.next_id;
                        self.next_id += 1;
                        let job = ReadJob { window, len, posted: 0, got: Vec::with_capacity(len), reply };
                        self.reads.insert(id, job);
                        self.read_queue.push_back(id);
                    }
                }
            }
        }
        while self.posted < ONE_SIDED_WRS {
            let (Some(&id), Some(&slot)) = (self.read_queue.front(), self.free_read_slots.last()) else { break };
            let job = self.reads.get_mut(&id).expect("a queued READ is under way");
            let n = (job.len - job.posted).min(READ_SLOT_BYTES);
            ep.post_read(TAG_READ | slot as u64, slot, job.window.addr + job.posted as u64, job.window.rkey, n)?;
            self.free_read_slots.pop();
            self.read_slots[slot] = Some((id, n));
            self.posted += 1;
            job.posted += n;
            if job.posted == job.len {
                self.read_queue.pop_front();
            }
            busy = true;
        }
        Ok(busy)
    }

    fn lend(
        &mut self,
        ep: &mut Endpoint,
        pin: Bytes,
        ttl: Duration,
        reply: oneshot::Sender<io::Result<(u64, Window)>>,
    ) {
        if !ep.can_lend() {
            let _ = reply.send(Err(io::Error::other("this RDMA connection lends nothing (no registered arena)")));
            return;
        }
        let index = match self.free_windows.pop() {
            Some(index) => index,
            None if ep.windows() < MAX_WINDOWS => match ep.alloc_window() {
                Ok(index) => index,
                Err(e) => {
                    let _ = reply.send(Err(e));
                    return;
                }
            },
            None => {
                let why = format!("all {MAX_WINDOWS} memory windows of this connection are lent");
                let _ = reply.send(Err(io::Error::new(io::ErrorKind::WouldBlock, why)));
                return;
            }
        };
        let id = self.next_id;
        self.next_id += 1;
        match ep.post_bind(TAG_BIND | id, index, pin.as_ptr() as u64, pin.len()) {
            Ok(rkey) => {
                self.posted += 1;
                let state = WindowState::Binding { rkey, reply };
                self.lent.insert(id, Lent { index, pin, until: Instant::now() + ttl, state });
            }
            Err(e) => {
                self.free_windows.push(index);
                let _ = reply.send(Err(e));
            }
        }
    }

    fn invalidate(
        &mut self,
        ep: &mut Endpoint,
        id: u64,
        waiters: Vec<oneshot::Sender<io::Result<bool>>>,
    ) -> io::Result<()> {
        let lent = self.lent.get_mut(&id).expect("a bound window");
        ep.post_invalidate(TAG_INVALIDATE | id, lent.index)?;
        self.posted += 1;
        lent.state = WindowState::Invalidating { waiters };
        Ok(())
    }

    /// A one-sided work request completed (successfully: a failed one fails the queue pair).
    pub(crate) fn complete(&mut self, ep: &mut Endpoint, wr_id: u64) {
        self.posted -= 1;
        let low = wr_id & !TAG_MASK;
        match wr_id & TAG_MASK {
            TAG_BIND => {
                let Some(lent) = self.lent.get_mut(&low) else { return };
                if let WindowState::Binding { rkey, .. } = lent.state {
                    ep.bound(lent.index, rkey);
                    let WindowState::Binding { reply, .. } = std::mem::replace(&mut lent.state, WindowState::Bound)
                    else {
                        unreachable!("matched above")
                    };
                    BINDS.fetch_add(1, Ordering::Relaxed);
                    // A lender that stopped waiting leaves the window to its expiry.
                    let _ = reply.send(Ok((low, Window { addr: lent.pin.as_ptr() as u64, rkey })));
                }
            }
            TAG_INVALIDATE => {
                let Some(lent) = self.lent.remove(&low) else { return };
                INVALIDATIONS.fetch_add(1, Ordering::Relaxed);
                self.free_windows.push(lent.index);
                if let WindowState::Invalidating { waiters } = lent.state {
                    for waiter in waiters {
                        let _ = waiter.send(Ok(true));
                    }
                }
                // Only now, with no key reaching them, may the bytes' slot be reused.
                drop(lent.pin);
            }
            _ => {
                let slot = low as usize;
                let Some((id, n)) = self.read_slots[slot].take() else { return };
                self.free_read_slots.push(slot);
                let Some(job) = self.reads.get_mut(&id) else { return };
                job.got.extend_from_slice(ep.read_slot(slot, n));
                if job.got.len() == job.len {
                    let job = self.reads.remove(&id).expect("present");
                    READS.fetch_add(1, Ordering::Relaxed);
                    let _ = job.reply.send(Ok(Bytes::from(job.got)));
                }
            }
        }
    }

    /// The queue pair failed or the connection ended: every waiter gets `why`. The pins stay
    /// with `self`, to be dropped after the endpoint (its windows deallocated).
    pub(crate) fn fail_all(&mut self, why: &str) {
        let err = || io::Error::new(io::ErrorKind::ConnectionReset, why.to_string());
        for (_, job) in self.reads.drain() {
            let _ = job.reply.send(Err(err()));
        }
        for lent in self.lent.values_mut() {
            match std::mem::replace(&mut lent.state, WindowState::Bound) {
                WindowState::Binding { reply, .. } => drop(reply.send(Err(err()))),
                WindowState::Invalidating { waiters } => {
                    for waiter in waiters {
                        let _ = waiter.send(Err(err()));
                    }
                }
                WindowState::Bound => {}
            }
        }
        self.cmds.close();
        while let Ok(cmd) = self.cmds.try_recv() {
            match cmd {
                Cmd::Lend { reply, .. } => drop(reply.send(Err(err()))),
                Cmd::Revoke { reply, .. } => drop(reply.send(Err(err()))),
                Cmd::Read { reply, .. } => drop(reply.send(Err(err()))),
            }
        }
    }
}
