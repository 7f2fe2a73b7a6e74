//! The io engines under the NVMe tier: one trait, two implementations.
//!
//! - [`UringEngine`]: io_uring (the `io-uring` crate) on one dedicated thread. Requests reach the
//!   thread over a channel bounded by a semaphore of `depth` permits (one per op until its
//!   completion), an eventfd read kept in the ring wakes the thread for new requests while it waits
//!   for completions, and each completion goes back through a oneshot channel. The thread owns
//!   every buffer in flight, so a caller that gives up cannot free memory the kernel still uses.
//! - [`PsyncEngine`]: pread/pwrite on tokio's blocking pool.
//!
//! Buffers are not registered with the ring (`IORING_REGISTER_BUFFERS`): with 1 MiB O_DIRECT ops
//! the page pinning it saves is a small share of each op, and registered memory counts against
//! RLIMIT_MEMLOCK.

use std::any::Any;
use std::fs::File;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::pin::Pin;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use io_uring::{opcode, types, IoUring};
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use super::aligned::AlignedBuf;

/// What an engine op gives back: the buffer (filled, for a read), or the error.
pub type IoFuture = Pin<Box<dyn Future<Output = io::Result<AlignedBuf>> + Send>>;
/// Kept alive until the kernel is done with a write, even if its future was dropped: what the
/// write lands in (the NVMe block's slot) must not be handed to another write meanwhile.
pub type KeepAlive = Option<Arc<dyn Any + Send + Sync>>;

/// Reads and writes of whole aligned buffers at aligned offsets of one file.
pub trait IoEngine: Send + Sync {
    /// "uring" or "psync": shown in heartbeats, `tern status` and metrics.
    fn name(&self) -> &'static str;
    /// Fills `buf` from the file at `offset`.
    fn read_at(&self, buf: AlignedBuf, offset: u64) -> IoFuture;
    /// Writes all of `buf` at `offset`; `keep` is dropped only once the write is over.
    fn write_at(&self, buf: AlignedBuf, offset: u64, keep: KeepAlive) -> IoFuture;
    /// Makes every write done so far durable (fdatasync: the device's write cache, and the
    /// filesystem's record that preallocated space now holds data). Blocking: call it off the
    /// async workers.
    fn sync_data(&self) -> io::Result<()>;
}

/// Which engine `--io-engine` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoEngineChoice {
    /// io_uring if the probe succeeds, else psync (logged at warn with the reason).
    #[default]
    Auto,
    /// io_uring or refuse to start.
    Uring,
    /// pread/pwrite on a blocking pool.
    Psync,
}

impl std::str::FromStr for IoEngineChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<IoEngineChoice, String> {
        match s {
            "auto" => Ok(IoEngineChoice::Auto),
            "uring" => Ok(IoEngineChoice::Uring),
            "psync" => Ok(IoEngineChoice::Psync),
            other => Err(format!("io engine {other:?} is not one of uring, psync or auto")),
        }
    }
}

impl std::fmt::Display for IoEngineChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoEngineChoice::Auto => "auto",
            IoEngineChoice::Uring => "uring",
            IoEngineChoice::Psync => "psync",
        })
    }
}

/// Most io_uring ops in flight per engine (and submission-queue entries).
pub const URING_DEPTH: u32 = 128;
/// How long the start-up probe's op may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The engine `choice` asks for on `file`, after probing io_uring with a real read of `align`
/// bytes at offset 0 (a fresh file reads zeros). `auto` falls back to psync with a warning;
/// `uring` refuses with the reason.
pub async fn choose(choice: IoEngineChoice, file: Arc<File>, align: usize) -> anyhow::Result<Arc<dyn IoEngine>> {
    if choice == IoEngineChoice::Psync {
        return Ok(Arc::new(PsyncEngine::new(file)));
    }
    match probe_uring(file.clone(), align).await {
        Ok(engine) => Ok(Arc::new(engine)),
        Err(e) if choice == IoEngineChoice::Uring => {
            anyhow::bail!("io engine uring was asked for, but io_uring does not work here: {e}")
        }
        Err(e) => {
            tracing::warn!("io_uring does not work here ({e}); the NVMe tier falls back to the psync engine");
            Ok(Arc::new(PsyncEngine::new(file)))
        }
    }
}

async fn probe_uring(file: Arc<File>, align: usize) -> io::Result<UringEngine> {
    let engine = UringEngine::start(file, URING_DEPTH)?;
    let op = engine.read_at(AlignedBuf::zeroed(align, align), 0);
    match tokio::time::timeout(PROBE_TIMEOUT, op).await {
        Ok(Ok(_)) => Ok(engine),
        Ok(Err(e)) => Err(io::Error::new(e.kind(), format!("a probe read through io_uring failed: {e}"))),
        Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "a probe read through io_uring did not complete in 5s")),
    }
}

/// pread/pwrite on tokio's blocking pool.
pub struct PsyncEngine {
    file: Arc<File>,
}

impl PsyncEngine {
    pub fn new(file: Arc<File>) -> PsyncEngine {
        PsyncEngine { file }
    }
}

/// A blocking-pool task's result, with a panic or cancellation turned into an io error.
async fn blocking(task: tokio::task::JoinHandle<io::Result<AlignedBuf>>) -> io::Result<AlignedBuf> {
    task.await.map_err(|e| io::Error::other(format!("psync io task failed: {e}")))?
}

impl IoEngine for PsyncEngine {
    fn name(&self) -> &'static str {
        "psync"
    }

    fn read_at(&self, mut buf: AlignedBuf, offset: u64) -> IoFuture {
        let file = self.file.clone();
        Box::pin(blocking(tokio::task::spawn_blocking(move || {
            file.read_exact_at(&mut buf, offset)?;
            Ok(buf)
        })))
    }

    fn write_at(&self, buf: AlignedBuf, offset: u64, keep: KeepAlive) -> IoFuture {
        let file = self.file.clone();
        // A blocking task runs to its end even if this future is dropped, holding `keep`.
        Box::pin(blocking(tokio::task::spawn_blocking(move || {
            let _keep = keep;
            file.write_all_at(&buf, offset)?;
            Ok(buf)
        })))
    }

    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
}

/// One op, owned by the ring thread from submission to completion.
struct Op {
    kind: Kind,
    buf: AlignedBuf,
    offset: u64,
    /// Bytes done so far (a short transfer is resubmitted for the rest).
    done: usize,
    reply: oneshot::Sender<io::Result<AlignedBuf>>,
    _keep: KeepAlive,
    _permit: OwnedSemaphorePermit,
}

/// io_uring on a dedicated thread.
pub struct UringEngine {
    /// For fdatasync, which needs no ring.
    file: Arc<File>,
    tx: Option<mpsc::Sender<Op>>,
    permits: Arc<Semaphore>,
    wake: Arc<OwnedFd>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// `user_data` of the eventfd read that wakes the thread.
const WAKE: u64 = u64::MAX;

impl UringEngine {
    /// Sets up a ring of `depth` entries and its thread. Fails where io_uring is unavailable
    /// (old kernels, seccomp in containers, `kernel.io_uring_disabled`).
    pub fn start(file: Arc<File>, depth: u32) -> io::Result<UringEngine> {
        let ring = IoUring::new(depth.next_power_of_two() * 2)?;
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor owned by nobody else.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let (tx, rx) = mpsc::channel();
        let thread_wake = wake.clone();
        let thread = std::thread::Builder::new().name("tern-uring".into()).spawn({
            let file = file.clone();
            move || ring_loop(ring, file, rx, thread_wake)
        })?;
        Ok(UringEngine {
            file,
            tx: Some(tx),
            permits: Arc::new(Semaphore::new(depth as usize)),
            wake,
            thread: Some(thread),
        })
    }

    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd. A failure (the counter is
        // saturated) means a wake-up is pending anyway.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn submit(&self, kind: Kind, buf: AlignedBuf, offset: u64, keep: KeepAlive) -> IoFuture {
        let permits = self.permits.clone();
        let tx = self.tx.clone();
        let wake = self.wake.clone();
        Box::pin(async move {
            let closed = || io::Error::other("the io_uring engine has stopped");
            // The bound on ops queued or in flight: a permit per op, given back at completion.
            let permit = permits.acquire_owned().await.map_err(|_| closed())?;
            let (reply, done) = oneshot::channel();
            let op = Op { kind, buf, offset, done: 0, reply, _keep: keep, _permit: permit };
            tx.ok_or_else(closed)?.send(op).map_err(|_| closed())?;
            let one: u64 = 1;
            // SAFETY: as in `wake`.
            unsafe { libc::write(wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
            done.await.map_err(|_| closed())?
        })
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        // The thread ends once the channel is closed and its ops are done.
        self.tx = None;
        self.wake();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "uring"
    }

    fn read_at(&self, buf: AlignedBuf, offset: u64) -> IoFuture {
        self.submit(Kind::Read, buf, offset, None)
    }

    fn write_at(&self, buf: AlignedBuf, offset: u64, keep: KeepAlive) -> IoFuture {
        self.submit(Kind::Write, buf, offset, keep)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

fn sqe(op: &mut Op, fd: i32, user_data: u64) -> io_uring::squeue::Entry {
    let remaining = (op.buf.len() - op.done) as u32;
    let offset = op.offset + op.done as u64;
    match op.kind {
        Kind::Read => {
            // SAFETY: the pointer stays within the buffer, which the op owns until completion.
            let ptr = unsafe { op.buf.as_mut_ptr().add(op.done) };
            opcode::Read::new(types::Fd(fd), ptr, remaining).offset(offset).build().user_data(user_data)
        }
        Kind::Write => {
            // SAFETY: as above.
            let ptr = unsafe { op.buf.as_ptr().add(op.done) };
            opcode::Write::new(types::Fd(fd), ptr, remaining).offset(offset).build().user_data(user_data)
        }
    }
}

/// The ring thread: submits queued ops, completes finished ones, sleeps in the kernel between.
fn ring_loop(mut ring: IoUring, file: Arc<File>, rx: mpsc::Receiver<Op>, wake: Arc<OwnedFd>) {
    let fd = file.as_raw_fd();
    // Ops in flight, by slot (their `user_data`); the semaphore bounds how many there are.
    let mut slots: Vec<Option<Op>> = Vec::new();
    let mut free_slots: Vec<usize> = Vec::new();
    let mut in_flight = 0usize;
    // The eventfd read's 8-byte target is leaked (8 bytes per engine): a read still pending when
    // the ring is torn down is cancelled asynchronously by the kernel, so no owner could know
    // when freeing it is safe.
    let wake_buf: &'static mut u64 = Box::leak(Box::new(0u64));
    let wake_fd = wake.as_raw_fd();
    let wake_sqe =
        |buf: &mut u64| opcode::Read::new(types::Fd(wake_fd), (buf as *mut u64).cast(), 8).build().user_data(WAKE);
    let mut pending: Vec<io_uring::squeue::Entry> = vec![wake_sqe(wake_buf)];
    let mut open = true;
    loop {
        if open {
            loop {
                match rx.try_recv() {
                    Ok(mut op) => {
                        let slot = free_slots.pop().unwrap_or_else(|| {
                            slots.push(None);
                            slots.len() - 1
                        });
                        pending.push(sqe(&mut op, fd, slot as u64));
                        slots[slot] = Some(op);
                        in_flight += 1;
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
        }
        if !open && in_flight == 0 {
            break;
        }
        {
            let mut sq = ring.submission();
            while let Some(entry) = pending.last() {
                // SAFETY: every entry points into a buffer owned by an op in `slots` (or the
                // eventfd target), which lives until its completion is reaped.
                if unsafe { sq.push(entry) }.is_err() {
                    break;
                }
                pending.pop();
            }
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::EBUSY) {
                continue;
            }
            tracing::error!("io_uring submit failed: {e}; failing every op in flight");
            for op in slots.iter_mut().filter_map(Option::take) {
                let _ = op.reply.send(Err(io::Error::new(e.kind(), format!("io_uring submit failed: {e}"))));
            }
            return;
        }
        let completions: Vec<(u64, i32)> = ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (user_data, result) in completions {
            if user_data == WAKE {
                pending.push(wake_sqe(wake_buf));
                continue;
            }
            let slot = user_data as usize;
            let Some(mut op) = slots[slot].take() else {
                continue;
            };
            let outcome = if result < 0 {
                Some(Err(io::Error::from_raw_os_error(-result)))
            } else if result == 0 {
                Some(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("io_uring transferred 0 bytes at offset {}", op.offset + op.done as u64),
                )))
            } else {
                op.done += result as usize;
                (op.done == op.buf.len()).then_some(Ok(()))
            };
            match outcome {
                None => {
                    pending.push(sqe(&mut op, fd, slot as u64));
                    slots[slot] = Some(op);
                }
                Some(result) => {
                    in_flight -= 1;
                    free_slots.push(slot);
                    let Op { buf, reply, .. } = op;
                    let _ = reply.send(result.map(|()| buf));
                }
            }
        }
    }
}
