//! The shuffle ops of the block service: Push (append a map's batch to a segment) and Fetch (a
//! page of a segment's committed batches), each naming its segment by the header's
//! [`segment_address`](Header::segment_address).

use bytes::Bytes;
use tern_proto::frame::{Frame, FrameError, Header};
use tern_proto::shuffle::{FetchRequest, PushHeader, MAX_FETCH_MAPS};
use tern_transport::BoxRead;

use super::{error_reply, frame_error, read_request_payload, Connection, Served};
use crate::shuffle::ShuffleError;

/// The largest Fetch request: its cursor, page size and the most `(map, attempt)` pairs one may
/// list. It may exceed the block size, the limit of every other op's payload.
pub(super) const MAX_FETCH_REQUEST_BYTES: u32 = 8 + 8 * MAX_FETCH_MAPS as u32;

fn shuffle_error(h: &Header, e: &ShuffleError) -> Frame {
    error_reply(h, e.kind(), &e.to_string())
}

/// Appends a Push's batch to its segment; the reply's length is the segment's size afterwards
/// (saturating at `u32::MAX`).
pub(super) async fn push(rd: &mut BoxRead, conn: &Connection, h: &Header) -> Result<Served, FrameError> {
    let payload = match read_request_payload(rd, h).await? {
        Ok(payload) => payload,
        Err(reply) => return Ok(Served::Reply(reply, 0)),
    };
    let (from, batch) = match PushHeader::decode(&payload) {
        Ok(decoded) => decoded,
        Err(e) => return Ok(Served::Reply(frame_error(h, &e), 0)),
    };
    Ok(match conn.store.push(h.segment_address(), from, batch).await {
        Ok(bytes) => {
            let length = u32::try_from(bytes).unwrap_or(u32::MAX);
            Served::Reply(Frame::reply(h, length, Bytes::new()), batch.len() as u64)
        }
        Err(e) => Served::Reply(shuffle_error(h, &e), 0),
    })
}

/// Answers a Fetch with a page of committed batches; the reply's length is the next cursor.
pub(super) async fn fetch(rd: &mut BoxRead, conn: &mut Connection, h: &Header) -> Result<Served, FrameError> {
    let payload = match read_request_payload(rd, h).await? {
        Ok(payload) => payload,
        Err(reply) => return Ok(Served::Reply(reply, 0)),
    };
    let request = match FetchRequest::decode(&payload) {
        Ok(request) => request,
        Err(e) => return Ok(Served::Reply(frame_error(h, &e), 0)),
    };
    Ok(match conn.store.fetch(h.segment_address(), &request).await {
        Ok(page) => {
            let bytes = page.payload.len() as u64;
            Served::Reply(super::leases::reply_with_page(conn, h, page).await, bytes)
        }
        Err(e) => Served::Reply(shuffle_error(h, &e), 0),
    })
}
