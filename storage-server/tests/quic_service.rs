//! The block service over QUIC and TCP at once: the same frames on both, one connection limit.

#![allow(clippy::unwrap_used, reason = "test support: helpers outside #[test] fns unwrap as the tests do")]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use prometheus_client::registry::Registry;
use tern_proto::frame::{self, Frame, MAX_PAYLOAD_BYTES};
use tern_proto::ErrorKind;
use tern_storage::{serve_block_listeners, BlockStore, Limits, Metrics};
use tern_transport::quic::{QuicConnector, QuicListener, QuicTuning};
use tern_transport::tcp::TcpConnector;
use tern_transport::tls::{self, TlsMaterial};
use tern_transport::{Connector, Listener, Stream};

const BS: u32 = 1 << 20;

async fn call(stream: &mut Stream, request: &Frame) -> Result<Frame, (ErrorKind, String)> {
    frame::write_frame(&mut stream.writer, request).await.unwrap();
    tokio::io::AsyncWriteExt::flush(&mut stream.writer).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(10), frame::read_frame(&mut stream.reader, MAX_PAYLOAD_BYTES))
        .await
        .expect("a reply within 10 s")
        .expect("a well-formed reply")
        .expect("a reply, not the end of the stream");
    reply.into_result()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_written_over_quic_read_back_over_both_and_the_limit_is_shared() {
    let dir = tempfile::tempdir().unwrap();
    tls::init(dir.path(), &tls::InitOptions::default()).unwrap();
    let material = TlsMaterial::load(dir.path()).unwrap();
    let store = Arc::new(BlockStore::new(BS, 8 * BS as u64).unwrap());
    store.set_server_id(tern_proto::ServerId::from_wire(1));
    let metrics = Metrics::register(&mut Registry::default());
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp_addr = tcp.local_addr().unwrap().to_string();
    let tuning = QuicTuning { endpoints: 2, ..QuicTuning::default() };
    let quic = QuicListener::bind("127.0.0.1:0".parse().unwrap(), &material, &tuning, 16).unwrap();
    let quic_addr = quic.local_addr().to_string();
    let limits = Limits { max_connections: 3, ..Limits::default() };
    let listeners: Vec<Box<dyn Listener>> = vec![Box::new(tcp), Box::new(quic)];
    let server = tokio::spawn(serve_block_listeners(listeners, store.clone(), limits, metrics));

    let connector = QuicConnector::new(&material, &tuning).unwrap();
    let mut over_quic = connector.connect(&quic_addr).await.unwrap();
    let mut over_tcp = TcpConnector.connect(&tcp_addr).await.unwrap();
    // Several full blocks over QUIC, each read back over QUIC and over TCP.
    for block in 0..4u64 {
        let data: Bytes = (0..BS).map(|i| (i as u64 * 31 + block) as u8).collect::<Vec<u8>>().into();
        call(&mut over_quic, &Frame::write(block + 1, block, 0, data.clone())).await.unwrap();
        let back = call(&mut over_quic, &Frame::read(100 + block, block, 0, BS)).await.unwrap();
        assert_eq!(back.payload, data);
        let back = call(&mut over_tcp, &Frame::read(200 + block, block, 0, BS)).await.unwrap();
        assert_eq!(back.payload, data);
    }

    // Two connections are open; a third (QUIC) fits, a fourth (TCP) is told the limit.
    let mut third = connector.connect(&quic_addr).await.unwrap();
    call(&mut third, &Frame::ping(1)).await.unwrap();
    let mut fourth = TcpConnector.connect(&tcp_addr).await.unwrap();
    let (kind, message) = call(&mut fourth, &Frame::ping(1)).await.unwrap_err();
    assert_eq!(kind, ErrorKind::Unavailable);
    assert!(message.contains("limit of 3 connections"), "{message}");
    // Closing the QUIC stream frees its place.
    drop(third);
    let mut fifth = None;
    for _ in 0..50 {
        let mut stream = connector.connect(&quic_addr).await.unwrap();
        if call(&mut stream, &Frame::ping(2)).await.is_ok() {
            fifth = Some(stream);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(fifth.is_some(), "a closed QUIC stream never gave its place back");
    server.abort();
}
