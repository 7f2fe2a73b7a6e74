//! `start` against a stand-in metadata server (a scripted Registry service): registration with
//! retries, heartbeats carrying frees (of blocks and shuffles) and their acknowledgement,
//! re-registration, metrics, shutdown.

#![allow(clippy::unwrap_used, reason = "test support: helpers outside #[test] fns unwrap as the tests do")]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tern_common::config::Serve;
use tern_common::ByteSize;
use tern_proto::frame::{self, Frame, Op, MAX_PAYLOAD_BYTES};
use tern_proto::shuffle::{FetchRequest, PushHeader, SegmentAddress};
use tern_proto::token::{GrantKind, TokenKey, VOLUME_SERIAL};
use tern_proto::v1::registry_server::{Registry, RegistryServer};
use tern_proto::v1::{
    HeartbeatRequest, HeartbeatResponse, RegisterServerRequest, RegisterServerResponse, ReportInventoryRequest,
    ReportInventoryResponse,
};
use tern_proto::{ErrorKind, MapAttempt, MapIndex, PartitionIndex, ShuffleId, StorageClass};
use tern_storage::{start, Config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const BS: u32 = 64 << 10;
/// The stand-in metadata server's token key.
const KEY: [u8; 32] = [7; 32];

#[derive(Default)]
struct State {
    registrations: Vec<RegisterServerRequest>,
    heartbeats: Vec<HeartbeatRequest>,
    inventories: Vec<ReportInventoryRequest>,
    /// Frees resent on every heartbeat until acknowledged.
    to_free: Vec<u64>,
    to_free_shuffles: Vec<u64>,
    free_seq: u64,
    reregister_next: bool,
}

#[derive(Clone, Default)]
struct FakeRegistry(Arc<Mutex<State>>);

#[tonic::async_trait]
impl Registry for FakeRegistry {
    async fn register_server(
        &self,
        request: tonic::Request<RegisterServerRequest>,
    ) -> Result<tonic::Response<RegisterServerResponse>, tonic::Status> {
        let mut state = self.0.lock();
        state.registrations.push(request.into_inner());
        let server_id = state.registrations.len() as u64;
        Ok(tonic::Response::new(RegisterServerResponse {
            server_id,
            block_size: BS,
            heartbeat_interval_ms: 20,
            token_key: KEY.to_vec(),
        }))
    }

    async fn report_inventory(
        &self,
        request: tonic::Request<ReportInventoryRequest>,
    ) -> Result<tonic::Response<ReportInventoryResponse>, tonic::Status> {
        self.0.lock().inventories.push(request.into_inner());
        Ok(tonic::Response::new(ReportInventoryResponse::default()))
    }

    async fn heartbeat(
        &self,
        request: tonic::Request<HeartbeatRequest>,
    ) -> Result<tonic::Response<HeartbeatResponse>, tonic::Status> {
        let mut state = self.0.lock();
        let request = request.into_inner();
        if request.freed_through_seq >= state.free_seq {
            state.to_free.clear();
            state.to_free_shuffles.clear();
        }
        state.heartbeats.push(request);
        let reregister = std::mem::take(&mut state.reregister_next);
        Ok(tonic::Response::new(HeartbeatResponse {
            free_block_ids: state.to_free.clone(),
            free_seq: state.free_seq,
            reregister,
            free_shuffle_ids: state.to_free_shuffles.clone(),
            ..HeartbeatResponse::default()
        }))
    }
}

async fn serve_registry(listener: TcpListener) -> FakeRegistry {
    let registry = FakeRegistry::default();
    let service = RegistryServer::new(registry.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    registry
}

fn config(metadata: SocketAddr) -> Config {
    Config {
        metadata: metadata.to_string(),
        serve: Serve::on_loopback(0, 0),
        cluster_secret_file: Some(secret_file()),
        dram: ByteSize::mib(1),
        ..Config::default()
    }
}

/// A cluster secret for this test binary's servers (the stand-in registry checks no credential).
fn secret_file() -> std::path::PathBuf {
    static FILE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep();
        let path = dir.join("cluster.secret");
        tern_proto::identity::ClusterSecret::generate().write_new(&path).unwrap();
        path
    })
    .clone()
}

/// Sends `request` as the volume principal (slot 0) with its grant, as a client would.
async fn call(stream: &mut TcpStream, request: &Frame) -> Result<Frame, (ErrorKind, String)> {
    let key = TokenKey::from_bytes(&KEY).unwrap();
    let h = request.header;
    let (kind, id) = if matches!(h.op, Op::Push | Op::Fetch) {
        (GrantKind::Shuffle, h.segment_address().shuffle.get())
    } else {
        (GrantKind::Block, h.block_id)
    };
    let request = request.clone().authorized(0, key.grant(kind, id, VOLUME_SERIAL));
    call_raw(stream, &request).await
}

async fn call_raw(stream: &mut TcpStream, request: &Frame) -> Result<Frame, (ErrorKind, String)> {
    frame::write_frame(stream, request).await.unwrap();
    frame::read_frame(stream, MAX_PAYLOAD_BYTES).await.unwrap().unwrap().into_result()
}

fn push(id: u64, segment: (u64, u32, u32), batch: &[u8]) -> Frame {
    let (map, attempt) = (MapIndex::from_wire(0), MapAttempt::from_wire(0));
    let mut payload = PushHeader { map, attempt, class: StorageClass::Any }.encode().to_vec();
    payload.extend_from_slice(batch);
    Frame::push(id, address(segment), Bytes::from(payload))
}

fn fetch(id: u64, segment: (u64, u32, u32)) -> Frame {
    let maps = vec![(MapIndex::from_wire(0), MapAttempt::from_wire(0))];
    let request = FetchRequest { cursor: 0, max_bytes: 1 << 20, maps };
    Frame::fetch(id, address(segment), request.encode())
}

/// Segment `index` of partition `partition` of shuffle `shuffle`, as Push and Fetch address it.
fn address((shuffle, partition, index): (u64, u32, u32)) -> SegmentAddress {
    SegmentAddress { shuffle: ShuffleId::from_wire(shuffle), partition: PartitionIndex::from_wire(partition), index }
}

/// Polls `check` until it holds, for up to 10 s.
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

async fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: tern\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_heartbeats_frees_and_reregisters() {
    // The metadata server comes up after the storage server: registration must wait for it.
    let metadata_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let starting = tokio::spawn(start(config(metadata_port)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let registry = serve_registry(TcpListener::bind(metadata_port).await.unwrap()).await;
    let server = starting.await.unwrap().unwrap();
    assert_eq!(server.server_id(), tern_proto::ServerId::from_wire(1));
    {
        let state = registry.0.lock();
        let registration = &state.registrations[0];
        assert_eq!(registration.address, server.addr().to_string());
        assert_eq!(registration.tiers[0].tier, "dram");
        assert_eq!(registration.tiers[0].capacity_bytes, 1 << 20);
        // The heartbeat sent before `start` returned reports the blocks that fit.
        let first = &state.heartbeats[0];
        assert_eq!((first.server_id, first.freed_through_seq), (1, 0));
        assert_eq!(first.tiers[0].capacity_blocks, 16);
    }

    let mut s = TcpStream::connect(server.addr()).await.unwrap();
    for block in [1, 2, 3] {
        call(&mut s, &Frame::write(block, block, 0, Bytes::from_static(b"shuffle data"))).await.unwrap();
    }
    // Segments of two shuffles; one is freed with the blocks, under the same sequence number.
    for (id, (shuffle, partition)) in [(20, 0), (20, 1), (21, 0)].into_iter().enumerate() {
        call(&mut s, &push(id as u64, (shuffle, partition, 0), b"batch")).await.unwrap();
    }
    {
        let mut state = registry.0.lock();
        state.to_free = vec![1, 2, 99];
        state.to_free_shuffles = vec![20, 98];
        state.free_seq = 5;
    }
    eventually("the frees are acknowledged", || {
        registry.0.lock().heartbeats.last().is_some_and(|h| h.freed_through_seq == 5)
    })
    .await;
    let (kind, message) = call(&mut s, &Frame::read(10, 1, 0, 1)).await.unwrap_err();
    assert_eq!((kind, message.as_str()), (ErrorKind::NotFound, "block 1 is not held by storage server 1"));
    assert_eq!(&call(&mut s, &Frame::read(11, 3, 0, 12)).await.unwrap().payload[..], b"shuffle data");
    // The daemon checks grants with the key the registration gave it: none, none served.
    let (kind, message) = call_raw(&mut s, &Frame::read(11, 3, 0, 12)).await.unwrap_err();
    assert_eq!(kind, ErrorKind::PermissionDenied, "{message}");
    let (kind, message) = call(&mut s, &fetch(12, (20, 1, 0))).await.unwrap_err();
    assert_eq!(
        (kind, message.as_str()),
        (ErrorKind::NotFound, "shuffle 20 partition 1 segment 0 is not held by storage server 1")
    );
    let page = call(&mut s, &fetch(13, (21, 0, 0))).await.unwrap();
    assert_eq!(page.payload.len(), tern_proto::shuffle::BATCH_HEADER_LEN + 5);
    // Shuffle data counts in the tier's use.
    eventually("heartbeats report the use", || {
        registry
            .0
            .lock()
            .heartbeats
            .last()
            .is_some_and(|h| h.tiers[0].used_blocks == 2 && h.tiers[0].used_bytes == 17 + 16)
    })
    .await;

    // The metadata server does not know this server (it restarted): the server registers again,
    // from the same process, and reports what it holds; nothing is dropped before the metadata
    // server says so.
    registry.0.lock().reregister_next = true;
    eventually("the server registers again", || server.server_id() == tern_proto::ServerId::from_wire(2)).await;
    assert_eq!(&call(&mut s, &Frame::read(12, 3, 0, 12)).await.unwrap().payload[..], b"shuffle data");
    call(&mut s, &fetch(14, (21, 0, 0))).await.unwrap();
    eventually("heartbeats come from the new id", || {
        registry.0.lock().heartbeats.last().is_some_and(|h| h.server_id == 2 && h.tiers[0].used_blocks == 2)
    })
    .await;
    {
        let state = registry.0.lock();
        assert_eq!(state.registrations.len(), 2);
        let (first, again) = (&state.registrations[0], &state.registrations[1]);
        assert!(first.instance_id != 0 && again.instance_id == first.instance_id, "one process, one instance id");
        let after: Vec<_> = state.heartbeats.iter().filter(|h| h.server_id == 2).collect();
        assert_eq!(after[0].freed_through_seq, 0, "a new registration acknowledges from zero");
        // At start an empty inventory; after registering again, the blocks, the shuffles and
        // their segments (one page: they fit).
        let inventories: Vec<(u64, Vec<u64>, Vec<u64>, bool)> = state
            .inventories
            .iter()
            .map(|i| (i.server_id, i.block_ids.clone(), i.shuffle_ids.clone(), i.last))
            .collect();
        assert_eq!(inventories, [(1, vec![], vec![], true), (2, vec![3], vec![21], true)]);
        let segments: Vec<Vec<(u64, u32, u32)>> = (state.inventories.iter())
            .map(|i| i.segments.iter().map(|s| (s.shuffle_id, s.partition, s.index)).collect())
            .collect();
        assert_eq!(segments, [vec![], vec![(21, 0, 0)]]);
    }

    let metrics = http_get(server.admin_addr(), "/metrics").await;
    for line in [
        "tern_storage_tier_capacity_bytes{tier=\"dram\"} 1048576",
        "tern_storage_requests_total{op=\"write\"} 3",
        "tern_storage_requests_total{op=\"push\"} 3",
        "tern_storage_errors_total{op=\"fetch\",kind=\"not-found\"} 1",
        "tern_storage_shuffle_segments 1",
        "tern_storage_errors_total{op=\"read\",kind=\"not-found\"} 1",
        "tern_storage_connections 1",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }

    let addr = server.addr();
    server.shutdown().await;
    assert!(TcpStream::connect(addr).await.is_err(), "the block service still accepts after shutdown");
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
    assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "open connections close on shutdown: {closed:?}");
}

#[tokio::test]
async fn start_refuses_what_cannot_work() {
    // Plain TCP beyond loopback needs TLS material or a trusted network.
    let unused: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let wide = Serve { listen: "0.0.0.0:0".parse().unwrap(), ..Serve::on_loopback(0, 0) };
    let wildcard = Config { serve: wide.clone(), ..config(unused) };
    let err = start(wildcard.clone()).await.err().unwrap().to_string();
    assert!(err.contains("tern cert init --dir DIR") && err.contains("--trusted-network"), "{err}");

    // A wildcard listen address cannot be registered for clients.
    let wildcard = Config { serve: Serve { trusted_network: true, ..wide }, ..wildcard };
    let err = start(wildcard).await.err().unwrap().to_string();
    assert!(err.contains("advertise"), "{err}");

    // Without the cluster secret it cannot prove it is a storage server.
    let no_secret = Config { cluster_secret_file: None, ..config(unused) };
    let err = format!("{:#}", start(no_secret).await.err().unwrap());
    assert!(err.contains("no cluster secret") && err.contains("cluster_secret_file"), "{err}");

    // A DRAM tier smaller than one of the cluster's blocks.
    let registry_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metadata = registry_listener.local_addr().unwrap();
    serve_registry(registry_listener).await;
    let tiny = Config { dram: ByteSize::kib(32), ..config(metadata) };
    let err = format!("{:#}", start(tiny).await.err().unwrap());
    assert!(err.contains("smaller than one block"), "{err}");
}
