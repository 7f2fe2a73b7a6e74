//! Same-host reads and writes (`tern_transport::local`): a client on a storage server's host
//! reaches it through the server's abstract Unix socket, reads leased DRAM blocks straight from
//! the server's arena, mapped read-only, and writes by staging the bytes in its connection's
//! staging area; leases are authorized as reads and staged writes as writes, and both are served
//! only there.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use common::{random_bytes, Cluster};
use tern_client::{ErrorKind, TransportKind};
use tern_proto::frame::{self, Frame, Lease, LentPage};
use tern_proto::shuffle::{FetchRequest, SegmentAddress};
use tern_proto::token::JobToken;
use tern_proto::v1::LocateShuffleRequest;
use tern_proto::{MapAttempt, MapIndex, PartitionIndex};
use tern_transport::local::LocalConnector;
use tern_transport::Stream;
use tokio::io::AsyncWriteExt;

/// The cluster's block size (the metadata server's default).
const BLOCK: usize = 1 << 20;

#[tokio::test]
async fn files_of_every_edge_size_read_back_exactly_through_the_shared_arena() {
    let cluster = Cluster::start(1, "64MiB").await;
    let writer = cluster.client().await;
    let sizes = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7];
    let mut files = Vec::new();
    for size in sizes {
        let data = Bytes::from(random_bytes(size));
        let path = format!("/same-host/{size}");
        writer.put(&path, data.clone()).await.unwrap();
        files.push((path, data));
    }
    // `local` reaches the server only through its same-host socket; `auto` picks it.
    for transport in [TransportKind::Local, TransportKind::Auto] {
        let reader = cluster.client_over(transport).await;
        for (path, data) in &files {
            let back = reader.open(path).await.unwrap().read_to_end().await.unwrap();
            assert!(back == *data, "{transport}: {path} read back differently");
            if data.len() > 10 {
                // Ranges inside one block and across a block boundary, twice (the lease is reused).
                let file = reader.open(path).await.unwrap();
                for _ in 0..2 {
                    for (offset, len) in [(3, 7), (data.len() as u64 / 2, data.len() as u64 / 3)] {
                        let got = file.read_at(offset, len as usize).await.unwrap();
                        assert_eq!(got[..], data[offset as usize..(offset + len) as usize], "{transport}: {path}");
                    }
                }
            }
        }
    }
}

/// A raw same-host connection, to check the ops as a hostile client would.
async fn raw_local(addr: &str) -> Stream {
    LocalConnector.dial(addr).await.expect("the storage server's same-host socket")
}

async fn call(stream: &mut Stream, frame: Frame) -> Result<Frame, (ErrorKind, String)> {
    let id = frame.header.request_id;
    frame::write_frame(&mut stream.writer, &frame).await.unwrap();
    stream.writer.flush().await.unwrap();
    let reply = frame::read_frame(&mut stream.reader, frame::MAX_PAYLOAD_BYTES).await.unwrap().unwrap();
    assert_eq!(reply.header.request_id, id);
    reply.into_result()
}

#[tokio::test]
async fn leases_are_authorized_as_reads_lend_the_blocks_bytes_and_are_served_only_on_the_host() {
    let cluster = Cluster::start(1, "64MiB").await;
    let addr = cluster.storage_addrs[0].clone();
    let client_b = cluster.client().await;
    let _job_b = client_b.start_job(Some("b"), Duration::from_secs(30)).await.unwrap();
    let data = Bytes::from(random_bytes(BLOCK + 5));
    client_b.put("/jobs/b/data", data.clone()).await.unwrap();
    let token_b = JobToken::from_text(&client_b.job_token("b").unwrap()).unwrap();
    let client_a = cluster.client().await;
    let _job_a = client_a.start_job(Some("a"), Duration::from_secs(30)).await.unwrap();
    let token_a = JobToken::from_text(&client_a.job_token("a").unwrap()).unwrap();
    // A learns B's block and grant (from B: the control plane does not tell A).
    let (_, blocks) = client_b.stat_with_blocks("/jobs/b/data", true).await.unwrap();
    let (first, grant): (_, [u8; 16]) = (blocks[0].0.clone(), blocks[0].0.grant[..].try_into().unwrap());

    let mut local = raw_local(&addr).await;
    let arena = local.local.as_ref().expect("a same-host stream carries the server's arena").arena.clone();
    call(&mut local, Frame::auth(1, 1, Bytes::from(token_a.encode()))).await.unwrap();
    call(&mut local, Frame::auth(2, 2, Bytes::from(token_b.encode()))).await.unwrap();
    // Job A holds B's grant but not B's token: refused, as a Read would be.
    let (kind, message) =
        call(&mut local, Frame::lease(3, first.block_id).authorized(1, grant)).await.expect_err("A leasing B's block");
    assert_eq!(kind, ErrorKind::PermissionDenied, "{message}");
    // Job B gets its block lent: the bytes at the lease's offset in the mapping are the block's.
    let reply = call(&mut local, Frame::lease(4, first.block_id).authorized(2, grant)).await.unwrap();
    let lease = Lease::decode(&reply.payload).unwrap();
    assert_eq!(reply.header.length as usize, BLOCK, "the whole published block is lent");
    assert!(arena.copy_out(lease.offset, BLOCK).unwrap() == data.slice(..BLOCK));
    assert!(arena.copy_out(arena.len() as u64 - 1, 2).is_err(), "bytes past the arena are refused, not read");
    let released = call(&mut local, Frame::release(5, &[lease.id, 999])).await.unwrap();
    assert_eq!(released.header.length, 1, "the unknown lease is skipped");

    // A Fetch page that is one extent of the arena comes lent, with the crc the server took.
    let shuffle = client_b.register_shuffle("b", 1, Default::default()).await.unwrap();
    let batch = random_bytes(200 << 10);
    let mut writer = shuffle.writer(0, 0);
    writer.write(0, &batch).await.unwrap();
    assert!(writer.commit().await.unwrap().committed);
    let token = client_b.job_token("b").unwrap();
    let mut metadata = crate::common::raw_metadata(&cluster.metadata_addr, Some(&token)).await;
    let request =
        LocateShuffleRequest { shuffle_id: shuffle.id().get(), end_partition: 1, end_map: 1, ..Default::default() };
    let located = metadata.locate_shuffle(request).await.unwrap().into_inner();
    let shuffle_grant: [u8; 16] = located.grant[..].try_into().unwrap();
    let maps = vec![(MapIndex::from_wire(0), MapAttempt::from_wire(0))];
    let fetch = FetchRequest { cursor: 0, max_bytes: 1 << 20, maps }.encode();
    let index = located.segments[0].index;
    let address = SegmentAddress { shuffle: shuffle.id(), partition: PartitionIndex::from_wire(0), index };
    let reply = call(&mut local, Frame::fetch(9, address, fetch).authorized(2, shuffle_grant)).await.unwrap();
    assert!(reply.is_lent(), "a one-batch page on a same-host connection is lent");
    let page = LentPage::decode(&reply.payload).unwrap();
    let bytes = arena.copy_out(page.lease.offset, page.len as usize).unwrap();
    assert_eq!(crc32c::crc32c(&bytes), page.crc);
    assert!(bytes.ends_with(&batch), "the page is the batch's header and bytes");
    call(&mut local, Frame::release(10, &[page.lease.id])).await.unwrap();

    // Over TCP neither op is served, even to the block's own job.
    let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    frame::write_frame(&mut tcp, &Frame::auth(6, 1, Bytes::from(token_b.encode()))).await.unwrap();
    frame::read_frame(&mut tcp, frame::MAX_PAYLOAD_BYTES).await.unwrap().unwrap().into_result().unwrap();
    for request in [Frame::lease(7, first.block_id).authorized(1, grant), Frame::release(8, &[1])] {
        frame::write_frame(&mut tcp, &request).await.unwrap();
        let reply = frame::read_frame(&mut tcp, frame::MAX_PAYLOAD_BYTES).await.unwrap().unwrap();
        let (kind, message) = reply.into_result().expect_err("a same-host op over TCP");
        assert_eq!(kind, ErrorKind::Invalid, "{message}");
        assert!(message.contains("own host"), "{message}");
    }
}

#[tokio::test]
async fn a_shuffle_written_and_read_on_the_servers_host_reads_back_exactly_over_map_ranges() {
    let cluster = Cluster::start(1, "256MiB").await;
    let client = cluster.client_over(TransportKind::Local).await;
    let _job = client.start_job(Some("local"), Duration::from_secs(60)).await.unwrap();
    let shuffle = client.register_shuffle("local", 4, Default::default()).await.unwrap();
    // Per (partition, map): one large batch (its own page, lent from the arena) and small ones
    // (gathered into a page, sent through the socket).
    let mut expected: BTreeMap<(u32, u32), Vec<u8>> = BTreeMap::new();
    for map in 0..3u32 {
        let mut writer = shuffle.writer(map, 0);
        for partition in 0..4u32 {
            let large = random_bytes(300 << 10 | (map * 4 + partition) as usize);
            writer.write(partition, &large).await.unwrap();
            let small = format!("map {map} partition {partition};").repeat(5);
            writer.write(partition, small.as_bytes()).await.unwrap();
            let bytes = expected.entry((partition, map)).or_default();
            bytes.extend_from_slice(&large);
            bytes.extend_from_slice(small.as_bytes());
        }
        assert!(writer.commit().await.unwrap().committed);
    }
    for (partitions, maps) in [(0..4, 0..3), (1..3, 1..2), (3..4, 0..2)] {
        let mut got: BTreeMap<(u32, u32), Vec<u8>> = BTreeMap::new();
        for batch in shuffle.reader(partitions.clone(), maps.clone()).await.unwrap().read_to_end().await.unwrap() {
            got.entry((batch.partition, batch.map)).or_default().extend_from_slice(&batch.data);
        }
        let want: BTreeMap<(u32, u32), Vec<u8>> = expected
            .iter()
            .filter(|((p, m), _)| partitions.contains(p) && maps.contains(m))
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{partitions:?} x {maps:?}");
        assert!(got == want, "{partitions:?} x {maps:?}: bytes differ");
    }
}

#[tokio::test]
async fn blocks_on_nvme_are_read_through_the_same_host_socket() {
    let cluster = Cluster::start_with_nvme(1, "4MiB", common::Nvme { size: "16MiB", engine: "psync" }).await;
    // Written staged (the server copies the staged bytes into the NVMe write's aligned buffer).
    let writer = cluster.client_over(TransportKind::Local).await;
    let data = Bytes::from(random_bytes(2 * BLOCK + 3));
    writer.put_with_class("/nvme", data.clone(), tern_proto::StorageClass::Nvme).await.unwrap();
    let over_tcp = cluster.client().await.open("/nvme").await.unwrap().read_to_end().await.unwrap();
    assert!(over_tcp == data, "an NVMe file written staged reads back differently over TCP");
    let reader = cluster.client_over(TransportKind::Local).await;
    let file = reader.open("/nvme").await.unwrap();
    // NVMe blocks are not lent: read through the socket, the refusal remembered, so a second
    // pass reads the same.
    for _ in 0..2 {
        assert!(file.read_at(0, data.len()).await.unwrap() == data);
        assert_eq!(file.read_at(BLOCK as u64 - 1, 5).await.unwrap()[..], data[BLOCK - 1..BLOCK + 4]);
    }
}

#[tokio::test]
async fn staged_writes_are_authorized_as_writes_checked_on_the_servers_copy_and_served_only_on_the_host() {
    use tern_proto::frame::Staged;
    use tern_proto::v1::{AllocateBlocksRequest, CreateRequest};
    let cluster = Cluster::start(1, "64MiB").await;
    let addr = cluster.storage_addrs[0].clone();
    let client_b = cluster.client().await;
    let _job_b = client_b.start_job(Some("b"), Duration::from_secs(30)).await.unwrap();
    let token_b = JobToken::from_text(&client_b.job_token("b").unwrap()).unwrap();
    let client_a = cluster.client().await;
    let _job_a = client_a.start_job(Some("a"), Duration::from_secs(30)).await.unwrap();
    let token_a = JobToken::from_text(&client_a.job_token("a").unwrap()).unwrap();
    // A block of B's, allocated and unwritten, and its grant.
    let mut metadata =
        crate::common::raw_metadata(&cluster.metadata_addr, Some(&client_b.job_token("b").unwrap())).await;
    let create = CreateRequest { path: "/jobs/b/staged".into(), ..Default::default() };
    let file_id = metadata.create(create).await.unwrap().into_inner().file_id;
    let ask = AllocateBlocksRequest { file_id, count: 1, client_host: "127.0.0.1".into() };
    let block = metadata.allocate_blocks(ask).await.unwrap().into_inner().blocks.remove(0);
    let grant: [u8; 16] = block.grant[..].try_into().unwrap();

    let mut local = raw_local(&addr).await;
    let staging = local.local.as_ref().expect("a same-host stream carries a staging area").staging.clone();
    call(&mut local, Frame::auth(1, 1, Bytes::from(token_a.encode()))).await.unwrap();
    call(&mut local, Frame::auth(2, 2, Bytes::from(token_b.encode()))).await.unwrap();
    let data = random_bytes(300 << 10);
    let crc = staging.stage(4096, &data).unwrap();
    assert_eq!(crc, crc32c::crc32c(&data), "staging takes the crc of what it copies");
    let len = data.len() as u32;
    let staged = |at, crc| Staged { at, crc };
    // Job A holding B's grant, but not B's token: refused, as a Write would be.
    let (kind, message) =
        call(&mut local, Frame::write_staged(3, block.block_id, 0, len, staged(4096, crc)).authorized(1, grant))
            .await
            .expect_err("A writing B's block");
    assert_eq!(kind, ErrorKind::PermissionDenied, "{message}");
    // Bytes outside the staging area are refused, never read; the connection goes on.
    for at in [staging.len() as u64 - 10, u64::MAX - 5] {
        let (kind, message) =
            call(&mut local, Frame::write_staged(4, block.block_id, 0, len, staged(at, crc)).authorized(2, grant))
                .await
                .expect_err("a staged range outside the area");
        assert_eq!(kind, ErrorKind::Invalid, "{message}");
        assert!(message.contains("outside"), "{message}");
    }
    // A crc that does not match what the server copied: nothing is stored.
    let (kind, message) =
        call(&mut local, Frame::write_staged(5, block.block_id, 0, len, staged(4096, crc ^ 1)).authorized(2, grant))
            .await
            .expect_err("a staged write whose crc does not match");
    assert_eq!(kind, ErrorKind::Corrupt, "{message}");
    // The right crc: stored, and what the client then does to its staging area does not reach
    // the block (the server copied it).
    let reply =
        call(&mut local, Frame::write_staged(6, block.block_id, 0, len, staged(4096, crc)).authorized(2, grant))
            .await
            .unwrap();
    assert_eq!(reply.header.length, len, "the block's length after the write");
    staging.stage(4096, &vec![0u8; data.len()]).unwrap();
    let back = call(&mut local, Frame::read(7, block.block_id, 0, len).authorized(2, grant)).await.unwrap();
    assert!(back.payload[..] == data[..], "the block holds the staged bytes as they were at the write");

    // Over TCP a WriteStaged is not served, even to the block's own job.
    let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    frame::write_frame(&mut tcp, &Frame::auth(8, 1, Bytes::from(token_b.encode()))).await.unwrap();
    frame::read_frame(&mut tcp, frame::MAX_PAYLOAD_BYTES).await.unwrap().unwrap().into_result().unwrap();
    let request = Frame::write_staged(9, block.block_id, len, 1, staged(0, 0)).authorized(1, grant);
    frame::write_frame(&mut tcp, &request).await.unwrap();
    let reply = frame::read_frame(&mut tcp, frame::MAX_PAYLOAD_BYTES).await.unwrap().unwrap();
    let (kind, message) = reply.into_result().expect_err("a WriteStaged over TCP");
    assert_eq!(kind, ErrorKind::Invalid, "{message}");
    assert!(message.contains("own host"), "{message}");

    // The client writes through its staging area on a same-host connection: files of every edge
    // size read back exactly over TCP, and every block went staged.
    let requests = |op: &str| {
        let metrics = crate::monitoring::http_get(cluster.storage_admin_addr(0).parse().unwrap(), "/metrics").unwrap();
        let line = format!("tern_storage_requests_total{{op=\"{op}\"}} ");
        let count = metrics.lines().find_map(|l| l.strip_prefix(line.as_str())?.parse::<u64>().ok());
        count.unwrap_or_else(|| panic!("no {line} in the storage server's metrics"))
    };
    let (writes, staged) = (requests("write"), requests("write_staged"));
    let writer = cluster.client_over(TransportKind::Local).await;
    let reader = cluster.client_over(TransportKind::Tcp).await;
    for size in [1, BLOCK - 1, BLOCK, 3 * BLOCK + 7] {
        let data = Bytes::from(random_bytes(size));
        let path = format!("/same-host/written-{size}");
        writer.put(&path, data.clone()).await.unwrap();
        let back = reader.open(&path).await.unwrap().read_to_end().await.unwrap();
        assert!(back == data, "{path} read back differently");
    }
    assert_eq!(requests("write"), writes, "a same-host client's block written through the socket");
    assert_eq!(requests("write_staged") - staged, 1 + 1 + 1 + 4, "one staged write per block");
}
