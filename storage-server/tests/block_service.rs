//! The block service over real TCP on loopback, without a metadata server: a store served by
//! `serve_blocks`, spoken to with real frames.

#![allow(clippy::unwrap_used, reason = "test support: helpers outside #[test] fns unwrap as the tests do")]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use tern_proto::frame::{self, Frame, Op, HEADER_LEN, MAX_PAYLOAD_BYTES};
use tern_proto::{BlockId, ErrorKind, ServerId};
use tern_storage::Limits;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

mod common;

use common::{call_err, call_ok, recv, send, serve, BS};

/// The stream ends (the server closed it) within a few seconds.
async fn assert_closed(stream: &mut TcpStream) {
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await;
    assert!(matches!(read, Ok(Ok(0))), "expected the server to close the connection, got {read:?}");
}

async fn ping(addr: SocketAddr) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let reply = call_ok(&mut stream, &Frame::ping(77)).await;
    assert!(reply.header.response);
    assert_eq!(reply.header.op, Op::Ping);
}

fn pattern(block: u64, chunk: u32, len: usize) -> Bytes {
    Bytes::from((0..len).map(|i| (block as usize * 31 + chunk as usize * 7 + i) as u8).collect::<Vec<_>>())
}

/// A header with a chosen op byte, checksummed like a real one.
fn raw_header(op_byte: u8, request_id: u64, payload_len: u32) -> [u8; HEADER_LEN] {
    let mut header = Frame::ping(request_id).header;
    header.payload_len = payload_len;
    let mut raw = header.encode();
    raw[3] = op_byte;
    let crc = crc32c::crc32c(&raw[..HEADER_LEN - 4]);
    raw[HEADER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
    raw
}

#[tokio::test]
async fn pipelined_writes_and_reads_round_trip() {
    let server = serve(8, Limits { max_connections: 8, max_in_flight_per_connection: 4 }).await;
    let stream = TcpStream::connect(server.addr).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    const CHUNK: u32 = 4096;
    const CHUNKS: u32 = BS / CHUNK;
    let blocks = 8u64;
    // Every request goes out before any reply is read: the server must pipeline, and push back
    // (it queues at most 4 replies) without losing or reordering anything.
    let sender = tokio::spawn(async move {
        let mut id = 0;
        for chunk in 0..CHUNKS {
            for block in 0..blocks {
                id += 1;
                frame::write_frame(
                    &mut wr,
                    &Frame::write(id, block, chunk * CHUNK, pattern(block, chunk, CHUNK as usize)),
                )
                .await
                .unwrap();
            }
        }
        for block in 0..blocks {
            for chunk in 0..CHUNKS {
                id += 1;
                frame::write_frame(&mut wr, &Frame::read(id, block, chunk * CHUNK, CHUNK)).await.unwrap();
            }
            id += 1;
            frame::write_frame(&mut wr, &Frame::read(id, block, 0, BS)).await.unwrap();
        }
        wr.flush().await.unwrap();
        wr
    });
    let mut id = 0;
    for chunk in 0..CHUNKS {
        for block in 0..blocks {
            id += 1;
            let reply = frame::read_frame(&mut rd, MAX_PAYLOAD_BYTES).await.unwrap().unwrap().into_result().unwrap();
            assert_eq!((reply.header.request_id, reply.header.op, reply.header.block_id), (id, Op::Write, block));
            assert_eq!(reply.header.length, (chunk + 1) * CHUNK, "block length after the write");
        }
    }
    for block in 0..blocks {
        let mut whole = Vec::new();
        for chunk in 0..CHUNKS {
            id += 1;
            let reply = frame::read_frame(&mut rd, MAX_PAYLOAD_BYTES).await.unwrap().unwrap().into_result().unwrap();
            assert_eq!((reply.header.request_id, reply.header.op), (id, Op::Read));
            assert_eq!(reply.header.length, BS);
            assert_eq!(reply.payload, pattern(block, chunk, CHUNK as usize));
            whole.extend_from_slice(&reply.payload);
        }
        id += 1;
        let reply = frame::read_frame(&mut rd, MAX_PAYLOAD_BYTES).await.unwrap().unwrap().into_result().unwrap();
        assert_eq!(reply.header.request_id, id);
        assert_eq!(reply.payload, whole);
        assert_eq!(reply.header.payload_crc, crc32c::crc32c(&whole));
    }
    drop(sender.await.unwrap());
    let usage = server.store.dram().usage();
    assert_eq!((usage.used_blocks, usage.used_bytes), (blocks, blocks * BS as u64));

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &server.registry).unwrap();
    let writes = blocks * CHUNKS as u64;
    for line in [
        format!("tern_storage_requests_total{{op=\"write\"}} {writes}"),
        format!("tern_storage_bytes_total{{op=\"write\"}} {}", blocks * BS as u64),
        format!("tern_storage_bytes_total{{op=\"read\"}} {}", 2 * blocks * BS as u64),
        format!("tern_storage_tier_used_bytes{{tier=\"dram\"}} {}", blocks * BS as u64),
        "tern_storage_blocks{tier=\"dram\"} 8".to_string(),
        "tern_storage_connections 1".to_string(),
    ] {
        assert!(text.contains(&line), "missing {line:?} in\n{text}");
    }
}

#[tokio::test]
async fn refused_requests_name_the_problem_and_keep_the_connection() {
    let server = serve(2, Limits::default()).await;
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    let (kind, message) = call_err(&mut s, &Frame::read(1, 9, 0, 10)).await;
    assert_eq!((kind, message.as_str()), (ErrorKind::NotFound, "block 9 is not held by storage server 3"));

    call_ok(&mut s, &Frame::write(2, 9, 0, Bytes::from_static(b"0123456789"))).await;
    let (kind, message) = call_err(&mut s, &Frame::write(3, 9, 4, Bytes::from_static(b"x"))).await;
    assert_eq!(kind, ErrorKind::Invalid);
    assert_eq!(message, "write at offset 4 to block 9 refused: block holds 10 bytes; blocks are append-only");
    let (kind, message) = call_err(&mut s, &Frame::write(4, 9, 10, Bytes::from(vec![0u8; BS as usize]))).await;
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains(&format!("range 10+{BS}")) && message.contains(&BS.to_string()), "{message}");
    let (kind, message) = call_err(&mut s, &Frame::read(5, 9, 8, 5)).await;
    assert_eq!(
        (kind, message.as_str()),
        (ErrorKind::Invalid, "read of block 9 range 8+5 is outside the block (it holds 10 bytes)")
    );

    // The tier holds two blocks.
    call_ok(&mut s, &Frame::write(6, 10, 0, Bytes::from_static(b"b"))).await;
    let (kind, message) = call_err(&mut s, &Frame::write(7, 11, 0, Bytes::from_static(b"c"))).await;
    assert_eq!((kind, message.as_str()), (ErrorKind::OutOfSpace, "dram tier full: 2 of 2 blocks in use"));

    // A reply frame sent as a request.
    let mut reply = Frame::reply(&Frame::read(8, 9, 0, 1).header, 1, Bytes::from_static(b"z"));
    reply.header.request_id = 8;
    let (kind, message) = call_err(&mut s, &reply).await;
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("requests only"), "{message}");

    // Free: the reply counts what was held; a bad list is refused without closing.
    let freed = call_ok(&mut s, &Frame::free(9, &[9, 10, 99])).await;
    assert_eq!(freed.header.length, 2);
    let mut bad = Frame::free(10, &[1]);
    bad.payload = Bytes::from_static(b"123");
    bad.header.payload_len = 3;
    bad.header.payload_crc = crc32c::crc32c(b"123");
    let (kind, message) = call_err(&mut s, &bad).await;
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("Free frame payload of 3 bytes"), "{message}");
    assert_eq!(call_err(&mut s, &Frame::read(11, 9, 0, 1)).await.0, ErrorKind::NotFound);
    call_ok(&mut s, &Frame::write(12, 11, 0, Bytes::from_static(b"room again"))).await;
    call_ok(&mut s, &Frame::ping(13)).await;
}

#[tokio::test]
async fn garbage_gets_an_error_frame_and_other_connections_carry_on() {
    let server = serve(2, Limits::default()).await;
    let mut idle = TcpStream::connect(server.addr).await.unwrap();
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    s.write_all(&[0x5a; 300]).await.unwrap();
    let (kind, message) = recv(&mut s).await.into_result().unwrap_err();
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("bad frame magic"), "{message}");
    assert_closed(&mut s).await;
    // A header with a broken checksum.
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    let mut raw = Frame::ping(1).header.encode();
    raw[20] ^= 1;
    s.write_all(&raw).await.unwrap();
    let (kind, message) = recv(&mut s).await.into_result().unwrap_err();
    assert_eq!(kind, ErrorKind::Corrupt);
    assert!(message.contains("header checksum"), "{message}");
    assert_closed(&mut s).await;

    ping(server.addr).await;
    call_ok(&mut idle, &Frame::ping(5)).await;
}

#[tokio::test]
async fn truncated_frames_get_a_truncated_error() {
    let server = serve(2, Limits::default()).await;
    // Half a header, then the end of the stream.
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    s.write_all(&Frame::ping(1).header.encode()[..20]).await.unwrap();
    s.shutdown().await.unwrap();
    let (kind, message) = recv(&mut s).await.into_result().unwrap_err();
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("truncated frame"), "{message}");
    assert_closed(&mut s).await;

    // A write whose payload stops short: the reply names the request, and nothing is stored.
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    let write = Frame::write(42, 6, 0, Bytes::from(vec![7u8; 1000]));
    s.write_all(&write.header.encode()).await.unwrap();
    s.write_all(&write.payload[..100]).await.unwrap();
    s.shutdown().await.unwrap();
    let reply = recv(&mut s).await;
    assert_eq!((reply.header.request_id, reply.header.op, reply.header.block_id), (42, Op::Write, 6));
    let (kind, message) = reply.into_result().unwrap_err();
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("truncated frame") && message.contains("block 6"), "{message}");
    assert_closed(&mut s).await;
    assert!(
        server.store.dram().read(BlockId::from_wire(6), 0, 0, ServerId::from_wire(3)).is_err(),
        "an unfinished first write must not leave a block"
    );
    assert_eq!(server.store.dram().usage().used_blocks, 0);
    ping(server.addr).await;
}

#[tokio::test]
async fn oversized_payloads_are_refused_before_reading() {
    let server = serve(2, Limits::default()).await;
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    let mut header = Frame::write(1, 1, 0, Bytes::from_static(b"x")).header;
    header.payload_len = BS + 1;
    s.write_all(&header.encode()).await.unwrap();
    let (kind, message) = recv(&mut s).await.into_result().unwrap_err();
    assert_eq!(kind, ErrorKind::Invalid);
    assert_eq!(message, format!("frame payload of {} bytes exceeds the limit of {BS} bytes", BS + 1));
    assert_closed(&mut s).await;
    ping(server.addr).await;
}

#[tokio::test]
async fn unknown_ops_are_answered_and_the_connection_keeps_working() {
    let server = serve(2, Limits::default()).await;
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    s.write_all(&raw_header(0x33, 42, 3)).await.unwrap();
    s.write_all(b"abc").await.unwrap();
    let reply = recv(&mut s).await;
    assert_eq!((reply.header.request_id, reply.header.op), (42, Op::Malformed));
    let (kind, message) = reply.into_result().unwrap_err();
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("unknown frame op 0x33"), "{message}");
    // The payload was skipped: the next frame is read from the right place.
    call_ok(&mut s, &Frame::write(43, 1, 0, Bytes::from_static(b"still here"))).await;
    let read = call_ok(&mut s, &Frame::read(44, 1, 0, 10)).await;
    assert_eq!(&read.payload[..], b"still here");
}

#[tokio::test]
async fn bad_payload_checksums_publish_nothing() {
    let server = serve(2, Limits::default()).await;
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    let mut write = Frame::write(1, 5, 0, Bytes::from_static(b"precious"));
    write.header.payload_crc ^= 1;
    let (kind, message) = call_err(&mut s, &write).await;
    assert_eq!(kind, ErrorKind::Corrupt);
    assert!(message.contains("block 5") && message.contains("checksum"), "{message}");
    assert_eq!(call_err(&mut s, &Frame::read(2, 5, 0, 0)).await.0, ErrorKind::NotFound);

    call_ok(&mut s, &Frame::write(3, 5, 0, Bytes::from_static(b"good"))).await;
    let mut append = Frame::write(4, 5, 4, Bytes::from_static(b"bad!"));
    append.header.payload_crc ^= 1;
    assert_eq!(call_err(&mut s, &append).await.0, ErrorKind::Corrupt);
    let (kind, message) = call_err(&mut s, &Frame::read(5, 5, 0, 8)).await;
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("holds 4 bytes"), "{message}");
    // The same connection retries the append correctly.
    call_ok(&mut s, &Frame::write(6, 5, 4, Bytes::from_static(b"data"))).await;
    assert_eq!(&call_ok(&mut s, &Frame::read(7, 5, 0, 8)).await.payload[..], b"gooddata");
}

#[tokio::test]
async fn connections_past_the_limit_are_told_and_closed() {
    let server = serve(2, Limits { max_connections: 2, max_in_flight_per_connection: 8 }).await;
    let mut first = TcpStream::connect(server.addr).await.unwrap();
    let mut second = TcpStream::connect(server.addr).await.unwrap();
    call_ok(&mut first, &Frame::ping(1)).await;
    call_ok(&mut second, &Frame::ping(1)).await;
    let mut third = TcpStream::connect(server.addr).await.unwrap();
    let reply = recv(&mut third).await;
    assert_eq!((reply.header.request_id, reply.header.op), (0, Op::Malformed));
    let (kind, message) = reply.into_result().unwrap_err();
    assert_eq!(kind, ErrorKind::Unavailable);
    assert!(message.contains("limit of 2 connections"), "{message}");
    assert_closed(&mut third).await;
    // Closing one makes room again (once the server has noticed).
    drop(first);
    let mut attempts = 0;
    loop {
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        send(&mut s, &Frame::ping(9)).await;
        if recv(&mut s).await.into_result().is_ok() {
            break;
        }
        attempts += 1;
        assert!(attempts < 100, "the closed connection never freed its place");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    call_ok(&mut second, &Frame::ping(2)).await;
}

#[tokio::test]
async fn a_freed_block_being_read_is_not_reused_until_sent() {
    // One block of room: a read reply in flight must keep the slot away from the next write.
    let server = serve(1, Limits::default()).await;
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    let data = pattern(1, 0, BS as usize);
    call_ok(&mut s, &Frame::write(1, 1, 0, data.clone())).await;
    let view = server.store.dram().read(BlockId::from_wire(1), 0, BS, ServerId::from_wire(3)).unwrap().data;
    assert_eq!(call_ok(&mut s, &Frame::free(2, &[1])).await.header.length, 1);
    assert_eq!(call_err(&mut s, &Frame::write(3, 2, 0, Bytes::from_static(b"x"))).await.0, ErrorKind::OutOfSpace);
    assert_eq!(view, data);
    drop(view);
    call_ok(&mut s, &Frame::write(4, 2, 0, Bytes::from_static(b"x"))).await;
}
