//! Same-host leases (`tern_transport::local`): the Lease and Release ops, which only a
//! connection from the server's own host accepts.
//!
//! A lease is a view of a DRAM block's published bytes, held here so the block's slot is not
//! reused (even if the block is freed) while the client reads the bytes straight from its
//! read-only mapping of the arena. Leases are bounded per connection, in number and in time
//! ([`LEASE_TTL`]); all of a connection's leases end with it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tern_proto::frame::{Frame, FrameError, Header, Lease, LEASE_TTL, MAX_RELEASE_IDS};
use tern_proto::{BlockId, ErrorKind};
use tern_transport::local::SharedArena;
use tern_transport::BoxRead;

use super::{error_reply, frame_error, read_request_payload, refuse, refuse_payload, Connection, Served};
use crate::store::TierRef;

/// Most leases one connection holds at once. A client keeps at most 32 blocks leased; past this a
/// Lease is refused (Unavailable) and the client reads through the socket instead. Expired
/// leases end at the connection's next Lease (or with the connection).
pub(super) const MAX_LEASES_PER_CONNECTION: usize = 64;

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

    /// Ends the leases whose time is up.
    fn expire(&mut self, now: Instant) {
        self.held.retain(|_, (_, lent)| now.duration_since(*lent) < LEASE_TTL);
    }
}

/// Lends a DRAM block's published bytes; the reply's payload is the [`Lease`].
pub(super) async fn lease(rd: &mut BoxRead, conn: &mut Connection, h: &Header) -> Result<Served, FrameError> {
    if h.payload_len > 0 {
        return refuse_payload(rd, h).await;
    }
    let Some(leases) = conn.leases.as_mut() else {
        let message = format!("{h}: Lease is served only to clients on the server's own host (its local socket)");
        return refuse(rd, h, ErrorKind::Invalid, &message).await;
    };
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
    let Some(offset) = leases.arena.offset_of(&view) else {
        let message = format!("{h}: block {block}'s bytes are not in the shared arena");
        return Ok(Served::Reply(error_reply(h, ErrorKind::Internal, &message), 0));
    };
    let now = Instant::now();
    leases.expire(now);
    if leases.held.len() >= MAX_LEASES_PER_CONNECTION {
        let message = format!("{h}: this connection holds {MAX_LEASES_PER_CONNECTION} leases; release some first");
        return Ok(Served::Reply(error_reply(h, ErrorKind::Unavailable, &message), 0));
    }
    let id = leases.next_id;
    leases.next_id += 1;
    let length = view.len() as u32;
    leases.held.insert(id, (view, now));
    Ok(Served::Reply(Frame::reply(h, length, Lease { id, offset }.encode()), 0))
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
    let Some(leases) = conn.leases.as_mut() else {
        let message = format!("{h}: Release is served only to clients on the server's own host (its local socket)");
        return Ok(Served::Reply(error_reply(h, ErrorKind::Invalid, &message), 0));
    };
    let ended = ids.iter().filter(|id| leases.held.remove(id).is_some()).count();
    Ok(Served::Reply(Frame::reply(h, ended as u32, Bytes::new()), 0))
}
