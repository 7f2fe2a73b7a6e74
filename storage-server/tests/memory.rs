//! Open connections must stay cheap: beyond the arena, 100 connections that have each done some
//! work cost well under 64 MiB. A test binary of its own, so no other test's memory is counted.

#![allow(clippy::unwrap_used, reason = "test support: helpers outside #[test] fns unwrap as the tests do")]

use std::sync::Arc;

use bytes::Bytes;
use prometheus_client::registry::Registry;
use tern_proto::frame::{self, Frame, MAX_PAYLOAD_BYTES};
use tern_storage::{serve_blocks, BlockStore, Limits, Metrics};
use tokio::net::{TcpListener, TcpStream};

/// Resident set size of this process, from /proc.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_connections_cost_little_memory() {
    const BS: u32 = 1 << 20;
    let store = Arc::new(BlockStore::new(BS, 4 * BS as u64).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let metrics = Metrics::register(&mut Registry::default());
    let server = tokio::spawn(serve_blocks(listener, store, Limits::default(), metrics));

    // Fault the arena in and warm up the allocator and runtime first, so only connections count.
    let mut warm = TcpStream::connect(addr).await.unwrap();
    let block = Bytes::from(vec![1u8; BS as usize]);
    for id in 0..4u64 {
        frame::write_frame(&mut warm, &Frame::write(id, id, 0, block.clone())).await.unwrap();
        frame::read_frame(&mut warm, MAX_PAYLOAD_BYTES).await.unwrap().unwrap().into_result().unwrap();
    }
    let before = rss_bytes();

    let mut connections = Vec::new();
    for i in 0..100u64 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        // Every connection has moved a full block each way, so its buffers are as large as they get.
        frame::write_frame(&mut s, &Frame::read(i, i % 4, 0, BS)).await.unwrap();
        let reply = frame::read_frame(&mut s, MAX_PAYLOAD_BYTES).await.unwrap().unwrap().into_result().unwrap();
        assert_eq!(reply.payload.len(), BS as usize);
        drop(reply);
        frame::write_frame(&mut s, &Frame::ping(i)).await.unwrap();
        frame::read_frame(&mut s, MAX_PAYLOAD_BYTES).await.unwrap().unwrap().into_result().unwrap();
        connections.push(s);
    }
    let grown = rss_bytes().saturating_sub(before);
    eprintln!("100 open connections grew RSS by {} KiB", grown / 1024);
    assert!(grown < 16 << 20, "100 idle connections cost {} MiB", grown >> 20);
    drop(connections);
    server.abort();
}
