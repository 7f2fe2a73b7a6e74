//! The block service under arbitrary input, for the fuzz targets (`fuzz/`) and the bounded
//! property test (`tests/bad_frames.rs`).
//!
//! [`script_to_wire`] turns arbitrary bytes into a stream of block frames that are mostly well
//! formed (right magic, version and checksums, small block ids, so requests reach the store and
//! meet each other: writes at wrong offsets, reads past the end, fetches before pushes, frees of
//! unknown ids) and then, as the script says, corrupted: a bit flipped, the payload length
//! replaced (oversized or short), the stream cut mid-frame, or raw bytes in between.
//! [`serve_script`] feeds such a stream to the real connection handler over an in-memory duplex
//! and checks what must hold whatever the input:
//! - every byte the server sends back is a well-formed reply frame (the stream is never left
//!   mid-frame); every error reply carries a known kind and a message;
//! - the server then still serves a new connection (a Ping, a Write and a Read of it).
//!
//! Not part of the server's API: hidden from its docs, used by tests and fuzzing only.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use futures::future::BoxFuture;
use tern_proto::frame::{self, Frame, Header, Op, HEADER_LEN, MAX_PAYLOAD_BYTES};
use tern_proto::shuffle::{FetchRequest, PushHeader, SegmentAddress};
use tern_proto::{ErrorKind, MapAttempt, MapIndex, PartitionIndex, ShuffleId, StorageClass, NVME_BLOCK_BIT};
use tern_transport::{Listener, Stream};
use tokio::io::{AsyncWriteExt, DuplexStream};
use tokio::sync::mpsc;

use crate::{serve_blocks, BlockStore, Limits, Metrics};

/// Block size of the store [`serve_script`] serves: small, so that scripts fill blocks.
pub const FUZZ_BLOCK_SIZE: u32 = 4096;
/// Blocks in that store: few, so that scripts fill the tier.
pub const FUZZ_BLOCKS: u64 = 8;
/// Longest a script's exchange may take before it counts as a hang.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);

/// Reads a script: bytes taken in order, zero once they run out.
struct Script<'a> {
    data: &'a [u8],
}

impl Script<'_> {
    fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }

    fn take(&mut self, n: usize) -> &[u8] {
        let (head, rest) = self.data.split_at(n.min(self.data.len()));
        self.data = rest;
        head
    }
}

/// The request a script step makes, before any corruption.
fn request(s: &mut Script<'_>, request_id: u64) -> Frame {
    let op = s.byte();
    // Few block ids and shuffle segments, so that requests meet the same ones.
    let mut block = u64::from(s.byte() % 4);
    if op & 0x80 != 0 {
        block |= NVME_BLOCK_BIT;
    }
    // Offsets near the block's current length or past its end.
    let offset = u32::from(s.u16()) % (2 * FUZZ_BLOCK_SIZE);
    let len = usize::from(s.u16()) % (FUZZ_BLOCK_SIZE as usize + 64);
    let fill = s.byte();
    let data = || Bytes::from((0..len).map(|i| fill.wrapping_add(i as u8)).collect::<Vec<_>>());
    match op % 8 {
        0 => Frame::ping(request_id),
        1 | 2 => Frame::write(request_id, block, offset, data()),
        3 => Frame::read(request_id, block, offset, len as u32),
        4 => {
            let ids: Vec<u64> =
                (0..s.byte() % 6).map(|i| if i % 2 == 0 { u64::from(i) } else { s.u32().into() }).collect();
            Frame::free(request_id, &ids)
        }
        5 => {
            let class = StorageClass::from_code(s.byte() % 3).expect("codes 0 to 2 are classes");
            let map = MapIndex::from_wire(u32::from(s.byte() % 4));
            let header = PushHeader { map, attempt: MapAttempt::from_wire(u32::from(s.byte() % 2)), class };
            let mut payload = BytesMut::from(&header.encode()[..]);
            payload.put_slice(&data()[..len.min(FUZZ_BLOCK_SIZE as usize / 2)]);
            Frame::push(request_id, segment(s, block), payload.freeze())
        }
        6 => {
            let mut maps = Vec::new();
            for _ in 0..s.byte() % 5 {
                let map = MapIndex::from_wire(u32::from(s.byte() % 8));
                maps.push((map, MapAttempt::from_wire(u32::from(s.byte() % 2))));
            }
            // Mostly ascending (valid), sometimes not.
            if !s.byte().is_multiple_of(4) {
                maps.sort_unstable();
                maps.dedup_by_key(|m| m.0);
            }
            let request = FetchRequest { cursor: s.u32() % 64, max_bytes: s.u32(), maps }.encode();
            Frame::fetch(request_id, segment(s, block), request)
        }
        _ => {
            // Any op byte, response bit included, with a payload.
            let mut frame = Frame::write(request_id, block, offset, data());
            frame.header.op = Op::from_code(s.byte() & 0x7f).unwrap_or(Op::Ping);
            frame.header.response = s.byte().is_multiple_of(2);
            frame
        }
    }
}

/// Recomputes a raw header's crc, so that a field changed after encoding still passes the check.
/// A segment of shuffle `block` (the script's block number doubles as the shuffle): partition
/// and index each 0 or 1, read in that order.
fn segment(s: &mut Script<'_>, block: u64) -> SegmentAddress {
    let partition = PartitionIndex::from_wire(u32::from(s.byte() % 2));
    SegmentAddress { shuffle: ShuffleId::from_wire(block), partition, index: u32::from(s.byte() % 2) }
}

fn reseal(raw: &mut [u8]) {
    let crc = crc32c::crc32c(&raw[..HEADER_LEN - 4]);
    raw[HEADER_LEN - 4..HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
}

/// Turns arbitrary bytes into a byte stream of block frames, as the module doc describes.
pub fn script_to_wire(data: &[u8]) -> Vec<u8> {
    let mut s = Script { data };
    let mut wire = Vec::new();
    let mut request_id = 0u64;
    while !s.data.is_empty() {
        let tag = s.byte();
        if tag.is_multiple_of(16) {
            // Raw bytes in between frames: garbage where a header should be.
            let n = usize::from(s.byte() % 64);
            wire.extend_from_slice(s.take(n));
            continue;
        }
        request_id += 1;
        let frame = request(&mut s, request_id);
        let mut raw = frame.header.encode().to_vec();
        raw.extend_from_slice(&frame.payload);
        // Most frames go as they are, so that requests meet each other; a quarter are corrupted.
        match tag % 16 {
            1 => {
                // A wrong payload length, the header still checksummed: oversized (refused before
                // reading), or shorter or longer than what follows (the stream loses its footing).
                let len = match s.byte() % 4 {
                    0 => MAX_PAYLOAD_BYTES + 1,
                    1 => u32::MAX,
                    2 => FUZZ_BLOCK_SIZE + 1,
                    _ => u32::from(s.u16()),
                };
                raw[32..36].copy_from_slice(&len.to_le_bytes());
                reseal(&mut raw);
            }
            2 | 3 => {
                // A bit flipped anywhere: header (caught by its crc, unless resealed) or payload.
                let at = usize::from(s.u16()) % raw.len();
                raw[at] ^= 1 << (s.byte() % 8);
                if tag & 0x10 != 0 && at < HEADER_LEN - 4 {
                    reseal(&mut raw);
                }
            }
            4 => {
                // Cut mid-frame: the stream ends here.
                let at = usize::from(s.u16()) % raw.len();
                wire.extend_from_slice(&raw[..at]);
                break;
            }
            _ => {}
        }
        wire.extend_from_slice(&raw);
    }
    wire
}

/// A [`Listener`] whose streams are in-memory duplexes handed over a channel.
struct DuplexListener {
    incoming: mpsc::Receiver<DuplexStream>,
}

const FAKE_PEER: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 1);

impl Listener for DuplexListener {
    fn accept(&mut self) -> BoxFuture<'_, io::Result<Stream>> {
        Box::pin(async move {
            match self.incoming.recv().await {
                Some(stream) => {
                    let (reader, writer) = tokio::io::split(stream);
                    Ok(Stream {
                        reader: Box::new(reader),
                        writer: Box::new(writer),
                        peer: FAKE_PEER,
                        local: None,
                        one_sided: None,
                    })
                }
                // Nobody connects any more: wait for the service to be dropped.
                None => std::future::pending().await,
            }
        })
    }

    fn local_addr(&self) -> SocketAddr {
        FAKE_PEER
    }

    fn name(&self) -> &'static str {
        "duplex"
    }
}

/// What the server answered to one script.
#[derive(Debug, Default)]
pub struct Exchange {
    /// Reply frames received.
    pub replies: usize,
    /// Of those, error replies.
    pub errors: usize,
}

/// Serves a fresh store of [`FUZZ_BLOCKS`] blocks over an in-memory connection, sends it `wire`
/// (then ends the stream), reads every reply, and checks that a second connection is served.
/// Panics with the reason when a check of the module doc fails. Runs on the caller's runtime.
pub async fn serve_script(wire: &[u8]) -> Exchange {
    let store = Arc::new(BlockStore::new(FUZZ_BLOCK_SIZE, FUZZ_BLOCKS * u64::from(FUZZ_BLOCK_SIZE)).expect("a store"));
    store.set_server_id(tern_proto::ServerId::from_wire(1));
    let metrics = Metrics::register(&mut prometheus_client::registry::Registry::default());
    let (connect, incoming) = mpsc::channel(2);
    let limits = Limits { max_connections: 4, max_in_flight_per_connection: 4 };
    let server = tokio::spawn(serve_blocks(DuplexListener { incoming }, store, limits, metrics));
    let exchange = tokio::time::timeout(EXCHANGE_TIMEOUT, async {
        let exchange = exchange(&connect, wire.to_vec()).await;
        still_serves(&connect).await;
        exchange
    })
    .await
    .expect("the server answered the script and a new connection within 10 s");
    server.abort();
    exchange
}

/// Sends `wire` on a new connection while reading the replies, until the server closes it.
async fn exchange(connect: &mpsc::Sender<DuplexStream>, wire: Vec<u8>) -> Exchange {
    let (client, server) = tokio::io::duplex(256 << 10);
    connect.send(server).await.expect("the service is accepting");
    let (mut rd, mut wr) = tokio::io::split(client);
    // Written from its own task: the server stops reading while its replies are not read.
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(&wire).await;
        let _ = wr.shutdown().await;
    });
    let mut exchange = Exchange::default();
    loop {
        match frame::read_frame(&mut rd, MAX_PAYLOAD_BYTES).await {
            Ok(Some(reply)) => {
                check_reply(&reply.header, &reply.payload);
                exchange.replies += 1;
                if reply.header.status != 0 {
                    exchange.errors += 1;
                }
            }
            Ok(None) => break,
            Err(e) => panic!("the server sent something other than whole reply frames: {e}"),
        }
    }
    let _ = writer.await;
    exchange
}

fn check_reply(h: &Header, payload: &[u8]) {
    assert!(h.response, "the server sent a request frame: {h}");
    if h.status != 0 {
        assert!(ErrorKind::from_code(h.status).is_some(), "error reply with unknown status {}: {h}", h.status);
        let message = std::str::from_utf8(payload).expect("error messages are UTF-8");
        assert!(!message.trim().is_empty(), "error reply without a message: {h}");
    }
}

/// A new connection gets a Ping, a Write of a fresh block and its Read answered.
async fn still_serves(connect: &mpsc::Sender<DuplexStream>) {
    let (client, server) = tokio::io::duplex(64 << 10);
    connect.send(server).await.expect("the service is accepting");
    let (mut rd, mut wr) = tokio::io::split(client);
    // A block id no script uses (they use 0..4), so the tier has room unless scripts filled it.
    let data = Bytes::from_static(b"still serving");
    for request in [Frame::ping(1), Frame::write(2, 1000, 0, data.clone()), Frame::read(3, 1000, 0, data.len() as u32)]
    {
        frame::write_frame(&mut wr, &request).await.expect("sending to the server");
        let reply = frame::read_frame(&mut rd, MAX_PAYLOAD_BYTES).await.expect("a reply").expect("not the end");
        assert_eq!(reply.header.request_id, request.header.request_id);
        match reply.into_result() {
            Ok(reply) if request.header.op == Op::Read => assert_eq!(reply.payload, data),
            Ok(_) => {}
            // The scripts may have filled the small tier with their blocks; that is an answer too.
            Err((ErrorKind::OutOfSpace, _)) if request.header.op == Op::Write => return,
            Err(e) => panic!("a good request after the script was refused: {e:?}"),
        }
    }
}
