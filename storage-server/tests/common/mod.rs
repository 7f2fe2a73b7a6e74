//! A block service on a loopback port (no metadata server) and helpers that speak real frames
//! to it, shared by the storage server's TCP tests.

#![allow(dead_code)] // each test binary uses a different part of it

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tern_proto::frame::{self, Frame, MAX_PAYLOAD_BYTES};
use tern_proto::shuffle::{PushHeader, SegmentAddress};
use tern_proto::{ErrorKind, MapAttempt, MapIndex, PartitionIndex, ShuffleId, StorageClass};
use tern_storage::{serve_blocks, BlockStore, Limits, Metrics};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

pub const BS: u32 = 64 << 10;

/// Segment `index` of partition `partition` of shuffle `shuffle`, as Push and Fetch address it.
pub fn segment((shuffle, partition, index): (u64, u32, u32)) -> SegmentAddress {
    SegmentAddress { shuffle: ShuffleId::from_wire(shuffle), partition: PartitionIndex::from_wire(partition), index }
}

/// The header of a batch that attempt `attempt` of map `map` pushes to an `any` shuffle.
pub fn pushed_by(map: u32, attempt: u32) -> PushHeader {
    PushHeader { map: MapIndex::from_wire(map), attempt: MapAttempt::from_wire(attempt), class: StorageClass::Any }
}

/// The `(map, attempt)` pairs a Fetch lists.
pub fn wanted(maps: &[(u32, u32)]) -> Vec<(MapIndex, MapAttempt)> {
    maps.iter().map(|&(map, attempt)| (MapIndex::from_wire(map), MapAttempt::from_wire(attempt))).collect()
}

pub struct Server {
    pub addr: SocketAddr,
    pub store: Arc<BlockStore>,
    pub registry: Registry,
    task: JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A block service of `blocks` blocks of `BS` bytes, as storage server 3.
pub async fn serve(blocks: u64, limits: Limits) -> Server {
    let store = Arc::new(BlockStore::new(BS, blocks * BS as u64).unwrap());
    store.set_server_id(tern_proto::ServerId::from_wire(3));
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(serve_blocks(listener, store.clone(), limits, metrics));
    Server { addr, store, registry, task }
}

/// A client connection; without Nagle's delay, as the real client's are.
pub async fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

pub async fn send(stream: &mut TcpStream, frame: &Frame) {
    frame::write_frame(stream, frame).await.unwrap();
}

pub async fn recv(stream: &mut TcpStream) -> Frame {
    tokio::time::timeout(Duration::from_secs(10), frame::read_frame(stream, MAX_PAYLOAD_BYTES))
        .await
        .expect("a reply within 10 s")
        .expect("a well-formed reply")
        .expect("a reply, not the end of the stream")
}

/// Sends `request` and returns its reply, which must answer it (same request id and op).
pub async fn call(stream: &mut TcpStream, request: &Frame) -> Result<Frame, (ErrorKind, String)> {
    send(stream, request).await;
    let reply = recv(stream).await;
    assert_eq!((reply.header.request_id, reply.header.op), (request.header.request_id, request.header.op));
    reply.into_result()
}

pub async fn call_ok(stream: &mut TcpStream, request: &Frame) -> Frame {
    call(stream, request).await.unwrap_or_else(|(kind, message)| panic!("{kind}: {message}"))
}

/// Sends `request` and returns the error kind and message of its reply.
pub async fn call_err(stream: &mut TcpStream, request: &Frame) -> (ErrorKind, String) {
    call(stream, request).await.expect_err("an error reply")
}
