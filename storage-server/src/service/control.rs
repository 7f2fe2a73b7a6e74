//! The control ops of the block service: Auth (binding a job token to a slot), Ping, the
//! admission check every data frame passes, and the replies to headers that could not be decoded.

use bytes::Bytes;
use tern_proto::frame::{self, Frame, FrameError, Header, Op};
use tern_proto::ErrorKind;
use tern_transport::BoxRead;

use super::{read_request_payload, refuse, refuse_payload, Connection, Served};
use crate::auth::{self, Denied, Slots};
use crate::store::BlockStore;

/// Ok when the request may go ahead: its slot's token is good and, for ops on one block or
/// shuffle, its grant proves that block or shuffle belongs to the slot's job. (A Free's grants
/// are in its payload: the Free checks them.) Ping and Auth need nothing.
pub(super) fn admit(store: &BlockStore, slots: &Slots, h: &Header) -> Result<(), Denied> {
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

/// Binds the token an Auth frame carries to its slot; the reply is empty.
pub(super) async fn auth(rd: &mut BoxRead, conn: &mut Connection, h: &Header) -> Result<Served, FrameError> {
    if h.payload_len as usize > tern_proto::token::MAX_TOKEN_BYTES {
        let message = format!("{h}: a token is at most {} bytes", tern_proto::token::MAX_TOKEN_BYTES);
        return refuse(rd, h, ErrorKind::Invalid, &message).await;
    }
    let payload = match read_request_payload(rd, h).await? {
        Ok(payload) => payload,
        Err(reply) => return Ok(Served::Reply(reply, 0)),
    };
    let reply = match conn.slots.bind(conn.store.authority(), h, &payload, tern_common::unix_ms()) {
        Ok(()) => Frame::reply(h, 0, Bytes::new()),
        Err(denied) => super::error_reply(h, denied.kind, &denied.message),
    };
    Ok(Served::Reply(reply, 0))
}

/// Answers a Ping, which carries no payload.
pub(super) async fn ping(rd: &mut BoxRead, h: &Header) -> Result<Served, FrameError> {
    if h.payload_len > 0 {
        return refuse_payload(rd, h).await;
    }
    Ok(Served::Reply(Frame::reply(h, 0, Bytes::new()), 0))
}

/// The reply to a header that could not be decoded: `Err` when the connection must close after it.
pub(super) async fn bad_header(rd: &mut BoxRead, err: FrameError) -> Result<Served, Frame> {
    if let FrameError::UnknownOp { request_id, payload_len, .. } = err {
        let message = format!(
            "request {request_id}: {err} (requests are Ping, Write, Read, Free, Push, Fetch, Auth, Lease, Release)"
        );
        // The header was sound, so skipping the payload brings the stream to the next frame.
        return match frame::skip_payload(rd, payload_len).await {
            Ok(()) => Ok(Served::Reply(Frame::error(request_id, Op::Malformed, 0, err.kind(), &message), 0)),
            Err(skip) => Err(Frame::error(request_id, Op::Malformed, 0, skip.kind(), &format!("{message}; {skip}"))),
        };
    }
    let reply = Frame::error(0, Op::Malformed, 0, err.kind(), &err.to_string());
    if err.is_fatal() {
        return Err(reply);
    }
    Ok(Served::Reply(reply, 0))
}
