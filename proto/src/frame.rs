//! The binary block-frame codec: every data-plane message between clients and storage servers.
//!
//! A frame is a fixed 60-byte header followed by `payload_len` bytes of payload. All integers are
//! little-endian. Version 2 (this one) added the slot and the grant (version 1 was 44 bytes, with
//! the slot's two bytes reserved and no grant); see [`crate::token`] for what they prove.
//!
//! | offset | size | field                                                             |
//! | ------ | ---- | ----------------------------------------------------------------- |
//! | 0      | 2    | magic `TB`                                                        |
//! | 2      | 1    | version (2)                                                       |
//! | 3      | 1    | op; the high bit marks a response                                 |
//! | 4      | 2    | status: 0 = ok, else an [`ErrorKind`] code (responses only)       |
//! | 6      | 2    | slot: whose token the request acts under (0: the volume principal) |
//! | 8      | 8    | request id, echoed by the response (many requests are in flight)  |
//! | 16     | 8    | block id                                                          |
//! | 24     | 4    | offset within the block                                           |
//! | 28     | 4    | length: bytes to read (Read); block length after the op (replies) |
//! | 32     | 4    | payload length                                                    |
//! | 36     | 4    | crc32c of the payload                                             |
//! | 40     | 16   | grant of the block or shuffle for the slot's job (requests)       |
//! | 56     | 4    | crc32c of bytes 0..56                                             |
//!
//! Every length is bounded on decode: a payload longer than the receiver's limit (never more than
//! [`MAX_PAYLOAD_BYTES`]) is refused before a byte of it is read. Payloads are [`Bytes`], so a
//! frame's data is never copied on its way between the socket and its owner.

use std::fmt;
use std::io;
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::buffers::{BufferPool, Pooled};
use crate::error::{cut_message, ErrorKind};
use crate::shuffle::SegmentAddress;
use crate::token::{Grant, GRANT_LEN, MAX_TOKEN_BYTES};
use crate::{PartitionIndex, ShuffleId};

pub const MAGIC: [u8; 2] = *b"TB";
pub const VERSION: u8 = 3;
pub const HEADER_LEN: usize = 60;
/// Set in the op byte of every response.
pub const RESPONSE_BIT: u8 = 0x80;
/// Hard ceiling on any payload, whatever a receiver is configured with.
pub const MAX_PAYLOAD_BYTES: u32 = crate::MAX_BLOCK_SIZE;
/// Error messages are cut to this many bytes.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 4096;
/// Most block ids one Free frame may carry.
pub const MAX_FREE_IDS: usize = 8192;
/// Bytes per Free entry: block id, then its grant.
pub const FREE_ENTRY_LEN: usize = 8 + GRANT_LEN;
/// Most lease ids one Release frame may carry.
pub const MAX_RELEASE_IDS: usize = 1024;
/// How long a lease holds a block's memory. A client reads a leased block only until this long
/// after it sent the Lease (client and server share the host's monotonic clock, so the server,
/// which counts from when it lent, never ends a lease its client still reads); the server ends
/// it this long after lending even without a Release, so a client that stops releasing cannot
/// pin memory (a freed block's, say) for long.
pub const LEASE_TTL: std::time::Duration = std::time::Duration::from_secs(5);

/// Highest slot number a connection may bind a token to (slots 1..=MAX_SLOT; 0 is the volume
/// principal's, bound to no token).
pub const MAX_SLOT: u16 = 1024;

/// What a frame asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Op {
    /// Liveness check; the reply is empty.
    Ping = 1,
    /// Append the payload to a block at `offset`, which must equal the block's current length.
    /// The reply's `length` is the block's length afterwards.
    Write = 2,
    /// Read `length` bytes of a block from `offset`; the reply's payload is the data.
    Read = 3,
    /// Free the blocks the payload lists (a u64 id and its 16-byte grant each); unknown ids are
    /// skipped. The reply's `length` is the number freed.
    Free = 4,
    /// Append a batch to a shuffle partition's segment (push-merge); see [`crate::shuffle`].
    /// The request names its segment with a [`SegmentAddress`], carried in the block-header
    /// fields (`block_id` = shuffle id, `offset` = partition, `length` = segment index): build it
    /// with [`Frame::push`], read it with [`Header::segment_address`]. The reply's `length` is
    /// the segment's size in bytes after the append.
    Push = 5,
    /// Read committed batches of a shuffle partition's segment, a page at a time; see
    /// [`crate::shuffle`]. Addressed as Push ([`Frame::fetch`]); the reply's `length` is the next
    /// cursor.
    Fetch = 6,
    /// Bind the job token in the payload (a `JobToken` message, at most
    /// [`MAX_TOKEN_BYTES`]) to slot `offset` (1 to [`MAX_SLOT`]) of this connection; later frames
    /// naming the slot act as that job. Rebinding a slot replaces its token.
    Auth = 7,
    /// Same-host and RDMA connections only: lend the published bytes of a DRAM block,
    /// authorized as a Read of it. The server keeps the block's memory from reuse until a
    /// Release or [`LEASE_TTL`] after the lease; the reply's `length` is the bytes lent (the
    /// block's length) and its payload, on a same-host connection (`tern_transport::local`), a
    /// [`Lease`] saying where they lie in the shared arena, on an RDMA connection a
    /// [`RemoteLease`]: the memory window to READ them through, and their crc32c.
    Lease = 8,
    /// Same-host and RDMA connections only: end the leases the payload lists (a u64 id each, at
    /// most [`MAX_RELEASE_IDS`]); unknown ids are skipped. The reply's `length` is the number
    /// ended (on RDMA: whose windows were invalidated before the reply).
    Release = 9,
    /// Same-host connections only: a Write whose payload the client copied into the connection's
    /// staging area (`tern_transport::local::Staging`) instead of sending it. `length` is the
    /// bytes to append at `offset`, and the frame's payload a [`Staged`]: where they lie in the
    /// staging area and their crc32c. Authorized as a Write; the reply is a Write's.
    WriteStaged = 10,
    /// Only in error replies to frames whose op could not be read.
    Malformed = 0x7f,
}

impl Op {
    pub fn from_code(code: u8) -> Option<Op> {
        match code {
            1 => Some(Op::Ping),
            2 => Some(Op::Write),
            3 => Some(Op::Read),
            4 => Some(Op::Free),
            5 => Some(Op::Push),
            6 => Some(Op::Fetch),
            7 => Some(Op::Auth),
            8 => Some(Op::Lease),
            9 => Some(Op::Release),
            10 => Some(Op::WriteStaged),
            0x7f => Some(Op::Malformed),
            _ => None,
        }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub op: Op,
    pub response: bool,
    /// 0 = ok; otherwise an [`ErrorKind`] code.
    pub status: u16,
    pub request_id: u64,
    pub block_id: u64,
    pub offset: u32,
    pub length: u32,
    pub payload_len: u32,
    pub payload_crc: u32,
    /// Requests: the slot whose token this frame acts under (0: none, the volume principal).
    pub slot: u16,
    /// Requests: the grant of `block_id` (a block, or a shuffle for Push and Fetch) for the slot's
    /// job; zero where none is needed.
    pub grant: Grant,
}

impl Header {
    /// The segment a Push or Fetch request addresses (meaningless for other ops, and for replies,
    /// whose `length` is a size or a cursor).
    pub fn segment_address(&self) -> SegmentAddress {
        debug_assert!(matches!(self.op, Op::Push | Op::Fetch), "{:?} frames address no segment", self.op);
        SegmentAddress {
            shuffle: ShuffleId::from_wire(self.block_id),
            partition: PartitionIndex::from_wire(self.offset),
            index: self.length,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        let mut buf = &mut out[..];
        buf.put_slice(&MAGIC);
        buf.put_u8(VERSION);
        buf.put_u8(self.op as u8 | if self.response { RESPONSE_BIT } else { 0 });
        buf.put_u16_le(self.status);
        buf.put_u16_le(self.slot);
        buf.put_u64_le(self.request_id);
        buf.put_u64_le(self.block_id);
        buf.put_u32_le(self.offset);
        buf.put_u32_le(self.length);
        buf.put_u32_le(self.payload_len);
        buf.put_u32_le(self.payload_crc);
        buf.put_slice(&self.grant);
        let crc = crc32c::crc32c(&out[..HEADER_LEN - 4]);
        out[HEADER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes and checks a header; payloads over `max_payload` bytes are refused.
    pub fn decode(raw: &[u8; HEADER_LEN], max_payload: u32) -> Result<Header, FrameError> {
        if raw[..2] != MAGIC {
            return Err(FrameError::BadMagic([raw[0], raw[1]]));
        }
        if raw[2] != VERSION {
            return Err(FrameError::UnsupportedVersion(raw[2]));
        }
        let expected = u32::from_le_bytes(raw[HEADER_LEN - 4..].try_into().expect("4 bytes"));
        let actual = crc32c::crc32c(&raw[..HEADER_LEN - 4]);
        if expected != actual {
            return Err(FrameError::HeaderChecksum { expected, actual });
        }
        let mut buf = &raw[3..HEADER_LEN - 4];
        let op_byte = buf.get_u8();
        let status = buf.get_u16_le();
        let slot = buf.get_u16_le();
        let request_id = buf.get_u64_le();
        let block_id = buf.get_u64_le();
        let offset = buf.get_u32_le();
        let length = buf.get_u32_le();
        let payload_len = buf.get_u32_le();
        let payload_crc = buf.get_u32_le();
        let mut grant = [0u8; GRANT_LEN];
        buf.copy_to_slice(&mut grant);
        let max = max_payload.min(MAX_PAYLOAD_BYTES);
        if payload_len > max {
            return Err(FrameError::PayloadTooLarge { len: payload_len, max });
        }
        let Some(op) = Op::from_code(op_byte & !RESPONSE_BIT) else {
            return Err(FrameError::UnknownOp { op: op_byte, request_id, payload_len });
        };
        Ok(Header {
            op,
            response: op_byte & RESPONSE_BIT != 0,
            status,
            request_id,
            block_id,
            offset,
            length,
            payload_len,
            payload_crc,
            slot,
            grant,
        })
    }
}

/// A whole frame: header and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub header: Header,
    pub payload: Bytes,
}

impl Frame {
    fn new(op: Op, response: bool, request_id: u64, block_id: u64, offset: u32, length: u32, payload: Bytes) -> Frame {
        let payload_crc = crc32c::crc32c(&payload);
        Frame::with_crc(op, response, request_id, block_id, offset, length, payload, payload_crc)
    }

    /// A frame whose payload crc32c the sender already knows (kept since the bytes were written,
    /// or combined from its parts' checksums), sparing a pass over the payload. `payload_crc` is
    /// what the receiver checks the payload against.
    #[allow(clippy::too_many_arguments)]
    fn with_crc(
        op: Op,
        response: bool,
        request_id: u64,
        block_id: u64,
        offset: u32,
        length: u32,
        payload: Bytes,
        payload_crc: u32,
    ) -> Frame {
        let payload_len = u32::try_from(payload.len()).expect("payloads are bounded by MAX_PAYLOAD_BYTES");
        Frame {
            header: Header {
                op,
                response,
                status: 0,
                request_id,
                block_id,
                offset,
                length,
                payload_len,
                payload_crc,
                slot: 0,
                grant: [0; GRANT_LEN],
            },
            payload,
        }
    }

    pub fn ping(request_id: u64) -> Frame {
        Frame::new(Op::Ping, false, request_id, 0, 0, 0, Bytes::new())
    }

    pub fn write(request_id: u64, block_id: u64, offset: u32, data: Bytes) -> Frame {
        let len = data.len() as u32;
        Frame::new(Op::Write, false, request_id, block_id, offset, len, data)
    }

    /// A Write of bytes whose crc32c is known (see [`Frame::reply_with_crc`]).
    pub fn write_with_crc(request_id: u64, block_id: u64, offset: u32, data: Bytes, crc: u32) -> Frame {
        let len = data.len() as u32;
        Frame::with_crc(Op::Write, false, request_id, block_id, offset, len, data, crc)
    }

    pub fn read(request_id: u64, block_id: u64, offset: u32, length: u32) -> Frame {
        Frame::new(Op::Read, false, request_id, block_id, offset, length, Bytes::new())
    }

    /// A Free of blocks without grants: only a server that checks no tokens (tests) honours it.
    pub fn free(request_id: u64, block_ids: &[u64]) -> Frame {
        let entries: Vec<(u64, Grant)> = block_ids.iter().map(|&id| (id, [0; GRANT_LEN])).collect();
        Frame::free_granted(request_id, &entries)
    }

    /// A Free of blocks, each with its grant for the job of the frame's slot.
    pub fn free_granted(request_id: u64, entries: &[(u64, Grant)]) -> Frame {
        assert!(entries.len() <= MAX_FREE_IDS, "at most {MAX_FREE_IDS} ids per Free frame");
        let mut payload = BytesMut::with_capacity(entries.len() * FREE_ENTRY_LEN);
        for (id, grant) in entries {
            payload.put_u64_le(*id);
            payload.put_slice(grant);
        }
        Frame::new(Op::Free, false, request_id, 0, 0, entries.len() as u32, payload.freeze())
    }

    /// Binds `token` (an encoded [`crate::token::JobToken`]) to `slot` of the connection.
    pub fn auth(request_id: u64, slot: u16, token: Bytes) -> Frame {
        assert!(token.len() <= MAX_TOKEN_BYTES, "tokens are at most {MAX_TOKEN_BYTES} bytes");
        Frame::new(Op::Auth, false, request_id, 0, u32::from(slot), 0, token)
    }

    /// A Lease of block `block_id`'s published bytes (same-host connections only).
    pub fn lease(request_id: u64, block_id: u64) -> Frame {
        Frame::new(Op::Lease, false, request_id, block_id, 0, 0, Bytes::new())
    }

    /// A WriteStaged (same-host connections only) of `len` bytes staged as `staged`, appended to
    /// `block_id` at `offset`.
    pub fn write_staged(request_id: u64, block_id: u64, offset: u32, len: u32, staged: Staged) -> Frame {
        Frame::new(Op::WriteStaged, false, request_id, block_id, offset, len, staged.encode())
    }

    /// A Release of `leases` (same-host connections only).
    pub fn release(request_id: u64, leases: &[u64]) -> Frame {
        assert!(leases.len() <= MAX_RELEASE_IDS, "at most {MAX_RELEASE_IDS} ids per Release frame");
        let mut payload = BytesMut::with_capacity(leases.len() * 8);
        for id in leases {
            payload.put_u64_le(*id);
        }
        Frame::new(Op::Release, false, request_id, 0, 0, leases.len() as u32, payload.freeze())
    }

    /// The lease ids a Release frame lists.
    pub fn release_ids(&self) -> Result<Vec<u64>, FrameError> {
        if !self.payload.len().is_multiple_of(8) || self.payload.len() / 8 > MAX_RELEASE_IDS {
            return Err(FrameError::BadReleaseList { bytes: self.payload.len() });
        }
        Ok(self.payload.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
    }

    /// This request, acting under `slot` with `grant` for its block or shuffle.
    pub fn authorized(mut self, slot: u16, grant: Grant) -> Frame {
        self.header.slot = slot;
        self.header.grant = grant;
        self
    }

    /// A Push of `payload` (which starts with a [`crate::shuffle::PushHeader`]) to a segment.
    pub fn push(request_id: u64, segment: SegmentAddress, payload: Bytes) -> Frame {
        Frame::segment_request(Op::Push, request_id, segment, payload)
    }

    /// A Fetch of a segment's committed batches; `request` from [`crate::shuffle::FetchRequest`].
    pub fn fetch(request_id: u64, segment: SegmentAddress, request: Bytes) -> Frame {
        Frame::segment_request(Op::Fetch, request_id, segment, request)
    }

    /// A Push or Fetch: the segment's address goes in the block-header fields (see [`Op::Push`]),
    /// the one place besides [`Header::segment_address`] that knows which carries what.
    fn segment_request(op: Op, request_id: u64, segment: SegmentAddress, payload: Bytes) -> Frame {
        let SegmentAddress { shuffle, partition, index } = segment;
        Frame::new(op, false, request_id, shuffle.get(), partition.get(), index, payload)
    }

    /// A successful reply to `request`.
    pub fn reply(request: &Header, length: u32, payload: Bytes) -> Frame {
        Frame::new(request.op, true, request.request_id, request.block_id, request.offset, length, payload)
    }

    /// A successful reply whose payload crc32c the sender already knows (kept since the bytes
    /// were written, or combined from checksums of its parts), sparing a pass over the payload.
    /// `payload_crc` must be the payload's crc32c: the receiver checks it.
    pub fn reply_with_crc(request: &Header, length: u32, payload: Bytes, payload_crc: u32) -> Frame {
        let (op, id, block, offset) = (request.op, request.request_id, request.block_id, request.offset);
        Frame::with_crc(op, true, id, block, offset, length, payload, payload_crc)
    }

    /// An error reply: `status` carries the kind, the payload the message (UTF-8, bounded).
    pub fn error(request_id: u64, op: Op, block_id: u64, kind: ErrorKind, message: &str) -> Frame {
        let payload = Bytes::copy_from_slice(cut_message(message, MAX_ERROR_MESSAGE_BYTES).as_bytes());
        let mut frame = Frame::new(op, true, request_id, block_id, 0, 0, payload);
        frame.header.status = kind.code();
        frame
    }

    /// For a reply: the frame itself when it says ok, else the kind and message it carries.
    pub fn into_result(self) -> Result<Frame, (ErrorKind, String)> {
        if self.header.status == 0 {
            return Ok(self);
        }
        let kind = ErrorKind::from_code(self.header.status).unwrap_or(ErrorKind::Internal);
        Err((kind, String::from_utf8_lossy(&self.payload).into_owned()))
    }

    /// The block ids a Free frame lists, with their grants.
    pub fn free_entries(&self) -> Result<Vec<(u64, Grant)>, FrameError> {
        if !self.payload.len().is_multiple_of(FREE_ENTRY_LEN) || self.payload.len() / FREE_ENTRY_LEN > MAX_FREE_IDS {
            return Err(FrameError::BadFreeList { bytes: self.payload.len() });
        }
        Ok(self
            .payload
            .chunks_exact(FREE_ENTRY_LEN)
            .map(|c| {
                let id = u64::from_le_bytes(c[..8].try_into().expect("8 bytes"));
                (id, c[8..].try_into().expect("16 bytes"))
            })
            .collect())
    }

    /// The block ids a Free frame lists.
    pub fn free_ids(&self) -> Result<Vec<u64>, FrameError> {
        Ok(self.free_entries()?.into_iter().map(|(id, _)| id).collect())
    }
}

/// A block lent over a same-host connection: the payload of a Lease reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// What a Release names it by.
    pub id: u64,
    /// Where the block's first byte lies in the server's shared arena.
    pub offset: u64,
}

impl Lease {
    pub const LEN: usize = 16;

    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(Lease::LEN);
        out.put_u64_le(self.id);
        out.put_u64_le(self.offset);
        out.freeze()
    }

    pub fn decode(mut payload: &[u8]) -> Result<Lease, FrameError> {
        if payload.len() != Lease::LEN {
            return Err(FrameError::BadLease { bytes: payload.len() });
        }
        Ok(Lease { id: payload.get_u64_le(), offset: payload.get_u64_le() })
    }
}

/// Where a staged write's bytes lie: the payload of a WriteStaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Staged {
    /// Offset of the first byte in the connection's staging area.
    pub at: u64,
    /// crc32c of the staged bytes, which the server checks its copy of them against.
    pub crc: u32,
}

impl Staged {
    pub const LEN: usize = 12;

    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(Staged::LEN);
        out.put_u64_le(self.at);
        out.put_u32_le(self.crc);
        out.freeze()
    }

    pub fn decode(mut payload: &[u8]) -> Result<Staged, FrameError> {
        if payload.len() != Staged::LEN {
            return Err(FrameError::BadStaged { bytes: payload.len() });
        }
        Ok(Staged { at: payload.get_u64_le(), crc: payload.get_u32_le() })
    }
}

/// A block lent over an RDMA connection: the payload of a Lease reply there. The client READs
/// `len` bytes at `addr` under `rkey` (a memory window over exactly those bytes, remote read
/// only, valid until a Release of `id` or [`LEASE_TTL`] after the Lease) and checks them against
/// `crc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteLease {
    /// What a Release names it by.
    pub id: u64,
    /// The block's first byte in the server's address space (the window's start).
    pub addr: u64,
    pub rkey: u32,
    pub len: u32,
    /// crc32c of the lent bytes.
    pub crc: u32,
}

impl RemoteLease {
    pub const LEN: usize = 28;

    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(RemoteLease::LEN);
        out.put_u64_le(self.id);
        out.put_u64_le(self.addr);
        out.put_u32_le(self.rkey);
        out.put_u32_le(self.len);
        out.put_u32_le(self.crc);
        out.freeze()
    }

    pub fn decode(mut payload: &[u8]) -> Result<RemoteLease, FrameError> {
        if payload.len() != RemoteLease::LEN {
            return Err(FrameError::BadLease { bytes: payload.len() });
        }
        Ok(RemoteLease {
            id: payload.get_u64_le(),
            addr: payload.get_u64_le(),
            rkey: payload.get_u32_le(),
            len: payload.get_u32_le(),
            crc: payload.get_u32_le(),
        })
    }
}

/// In a reply's `slot` field (requests-only otherwise): the payload says where the reply's bytes
/// lie instead of carrying them: a [`LentPage`] in the server's shared arena (same-host
/// connections), a [`RemoteLease`] (RDMA connections: the memory window to READ). Only those
/// connections carry such replies (Fetch pages that are one extent of the arena).
pub const REPLY_LENT: u16 = 1;

/// A reply's bytes lent in the shared arena: the payload of a reply marked [`REPLY_LENT`]. The
/// reader copies `len` bytes at the lease's offset, checks them against `crc`, and releases
/// the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LentPage {
    pub lease: Lease,
    pub len: u32,
    /// crc32c of the lent bytes (what the payload crc would have been).
    pub crc: u32,
}

impl LentPage {
    pub const LEN: usize = Lease::LEN + 8;

    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(LentPage::LEN);
        out.put_slice(&self.lease.encode());
        out.put_u32_le(self.len);
        out.put_u32_le(self.crc);
        out.freeze()
    }

    pub fn decode(payload: &[u8]) -> Result<LentPage, FrameError> {
        if payload.len() != LentPage::LEN {
            return Err(FrameError::BadLease { bytes: payload.len() });
        }
        let lease = Lease::decode(&payload[..Lease::LEN])?;
        let mut rest = &payload[Lease::LEN..];
        Ok(LentPage { lease, len: rest.get_u32_le(), crc: rest.get_u32_le() })
    }
}

impl Frame {
    /// This reply with its payload lent as `page` instead of carried (see [`REPLY_LENT`]).
    pub fn lent(self, page: LentPage) -> Frame {
        self.lent_with(page.encode())
    }

    /// This reply with its payload lent instead of carried, `lease` saying where: a
    /// [`LentPage`] on a same-host connection, a [`RemoteLease`] on an RDMA one.
    pub fn lent_with(self, lease: Bytes) -> Frame {
        let mut lent = Frame::reply(&self.header, self.header.length, lease);
        lent.header.slot = REPLY_LENT;
        lent
    }

    /// Whether this reply's payload is a [`LentPage`].
    pub fn is_lent(&self) -> bool {
        self.header.response && self.header.slot == REPLY_LENT
    }
}

/// Why a frame could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("bad frame magic {0:02x?} (expected \"TB\"): not a Tern block frame")]
    BadMagic([u8; 2]),
    #[error("unsupported frame version {0} (this side speaks version {VERSION})")]
    UnsupportedVersion(u8),
    #[error("frame header checksum mismatch (header says {expected:#010x}, bytes give {actual:#010x})")]
    HeaderChecksum { expected: u32, actual: u32 },
    #[error("unknown frame op {op:#04x}")]
    UnknownOp { op: u8, request_id: u64, payload_len: u32 },
    #[error("frame payload of {len} bytes exceeds the limit of {max} bytes")]
    PayloadTooLarge { len: u32, max: u32 },
    #[error("truncated frame: expected {expected} more bytes, the stream ended after {got}")]
    Truncated { expected: usize, got: usize },
    #[error("frame payload checksum mismatch (header says {expected:#010x}, payload gives {actual:#010x})")]
    PayloadChecksum { expected: u32, actual: u32 },
    #[error("Free frame payload of {bytes} bytes is not a list of at most {MAX_FREE_IDS} entries (u64 block id, 16-byte grant)")]
    BadFreeList { bytes: usize },
    #[error("Release frame payload of {bytes} bytes is not a list of at most {MAX_RELEASE_IDS} u64 lease ids")]
    BadReleaseList { bytes: usize },
    #[error(
        "lease payload of {bytes} bytes (expected {} for a Lease reply, {} for a lent page, {} for an RDMA Lease reply)",
        Lease::LEN,
        LentPage::LEN,
        RemoteLease::LEN
    )]
    BadLease { bytes: usize },
    #[error("a WriteStaged's payload is {bytes} bytes, not the {} of where the bytes are staged", Staged::LEN)]
    BadStaged { bytes: usize },
    #[error("malformed shuffle payload: {0}")]
    BadShufflePayload(String),
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
}

impl FrameError {
    /// True when the byte stream can no longer be trusted to be at a frame boundary, so the
    /// connection must close after the error reply.
    pub fn is_fatal(&self) -> bool {
        !matches!(
            self,
            FrameError::UnknownOp { .. }
                | FrameError::PayloadChecksum { .. }
                | FrameError::BadFreeList { .. }
                | FrameError::BadReleaseList { .. }
                | FrameError::BadLease { .. }
                | FrameError::BadStaged { .. }
                | FrameError::BadShufflePayload(_)
        )
    }

    pub fn kind(&self) -> ErrorKind {
        match self {
            FrameError::PayloadChecksum { .. } | FrameError::HeaderChecksum { .. } => ErrorKind::Corrupt,
            FrameError::Io(_) => ErrorKind::Unavailable,
            _ => ErrorKind::Invalid,
        }
    }
}

/// Reads the next header. `Ok(None)` on a clean end of stream at a frame boundary. Bytes that
/// do not start with the magic are refused as soon as two have arrived, so a peer speaking
/// another protocol gets its answer without having to send a whole header.
pub async fn read_header<R: AsyncRead + Unpin>(r: &mut R, max_payload: u32) -> Result<Option<Header>, FrameError> {
    let mut raw = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut raw[got..]).await? {
            0 if got == 0 => return Ok(None),
            0 => return Err(FrameError::Truncated { expected: HEADER_LEN, got }),
            n => got += n,
        }
        if got >= MAGIC.len() && raw[..MAGIC.len()] != MAGIC {
            return Err(FrameError::BadMagic([raw[0], raw[1]]));
        }
    }
    Header::decode(&raw, max_payload).map(Some)
}

/// Reads `header`'s payload into a buffer of exactly its size and checks its crc.
pub async fn read_payload<R: AsyncRead + Unpin>(r: &mut R, header: &Header) -> Result<Bytes, FrameError> {
    read_payload_into(r, header, Pooled::unpooled(header.payload_len as usize)).await
}

async fn read_payload_into<R: AsyncRead + Unpin>(
    r: &mut R,
    header: &Header,
    mut into: Pooled,
) -> Result<Bytes, FrameError> {
    let len = header.payload_len as usize;
    // Read into uninitialised capacity: zeroing a 1 MiB payload first costs as much as a tenth
    // of receiving it. The crc is taken as the bytes arrive, while they are still in cache.
    let buf = into.buf();
    let mut crc = 0;
    while buf.len() < len {
        let before = buf.len();
        let mut rest = (&mut *buf).limit(len - before);
        if r.read_buf(&mut rest).await? == 0 {
            return Err(FrameError::Truncated { expected: len, got: before });
        }
        crc = crc32c::crc32c_append(crc, &buf[before..]);
    }
    let actual = crc;
    if actual != header.payload_crc {
        return Err(FrameError::PayloadChecksum { expected: header.payload_crc, actual });
    }
    Ok(into.freeze())
}

/// Reads and discards `len` payload bytes (of a frame that will be answered with an error).
pub async fn skip_payload<R: AsyncRead + Unpin>(r: &mut R, len: u32) -> Result<(), FrameError> {
    let copied = tokio::io::copy(&mut (&mut *r).take(len as u64), &mut tokio::io::sink()).await?;
    if copied < len as u64 {
        return Err(FrameError::Truncated { expected: len as usize, got: copied as usize });
    }
    Ok(())
}

/// Reads one whole frame. `Ok(None)` on a clean end of stream at a frame boundary.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, max_payload: u32) -> Result<Option<Frame>, FrameError> {
    let Some(header) = read_header(r, max_payload).await? else {
        return Ok(None);
    };
    let payload = read_payload(r, &header).await?;
    Ok(Some(Frame { header, payload }))
}

/// [`read_frame`], its payload read into a buffer of `pool` (see [`crate::buffers`]).
pub async fn read_frame_pooled<R: AsyncRead + Unpin>(
    r: &mut R,
    max_payload: u32,
    pool: &Arc<BufferPool>,
) -> Result<Option<Frame>, FrameError> {
    let Some(header) = read_header(r, max_payload).await? else {
        return Ok(None);
    };
    let payload = read_payload_into(r, &header, pool.take(header.payload_len as usize)).await?;
    Ok(Some(Frame { header, payload }))
}

/// Writes a frame: header, then the payload as is (no copy into a staging buffer for large ones).
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, frame: &Frame) -> io::Result<()> {
    w.write_all(&frame.header.encode()).await?;
    if !frame.payload.is_empty() {
        w.write_all(&frame.payload).await?;
    }
    Ok(())
}

impl fmt::Display for Header {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?}{} req {} block {} offset {} length {} payload {}{}",
            self.op,
            if self.response { " reply" } else { "" },
            self.request_id,
            self.block_id,
            self.offset,
            self.length,
            self.payload_len,
            if self.slot > 0 { format!(" slot {}", self.slot) } else { String::new() }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn round_trip(frame: &Frame) -> Frame {
        let mut wire = Vec::new();
        write_frame(&mut wire, frame).await.unwrap();
        assert_eq!(wire.len(), HEADER_LEN + frame.payload.len());
        read_frame(&mut &wire[..], MAX_PAYLOAD_BYTES).await.unwrap().unwrap()
    }

    #[test]
    fn remote_lease_round_trips_and_rejects_other_lengths() {
        let lease = RemoteLease { id: 7, addr: 0x7f00_1234_5000, rkey: 0xabcd_ef01, len: 1 << 20, crc: 0x1234_5678 };
        let wire = lease.encode();
        assert_eq!(wire.len(), RemoteLease::LEN);
        assert_eq!(RemoteLease::decode(&wire).unwrap(), lease);
        // A same-host Lease's payload is not an RDMA one, nor the other way round.
        let local = Lease { id: 7, offset: 4096 }.encode();
        assert!(matches!(RemoteLease::decode(&local), Err(FrameError::BadLease { bytes: 16 })));
        assert!(matches!(Lease::decode(&wire), Err(FrameError::BadLease { bytes: 28 })));
    }

    #[tokio::test]
    async fn frames_round_trip() {
        let data = Bytes::from((0..5000u32).map(|i| i as u8).collect::<Vec<_>>());
        for frame in [
            Frame::ping(1),
            Frame::write(2, 77, 4096, data.clone()),
            Frame::read(3, 77, 10, 20),
            Frame::free(4, &[1, 2, u64::MAX]),
            Frame::free_granted(8, &[(3, [7; GRANT_LEN])]),
            Frame::auth(9, 3, Bytes::from_static(b"token")),
            Frame::read(10, 77, 0, 1).authorized(MAX_SLOT, [0xab; GRANT_LEN]),
            Frame::reply(&Frame::read(5, 9, 0, 5).header, 5, Bytes::from_static(b"hello")),
            Frame::error(6, Op::Read, 9, ErrorKind::NotFound, "block 9 not held"),
        ] {
            assert_eq!(round_trip(&frame).await, frame);
        }
        let free = round_trip(&Frame::free(7, &[5, 6])).await;
        assert_eq!(free.free_ids().unwrap(), vec![5, 6]);
        let granted = round_trip(&Frame::free_granted(7, &[(5, [1; GRANT_LEN])])).await;
        assert_eq!(granted.free_entries().unwrap(), vec![(5, [1; GRANT_LEN])]);
        let authorized = round_trip(&Frame::write(11, 5, 0, data).authorized(7, [9; GRANT_LEN])).await;
        assert_eq!((authorized.header.slot, authorized.header.grant), (7, [9; GRANT_LEN]));
        // Replies carry neither.
        let reply = Frame::reply(&authorized.header, 0, Bytes::new());
        assert_eq!((reply.header.slot, reply.header.grant), (0, [0; GRANT_LEN]));
    }

    #[tokio::test]
    async fn segment_addresses_round_trip_in_the_block_header_fields() {
        let segment =
            SegmentAddress { shuffle: ShuffleId::from_wire(42), partition: PartitionIndex::from_wire(7), index: 3 };
        let push = round_trip(&Frame::push(1, segment, Bytes::from_static(b"batch"))).await;
        let fetch = round_trip(&Frame::fetch(2, segment, Bytes::from_static(b"request"))).await;
        assert_eq!((push.header.op, push.header.segment_address()), (Op::Push, segment));
        assert_eq!((fetch.header.op, fetch.header.segment_address()), (Op::Fetch, segment));
        // The wire is the block header's, unchanged: shuffle in block_id, partition in offset,
        // segment index in length.
        let raw = push.header.encode();
        assert_eq!(raw[16..24], 42u64.to_le_bytes());
        assert_eq!(raw[24..28], 7u32.to_le_bytes());
        assert_eq!(raw[28..32], 3u32.to_le_bytes());
    }

    #[tokio::test]
    async fn error_frames_carry_kind_and_message() {
        let frame = round_trip(&Frame::error(9, Op::Write, 3, ErrorKind::OutOfSpace, "dram tier full")).await;
        assert!(frame.header.response);
        assert_eq!(frame.into_result().unwrap_err(), (ErrorKind::OutOfSpace, "dram tier full".to_string()));
        let long = "é".repeat(MAX_ERROR_MESSAGE_BYTES);
        let frame = Frame::error(1, Op::Read, 0, ErrorKind::Invalid, &long);
        assert!(frame.payload.len() <= MAX_ERROR_MESSAGE_BYTES);
        assert!(std::str::from_utf8(&frame.payload).is_ok());
    }

    #[tokio::test]
    async fn short_garbage_is_refused_without_waiting_for_a_whole_header() {
        let err = read_header(&mut &b"GET / HTTP/1.1"[..], 1024).await.unwrap_err();
        assert!(matches!(err, FrameError::BadMagic([b'G', b'E'])), "{err}");
    }

    #[tokio::test]
    async fn clean_end_of_stream_is_none() {
        assert!(read_frame(&mut &[][..], 1024).await.unwrap().is_none());
    }

    #[test]
    fn garbage_is_refused() {
        let mut raw = Frame::ping(1).header.encode();
        raw[0] = b'X';
        assert!(matches!(Header::decode(&raw, 1024), Err(FrameError::BadMagic(_))));
        let mut raw = Frame::ping(1).header.encode();
        raw[2] = 9;
        assert!(matches!(Header::decode(&raw, 1024), Err(FrameError::UnsupportedVersion(9))));
        let mut raw = Frame::ping(1).header.encode();
        raw[20] ^= 1;
        let err = Header::decode(&raw, 1024).unwrap_err();
        assert!(matches!(err, FrameError::HeaderChecksum { .. }));
        assert!(err.is_fatal());
    }

    #[test]
    fn unknown_op_keeps_request_id_and_is_not_fatal() {
        let mut header = Frame::ping(42).header;
        header.payload_len = 3;
        let mut raw = header.encode();
        raw[3] = 0x33;
        let crc = crc32c::crc32c(&raw[..HEADER_LEN - 4]);
        raw[HEADER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
        let err = Header::decode(&raw, 1024).unwrap_err();
        assert!(matches!(err, FrameError::UnknownOp { op: 0x33, request_id: 42, payload_len: 3 }));
        assert!(!err.is_fatal());
    }

    #[test]
    fn oversized_payloads_are_refused_before_reading() {
        let frame = Frame::write(1, 1, 0, Bytes::from(vec![0u8; 2048]));
        let raw = frame.header.encode();
        let err = Header::decode(&raw, 1024).unwrap_err();
        assert!(matches!(err, FrameError::PayloadTooLarge { len: 2048, max: 1024 }));
        // The hard ceiling holds whatever the caller asks for.
        let mut header = frame.header;
        header.payload_len = u32::MAX;
        let err = Header::decode(&header.encode(), u32::MAX).unwrap_err();
        assert!(matches!(err, FrameError::PayloadTooLarge { max: MAX_PAYLOAD_BYTES, .. }));
    }

    #[tokio::test]
    async fn truncation_and_corruption_are_detected() {
        let frame = Frame::write(1, 1, 0, Bytes::from_static(b"0123456789"));
        let mut wire = Vec::new();
        write_frame(&mut wire, &frame).await.unwrap();
        for cut in [1, HEADER_LEN - 1, HEADER_LEN + 3] {
            let err = read_frame(&mut &wire[..cut], 1024).await.unwrap_err();
            assert!(matches!(err, FrameError::Truncated { .. }), "cut at {cut}: {err}");
        }
        let last = wire.len() - 1;
        wire[last] ^= 0xff;
        let err = read_frame(&mut &wire[..], 1024).await.unwrap_err();
        assert!(matches!(err, FrameError::PayloadChecksum { .. }));
        assert_eq!(err.kind(), ErrorKind::Corrupt);
    }

    #[test]
    fn bad_free_lists_are_refused() {
        let mut frame = Frame::free(1, &[1]);
        frame.payload = Bytes::from_static(b"123");
        assert!(frame.free_ids().is_err());
    }
}
