//! The shuffle service through a real cluster: exactly-once commits, ranges, splits, frees,
//! lost servers, and pushes that wait for space.

use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::Cluster;
use tern_client::{ErrorKind, MapWriterOptions, ShuffleOptions, SpaceWait};
use tern_proto::v1::LocateShuffleRequest;

/// A recognisable record: which map, attempt and partition wrote it, and its number.
fn record(map: u32, attempt: u32, partition: u32, n: u32) -> Vec<u8> {
    format!("m{map:03}a{attempt}p{partition:03}n{n:06};").into_bytes()
}

/// Every record of (map, attempt) for `partition`: `count` of them.
fn records(map: u32, attempt: u32, partition: u32, count: u32) -> Vec<u8> {
    (0..count).flat_map(|n| record(map, attempt, partition, n)).collect()
}

/// Reads partitions x maps back into per-(partition, map) byte strings, checking order is stable.
async fn read_back(
    shuffle: &tern_client::Shuffle,
    partitions: std::ops::Range<u32>,
    maps: std::ops::Range<u32>,
) -> BTreeMap<(u32, u32), Vec<u8>> {
    let mut out: BTreeMap<(u32, u32), Vec<u8>> = BTreeMap::new();
    let mut last = None;
    for batch in shuffle.reader(partitions, maps).await.unwrap().read_to_end().await.unwrap() {
        assert!(last.is_none_or(|p| p <= batch.partition), "partitions come in order");
        last = Some(batch.partition);
        out.entry((batch.partition, batch.map)).or_default().extend_from_slice(&batch.data);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_one_attempt_per_map_is_read_over_any_range() {
    let cluster = Cluster::start(2, "128MiB").await;
    let client = cluster.client().await;
    let job = client.start_job(Some("exactly-once"), Duration::from_secs(30)).await.unwrap();
    let shuffle = client.register_shuffle(job.id(), 4, ShuffleOptions { maps: 3, ..Default::default() }).await.unwrap();
    // Small batches and a small buffer bound, so the pushes interleave and the bound is exercised.
    let small = MapWriterOptions { buffer_bytes: 8 << 10, batch_bytes: 2 << 10, pushes_in_flight: 4 };
    let write = |map: u32, attempt: u32| {
        let shuffle = shuffle.clone();
        let small = small.clone();
        async move {
            let mut writer = shuffle.writer_with(map, attempt, small);
            for n in 0..300 {
                for partition in 0..4 {
                    writer.write(partition, &record(map, attempt, partition, n)).await.unwrap();
                }
            }
            writer
        }
    };
    // Map 0: one clean attempt.
    assert!(write(0, 0).await.commit().await.unwrap().committed);
    // Map 1: attempt 0 fails before committing; attempt 1 commits.
    drop(write(1, 0).await);
    assert!(write(1, 1).await.commit().await.unwrap().committed);
    // Map 2: a speculative duplicate; attempt 1 commits first and wins, attempt 0 learns it lost.
    let (slow, fast) = (write(2, 0).await, write(2, 1).await);
    let won = fast.commit().await.unwrap();
    let lost = slow.commit().await.unwrap();
    assert_eq!((won.committed, won.winning_attempt), (true, 1));
    assert_eq!((lost.committed, lost.winning_attempt), (false, 1));

    let winners = [(0, 0), (1, 1), (2, 1)];
    let all = read_back(&shuffle, 0..4, 0..3).await;
    assert_eq!(all.len(), 12);
    for (map, attempt) in winners {
        for partition in 0..4 {
            assert!(all[&(partition, map)] == records(map, attempt, partition, 300), "partition {partition} map {map}");
        }
    }
    // The same read again yields the same bytes in the same order.
    assert_eq!(read_back(&shuffle, 0..4, 0..3).await, all);
    // Partition and map ranges (as AQE coalescing and skew splitting ask for them).
    let some = read_back(&shuffle, 1..3, 1..2).await;
    assert_eq!(some.keys().copied().collect::<Vec<_>>(), vec![(1, 1), (2, 1)]);
    assert!(some[&(2, 1)] == records(1, 1, 2, 300));
    // Exact lengths, without reading data.
    let lengths = shuffle.lengths(0..4, 0..3).await.unwrap();
    assert_eq!(lengths.len(), 3);
    for (map, bytes) in lengths {
        let attempt = winners[map as usize].1;
        let expected: Vec<u64> = (0..4).map(|p| records(map, attempt, p, 300).len() as u64).collect();
        assert_eq!(bytes, expected, "map {map}");
    }
    // After its data is lost a map can be invalidated and recommitted by a new attempt.
    assert_eq!(shuffle.invalidate_maps(&[0]).await.unwrap(), 1);
    assert!(write(0, 5).await.commit().await.unwrap().committed);
    assert!(read_back(&shuffle, 3..4, 0..1).await[&(3, 0)] == records(0, 5, 3, 300));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_past_its_split_size_continues_on_another_server() {
    let cluster = Cluster::start(2, "128MiB").await;
    let client = cluster.client().await;
    let job = client.start_job(None, Duration::from_secs(30)).await.unwrap();
    let options = ShuffleOptions { maps: 2, split_size_bytes: 1 << 20, ..Default::default() };
    let shuffle = client.register_shuffle(job.id(), 1, options).await.unwrap();
    // Map 1 writes through the shuffle as another process sees it: opened by id.
    let reopened = client.open_shuffle(shuffle.id()).await.unwrap();
    for map in 0..2 {
        let mut writer = if map == 0 { shuffle.writer(map, 0) } else { reopened.writer(map, 0) };
        for n in 0..(3 << 20) / 24 {
            writer.write(0, &record(map, 0, 0, n)).await.unwrap();
        }
        assert!(writer.commit().await.unwrap().committed);
    }
    let token = client.job_token(job.id()).unwrap();
    let mut metadata = crate::common::raw_metadata(&cluster.metadata_addr, Some(&token)).await;
    let located = metadata
        .locate_shuffle(LocateShuffleRequest {
            shuffle_id: shuffle.id().get(),
            end_partition: 1,
            end_map: 2,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(located.segments.len() >= 3, "6 MiB in 1 MiB segments: {:?}", located.segments);
    let servers: std::collections::HashSet<u64> = located.segments.iter().map(|s| s.server_id).collect();
    assert_eq!(servers.len(), 2, "segments on both servers");
    let back = read_back(&shuffle, 0..1, 0..2).await;
    for map in 0..2 {
        assert!(back[&(0, map)] == records(map, 0, 0, (3 << 20) / 24), "map {map} reads back whole across segments");
    }
}

fn used_blocks(status: &tern_client::StatusResponse) -> u64 {
    status.servers.iter().flat_map(|s| &s.tiers).map(|t| t.used_blocks).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ending_the_job_or_unregistering_frees_the_shuffle() {
    let cluster = Cluster::start(2, "128MiB").await;
    let client = cluster.client().await;
    for end_job in [false, true] {
        let job = client.start_job(None, Duration::from_secs(30)).await.unwrap();
        let shuffle = client.register_shuffle(job.id(), 8, ShuffleOptions::default()).await.unwrap();
        let mut writer = shuffle.writer(0, 0);
        for partition in 0..8 {
            writer.write(partition, &vec![partition as u8; 1 << 20]).await.unwrap();
        }
        writer.commit().await.unwrap();
        cluster
            .wait_for("the servers to report the shuffle's blocks", Duration::from_secs(10), || async {
                (used_blocks(&client.status().await.ok()?) >= 8).then_some(())
            })
            .await;
        if end_job {
            job.end().await.unwrap();
        } else {
            shuffle.unregister().await.unwrap();
        }
        cluster
            .wait_for("the shuffle's space to come back", Duration::from_secs(10), || async {
                (used_blocks(&client.status().await.ok()?) == 0).then_some(())
            })
            .await;
        let err = shuffle.reader(0..8, 0..1).await.err().unwrap();
        assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_names_exactly_the_maps_to_recompute() {
    let mut cluster = Cluster::start(2, "128MiB").await;
    let client = cluster.client().await;
    let job = client.start_job(None, Duration::from_secs(30)).await.unwrap();
    let shuffle = client.register_shuffle(job.id(), 4, ShuffleOptions { maps: 3, ..Default::default() }).await.unwrap();
    // Map 2 writes only to partition 0; maps 0 and 1 write everywhere.
    for map in 0..3 {
        let mut writer = shuffle.writer(map, 0);
        let partitions = if map == 2 { 0..1 } else { 0..4 };
        for partition in partitions {
            writer.write(partition, &records(map, 0, partition, 100)).await.unwrap();
        }
        writer.commit().await.unwrap();
    }
    let token = client.job_token(job.id()).unwrap();
    let mut metadata = crate::common::raw_metadata(&cluster.metadata_addr, Some(&token)).await;
    let located = metadata
        .locate_shuffle(LocateShuffleRequest {
            shuffle_id: shuffle.id().get(),
            end_partition: 4,
            end_map: 3,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let victim = cluster.storage_addrs[0].clone();
    let victim_partitions: Vec<u32> =
        located.segments.iter().filter(|s| s.address == victim).map(|s| s.partition).collect();
    let survivor_partition = located.segments.iter().find(|s| s.address != victim).map(|s| s.partition).unwrap();
    assert!(!victim_partitions.is_empty(), "partitions spread over both servers");
    cluster.kill_storage(0);
    cluster
        .wait_for("the server to be declared dead", Duration::from_secs(10), || async {
            client.status().await.ok()?.servers.iter().any(|s| s.address == victim && !s.alive).then_some(())
        })
        .await;
    let mut expected: Vec<u32> = vec![0, 1];
    if victim_partitions.contains(&0) {
        expected.push(2);
    }
    assert_eq!(shuffle.lost_maps(0..4, 0..3).await.unwrap(), expected);
    let err = shuffle.reader(0..4, 0..3).await.err().unwrap();
    assert_eq!(err.kind(), ErrorKind::DataLost);
    assert!(err.message().contains(&format!("shuffle {}", shuffle.id())) && err.message().contains("maps"), "{err}");
    // Partitions on the live server still read.
    let back = read_back(&shuffle, survivor_partition..survivor_partition + 1, 0..3).await;
    assert!(back[&(survivor_partition, 0)] == records(0, 0, survivor_partition, 100));
    // Recompute the lost maps with new attempts: they go to the surviving server.
    assert_eq!(shuffle.invalidate_maps(&expected).await.unwrap(), expected.len() as u32);
    for &map in &expected {
        let mut writer = shuffle.writer(map, 1);
        let partitions = if map == 2 { 0..1 } else { 0..4 };
        for partition in partitions {
            writer.write(partition, &records(map, 1, partition, 100)).await.unwrap();
        }
        assert!(writer.commit().await.unwrap().committed);
    }
    let lost_before: Vec<u32> = shuffle.lost_maps(0..4, 0..3).await.unwrap();
    assert!(lost_before.is_empty(), "after recomputation nothing is lost: {lost_before:?}");
    let back = read_back(&shuffle, 0..4, 0..3).await;
    assert!(back[&(victim_partitions[0], 0)] == records(0, 1, victim_partitions[0], 100));
}

/// The shuffle bytes storage server 0 reports in `tier`.
async fn shuffle_bytes(client: &tern_client::Client, tier: &str) -> Option<u64> {
    let status = client.status().await.ok()?;
    status.servers.first()?.tiers.iter().find(|t| t.tier == tier).map(|t| t.shuffle_bytes)
}

/// A storage server killed with SIGKILL and started again on the same NVMe path: the segments of
/// an `nvme` shuffle come back from NVMe and read byte for byte with nothing to recompute; those
/// of a `dram` shuffle are reported lost (its maps to recompute), never served stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_keeps_nvme_segments_and_reports_dram_ones_lost() {
    let nvme = common::Nvme { size: "128MiB", engine: "auto" };
    let mut cluster = Cluster::start_with_nvme(1, "64MiB", nvme).await;
    let client = cluster.client().await;
    let job = client.start_job(Some("restart"), Duration::from_secs(120)).await.unwrap();
    let mut shuffles = Vec::new();
    for class in ["nvme", "dram"] {
        let options = ShuffleOptions { maps: 3, storage_class: class.into(), ..Default::default() };
        let shuffle = client.register_shuffle(job.id(), 4, options).await.unwrap();
        for map in 0..3 {
            let mut writer = shuffle.writer(map, 0);
            for partition in 0..4 {
                writer.write(partition, &records(map, 0, partition, 2000)).await.unwrap();
            }
            assert!(writer.commit().await.unwrap().committed);
        }
        if class == "nvme" {
            // Idle for a tick of the mover, the segments move down whole and are sealed.
            cluster
                .wait_for("the nvme shuffle to be wholly on NVMe", Duration::from_secs(20), || async {
                    let on_nvme = shuffle_bytes(&client, "nvme").await? > 0;
                    (on_nvme && shuffle_bytes(&client, "dram").await? == 0).then_some(())
                })
                .await;
            // The seal follows the move in the same pass, within milliseconds; a tick covers it.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        shuffles.push(shuffle);
    }
    let (on_nvme, in_dram) = (&shuffles[0], &shuffles[1]);

    cluster.restart_storage(0);
    cluster.wait_storage_back(0, &client).await;
    assert_eq!(on_nvme.lost_maps(0..4, 0..3).await.unwrap(), Vec::<u32>::new(), "nothing to recompute");
    let back = read_back(on_nvme, 0..4, 0..3).await;
    for map in 0..3 {
        for partition in 0..4 {
            assert!(back[&(partition, map)] == records(map, 0, partition, 2000), "partition {partition} map {map}");
        }
    }
    assert_eq!(in_dram.lost_maps(0..4, 0..3).await.unwrap(), vec![0, 1, 2]);
    let err = in_dram.reader(0..4, 0..3).await.err().expect("a dram shuffle's segments are lost with the process");
    assert_eq!(err.kind(), ErrorKind::DataLost, "{err}");
}

/// A push refused for space waits (`SpaceWait`) and lands once space is freed meanwhile, telling
/// its hook at each pause; with nothing freed it fails when the wait runs out, saying how long it
/// waited and which server and tier are full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_refused_for_space_waits_for_room_within_its_bound() {
    let cluster = Cluster::start(1, "8MiB").await;
    let client = cluster.client().await;
    let job = client.start_job(Some("space-wait"), Duration::from_secs(30)).await.unwrap();
    let dram = || ShuffleOptions { storage_class: "dram".into(), ..Default::default() };
    // Three chunks make one batch, which fills most of one 1 MiB block.
    let chunk = vec![7u8; 300 << 10];
    // Five of the server's 8 blocks go to a first shuffle.
    let first = client.register_shuffle(job.id(), 1, dram()).await.unwrap();
    let mut writer = first.writer(0, 0);
    for _ in 0..15 {
        writer.write(0, &chunk).await.unwrap();
    }
    writer.commit().await.unwrap();

    // A second shuffle of four blocks does not fit beside it; its pushes wait, and the first pause frees the first.
    let second = client.register_shuffle(job.id(), 1, dram()).await.unwrap();
    let (paused, mut pauses) = tokio::sync::mpsc::unbounded_channel::<String>();
    let wait = SpaceWait {
        limit: Duration::from_secs(20),
        on_wait: Some(Arc::new(move |refusal: &tern_client::Error| {
            let _ = paused.send(refusal.to_string());
        })),
    };
    let freer = tokio::spawn(async move {
        let refusal = pauses.recv().await.expect("no push paused for space");
        first.unregister().await.unwrap();
        refusal
    });
    let mut writer = second.writer(0, 0).wait_for_space(wait);
    for _ in 0..12 {
        writer.write(0, &chunk).await.unwrap();
    }
    assert!(writer.commit().await.unwrap().committed);
    let refusal = freer.await.unwrap();
    assert!(refusal.contains("dram tier full") && refusal.contains(&cluster.storage_addrs[0]), "{refusal}");
    let read = read_back(&second, 0..1, 0..1).await;
    assert_eq!(read[&(0, 0)], chunk.repeat(12));

    // Nothing frees room for a third: it fails once its wait has run out.
    let third = client.register_shuffle(job.id(), 1, dram()).await.unwrap();
    let limit = Duration::from_secs(2);
    let mut writer = third.writer(0, 0).wait_for_space(SpaceWait { limit, on_wait: None });
    let started = std::time::Instant::now();
    let mut failed = None;
    for _ in 0..30 {
        if let Err(e) = writer.write(0, &chunk).await {
            failed = Some(e);
            break;
        }
    }
    let err = match failed {
        Some(e) => e,
        None => writer.commit().await.unwrap_err(),
    };
    let took = started.elapsed();
    assert_eq!(err.kind(), ErrorKind::OutOfSpace, "{err}");
    assert!(err.message().contains("still no room after waiting 2.") && err.message().contains("is full"), "{err}");
    assert!(took >= limit && took < limit * 3, "failed after {took:?} with a {limit:?} wait");
}
