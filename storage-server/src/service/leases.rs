//! Leases: the Lease and Release ops, which only a connection from the server's own host
//! (`tern_transport::local`) or an RDMA connection accepts.
//!
//! Over RDMA a lease is a memory window (`tern_transport::rdma_provider::OneSided`): bound over
//! exactly the block's bytes, remote read only, its key and the bytes' crc32c in the reply
//! ([`RemoteLease`]), so the client READs the block with no work of this server's. The
//! connection's pump holds the view until the window is invalidated (Release, [`LEASE_TTL`],
//! the connection's end) and that completed; windows per connection are bounded like leases
//! ([`MAX_LEASES_PER_CONNECTION`]), and every wait on the pump here has a deadline
//! ([`WINDOW_DEADLINE`]).
//!
//! A lease is a view of a DRAM block's published bytes (or of a Fetch page that is one extent of
//! the arena), held here so its slot is not reused (even if the block or shuffle is freed) while
//! the client reads the bytes straight from its read-only mapping of the arena. Leases are bounded per connection, in number and in time
//! ([`LEASE_TTL`]); all of a connection's leases end with it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tern_proto::frame::{Frame, FrameError, Header, Lease, LentPage, RemoteLease, LEASE_TTL, MAX_RELEASE_IDS};
use tern_proto::{BlockId, ErrorKind};
use tern_transport::local::SharedArena;
use tern_transport::rdma_provider::OneSided;
use tern_transport::BoxRead;

use super::{error_reply, frame_error, read_request_payload, refuse, refuse_payload, Connection, Served};
use crate::store::TierRef;

/// Most leases one connection holds at once. A client keeps at most 32 blocks leased; past this a
/// Lease is refused (Unavailable) and the client reads through the socket instead. Expired
/// leases end at the connection's next Lease (or with the connection).
pub(super) const MAX_LEASES_PER_CONNECTION: usize = 64;
/// How long a Lease or Release waits for the RDMA connection to bind or invalidate its windows
/// (microseconds normally); past it a Lease is refused (Unavailable: the client reads instead)
/// and a Release answers what completed. A window not confirmed invalidated keeps its pin.
const WINDOW_DEADLINE: Duration = Duration::from_secs(2);

/// One same-host connection's leases.
pub(super) struct Leases {
    arena: Arc<SharedArena>,
    held: HashMap<u64, (Bytes, Instant)>,
    next_id: u64,
}

impl Leases {
    pub(super) fn new(arena: Arc<SharedArena>) -> Leases {
        Leases { arena, held: HashMap::new(), next_id: 1 }
    }

    /// Lends `view`: `Err` with the reason when it is not in the shared arena or this
    /// connection holds all the leases it may. Expired leases end first.
    pub(super) fn lend(&mut self, view: Bytes) -> Result<Lease, (ErrorKind, String)> {
        let Some(offset) = self.arena.offset_of(&view) else {
            return Err((ErrorKind::Internal, "its bytes are not in the shared arena".to_string()));
        };
        let now = Instant::now();
        self.held.retain(|_, (_, lent)| now.duration_since(*lent) < LEASE_TTL);
        if self.held.len() >= MAX_LEASES_PER_CONNECTION {
            let why = format!("this connection holds {MAX_LEASES_PER_CONNECTION} leases; release some first");
            return Err((ErrorKind::Unavailable, why));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.held.insert(id, (view, now));
        Ok(Lease { id, offset })
    }
}

/// `reply` (a Fetch page) on a same-host or RDMA connection: lent when its bytes are one extent
/// of the arena (the usual page of large batches), so the client copies them from its mapping
/// or READs them through a memory window; as it is otherwise (a page gathered from several
/// batches, or read from NVMe, or any the connection cannot lend now).
pub(super) async fn lend_page(conn: &mut Connection, reply: Frame) -> Frame {
    if reply.payload.is_empty() {
        return reply;
    }
    let (len, crc) = (reply.payload.len() as u32, reply.header.payload_crc);
    if let Some(one_sided) = conn.one_sided.clone() {
        // A page that is not one extent of the arena fails the bind's range check at once.
        let lent = tokio::time::timeout(WINDOW_DEADLINE, one_sided.lend(reply.payload.clone(), LEASE_TTL)).await;
        return match lent {
            Ok(Ok((id, window))) => {
                let lease = RemoteLease { id, addr: window.addr, rkey: window.rkey, len, crc };
                reply.lent_with(lease.encode())
            }
            _ => reply,
        };
    }
    let Some(leases) = conn.leases.as_mut() else { return reply };
    match leases.lend(reply.payload.clone()) {
        Ok(lease) => reply.lent(LentPage { lease, len, crc }),
        Err(_) => reply,
    }
}

/// Lends a DRAM block's published bytes; the reply's payload is the [`Lease`].
pub(super) async fn lease(rd: &mut BoxRead, conn: &mut Connection, h: &Header) -> Result<Served, FrameError> {
    if h.payload_len > 0 {
        return refuse_payload(rd, h).await;
    }
    if conn.leases.is_none() && conn.one_sided.is_none() {
        let message =
            format!("{h}: Lease is served only to clients on the server's own host (its local socket) or over RDMA");
        return refuse(rd, h, ErrorKind::Invalid, &message).await;
    }
    let block = BlockId::from(h.block_id);
    let view = match conn.store.tier(block) {
        Ok(TierRef::Dram(dram)) => match dram.read_published(block, conn.store.server_id()) {
            Ok(view) => view,
            Err(e) => return Ok(Served::Reply(error_reply(h, e.kind(), &e.to_string()), 0)),
        },
        Ok(TierRef::Nvme(_)) => {
            let message = format!("{h}: block {block} is on NVMe; only DRAM blocks are lent (read it instead)");
            return Ok(Served::Reply(error_reply(h, ErrorKind::Invalid, &message), 0));
        }
        Err(e) => return Ok(Served::Reply(error_reply(h, e.kind(), &e.to_string()), 0)),
    };
    let length = view.len() as u32;
    if let Some(one_sided) = conn.one_sided.clone() {
        return Ok(Served::Reply(lend_window(one_sided.as_ref(), h, block, view).await, 0));
    }
    let leases = conn.leases.as_mut().expect("a same-host connection when not an RDMA one");
    let lease = match leases.lend(view) {
        Ok(lease) => lease,
        Err((kind, why)) => return Ok(Served::Reply(error_reply(h, kind, &format!("{h}: block {block}: {why}")), 0)),
    };
    Ok(Served::Reply(Frame::reply(h, length, lease.encode()), 0))
}

/// Lends `view` over RDMA: a memory window bound over exactly its bytes, answered as a
/// [`RemoteLease`].
async fn lend_window(one_sided: &dyn OneSided, h: &Header, block: BlockId, view: Bytes) -> Frame {
    if view.is_empty() {
        // A window covers at least a byte; there is nothing to READ anyway.
        return error_reply(h, ErrorKind::Invalid, &format!("{h}: block {block} is empty; nothing to lend"));
    }
    let (len, crc) = (view.len() as u32, crc32c::crc32c(&view));
    match tokio::time::timeout(WINDOW_DEADLINE, one_sided.lend(view, LEASE_TTL)).await {
        Ok(Ok((id, window))) => {
            let lease = RemoteLease { id, addr: window.addr, rkey: window.rkey, len, crc };
            Frame::reply(h, len, lease.encode())
        }
        Ok(Err(e)) => error_reply(h, ErrorKind::Unavailable, &format!("{h}: block {block}: not lent ({e}); read it")),
        Err(_) => {
            let why = format!("{h}: block {block}: no memory window bound within {WINDOW_DEADLINE:?}; read it");
            error_reply(h, ErrorKind::Unavailable, &why)
        }
    }
}

/// Ends the leases a Release lists; the reply's length is how many were held.
pub(super) async fn release(rd: &mut BoxRead, conn: &mut Connection, h: &Header) -> Result<Served, FrameError> {
    if h.payload_len as usize > MAX_RELEASE_IDS * 8 {
        let err = FrameError::BadReleaseList { bytes: h.payload_len as usize };
        return refuse(rd, h, err.kind(), &format!("{h}: {err}")).await;
    }
    let payload = match read_request_payload(rd, h).await? {
        Ok(payload) => payload,
        Err(reply) => return Ok(Served::Reply(reply, 0)),
    };
    let request = Frame { header: *h, payload };
    let ids = match request.release_ids() {
        Ok(ids) => ids,
        Err(e) => return Ok(Served::Reply(frame_error(h, &e), 0)),
    };
    if let Some(one_sided) = conn.one_sided.clone() {
        // Each window invalidated, and that completed, before the reply counts it.
        let revokes = futures::future::join_all(ids.iter().map(|&id| one_sided.revoke(id)));
        let ended = match tokio::time::timeout(WINDOW_DEADLINE, revokes).await {
            Ok(done) => done.into_iter().filter(|r| matches!(r, Ok(true))).count(),
            Err(_) => {
                let why = format!("{h}: the windows were not invalidated within {WINDOW_DEADLINE:?}");
                return Ok(Served::Reply(error_reply(h, ErrorKind::Unavailable, &why), 0));
            }
        };
        return Ok(Served::Reply(Frame::reply(h, ended as u32, Bytes::new()), 0));
    }
    let Some(leases) = conn.leases.as_mut() else {
        let message =
            format!("{h}: Release is served only to clients on the server's own host (its local socket) or over RDMA");
        return Ok(Served::Reply(error_reply(h, ErrorKind::Invalid, &message), 0));
    };
    let ended = ids.iter().filter(|id| leases.held.remove(id).is_some()).count();
    Ok(Served::Reply(Frame::reply(h, ended as u32, Bytes::new()), 0))
}
