//! Push and Fetch over real TCP on loopback, without a metadata server: a store served by
//! `serve_blocks`, spoken to with real frames.

#![allow(clippy::unwrap_used, reason = "test support: helpers outside #[test] fns unwrap as the tests do")]

use bytes::{BufMut, Bytes, BytesMut};
use tern_proto::frame::{self, Frame, MAX_PAYLOAD_BYTES};
use tern_proto::shuffle::{batches, FetchRequest, FETCH_DONE, PUSH_HEADER_LEN};
use tern_proto::ErrorKind;
use tern_storage::Limits;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

mod common;

use common::{call_err, call_ok, connect, pushed_by, segment, wanted, Server, BS};

/// A block service with the default limits.
async fn serve(blocks: u64) -> Server {
    common::serve(blocks, Limits::default()).await
}

fn batch(map: u32, attempt: u32, n: u32, len: usize) -> Bytes {
    Bytes::from(
        (0..len).map(|i| (map as usize * 53 + attempt as usize * 11 + n as usize * 5 + i) as u8).collect::<Vec<_>>(),
    )
}

fn push_frame(id: u64, segment: (u64, u32, u32), map: u32, attempt: u32, data: &[u8]) -> Frame {
    let mut payload = BytesMut::with_capacity(PUSH_HEADER_LEN + data.len());
    payload.put_slice(&pushed_by(map, attempt).encode());
    payload.put_slice(data);
    Frame::push(id, common::segment(segment), payload.freeze())
}

fn fetch_frame(id: u64, segment: (u64, u32, u32), cursor: u32, max_bytes: u32, maps: &[(u32, u32)]) -> Frame {
    let request = FetchRequest { cursor, max_bytes, maps: wanted(maps) };
    Frame::fetch(id, common::segment(segment), request.encode())
}

/// The batches of a Fetch reply, each checked against its crc32c.
fn parse(reply: &Frame) -> Vec<(u32, u32, Bytes)> {
    batches(reply.payload.clone())
        .map(|batch| {
            let (header, bytes) = batch.expect("a well-formed page");
            assert_eq!(header.crc, crc32c::crc32c(&bytes), "batch of map {} fails its crc", header.map);
            (header.map.get(), header.attempt.get(), bytes)
        })
        .collect()
}

/// What a list of batches holds, short enough to print: map, attempt, length and crc of each.
fn summary(batches: &[(u32, u32, Bytes)]) -> Vec<(u32, u32, usize, u32)> {
    batches.iter().map(|(map, attempt, bytes)| (*map, *attempt, bytes.len(), crc32c::crc32c(bytes))).collect()
}

/// Fetches every committed batch, `max_bytes` a page; returns them and the number of pages.
async fn fetch_all(
    s: &mut TcpStream,
    segment: (u64, u32, u32),
    maps: &[(u32, u32)],
    max_bytes: u32,
) -> (Vec<(u32, u32, Bytes)>, usize) {
    let (mut cursor, mut all, mut pages) = (0, Vec::new(), 0);
    loop {
        let reply = call_ok(s, &fetch_frame(1000 + pages as u64, segment, cursor, max_bytes, maps)).await;
        let page = parse(&reply);
        pages += 1;
        assert!(pages < 10_000, "fetch never finished");
        if reply.header.length == FETCH_DONE {
            all.extend(page);
            return (all, pages);
        }
        assert!(!page.is_empty(), "a page that is not the last holds batches");
        assert_eq!(reply.header.length, cursor + page.len() as u32);
        cursor = reply.header.length;
        all.extend(page);
    }
}

#[tokio::test]
async fn pushed_batches_are_fetched_by_committed_attempt_in_pages() {
    let server = serve(16).await;
    let mut s = connect(server.addr).await;
    let seg = (7, 3, 0);
    // Map 0's first attempt (its executor was lost), its second, and map 1, interleaved.
    let pushes = [(0, 0, 3000), (1, 0, 500), (0, 1, 20_000), (0, 0, 700), (1, 0, 40_000), (0, 1, 9), (2, 0, 100)];
    let mut size = 0;
    for (n, (map, attempt, len)) in pushes.into_iter().enumerate() {
        let reply =
            call_ok(&mut s, &push_frame(n as u64, seg, map, attempt, &batch(map, attempt, n as u32, len))).await;
        size += len as u32;
        assert_eq!(reply.header.length, size, "the segment's size after push {n}");
    }
    // The largest batch: a block less the header it is stored behind.
    let largest = batch(3, 0, 99, (BS as usize) - tern_proto::shuffle::BATCH_HEADER_LEN);
    call_ok(&mut s, &push_frame(50, seg, 3, 0, &largest)).await;

    let committed = [(0, 1), (1, 0), (3, 0)];
    let want = vec![
        (0, 1, batch(0, 1, 2, 20_000)),
        (0, 1, batch(0, 1, 5, 9)),
        (1, 0, batch(1, 0, 1, 500)),
        (1, 0, batch(1, 0, 4, 40_000)),
        (3, 0, largest.clone()),
    ];
    // One page; pages of one batch each; pages of whole batches up to 30,000 bytes (20,557 bytes,
    // then the 40,000-byte batch alone, then the largest alone). Every batch exactly once, in the
    // same order.
    for (max_bytes, want_pages) in [(1 << 30, 1), (1, 5), (30_000, 3)] {
        let (all, pages) = fetch_all(&mut s, seg, &committed, max_bytes).await;
        assert_eq!(summary(&all), summary(&want), "pages of {max_bytes} bytes");
        assert!(all == want, "pages of {max_bytes} bytes: the bytes differ");
        assert_eq!(pages, want_pages, "pages of {max_bytes} bytes");
    }
    // Nothing committed here: an empty page that says done.
    let reply = call_ok(&mut s, &fetch_frame(60, seg, 0, 1 << 20, &[(0, 5), (9, 0)])).await;
    assert_eq!((reply.payload.len(), reply.header.length), (0, FETCH_DONE));

    let usage = server.store.dram().usage();
    // Every batch is stored behind its 16-byte header.
    let stored_headers = (pushes.len() as u64 + 1) * tern_proto::shuffle::BATCH_HEADER_LEN as u64;
    assert_eq!(usage.used_bytes, u64::from(size) + largest.len() as u64 + stored_headers);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &server.registry).unwrap();
    for line in [
        "tern_storage_requests_total{op=\"push\"} 8".to_string(),
        format!("tern_storage_bytes_total{{op=\"push\"}} {}", usage.used_bytes - stored_headers),
        "tern_storage_requests_total{op=\"fetch\"} 10".to_string(),
        "tern_storage_shuffle_segments 1".to_string(),
        format!("tern_storage_tier_used_bytes{{tier=\"dram\"}} {}", usage.used_bytes),
        format!("tern_storage_blocks{{tier=\"dram\"}} {}", usage.used_blocks),
    ] {
        assert!(text.contains(&line), "missing {line:?} in\n{text}");
    }
}

#[tokio::test]
async fn refused_shuffle_requests_name_the_problem_and_keep_the_connection() {
    let server = serve(2).await;
    let mut s = connect(server.addr).await;
    let (kind, message) = call_err(&mut s, &fetch_frame(1, (9, 1, 2), 0, 1 << 20, &[(0, 0)])).await;
    assert_eq!(
        (kind, message.as_str()),
        (ErrorKind::NotFound, "shuffle 9 partition 1 segment 2 is not held by storage server 3")
    );

    // Malformed Fetch payloads: too short, and maps out of order.
    let mut bad = Frame::fetch(2, segment((9, 1, 2)), Bytes::from_static(b"12345"));
    let (kind, message) = call_err(&mut s, &bad).await;
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("Fetch request") && message.contains("req 2"), "{message}");
    bad = fetch_frame(3, (9, 1, 2), 0, 1, &[]);
    let mut payload = BytesMut::from(&bad.payload[..]);
    payload.put_slice(&[5, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0]);
    bad = Frame::fetch(3, segment((9, 1, 2)), payload.freeze());
    let (kind, message) = call_err(&mut s, &bad).await;
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("not strictly ascending"), "{message}");
    call_ok(&mut s, &Frame::ping(4)).await;

    // A Push with no batch, and one whose payload was damaged in flight: nothing is stored.
    let (kind, message) = call_err(&mut s, &Frame::push(5, segment((9, 1, 2)), Bytes::from_static(b"8 bytes!"))).await;
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("holds no batch"), "{message}");
    let mut damaged = push_frame(6, (9, 1, 2), 0, 0, b"records");
    damaged.header.payload_crc ^= 1;
    assert_eq!(call_err(&mut s, &damaged).await.0, ErrorKind::Corrupt);
    assert_eq!(call_err(&mut s, &fetch_frame(7, (9, 1, 2), 0, 1 << 20, &[(0, 0)])).await.0, ErrorKind::NotFound);
    assert_eq!(server.store.dram().usage().used_blocks, 0);
    call_ok(&mut s, &Frame::ping(8)).await;

    // Two blocks of room: a third segment is refused, naming it and the tier's use.
    call_ok(&mut s, &push_frame(9, (9, 1, 2), 0, 0, b"one")).await;
    call_ok(&mut s, &push_frame(10, (9, 1, 3), 0, 0, b"two")).await;
    let (kind, message) = call_err(&mut s, &push_frame(11, (9, 2, 0), 0, 0, b"three")).await;
    assert_eq!(
        (kind, message.as_str()),
        (
            ErrorKind::OutOfSpace,
            "push to shuffle 9 partition 2 segment 0 refused: dram tier full: 2 of 2 blocks in use"
        )
    );
    // File blocks share the arena with shuffle data.
    assert_eq!(call_err(&mut s, &Frame::write(12, 1, 0, Bytes::from_static(b"x"))).await.0, ErrorKind::OutOfSpace);
    // A cursor past the end is refused.
    let (kind, message) = call_err(&mut s, &fetch_frame(13, (9, 1, 2), 2, 1 << 20, &[(0, 0)])).await;
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("cursor 2 is past the 1 batches"), "{message}");
    call_ok(&mut s, &Frame::ping(14)).await;
}

#[tokio::test]
async fn a_fetch_may_list_more_maps_than_a_block_holds() {
    let server = serve(2).await;
    let mut s = connect(server.addr).await;
    let seg = (1, 0, 0);
    call_ok(&mut s, &push_frame(1, seg, 20_000, 0, b"map 20000")).await;
    call_ok(&mut s, &push_frame(2, seg, 5, 0, b"map 5")).await;
    // 20,001 pairs: 160 KB of request, more than a 64 KiB block.
    let maps: Vec<(u32, u32)> = (0..=20_000).map(|map| (map, 0)).collect();
    let (all, _) = fetch_all(&mut s, seg, &maps, 1 << 20).await;
    let want = vec![(5, 0, Bytes::from_static(b"map 5")), (20_000, 0, Bytes::from_static(b"map 20000"))];
    assert_eq!(all, want);
    // Any other op's payload is still bounded by the block size, and refused before it is read.
    let mut header = push_frame(3, seg, 0, 0, b"x").header;
    header.payload_len = BS + 1;
    s.write_all(&header.encode()).await.unwrap();
    let reply = frame::read_frame(&mut s, MAX_PAYLOAD_BYTES).await.unwrap().unwrap();
    let (kind, message) = reply.into_result().unwrap_err();
    assert_eq!(kind, ErrorKind::Invalid);
    assert_eq!(message, format!("frame payload of {} bytes exceeds the limit of {BS} bytes", BS + 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_pushes_from_many_connections_serialise_per_segment() {
    let server = serve(64).await;
    let shared = (2, 0, 0);
    let tasks: Vec<_> = (0..4u32)
        .map(|map| {
            let addr = server.addr;
            tokio::spawn(async move {
                let stream = connect(addr).await;
                let (mut rd, mut wr) = stream.into_split();
                // Pipelined: every push is sent before its reply is read.
                let sender = tokio::spawn(async move {
                    for n in 0..100u32 {
                        let data = batch(map, 0, n, 1 + (n as usize * 211) % 3000);
                        frame::write_frame(&mut wr, &push_frame(u64::from(n), shared, map, 0, &data)).await.unwrap();
                        let own = (2, 1 + map, 0);
                        frame::write_frame(&mut wr, &push_frame(u64::from(n), own, map, 0, &data)).await.unwrap();
                    }
                    wr
                });
                for _ in 0..200 {
                    let reply = frame::read_frame(&mut rd, MAX_PAYLOAD_BYTES).await.unwrap().unwrap();
                    reply.into_result().unwrap();
                }
                drop(sender.await.unwrap());
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let mut s = connect(server.addr).await;
    let maps: Vec<_> = (0..4).map(|map| (map, 0)).collect();
    let (all, _) = fetch_all(&mut s, shared, &maps, 16 << 10).await;
    assert_eq!(all.len(), 400);
    for map in 0..4u32 {
        let want: Vec<_> = (0..100u32).map(|n| (map, 0, batch(map, 0, n, 1 + (n as usize * 211) % 3000))).collect();
        let of_map: Vec<_> = all.iter().filter(|(m, _, _)| *m == map).cloned().collect();
        assert_eq!(summary(&of_map), summary(&want), "map {map}: every batch once, in push order");
        let own = fetch_all(&mut s, (2, 1 + map, 0), &maps, 1 << 20).await.0;
        assert_eq!(summary(&own), summary(&want), "map {map}'s own segment");
    }
    assert_eq!(server.store.shuffle_segments(), 5);
}
