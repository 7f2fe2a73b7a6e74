//! The bounded property-based fuzz of the metadata server's request validation that CI runs (the
//! unbounded one is `fuzz/`, cargo-fuzz). Seeded sequences of requests of every RPC, built from
//! pools of good and bad values (paths with `..`, NULs, empty parts, huge lengths, ids that never
//! existed, zero and huge counts), encoded as on the wire and sometimes mutated, go through
//! `tern_metadata::fuzzing::Harness` (the state methods the gRPC handlers call; it checks every
//! refusal names its kind and reason, and every accepted change replays as the log would). A
//! shorter run goes over real gRPC to a running server, which must still serve afterwards.

#![allow(clippy::unwrap_used, reason = "test support: helpers outside #[test] fns unwrap as the tests do")]

use std::time::Duration;

use prost::Message;
use tern_metadata::fuzzing::{method_name, Harness, Outcome, METHODS};
use tern_proto::error::KIND_METADATA_KEY;
use tern_proto::v1::metadata_client::MetadataClient;
use tern_proto::v1::*;

use tern_common::SplitMix64 as Rng;

/// This test's draws, over the shared generator.
trait Draw {
    fn pick<T: Clone>(&mut self, items: &[T]) -> T;
    fn path(&mut self) -> String;
    fn count(&mut self) -> u64;
    fn class(&mut self) -> String;
}

impl Draw for Rng {
    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize].clone()
    }

    fn path(&mut self) -> String {
        let long = "x".repeat(5000);
        let deep = "/d".repeat(300);
        let parts = [
            "/a",
            "/a/b",
            "/a/b/c",
            "/f",
            "/a/f",
            "/jobs",
            "/jobs/0",
            "/jobs/0/x",
            "/jobs/1/y/z",
            "",
            "/",
            "//",
            "a",
            "/a/../b",
            "/./a",
            "/a/",
            "/a\0b",
            "/é",
            &long,
            &deep,
            "/jobs/",
            "/a//b",
            " ",
            "/\n",
        ];
        self.pick(&parts).to_string()
    }

    fn count(&mut self) -> u64 {
        self.pick(&[0, 1, 2, 3, 7, 64, 1024, 1025, u64::from(u32::MAX), u64::MAX])
    }

    fn class(&mut self) -> String {
        self.pick(&["", "any", "dram", "nvme", "tape", "DRAM"]).to_string()
    }
}

/// A request of method `method`, from the pools, encoded as on the wire.
fn request(rng: &mut Rng, method: u8) -> Vec<u8> {
    // Most requests are sane in the fields that need to agree (counts, ranges), so that they get
    // past validation and meet the state; the rest take anything from the pools.
    let sane = rng.below(10) < 7;
    let small = rng.below(8);
    let few = 1 + rng.below(4);
    let job = rng.pick(&["", "\u{0}", "\u{1}", "\u{2}", "nosuchjob", "a/b"]).to_string();
    let lengths: Vec<u64> = (0..rng.below(6)).map(|_| rng.count()).collect();
    let segments: Vec<u32> = (0..rng.below(6)).map(|_| rng.count() as u32).collect();
    match method % METHODS {
        0 => MkdirRequest { path: rng.path(), parents: rng.below(2) == 0, owner: rng.path() }.encode_to_vec(),
        1 => CreateRequest {
            path: rng.path(),
            parents: rng.below(2) == 0,
            sealed: rng.below(4) == 0,
            storage_class: rng.class(),
            replicas: rng.below(4) as u32,
            owner: rng.path(),
        }
        .encode_to_vec(),
        2 => AllocateBlocksRequest { file_id: small, count: rng.count() as u32, client_host: "127.0.0.1".into() }
            .encode_to_vec(),
        3 => SealRequest { file_id: small, length: rng.count() }.encode_to_vec(),
        4 => OpenRequest { path: rng.path() }.encode_to_vec(),
        5 => StatRequest { path: rng.path(), with_blocks: rng.below(2) == 0 }.encode_to_vec(),
        6 => ListRequest { path: rng.path(), start_after: rng.path(), limit: rng.count() as u32 }.encode_to_vec(),
        7 => DeleteRequest { path: rng.path(), recursive: rng.below(2) == 0 }.encode_to_vec(),
        8 => RenameRequest { from: rng.path(), to: rng.path() }.encode_to_vec(),
        9 => RegisterJobRequest {
            name: rng.pick(&["", "", "j", "a/b", "..", "\0"]).into(),
            lease_ms: if sane { 0 } else { rng.count() },
            tenant: rng.pick(&["", "", "t", "a/b", "\0"]).into(),
            serial: if sane { 0 } else { rng.count() },
        }
        .encode_to_vec(),
        10 => RenewJobRequest { job_id: job, token: rng.pick(&["", "00", "zz"]).into() }.encode_to_vec(),
        11 => EndJobRequest { job_id: job, token: rng.pick(&["", "00", "zz"]).into() }.encode_to_vec(),
        12 => StatusRequest {}.encode_to_vec(),
        13 => RegisterShuffleRequest {
            job_id: job,
            partitions: if sane { few as u32 } else { rng.count() as u32 % 5000 },
            maps: if sane { few as u32 } else { rng.count() as u32 },
            storage_class: if sane { String::new() } else { rng.class() },
            split_size_bytes: if sane { 0 } else { rng.count() },
            replicas: if sane { 0 } else { rng.below(4) as u32 },
        }
        .encode_to_vec(),
        14 => AdvanceSegmentRequest {
            shuffle_id: small,
            partition: if sane { rng.below(4) as u32 } else { rng.count() as u32 },
            full_segment: if sane { 0 } else { rng.count() as u32 },
        }
        .encode_to_vec(),
        15 => CommitMapRequest {
            shuffle_id: small,
            map_index: if sane { rng.below(4) as u32 } else { rng.count() as u32 },
            attempt: rng.below(3) as u32,
            partition_bytes: if sane { (0..few).map(|_| rng.below(100)).collect() } else { lengths },
            first_segment: if sane { vec![0; few as usize] } else { segments.clone() },
            last_segment: if sane { vec![0; few as usize] } else { segments },
        }
        .encode_to_vec(),
        16 => LocateShuffleRequest {
            shuffle_id: small,
            start_partition: if sane { 0 } else { rng.count() as u32 },
            end_partition: if sane { few as u32 } else { rng.count() as u32 },
            start_map: if sane { 0 } else { rng.count() as u32 },
            end_map: if sane { few as u32 } else { rng.count() as u32 },
        }
        .encode_to_vec(),
        17 => InvalidateMapsRequest { shuffle_id: small, map_indexes: segments }.encode_to_vec(),
        18 => UnregisterShuffleRequest { shuffle_id: small }.encode_to_vec(),
        19 => RegisterServerRequest {
            address: rng.pick(&["", "x", "127.0.0.1:1", "[::1]:70000"]).into(),
            ..Default::default()
        }
        .encode_to_vec(),
        20 => {
            HeartbeatRequest { server_id: small, freed_through_seq: rng.count(), ..Default::default() }.encode_to_vec()
        }
        _ => ReportInventoryRequest {
            server_id: small,
            block_ids: lengths,
            shuffle_ids: Vec::new(),
            last: rng.below(2) == 0,
            segments: Vec::new(),
        }
        .encode_to_vec(),
    }
}

#[test]
fn random_request_sequences_are_validated_and_replay() {
    let (mut accepted, mut refused, mut undecodable) = (0u32, 0u32, 0u32);
    let mut methods_accepted = [false; METHODS as usize];
    for sequence in 0..400u64 {
        let mut rng = Rng(sequence);
        let mut harness = Harness::new();
        for step in 0..60 {
            let method = rng.below(u64::from(METHODS)) as u8;
            let mut body = request(&mut rng, method);
            match rng.below(10) {
                // A bit flipped or the message cut: often still decodes, as something else.
                0 if !body.is_empty() => {
                    let at = rng.below(body.len() as u64) as usize;
                    body[at] ^= 1 << rng.below(8);
                }
                1 => body.truncate(rng.below(body.len() as u64 + 1) as usize),
                2 => body = (0..rng.below(40)).map(|_| rng.next_u64() as u8).collect(),
                3 => harness.advance(Duration::from_millis(rng.pick(&[10, 1000, 1000, 6000, 40_000]))),
                _ => {}
            }
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| harness.call(method, &body)))
                .unwrap_or_else(|_| panic!("sequence {sequence} step {step}: {} panicked", method_name(method)));
            match outcome {
                Outcome::Accepted => {
                    accepted += 1;
                    methods_accepted[method as usize] = true;
                }
                Outcome::Refused(_) => refused += 1,
                Outcome::Undecodable => undecodable += 1,
            }
        }
    }
    // The pools reach past validation into the state, and validation refuses plenty.
    assert!(accepted > 2000 && refused > 2000, "{accepted} accepted, {refused} refused, {undecodable} undecodable");
    let never: Vec<&str> = (0..METHODS).filter(|&m| !methods_accepted[m as usize]).map(method_name).collect();
    assert!(never.len() <= 3, "methods never accepted: {never:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_over_grpc_get_statuses_and_the_server_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let config = tern_metadata::Config {
        serve: tern_common::config::Serve::on_loopback(0, 0),
        dir: dir.path().join("metadata"),
        fsync: false,
        ..Default::default()
    };
    let server = tern_metadata::start(config).await.unwrap();
    let mut client = MetadataClient::connect(format!("http://{}", server.addr())).await.unwrap();
    let mut rng = Rng(0x6a09);
    let mut refused = 0;
    for _ in 0..600 {
        let status = match rng.below(8) {
            0 => client
                .mkdir(MkdirRequest { path: rng.path(), parents: rng.below(2) == 0, owner: rng.path() })
                .await
                .err(),
            1 => {
                let req = CreateRequest {
                    path: rng.path(),
                    parents: true,
                    sealed: rng.below(2) == 0,
                    storage_class: rng.class(),
                    replicas: rng.below(4) as u32,
                    owner: rng.path(),
                };
                client.create(req).await.err()
            }
            2 => client.stat(StatRequest { path: rng.path(), with_blocks: true }).await.err(),
            3 => client
                .list(ListRequest { path: rng.path(), start_after: String::new(), limit: rng.count() as u32 })
                .await
                .err(),
            4 => client.delete(DeleteRequest { path: rng.path(), recursive: rng.below(2) == 0 }).await.err(),
            5 => client.rename(RenameRequest { from: rng.path(), to: rng.path() }).await.err(),
            6 => client.seal(SealRequest { file_id: rng.below(8), length: rng.count() }).await.err(),
            _ => {
                let req = AllocateBlocksRequest {
                    file_id: rng.below(8),
                    count: rng.count() as u32,
                    client_host: String::new(),
                };
                client.allocate_blocks(req).await.err()
            }
        };
        if let Some(status) = status {
            refused += 1;
            assert!(!status.message().is_empty(), "{status:?}");
            assert!(status.metadata().get(KIND_METADATA_KEY).is_some(), "{status:?}");
        }
    }
    assert!(refused > 100, "only {refused} refusals");
    // A message over the gRPC limit is refused by the transport, with a status.
    let huge = "/h".repeat(tern_proto::MAX_GRPC_MESSAGE_BYTES / 2 + 16);
    let status = client.stat(StatRequest { path: huge, with_blocks: false }).await.unwrap_err();
    assert!(!status.message().is_empty(), "{status:?}");
    // And a good request still works.
    client.mkdir(MkdirRequest { path: "/after/fuzz".into(), parents: true, ..Default::default() }).await.unwrap();
    client.stat(StatRequest { path: "/after/fuzz".into(), with_blocks: false }).await.unwrap();
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_are_closed_and_the_server_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let config = tern_metadata::Config {
        serve: tern_common::config::Serve::on_loopback(0, 0),
        dir: dir.path().join("metadata"),
        fsync: false,
        max_connections: 2,
        ..Default::default()
    };
    let server = tern_metadata::start(config).await.unwrap();
    let url = format!("http://{}", server.addr());
    let status = || StatusRequest {};
    let mut first = MetadataClient::connect(url.clone()).await.unwrap();
    let mut second = MetadataClient::connect(url.clone()).await.unwrap();
    first.status(status()).await.unwrap();
    second.status(status()).await.unwrap();
    // The third is closed as it arrives: its handshake or its first call fails.
    let third = async {
        let mut client = MetadataClient::connect(url.clone()).await.map_err(|e| e.to_string())?;
        client.status(status()).await.map_err(|e| e.to_string())
    };
    let refused = tokio::time::timeout(Duration::from_secs(10), third).await.expect("an answer within 10 s");
    assert!(refused.is_err(), "a third connection was served past max_connections = 2");
    // Counted (the client may have tried more than once).
    let metrics = metrics_page(server.admin_addr()).await;
    let refused: u64 = metrics
        .lines()
        .find_map(|line| line.strip_prefix("tern_metadata_connections_refused_total "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no refused-connections counter: {metrics}"));
    assert!(refused >= 1, "{metrics}");
    // The two held keep working; closing one makes room for a new one.
    first.status(status()).await.unwrap();
    drop(second);
    let mut attempts = 0;
    loop {
        let next = async {
            let mut client = MetadataClient::connect(url.clone()).await.map_err(|e| e.to_string())?;
            client.status(status()).await.map_err(|e| e.to_string())
        };
        if next.await.is_ok() {
            break;
        }
        attempts += 1;
        assert!(attempts < 100, "the closed connection never freed its place");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.shutdown().await;
}

/// The admin endpoint's metrics page, over a plain HTTP/1.0 request.
async fn metrics_page(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await.unwrap();
    let mut page = String::new();
    stream.read_to_string(&mut page).await.unwrap();
    page
}
