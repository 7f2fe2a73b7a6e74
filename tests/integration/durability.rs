//! Durable metadata through real processes: the metadata server is killed with SIGKILL again and
//! again under concurrent file and shuffle load, and restarted on the same --dir and port; every
//! operation acknowledged before a kill must be there, byte for byte, afterwards.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::Cluster;
use tern_client::{Client, MapWriterOptions, ShuffleOptions};

const CYCLES: usize = 20;
const WRITERS: u32 = 4;
const PARTITIONS: u32 = 4;

/// The bytes of file `n` of writer `t`: recognisable, of varied sizes (some span blocks).
fn file_bytes(t: u32, n: u32) -> Vec<u8> {
    let len = 1 + (n as usize * 7919 + t as usize * 104_729) % (96 << 10);
    (0..len).map(|i| (i as u32 ^ (t << 5) ^ n.wrapping_mul(31)) as u8).collect()
}

/// What map `map` writes to `partition`.
fn map_bytes(map: u32, partition: u32) -> Vec<u8> {
    format!("map {map} partition {partition};").repeat(1 + (map as usize % 50)).into_bytes()
}

/// Each writer keeps this many of its files, deleting the oldest beyond it (so the cluster's DRAM
/// does not fill up, and deletes are checked too).
const FILES_KEPT: usize = 40;

#[derive(Default)]
struct Acked {
    files: BTreeMap<String, (u32, u32)>,
    /// Files whose deletion was acknowledged: they must stay gone.
    deleted: Vec<String>,
    maps: Vec<u32>,
    /// The last few failures, to print.
    errors: Vec<String>,
}

impl Acked {
    fn failed(&mut self, what: String) {
        if self.errors.len() >= 8 {
            self.errors.remove(0);
        }
        self.errors.push(what);
    }
}

/// Files and map commits until `stop`, recording each one acknowledged; failures (the metadata
/// server is down, or reconciling) are expected and counted.
async fn load(
    client: Client,
    root: String,
    shuffle: tern_client::Shuffle,
    t: u32,
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Acked>>,
    failures: Arc<AtomicU64>,
) {
    let small = MapWriterOptions { buffer_bytes: 64 << 10, batch_bytes: 4 << 10, pushes_in_flight: 4 };
    let mut n = 0u32;
    let mut mine = std::collections::VecDeque::new();
    while !stop.load(Ordering::Relaxed) {
        if mine.len() > FILES_KEPT {
            let oldest: String = mine.pop_front().expect("more than FILES_KEPT");
            let deleted = client.delete(&oldest, false).await;
            let mut acked = acked.lock().unwrap();
            // Deleted or not, an unacknowledged delete leaves the file in doubt: check it no more.
            acked.files.remove(&oldest);
            match deleted {
                Ok(_) => acked.deleted.push(oldest),
                Err(e) => acked.failed(format!("delete {oldest}: {e}")),
            }
        }
        let path = format!("{root}/w{t}/f{n}");
        match client.put(&path, Bytes::from(file_bytes(t, n))).await {
            Ok(()) => {
                acked.lock().unwrap().files.insert(path.clone(), (t, n));
                mine.push_back(path);
            }
            Err(e) => {
                acked.lock().unwrap().failed(format!("put {path}: {e}"));
                failures.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        // Dense map indexes, so one locate covers them all.
        let map = n * WRITERS + t;
        let mut writer = shuffle.writer_with(map, 0, small.clone());
        let mut pushed = true;
        for partition in 0..PARTITIONS {
            pushed &= writer.write(partition, &map_bytes(map, partition)).await.is_ok();
        }
        match writer.commit().await {
            Ok(outcome) if pushed && outcome.committed => acked.lock().unwrap().maps.push(map),
            outcome => {
                acked.lock().unwrap().failed(format!("map {map} (pushed: {pushed}): {outcome:?}"));
                failures.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        n += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_metadata_server_loses_no_acknowledged_operation() {
    let started = Instant::now();
    let mut cluster = Cluster::start(2, "256MiB").await;
    let client = cluster.client().await;
    let job = client.start_job(Some("crash"), Duration::from_secs(300)).await.unwrap();
    let root = "/jobs/crash".to_string();
    let shuffle = client.register_shuffle(job.id(), PARTITIONS, ShuffleOptions::default()).await.unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(Acked::default()));
    let failures = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..WRITERS {
        let (client, shuffle) = (client.clone(), shuffle.clone());
        let (stop, acked, failures) = (stop.clone(), acked.clone(), failures.clone());
        tasks.push(tokio::spawn(load(client, root.clone(), shuffle, t, stop, acked, failures)));
    }
    // Acknowledged (files put, files deleted, maps committed) before each kill.
    let mut acked_before_kill = Vec::new();
    for cycle in 0..CYCLES {
        // Let the load run (and the storage servers register again) between kills.
        tokio::time::sleep(Duration::from_millis(500 + 37 * (cycle as u64 % 7))).await;
        {
            let acked = acked.lock().unwrap();
            acked_before_kill.push((acked.files.len() + acked.deleted.len(), acked.deleted.len(), acked.maps.len()));
        }
        cluster.restart_metadata(cycle);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    cluster
        .wait_for("both storage servers to register again", Duration::from_secs(20), || async {
            let status = client.status().await.ok()?;
            (status.servers.iter().filter(|s| s.alive).count() == 2).then_some(())
        })
        .await;

    // Every acknowledged file reads back byte for byte.
    let acked = std::mem::take(&mut *acked.lock().unwrap());
    let mut lost = Vec::new();
    for (path, (t, n)) in &acked.files {
        let read = match client.open(path).await {
            Ok(reader) => reader.read_to_end().await,
            Err(e) => Err(e),
        };
        match read {
            Ok(bytes) if bytes == file_bytes(*t, *n) => {}
            Ok(bytes) => {
                lost.push(format!("{path}: {} bytes differ from the {} written", bytes.len(), file_bytes(*t, *n).len()))
            }
            Err(e) => lost.push(format!("{path}: {e}")),
        }
    }
    // Every acknowledged delete stays done.
    for path in &acked.deleted {
        match client.stat(path).await {
            Err(e) if e.kind() == tern_client::ErrorKind::NotFound => {}
            other => lost.push(format!("{path}: deleted, but stat says {other:?}")),
        }
    }
    // Every acknowledged map commit is committed, and its bytes read back.
    let end_map = acked.maps.iter().max().map_or(0, |m| m + 1);
    let mut read: BTreeMap<(u32, u32), Vec<u8>> = BTreeMap::new();
    match shuffle.reader(0..PARTITIONS, 0..end_map).await {
        Ok(reader) => match reader.read_to_end().await {
            Ok(batches) => {
                for batch in batches {
                    read.entry((batch.map, batch.partition)).or_default().extend_from_slice(&batch.data);
                }
            }
            Err(e) => lost.push(format!("reading the shuffle: {e}")),
        },
        Err(e) => lost.push(format!("locating the shuffle: {e}")),
    }
    for &map in &acked.maps {
        for partition in 0..PARTITIONS {
            if read.get(&(map, partition)) != Some(&map_bytes(map, partition)) {
                lost.push(format!("map {map} partition {partition}: not read back as committed"));
            }
        }
    }
    println!("last failures (expected while the metadata server is down):\n{}", acked.errors.join("\n"));
    let growth: Vec<String> = acked_before_kill.iter().map(|(f, d, m)| format!("{f}/{d}/{m}")).collect();
    println!(
        "crash-restart cycles run: {CYCLES}; acknowledged: {} files put, {} deleted, {} map commits (put/deleted/\
         committed before each kill: {}); failed attempts while down: {}; operations lost: {}; took {:.1?}",
        acked.files.len() + acked.deleted.len(),
        acked.deleted.len(),
        acked.maps.len(),
        growth.join(" "),
        failures.load(Ordering::Relaxed),
        lost.len(),
        started.elapsed()
    );
    assert!(lost.is_empty(), "{} acknowledged operations lost:\n{}\n{}", lost.len(), lost.join("\n"), cluster.logs());
    // The load made progress through the kills, not only before the first: in the last cycle too.
    let (files, _, maps) = acked_before_kill[CYCLES - 2];
    assert!(
        acked.files.len() + acked.deleted.len() > files && acked.maps.len() > maps,
        "no operation succeeded after the later restarts"
    );
    drop(job);
}

/// A storage server killed with SIGKILL and started again on the same NVMe path: its NVMe blocks
/// come back byte for byte (the tier's durable index), its DRAM blocks are reported lost, naming
/// the file, and never served stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_storage_server_keeps_its_nvme_blocks_and_reports_dram_lost() {
    use tern_client::StorageClass;
    let nvme = common::Nvme { size: "64MiB", engine: "auto" };
    let mut cluster = Cluster::start_with_nvme(1, "32MiB", nvme).await;
    let client = cluster.client().await;
    let mut files = Vec::new();
    for (i, len) in [1usize, 4096, 1 << 20, (3 << 20) + 17].into_iter().enumerate() {
        for (class, name) in [(StorageClass::Nvme, "nvme"), (StorageClass::Dram, "dram")] {
            let path = format!("/{name}-{i}");
            let data = common::random_bytes(len);
            client.put_with_class(&path, Bytes::from(data.clone()), class).await.unwrap();
            files.push((path, class, data));
        }
    }
    // One NVMe file deleted before the kill stays deleted, and its space comes back.
    client.put_with_class("/nvme-gone", Bytes::from(vec![7u8; 5000]), StorageClass::Nvme).await.unwrap();
    client.delete("/nvme-gone", false).await.unwrap();

    cluster.restart_storage(0);
    cluster.wait_storage_back(0, &client).await;
    for (path, class, data) in &files {
        let read = match client.open(path).await {
            Ok(reader) => reader.read_to_end().await,
            Err(e) => Err(e),
        };
        match class {
            StorageClass::Nvme => assert!(read.unwrap() == *data, "{path} reads back byte for byte"),
            _ => {
                let err = read.unwrap_err();
                assert_eq!(err.kind(), tern_client::ErrorKind::DataLost, "{path}: {err}");
                assert!(err.message().contains(path.as_str()), "the error names the file: {err}");
            }
        }
    }
    assert_eq!(client.stat("/nvme-gone").await.unwrap_err().kind(), tern_client::ErrorKind::NotFound);
    // Writing goes on, on both tiers.
    client.put_with_class("/after", Bytes::from(vec![1u8; 100_000]), StorageClass::Nvme).await.unwrap();
    assert_eq!(client.open("/after").await.unwrap().read_to_end().await.unwrap(), vec![1u8; 100_000]);
}
