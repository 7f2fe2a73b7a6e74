//! The block ops of the block service: Read, Write and Free. Each goes to the tier its block id
//! names: DRAM ops are served in line (a Write's payload is read from the socket straight into
//! the arena, a Read's reply is a view of it); NVMe ops are handed to a task once their payload
//! is read, so the disk does not hold the connection up.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tern_proto::frame::{self, Frame, FrameError, Header, Op, Staged, MAX_FREE_IDS};
use tern_proto::token::GrantKind;
use tern_proto::{BlockId, ErrorKind};
use tern_transport::local::Staging;
use tern_transport::BoxRead;
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use super::{error_reply, frame_error, read_exactly, read_request_payload, record, refuse, refuse_payload};
use super::{Connection, Served};
use crate::block_table::{BlockRead, StoreError};
use crate::metrics::Metrics;
use crate::store::{BlockStore, TierRef};

fn store_error(h: &Header, e: &StoreError) -> Frame {
    error_reply(h, e.kind(), &e.to_string())
}

/// Skips a refused request's payload and answers with the store's reason.
async fn refused(rd: &mut BoxRead, h: &Header, e: &StoreError) -> Result<Served, FrameError> {
    frame::skip_payload(rd, h.payload_len).await?;
    Ok(Served::Reply(store_error(h, e), 0))
}

/// Reads published bytes of a block: a view of the arena, or of the buffer an NVMe read filled.
/// `started` is when its header was read.
pub(super) async fn read(
    rd: &mut BoxRead,
    conn: &Connection,
    h: &Header,
    started: Instant,
) -> Result<Served, FrameError> {
    if h.payload_len > 0 {
        return refuse_payload(rd, h).await;
    }
    let block = BlockId::from_wire(h.block_id);
    let server = conn.store.server_id();
    let nvme = match conn.store.tier(block) {
        Ok(TierRef::Dram(dram)) => {
            let (reply, bytes) = read_reply(h, dram.read(block, h.offset, h.length, server));
            return Ok(Served::Reply(reply, bytes));
        }
        Ok(TierRef::Nvme(nvme)) => nvme.clone(),
        Err(e) => return refused(rd, h, &e).await,
    };
    let Some(task) = NvmeTask::start(conn, started).await else {
        return Ok(Served::Reply(closing(h), 0));
    };
    let h = *h;
    tokio::spawn(async move {
        let (reply, bytes) = read_reply(&h, nvme.read(block, h.offset, h.length, server).await);
        task.finish(&h, reply, bytes).await;
    });
    Ok(Served::Spawned)
}

/// The reply to Read `h` and the bytes it carries, with the crc32c the tier has for them.
fn read_reply(h: &Header, read: Result<BlockRead, StoreError>) -> (Frame, u64) {
    match read {
        Ok(BlockRead { data, held, crc }) => {
            let bytes = data.len() as u64;
            (Frame::reply_with_crc(h, held, data, crc), bytes)
        }
        Err(e) => (store_error(h, &e), 0),
    }
}

/// Appends a Write's payload to its block: read from the socket straight into the arena, or into
/// an aligned buffer that a task then writes to disk.
/// `started` is when its header was read.
pub(super) async fn write(
    rd: &mut BoxRead,
    conn: &Connection,
    h: &Header,
    started: Instant,
) -> Result<Served, FrameError> {
    append(rd, conn, h, started, Payload::Stream).await
}

/// Appends the bytes a same-host client staged (see `tern_transport::local::Staging`) to its
/// block: copied from the connection's staging area into the arena or the aligned buffer, where
/// their crc is checked, so what the client does to its staging area meanwhile cannot reach the
/// block unchecked.
pub(super) async fn write_staged(
    rd: &mut BoxRead,
    conn: &Connection,
    h: &Header,
    started: Instant,
) -> Result<Served, FrameError> {
    let Some(staging) = conn.staging.clone() else {
        let message = format!("{h}: WriteStaged is served only to clients on the server's own host (its local socket)");
        return refuse(rd, h, ErrorKind::Invalid, &message).await;
    };
    let staged = match read_request_payload(rd, h).await? {
        Ok(payload) => match Staged::decode(&payload) {
            Ok(staged) => staged,
            Err(e) => return Ok(Served::Reply(frame_error(h, &e), 0)),
        },
        Err(reply) => return Ok(Served::Reply(reply, 0)),
    };
    if let Err(e) = staging.check(staged.at, h.length as usize) {
        return Ok(Served::Reply(error_reply(h, ErrorKind::Invalid, &format!("{h}: {e}")), 0));
    }
    append(rd, conn, h, started, Payload::Staged { staging: &staging, staged }).await
}

/// Where an append's bytes come from.
enum Payload<'a> {
    /// The request's own payload, next on the stream (`payload_len` bytes, `payload_crc`).
    Stream,
    /// The connection's staging area (`length` bytes), where a WriteStaged says.
    Staged { staging: &'a Staging, staged: Staged },
}

impl Payload<'_> {
    /// The bytes appended and their crc32c, as the request says.
    fn len_and_crc(&self, h: &Header) -> (u32, u32) {
        match self {
            Payload::Stream => (h.payload_len, h.payload_crc),
            Payload::Staged { staged, .. } => (h.length, staged.crc),
        }
    }

    /// Puts the bytes in `buf`. On an error the write's pending state is dropped unpublished:
    /// nothing of it becomes visible.
    async fn fill(&self, rd: &mut BoxRead, buf: &mut [u8]) -> Result<(), FrameError> {
        match self {
            Payload::Stream => read_exactly(rd, buf).await,
            // In range: checked before the write began.
            Payload::Staged { staging, staged } => Ok(staging.copy_out(staged.at, buf)?),
        }
    }

    /// Answers `e`, skipping what is left of a payload on the stream.
    async fn refused(&self, rd: &mut BoxRead, h: &Header, e: &StoreError) -> Result<Served, FrameError> {
        match self {
            Payload::Stream => refused(rd, h, e).await,
            Payload::Staged { .. } => Ok(Served::Reply(store_error(h, e), 0)),
        }
    }
}

/// Appends `payload` to the block `h` names (see [`write`]).
async fn append(
    rd: &mut BoxRead,
    conn: &Connection,
    h: &Header,
    started: Instant,
    payload: Payload<'_>,
) -> Result<Served, FrameError> {
    let block = BlockId::from_wire(h.block_id);
    let (len, crc) = payload.len_and_crc(h);
    let nvme = match conn.store.tier(block) {
        Ok(TierRef::Dram(_)) => {
            let mut pending = match conn.store.begin_dram_write(block, h.offset, len).await {
                Ok(pending) => pending,
                Err(e) => return payload.refused(rd, h, &e).await,
            };
            payload.fill(rd, pending.buf()).await?;
            return Ok(match pending.commit(crc) {
                Ok(held) => Served::Reply(Frame::reply(h, held, Bytes::new()), u64::from(len)),
                Err(e) => Served::Reply(store_error(h, &e), 0),
            });
        }
        Ok(TierRef::Nvme(nvme)) => nvme,
        Err(e) => return payload.refused(rd, h, &e).await,
    };
    let mut pending = match nvme.begin_write(block, h.offset, len) {
        Ok(pending) => pending,
        Err(e) => return payload.refused(rd, h, &e).await,
    };
    let Some(task) = NvmeTask::start(conn, started).await else {
        return Ok(Served::Reply(closing(h), 0));
    };
    payload.fill(rd, pending.payload()).await?;
    let h = *h;
    tokio::spawn(async move {
        let (reply, bytes) = match pending.commit(crc).await {
            Ok(held) => (Frame::reply(&h, held, Bytes::new()), u64::from(len)),
            Err(e) => (store_error(&h, &e), 0),
        };
        task.finish(&h, reply, bytes).await;
    });
    Ok(Served::Spawned)
}

/// An NVMe op handed to a task: what it needs to record and send its reply, and its permit,
/// held until the reply is queued.
struct NvmeTask {
    store: Arc<BlockStore>,
    metrics: Arc<Metrics>,
    tx: mpsc::Sender<Frame>,
    started: Instant,
    _permit: OwnedSemaphorePermit,
}

impl NvmeTask {
    /// Waits for one of the connection's NVMe permits; `None` if the connection is closing.
    async fn start(conn: &Connection, started: Instant) -> Option<NvmeTask> {
        // Never closed, so acquiring only waits.
        let permit = conn.nvme_ops.clone().acquire_owned().await.ok()?;
        Some(NvmeTask {
            store: conn.store.clone(),
            metrics: conn.metrics.clone(),
            tx: conn.replies.tx.clone(),
            started,
            _permit: permit,
        })
    }

    /// Records the op's reply and queues it.
    async fn finish(self, h: &Header, reply: Frame, bytes: u64) {
        record(&self.metrics, &self.store, h.op, self.started, &reply, bytes);
        let _ = self.tx.send(reply).await;
    }
}

/// The reply when a connection closes under an op that waited for a permit.
fn closing(h: &Header) -> Frame {
    error_reply(h, ErrorKind::Internal, "connection closing")
}

/// Frees the blocks a Free frame lists; the reply's length is the number freed.
pub(super) async fn free(rd: &mut BoxRead, conn: &Connection, h: &Header) -> Result<Served, FrameError> {
    if h.payload_len as usize > MAX_FREE_IDS * frame::FREE_ENTRY_LEN {
        let err = FrameError::BadFreeList { bytes: h.payload_len as usize };
        return refuse(rd, h, err.kind(), &format!("{h}: {err}")).await;
    }
    let payload = match read_request_payload(rd, h).await? {
        Ok(payload) => payload,
        Err(reply) => return Ok(Served::Reply(reply, 0)),
    };
    let request = Frame { header: *h, payload };
    let entries = match request.free_entries() {
        Ok(entries) => entries,
        Err(e) => return Ok(Served::Reply(frame_error(h, &e), 0)),
    };
    // Every block must be the slot's job's, else nothing is freed.
    let principal = match conn.slots.principal(conn.store.authority(), h, tern_common::unix_ms()) {
        Ok(principal) => principal,
        Err(denied) => return Ok(Served::Reply(error_reply(h, denied.kind, &denied.message), 0)),
    };
    if let Some(principal) = principal {
        for (id, grant) in &entries {
            if let Err(denied) = principal.check(Op::Free, GrantKind::Block, *id, grant) {
                return Ok(Served::Reply(error_reply(h, denied.kind, &denied.message), 0));
            }
        }
    }
    let freed = conn.store.free(entries.into_iter().map(|(id, _)| BlockId::from_wire(id)));
    Ok(Served::Reply(Frame::reply(h, freed as u32, Bytes::new()), 0))
}
