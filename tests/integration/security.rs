//! Job tokens and tenant quotas through a real cluster: a client of one job, knowing another
//! job's block and shuffle ids (and even their grants), is refused on every data op; forged,
//! expired and missing tokens are refused; quotas on jobs and DRAM bytes are enforced, exact
//! across frees, job ends and a metadata restart; shuffle bytes count per tier and hold pushes.

use crate::common;

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use common::{random_bytes, Cluster, Nvme};
use tern_client::{Client, ErrorKind, ShuffleOptions};
use tern_proto::frame::{self, Frame};
use tern_proto::shuffle::{FetchRequest, PushHeader, SegmentAddress};
use tern_proto::token::{JobToken, TokenKey};
use tern_proto::v1::{EndJobRequest, LocateShuffleRequest, RenewJobRequest};
use tern_proto::{MapAttempt, MapIndex, PartitionIndex, StorageClass};
use tokio::net::TcpStream;

const MIB: usize = 1 << 20;

/// One raw block connection, to speak as a hostile client would.
struct Raw {
    stream: TcpStream,
    next: u64,
}

impl Raw {
    async fn connect(addr: &str) -> Raw {
        Raw { stream: TcpStream::connect(addr).await.unwrap(), next: 1 }
    }

    async fn call(&mut self, build: impl FnOnce(u64) -> Frame) -> Result<Frame, (ErrorKind, String)> {
        let id = self.next;
        self.next += 1;
        frame::write_frame(&mut self.stream, &build(id)).await.unwrap();
        let reply = frame::read_frame(&mut self.stream, frame::MAX_PAYLOAD_BYTES).await.unwrap().unwrap();
        assert_eq!(reply.header.request_id, id);
        reply.into_result()
    }

    async fn denied(&mut self, what: &str, build: impl FnOnce(u64) -> Frame) -> String {
        let (kind, message) = self.call(build).await.expect_err(what);
        assert_eq!(kind, ErrorKind::PermissionDenied, "{what}: {message}");
        message
    }
}

fn grant(bytes: &[u8]) -> [u8; 16] {
    bytes.try_into().expect("a 16-byte grant")
}

#[tokio::test]
async fn a_job_cannot_read_write_or_free_another_jobs_data() {
    let cluster = Cluster::start(1, "64MiB").await;
    let addr = cluster.storage_addrs[0].clone();

    // Job B writes a file and a shuffle output.
    let client_b = cluster.client().await;
    let job_b = client_b.start_job(Some("b"), Duration::from_secs(30)).await.unwrap();
    let data = Bytes::from(random_bytes(2 * MIB + 5));
    client_b.put("/jobs/b/data", data.clone()).await.unwrap();
    let shuffle_b = client_b.register_shuffle("b", 2, ShuffleOptions::default()).await.unwrap();
    let mut writer = shuffle_b.writer(0, 0);
    writer.write(1, b"b's shuffle bytes").await.unwrap();
    assert!(writer.commit().await.unwrap().committed);

    // Job A, another client: it can learn B's block ids, grants and shuffle id from the
    // control plane, but not B's token.
    let client_a = cluster.client().await;
    let _job_a = client_a.start_job(Some("a"), Duration::from_secs(30)).await.unwrap();
    let token_a = JobToken::from_text(&client_a.job_token("a").unwrap()).unwrap();
    assert!(client_a.job_token("b").is_none());
    // The control plane tells A nothing of B's files or shuffles: they need B's token.
    let refused = client_a.stat_with_blocks("/jobs/b/data", true).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::PermissionDenied, "{refused}");
    assert!(refused.message().contains("job b"), "{refused}");
    let mut stranger = crate::common::raw_metadata(&cluster.metadata_addr, client_a.job_token("a").as_deref()).await;
    let ask =
        LocateShuffleRequest { shuffle_id: shuffle_b.id().get(), end_partition: 2, end_map: 1, ..Default::default() };
    let refused = stranger.locate_shuffle(ask).await.unwrap_err();
    assert_eq!(tern_proto::ErrorKind::of_status(&refused), tern_proto::ErrorKind::PermissionDenied, "{refused:?}");
    // Say A learned them anyway (a leaked listing): the storage servers still refuse it.
    let (_, blocks) = client_b.stat_with_blocks("/jobs/b/data", true).await.unwrap();
    let block = blocks[0].0.clone();
    let mut metadata = crate::common::raw_metadata(&cluster.metadata_addr, client_b.job_token("b").as_deref()).await;
    let located = metadata
        .locate_shuffle(LocateShuffleRequest {
            shuffle_id: shuffle_b.id().get(),
            end_partition: 2,
            end_map: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(located.job_id, "b");

    // Through the client library: the control plane does not even open B's file for A.
    let err = client_a.open("/jobs/b/data").await.err().unwrap();
    assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");

    // Raw frames under A's token (slot 1) with B's grants.
    let mut raw = Raw::connect(&addr).await;
    raw.call(|id| Frame::auth(id, 1, Bytes::from(token_a.encode()))).await.unwrap();
    let b_grant = grant(&block.grant);
    let message = raw.denied("read", |id| Frame::read(id, block.block_id, 0, 16).authorized(1, b_grant)).await;
    assert!(message.contains(&format!("block {}", block.block_id)) && message.contains("job a"), "{message}");
    raw.denied("write", |id| {
        Frame::write(id, block.block_id, block.length, Bytes::from_static(b"evil")).authorized(1, b_grant)
    })
    .await;
    raw.denied("free", |id| Frame::free_granted(id, &[(block.block_id, b_grant)]).authorized(1, [0; 16])).await;
    let shuffle_grant = grant(&located.grant);
    let segment = located.segments.iter().find(|s| s.partition == 1).unwrap().clone();
    let mut push = BytesMut::new();
    let (map, attempt) = (MapIndex::from_wire(1), MapAttempt::from_wire(0));
    push.extend_from_slice(&PushHeader { map, attempt, class: StorageClass::Any }.encode());
    push.extend_from_slice(b"evil");
    let push = push.freeze();
    let address =
        SegmentAddress { shuffle: shuffle_b.id(), partition: PartitionIndex::from_wire(1), index: segment.index };
    let message = raw.denied("push", |id| Frame::push(id, address, push).authorized(1, shuffle_grant)).await;
    assert!(message.contains(&format!("shuffle {}", shuffle_b.id())), "{message}");
    let maps = vec![(MapIndex::from_wire(0), MapAttempt::from_wire(0))];
    let fetch = FetchRequest { cursor: 0, max_bytes: 1 << 20, maps }.encode();
    raw.denied("fetch", |id| Frame::fetch(id, address, fetch).authorized(1, shuffle_grant)).await;
    // Without a token (slot 0, the volume principal) and on a slot never bound: refused too.
    raw.denied("read as nobody", |id| Frame::read(id, block.block_id, 0, 16).authorized(0, b_grant)).await;
    let message = raw.denied("unbound slot", |id| Frame::read(id, block.block_id, 0, 16).authorized(9, b_grant)).await;
    assert!(message.contains("Auth"), "{message}");

    // Forged tokens: signed by another key, or A's token renamed to B.
    let forged = TokenKey::generate().issue("b", token_a.serial, token_a.expires_unix_ms, token_a.lease_ms);
    let message = raw.denied("forged", |id| Frame::auth(id, 2, Bytes::from(forged.encode()))).await;
    assert!(message.contains("not signed"), "{message}");
    let renamed = JobToken { job: "b".into(), ..token_a.clone() };
    raw.denied("renamed", |id| Frame::auth(id, 2, Bytes::from(renamed.encode()))).await;

    // An expired token: a job whose lease lapsed (past the storage servers' 2 s clock skew).
    let short = client_a.start_job(Some("short"), Duration::from_millis(300)).await.unwrap();
    let expired = JobToken::from_text(&short.token()).unwrap();
    short.abandon();
    tokio::time::sleep(Duration::from_millis(2600)).await;
    let message = raw.denied("expired", |id| Frame::auth(id, 3, Bytes::from(expired.encode()))).await;
    assert!(message.contains("expired"), "{message}");

    // The control plane: A cannot renew or end B.
    let token_text = token_a.to_text();
    for (what, result) in [
        (
            "renew",
            metadata.renew_job(RenewJobRequest { job_id: "b".into(), token: token_text.clone() }).await.map(|_| ()),
        ),
        ("end", metadata.end_job(EndJobRequest { job_id: "b".into(), token: token_text.clone() }).await.map(|_| ())),
        (
            "end without a token",
            metadata.end_job(EndJobRequest { job_id: "b".into(), token: String::new() }).await.map(|_| ()),
        ),
    ] {
        let status = result.expect_err(what);
        assert_eq!(ErrorKind::of_status(&status), ErrorKind::PermissionDenied, "{what}: {status:?}");
    }

    // B's data is intact, and B itself is served.
    assert_eq!(client_b.open("/jobs/b/data").await.unwrap().read_to_end().await.unwrap(), data);
    let batches = shuffle_b.reader(0..2, 0..1).await.unwrap().read_to_end().await.unwrap();
    assert_eq!(batches.len(), 1);
    assert_eq!(&batches[0].data[..], b"b's shuffle bytes");
    // A process given B's token (as an executor is) acts for B.
    let executor = cluster.client().await;
    executor.add_job_token(&job_b.token()).unwrap();
    assert_eq!(executor.open("/jobs/b/data").await.unwrap().read_to_end().await.unwrap(), data);
    job_b.end().await.unwrap();
}

const QUOTAS: &str = r#"
[tenants.small]
max_jobs = 1
dram_bytes = "3MiB"
"#;

async fn tenant(client: &Client, name: &str) -> tern_proto::v1::TenantStatus {
    let status = client.status().await.unwrap();
    status.tenants.into_iter().find(|t| t.tenant == name).unwrap_or_else(|| panic!("no tenant {name}"))
}

#[tokio::test]
async fn tenant_quotas_bound_jobs_and_dram_bytes_exactly() {
    let mut cluster = Cluster::start_with_metadata_config(1, "64MiB", QUOTAS).await;
    // Nobody spends a tenant's quota but its own clients: a client of the default tenant naming
    // tenant small is refused, and counts nothing against it.
    let stranger = cluster.client().await;
    let Err(err) = stranger.start_job_for("small", Some("q0"), Duration::from_secs(30)).await else {
        panic!("a client of the default tenant registered a job of tenant small");
    };
    assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");
    assert!(err.message().contains("it names tenant small"), "{err}");
    let client = cluster.tenant_client("small").await;
    let job = client.start_job_for("small", Some("q1"), Duration::from_secs(30)).await.unwrap();
    // The second job of the tenant is refused, naming tenant, resource, limit and use.
    let Err(err) = client.start_job_for("small", Some("q2"), Duration::from_secs(30)).await else {
        panic!("a second job of tenant small was registered past max_jobs = 1");
    };
    assert_eq!(err.kind(), ErrorKind::QuotaExceeded, "{err}");
    for part in ["tenant small", "jobs", "limit 1", "1 in use"] {
        assert!(err.message().contains(part), "{part:?} missing: {err}");
    }
    // Other tenants are unlimited.
    stranger.start_job(Some("other"), Duration::from_secs(30)).await.unwrap().end().await.unwrap();

    // 2 MiB + 1 byte: three blocks, within the 3 MiB.
    client.put("/jobs/q1/kept", Bytes::from(random_bytes(2 * MIB + 1))).await.unwrap();
    assert_eq!(tenant(&client, "small").await.dram_bytes, 3 * MIB as u64);
    // Writes past the quota are refused.
    let err = client.put("/jobs/q1/more", Bytes::from(random_bytes(2 * MIB))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::QuotaExceeded, "{err}");
    assert!(err.message().contains("tenant small") && err.message().contains("dram"), "{err}");
    // The refused writer's file is deleted: the use is what the kept file holds.
    cluster
        .wait_for("the refused file's blocks to be released", Duration::from_secs(10), || async {
            (tenant(&client, "small").await.dram_bytes == 3 * MIB as u64).then_some(())
        })
        .await;

    // Exact across a restart: rebuilt from the log, the job and its token still good.
    cluster.restart_metadata(1);
    let client = cluster.tenant_client("small").await;
    client.add_job_token(&job.token()).unwrap();
    let small = cluster
        .wait_for("the metadata server to come back", Duration::from_secs(20), || async {
            let status = client.status().await.ok()?;
            status.tenants.into_iter().find(|t| t.tenant == "small")
        })
        .await;
    assert_eq!(
        (small.jobs, small.max_jobs, small.dram_bytes, small.dram_limit_bytes),
        (1, 1, 3 * MIB as u64, 3 * MIB as u64)
    );
    let status = cluster.tern_ok(&["status", "--json"]);
    assert!(status.contains("\"tenant\":\"small\""), "{status}");

    // Deleting frees the quota; ending the job brings the use back to 0.
    job.renew().await.unwrap();
    let freed = client.delete("/jobs/q1/kept", false).await.unwrap();
    assert_eq!(freed.blocks_freed, 3);
    assert_eq!(tenant(&client, "small").await.dram_bytes, 0);
    job.end().await.unwrap();
    let small = tenant(&client, "small").await;
    assert_eq!((small.jobs, small.dram_bytes), (0, 0));
    client.start_job_for("small", Some("q3"), Duration::from_secs(30)).await.unwrap().end().await.unwrap();
}

const SHUFFLE_QUOTAS: &str = r#"
[tenants.etl]
dram_bytes = "4MiB"
nvme_bytes = "6MiB"
"#;

/// Writes `mib` MiB of map `map` into partition 0 and commits it.
async fn shuffle_map(shuffle: &tern_client::Shuffle, map: u32, mib: usize) -> tern_client::Result<()> {
    let mut writer = shuffle.writer(map, 0);
    writer.write(0, &random_bytes(mib * MIB)).await?;
    writer.commit().await.map(drop)
}

/// The etl tenant's (DRAM, NVMe) bytes of shuffles, once the heartbeats report `at_least`.
async fn etl_shuffles(cluster: &Cluster, client: &Client, at_least: (u64, u64)) -> (u64, u64) {
    cluster
        .wait_for("the heartbeats to report the shuffle's bytes", Duration::from_secs(10), || async {
            let t = tenant(client, "etl").await;
            let held = (t.dram_shuffle_bytes, t.nvme_shuffle_bytes);
            (held.0 >= at_least.0 && held.1 >= at_least.1).then_some(held)
        })
        .await
}

#[tokio::test]
async fn tenant_quotas_count_shuffle_bytes_per_tier_and_hold_pushes_to_them() {
    let nvme = Nvme { size: "64MiB", engine: "psync" };
    let cluster = Cluster::start_with_nvme_and_metadata_config(1, "64MiB", nvme, SHUFFLE_QUOTAS).await;
    let client = cluster.tenant_client("etl").await;
    let job = client.start_job_for("etl", Some("s"), Duration::from_secs(30)).await.unwrap();
    let shuffle = client.register_shuffle("s", 1, ShuffleOptions::default()).await.unwrap();
    let mib = MIB as u64;

    // 5 MiB pushed at once lands in DRAM (the stop comes a heartbeat later) and is counted there.
    shuffle_map(&shuffle, 0, 5).await.unwrap();
    let (dram, nvme) = etl_shuffles(&cluster, &client, (5 * mib, 0)).await;
    assert!(dram < 5 * mib + mib / 8 && nvme == 0, "({dram}, {nvme})");
    let status = cluster.tern_ok(&["status"]);
    assert!(status.contains("DRAM (SHUFFLES)/LIMIT") && status.contains("/4MiB"), "{status}");
    // Past the DRAM quota, new batches go to NVMe; a `dram` shuffle cannot be registered.
    shuffle_map(&shuffle, 1, 2).await.unwrap();
    let (after, nvme) = etl_shuffles(&cluster, &client, (0, 2 * mib)).await;
    assert_eq!(after, dram, "nothing more went to DRAM");
    assert!(nvme < 2 * mib + mib / 8, "{nvme}");
    let dram_only = ShuffleOptions { storage_class: "dram".into(), ..ShuffleOptions::default() };
    let err = client.register_shuffle("s", 1, dram_only).await.err().expect("a dram shuffle past the dram quota");
    assert_eq!(err.kind(), ErrorKind::QuotaExceeded, "{err}");
    assert!(err.message().contains("tenant etl: dram bytes quota exceeded"), "{err}");

    // Past both: pushes are refused, naming the tenant's quotas, within a few heartbeats.
    let mut map = 2;
    let err = loop {
        match shuffle_map(&shuffle, map, 1).await {
            Ok(()) => assert!(map < 12, "map {map}: pushes past both quotas are still taken"),
            Err(err) => break err,
        }
        map += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(err.kind(), ErrorKind::QuotaExceeded, "{err}");
    assert!(err.message().contains("tenant etl: nvme bytes quota exceeded"), "{err}");
    // What was committed reads back; unregistering the shuffle releases the tenant's bytes.
    let batches = shuffle.reader(0..1, 0..map).await.unwrap().read_to_end().await.unwrap();
    let read: usize = batches.iter().map(|batch| batch.data.len()).sum();
    assert_eq!(read, (7 + map as usize - 2) * MIB);
    shuffle.unregister().await.unwrap();
    etl_zero(&cluster, &client).await;
    job.end().await.unwrap();
}

async fn etl_zero(cluster: &Cluster, client: &Client) {
    cluster
        .wait_for("the unregistered shuffle's bytes to be released", Duration::from_secs(10), || async {
            let t = tenant(client, "etl").await;
            (t.dram_shuffle_bytes + t.nvme_shuffle_bytes == 0).then_some(())
        })
        .await
}
