//! What the shuffle frames, Push and Fetch, address and carry (one definition for servers and
//! clients).
//!
//! A shuffle partition is a chain of segments; each segment lives on one storage server, which
//! appends the batches map writers push to it. Every batch is stored whole, with the map index and
//! attempt that wrote it and a crc32c of its bytes, so a reader can ask for exactly the committed
//! attempts and check every byte it gets.
//!
//! - **Address**: a Push or Fetch request names its segment with a [`SegmentAddress`] (shuffle,
//!   partition, segment index). The frame header has no fields of its own for it: it travels in
//!   the block-header fields (`block_id` = shuffle id, `offset` = partition, `length` = segment
//!   index), which only [`Frame::push`](crate::frame::Frame::push),
//!   [`Frame::fetch`](crate::frame::Frame::fetch) and
//!   [`Header::segment_address`](crate::frame::Header::segment_address) read or write.
//! - **Push** payload: [`PushHeader`] (12 bytes: map index u32, attempt u32, the shuffle's storage
//!   class u8 (see [`StorageClass::code`]), 3 zero bytes), then the batch. The class tells the
//!   server where the segment may live; the first push of a segment fixes it.
//! - **Fetch** payload: [`FetchRequest`]: cursor u32, max_bytes u32, then the committed
//!   `(map, attempt)` pairs wanted, ascending by map. The reply's payload is a run of whole
//!   batches, each a [`BatchHeader`] (16 bytes: map u32, attempt u32, length u32, crc32c u32)
//!   followed by its bytes; the reply header's `length` is the cursor to ask with next, or
//!   [`FETCH_DONE`]. A segment's batches are served ordered by map index, then push order, so
//!   the same fetch always yields the same bytes in the same order.
//!
//! All integers are little-endian; every count and length is bounded on decode.

use std::fmt;

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::frame::FrameError;
use crate::{MapAttempt, MapIndex, PartitionIndex, ShuffleId, StorageClass};

pub const PUSH_HEADER_LEN: usize = 12;
pub const BATCH_HEADER_LEN: usize = 16;
/// The reply cursor saying a segment has no more batches for this request.
pub const FETCH_DONE: u32 = u32::MAX;
/// Most `(map, attempt)` pairs one Fetch may list.
pub const MAX_FETCH_MAPS: usize = 1 << 17;

/// The segment a Push or Fetch request is about: the `index`th segment in the chain of
/// `partition` of `shuffle`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SegmentAddress {
    pub shuffle: ShuffleId,
    pub partition: PartitionIndex,
    /// The segment's place in the partition's chain, 0 first.
    pub index: u32,
}

impl fmt::Display for SegmentAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "shuffle {} partition {} segment {}", self.shuffle, self.partition, self.index)
    }
}

/// Who wrote a pushed batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushHeader {
    pub map: MapIndex,
    pub attempt: MapAttempt,
    /// The shuffle's storage class: which tiers its segments may use on the server.
    pub class: StorageClass,
}

impl PushHeader {
    pub fn encode(&self) -> [u8; PUSH_HEADER_LEN] {
        let mut out = [0u8; PUSH_HEADER_LEN];
        out[..4].copy_from_slice(&self.map.get().to_le_bytes());
        out[4..8].copy_from_slice(&self.attempt.get().to_le_bytes());
        out[8] = self.class.code();
        out
    }

    /// Splits a Push payload into its header and the batch.
    pub fn decode(payload: &[u8]) -> Result<(PushHeader, &[u8]), FrameError> {
        if payload.len() <= PUSH_HEADER_LEN {
            return Err(FrameError::BadShufflePayload(format!(
                "Push payload of {} bytes holds no batch after its {PUSH_HEADER_LEN}-byte header",
                payload.len()
            )));
        }
        let (mut head, batch) = payload.split_at(PUSH_HEADER_LEN);
        let (map, attempt) = (MapIndex::from_wire(head.get_u32_le()), MapAttempt::from_wire(head.get_u32_le()));
        let class = StorageClass::from_code(head[0]).filter(|_| head[1..] == [0; 3]).ok_or_else(|| {
            FrameError::BadShufflePayload(format!(
                "Push header's storage class bytes {:02x?} are not a class code (0 any, 1 dram, 2 nvme) and 3 zero bytes",
                head
            ))
        })?;
        Ok((PushHeader { map, attempt, class }, batch))
    }
}

/// What a Fetch asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchRequest {
    /// 0 at first, then the cursor the previous reply returned.
    pub cursor: u32,
    /// A page holds whole batches up to about this many bytes (always at least one batch).
    pub max_bytes: u32,
    /// The committed attempt of each wanted map, ascending by map.
    pub maps: Vec<(MapIndex, MapAttempt)>,
}

impl FetchRequest {
    pub fn encode(&self) -> Bytes {
        assert!(self.maps.len() <= MAX_FETCH_MAPS, "at most {MAX_FETCH_MAPS} maps per Fetch");
        let mut out = BytesMut::with_capacity(8 + 8 * self.maps.len());
        out.put_u32_le(self.cursor);
        out.put_u32_le(self.max_bytes);
        for (map, attempt) in &self.maps {
            out.put_u32_le(map.get());
            out.put_u32_le(attempt.get());
        }
        out.freeze()
    }

    pub fn decode(mut payload: &[u8]) -> Result<FetchRequest, FrameError> {
        let bad = |why: String| FrameError::BadShufflePayload(format!("Fetch request: {why}"));
        if payload.len() < 8 || !(payload.len() - 8).is_multiple_of(8) {
            return Err(bad(format!("{} bytes is not 8 plus 8 per map", payload.len())));
        }
        let count = (payload.len() - 8) / 8;
        if count > MAX_FETCH_MAPS {
            return Err(bad(format!("{count} maps listed, at most {MAX_FETCH_MAPS} allowed")));
        }
        let cursor = payload.get_u32_le();
        let max_bytes = payload.get_u32_le();
        let mut maps = Vec::with_capacity(count);
        for _ in 0..count {
            maps.push((MapIndex::from_wire(payload.get_u32_le()), MapAttempt::from_wire(payload.get_u32_le())));
        }
        if maps.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(bad("maps are not strictly ascending".to_string()));
        }
        Ok(FetchRequest { cursor, max_bytes, maps })
    }

    /// The attempt wanted for `map`, if it is listed.
    pub fn attempt_of(&self, map: MapIndex) -> Option<MapAttempt> {
        self.maps.binary_search_by_key(&map, |(m, _)| *m).ok().map(|i| self.maps[i].1)
    }
}

/// The header of one batch in a Fetch reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchHeader {
    pub map: MapIndex,
    pub attempt: MapAttempt,
    pub len: u32,
    /// crc32c of the batch's bytes, taken when it was pushed.
    pub crc: u32,
}

impl BatchHeader {
    pub fn encode(&self) -> [u8; BATCH_HEADER_LEN] {
        let mut out = [0u8; BATCH_HEADER_LEN];
        let mut buf = &mut out[..];
        buf.put_u32_le(self.map.get());
        buf.put_u32_le(self.attempt.get());
        buf.put_u32_le(self.len);
        buf.put_u32_le(self.crc);
        out
    }

    pub fn decode(bytes: &[u8; BATCH_HEADER_LEN]) -> BatchHeader {
        let mut buf = &bytes[..];
        BatchHeader {
            map: MapIndex::from_wire(buf.get_u32_le()),
            attempt: MapAttempt::from_wire(buf.get_u32_le()),
            len: buf.get_u32_le(),
            crc: buf.get_u32_le(),
        }
    }
}

/// The batches of a Fetch reply payload, each with its bytes (slices of the payload, no copy).
/// Yields an error, then stops, if the payload is malformed.
pub fn batches(payload: Bytes) -> impl Iterator<Item = Result<(BatchHeader, Bytes), FrameError>> {
    let mut rest = payload;
    let mut failed = false;
    std::iter::from_fn(move || {
        if rest.is_empty() || failed {
            return None;
        }
        if rest.len() < BATCH_HEADER_LEN {
            failed = true;
            return Some(Err(FrameError::BadShufflePayload(format!(
                "{} stray bytes after the last batch",
                rest.len()
            ))));
        }
        let head = rest.split_to(BATCH_HEADER_LEN);
        let header = BatchHeader::decode(head[..].try_into().expect("a header's bytes"));
        if header.len as usize > rest.len() {
            failed = true;
            return Some(Err(FrameError::BadShufflePayload(format!(
                "batch of map {} claims {} bytes but {} remain",
                header.map,
                header.len,
                rest.len()
            ))));
        }
        Some(Ok((header, rest.split_to(header.len as usize))))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `(map, attempt)` pair from plain numbers.
    fn entry(index: u32, attempt: u32) -> (MapIndex, MapAttempt) {
        (MapIndex::from_wire(index), MapAttempt::from_wire(attempt))
    }

    #[test]
    fn push_headers_round_trip() {
        for class in [StorageClass::Any, StorageClass::Dram, StorageClass::Nvme] {
            let (map, attempt) = entry(7, 2);
            let mut payload = PushHeader { map, attempt, class }.encode().to_vec();
            payload.extend_from_slice(b"records");
            let (header, batch) = PushHeader::decode(&payload).unwrap();
            assert_eq!((header, batch), (PushHeader { map, attempt, class }, &b"records"[..]));
            assert!(PushHeader::decode(&payload[..PUSH_HEADER_LEN]).is_err(), "an empty batch is refused");
            for (at, bad) in [(8, 3), (9, 1), (11, 1)] {
                let mut wrong = payload.clone();
                wrong[at] = bad;
                let err = PushHeader::decode(&wrong).unwrap_err().to_string();
                assert!(err.contains("storage class"), "{err}");
            }
        }
    }

    #[test]
    fn fetch_requests_round_trip_and_are_checked() {
        let request = FetchRequest { cursor: 3, max_bytes: 1 << 20, maps: vec![entry(0, 1), entry(4, 0), entry(9, 2)] };
        let decoded = FetchRequest::decode(&request.encode()).unwrap();
        assert_eq!(decoded, request);
        let attempt_of = |index| decoded.attempt_of(MapIndex::from_wire(index)).map(MapAttempt::get);
        assert_eq!((attempt_of(4), attempt_of(5)), (Some(0), None));
        assert!(FetchRequest::decode(&request.encode()[..11]).is_err());
        let unsorted = FetchRequest { cursor: 0, max_bytes: 1, maps: vec![entry(4, 0), entry(4, 1)] };
        assert!(FetchRequest::decode(&unsorted.encode()).is_err());
    }

    #[test]
    fn batches_parse_and_bounds_are_checked() {
        let mut payload = BytesMut::new();
        for (index, data) in [(1u32, &b"abc"[..]), (2, &b""[..]), (3, &b"xyz!"[..])] {
            let (map, attempt) = entry(index, 0);
            let header = BatchHeader { map, attempt, len: data.len() as u32, crc: crc32c::crc32c(data) };
            payload.extend_from_slice(&header.encode());
            payload.extend_from_slice(data);
        }
        let parsed: Vec<_> = batches(payload.clone().freeze()).collect::<Result<_, _>>().unwrap();
        assert_eq!(parsed.len(), 3);
        assert_eq!((parsed[2].0.map.get(), &parsed[2].1[..]), (3, &b"xyz!"[..]));
        let cut = payload.len() - 2;
        let results: Vec<_> = batches(payload.freeze().slice(..cut)).collect();
        assert!(results.last().unwrap().is_err());
    }
}
