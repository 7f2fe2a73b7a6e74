//! Copies of this server's blocks to other storage servers, as the metadata server directs in
//! heartbeat replies (re-replication after another server died, or this server's drain; why
//! server to server: see `metadata-server/src/copies.rs`).
//!
//! Each copy reads the block here and writes it whole to its target in one Write frame, under the
//! grant and job token the metadata server gave, so the target checks it as it checks a
//! client's write (crc, write-once, grant). Outcomes go back in the next heartbeat; when the last
//! running copy ends the heartbeater is woken to send it at once, so copying runs at the rate the
//! metadata server hands copies out, not one batch per heartbeat interval.
//!
//! Bounds: at most [`PARALLEL`] copies at once (each holds one block in memory and one
//! connection), each within [`COPY_TIMEOUT`]; at most [`MAX_RUNNING`] accepted (more are left for
//! the metadata server to hand out again); connections are kept per target, at most
//! [`PARALLEL`] idle each.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use bytes::Bytes;
use parking_lot::Mutex;
use tern_proto::frame::{self, Frame, MAX_SLOT};
use tern_proto::token::Grant;
use tern_proto::v1::{CopyBlock, CopyDone};
use tern_proto::BlockId;
use tern_transport::{BoxRead, BoxWrite, Connector};
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::sync::{Notify, Semaphore};

use crate::store::{BlockStore, TierRef};

/// Copies running at once.
pub const PARALLEL: usize = 8;
/// Copies accepted and not yet reported, at most.
pub const MAX_RUNNING: usize = 1024;
/// Connect, bind and write of one copy, at most.
pub const COPY_TIMEOUT: Duration = Duration::from_secs(30);
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
    pub fn start(self: &Arc<Copier>, tasks: &[CopyBlock]) {
        for task in tasks {
            {
                let mut running = self.running.lock();
                if running.len() >= MAX_RUNNING || !running.insert(task.copy_id) {
                    continue;
                }
            }
            tokio::spawn(self.clone().run(task.clone()));
        }
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

    async fn run(self: Arc<Copier>, task: CopyBlock) {
        let outcome = match self.permits.acquire().await {
            Ok(_permit) => match tokio::time::timeout(COPY_TIMEOUT, self.copy(&task)).await {
                Ok(result) => result,
                Err(_) => Err(anyhow!("not done within {COPY_TIMEOUT:?}")),
            },
            Err(_) => Err(anyhow!("the copier is closed")),
        };
        let error = match outcome {
            Ok(()) => String::new(),
            Err(e) => format!("block {} to {}: {e:#}", task.block_id, task.target_address),
        };
        self.done.lock().push(CopyDone { copy_id: task.copy_id, error });
        let mut running = self.running.lock();
        running.remove(&task.copy_id);
        if running.is_empty() {
            self.settled.notify_one();
        }
    }

    async fn copy(&self, task: &CopyBlock) -> anyhow::Result<()> {
        let block = BlockId::from(task.block_id);
        let server = self.store.server_id();
        let (data, _) = match self.store.tier(block)? {
            TierRef::Dram(tier) => tier.read(block, 0, task.length, server)?,
            TierRef::Nvme(tier) => tier.read(block, 0, task.length, server).await?,
        };
        let grant: Grant =
            task.grant.as_slice().try_into().map_err(|_| anyhow!("a grant of {} bytes", task.grant.len()))?;
        let max_payload = self.store.block_size();
        let mut conn = self.checkout(&task.target_address).await?;
        let slot = conn.slot_for(&task.token, max_payload).await?;
        let id = conn.take_id();
        conn.call(Frame::write(id, task.target_block_id, 0, data).authorized(slot, grant), max_payload).await?;
        // A connection that failed is dropped with the error above; a good one goes back.
        if conn.slots.len() < usize::from(SLOTS_PER_CONNECTION) {
            let mut idle = self.idle.lock();
            let pool = idle.entry(task.target_address.clone()).or_default();
            if pool.len() < PARALLEL {
                pool.push(conn);
            }
        }
        Ok(())
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
