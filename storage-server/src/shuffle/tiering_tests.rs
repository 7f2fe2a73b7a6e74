//! Shuffle segments across DRAM and NVMe: the mover's policy, pushes that go straight to NVMe,
//! and fetches that read extents of both tiers. The NVMe tier is a real O_DIRECT file under the
//! psync engine (tmpfs refuses O_DIRECT, so it lives in the crate's directory).

use std::sync::Arc;

use tern_common::ByteSize;
use tern_proto::shuffle::{batches, FetchRequest, FETCH_DONE};
use tern_proto::{ErrorKind, PartitionIndex, ShuffleId, StorageClass};

use super::test_wire::{pushed_by, wanted, written_by};
use super::{SegmentId, ShuffleBytes, ShuffleError, HIGH_WATERMARK, LOW_WATERMARK};
use crate::nvme::engine::{self, IoEngineChoice};
use crate::nvme::{device, NvmeTier};
use crate::store::BlockStore;

const BS: u32 = 64 << 10;
/// Three batches (each behind its 16-byte header) fill a slot but for a few bytes.
const BATCH: usize = 21_000;

/// A store of blocks of `BS`: too small for pieces, so segments take whole slots (see
/// `young_segments_take_pieces_of_slots_and_grow_into_whole_ones` for pieces).
async fn store(dram_blocks: u64, nvme_blocks: u64) -> (tempfile::TempDir, Arc<BlockStore>) {
    store_of(BS, dram_blocks, nvme_blocks).await
}

async fn store_of(block: u32, dram_blocks: u64, nvme_blocks: u64) -> (tempfile::TempDir, Arc<BlockStore>) {
    let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let path = dir.path().join("tier.nvme");
    let device = device::open(&path, Some(ByteSize(nvme_blocks * u64::from(block)))).unwrap();
    let engine = engine::choose(IoEngineChoice::Psync, Arc::new(device.file), device.align as usize).await.unwrap();
    let nvme = NvmeTier::new(engine, device.size, device.align, block).unwrap();
    let store = BlockStore::new(block, dram_blocks * u64::from(block)).unwrap().with_nvme(nvme);
    (dir, Arc::new(store))
}

fn seg(shuffle: u64, partition: u32) -> SegmentId {
    SegmentId { shuffle: ShuffleId::from_wire(shuffle), partition: PartitionIndex::from_wire(partition), index: 0 }
}

fn data(map: u32, n: u32) -> Vec<u8> {
    (0..BATCH).map(|i| (i as u32).wrapping_mul(7).wrapping_add(map * 131 + n * 17) as u8).collect()
}

async fn push(store: &BlockStore, id: SegmentId, class: StorageClass, map: u32, n: u32) -> Result<u64, ShuffleError> {
    store.push(id, pushed_by(map, 0, class), &data(map, n)).await
}

/// Every batch of `maps` (attempt 0), `max_bytes` a page, each checked against its crc.
async fn fetch_all(store: &BlockStore, id: SegmentId, maps: u32, max_bytes: u32) -> Vec<(u32, Vec<u8>)> {
    let maps: Vec<(u32, u32)> = (0..maps).map(|m| (m, 0)).collect();
    let maps = wanted(&maps);
    let (mut cursor, mut all) = (0, Vec::new());
    while cursor != FETCH_DONE {
        let request = FetchRequest { cursor, max_bytes, maps: maps.clone() };
        let page = store.fetch(id, &request).await.unwrap();
        assert_eq!(page.crc, crc32c::crc32c(&page.payload), "the page's crc covers its payload");
        for batch in batches(page.payload.clone()) {
            let (header, bytes) = batch.unwrap();
            assert_eq!(header.crc, crc32c::crc32c(&bytes));
            all.push((written_by(&header).0, bytes.to_vec()));
        }
        cursor = page.next_cursor;
    }
    all
}

fn blocks(store: &BlockStore) -> (u64, u64) {
    (store.dram().usage().used_blocks, store.nvme().unwrap().usage().used_blocks)
}

#[tokio::test]
async fn nvme_segments_move_each_full_slot_down_and_read_back_from_both_tiers() {
    let (_dir, store) = store(16, 16).await;
    let id = seg(1, 0);
    // 10 batches: slots of 3, 3, 3 and 1 (the last still taking batches).
    for n in 0..10 {
        push(&store, id, StorageClass::Nvme, n % 2, n).await.unwrap();
    }
    assert_eq!(blocks(&store), (4, 0));
    assert_eq!(store.move_shuffles_down().await, 3, "the three full slots, at once: not a matter of pressure");
    assert_eq!(blocks(&store), (1, 3));
    let stored = |batches: u64| batches * (BATCH as u64 + 16);
    assert_eq!(store.shuffle_bytes(), ShuffleBytes { dram: stored(1), nvme: stored(9) });
    assert_eq!(store.move_shuffles_down().await, 0, "the open slot stays in DRAM");

    // By map, then arrival, whatever tier each batch is in, in pages of every size.
    let want: Vec<(u32, Vec<u8>)> = [0, 1]
        .iter()
        .flat_map(|&map| (0..10).filter(move |n| n % 2 == map).map(move |n| (map, data(map, n))))
        .collect();
    for max_bytes in [1, 30_000, 100_000, u32::MAX] {
        assert_eq!(fetch_all(&store, id, 2, max_bytes).await, want, "pages of {max_bytes} bytes");
    }

    // A page read from NVMe starts reading the next one ahead.
    let request = FetchRequest { cursor: 0, max_bytes: 1, maps: wanted(&[(0, 0), (1, 0)]) };
    store.fetch(id, &request).await.unwrap();
    let ahead = store.shuffles().read_ahead_bytes.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(ahead, BATCH + 16, "the second page's batch");
    let request = FetchRequest { cursor: 1, ..request };
    let page = store.fetch(id, &request).await.unwrap();
    assert_eq!(page.payload.len(), BATCH + 16);
    assert_eq!(&page.payload[16..], &data(0, 2)[..], "map 0's second batch, taken from the read-ahead");
    assert_eq!(page.layout, crate::shuffle::PageLayout::Disk, "a page read from NVMe is never lent");

    // Freeing gives both tiers their slots back, once the reads ahead still under way are done.
    assert_eq!(store.free_shuffles([ShuffleId::from_wire(1)]), 1);
    assert_eq!(store.shuffle_bytes(), ShuffleBytes::default());
    for _ in 0..100 {
        if blocks(&store) == (0, 0) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(blocks(&store), (0, 0));
    assert_eq!(store.shuffles().read_ahead_bytes.load(std::sync::atomic::Ordering::Relaxed), 0);
}

/// Spark's small shuffles: 200 partitions of a few hundred bytes each take pieces of 4 slots, not
/// 200 slots; a partition that grows goes on to a bigger piece, then to whole slots; under
/// pressure new partitions still take pieces, whole slots move down and pieces stay; `nvme`
/// segments take whole slots.
#[tokio::test]
async fn young_segments_take_pieces_of_slots_and_grow_into_whole_ones() {
    const BLOCK: u32 = 256 << 10;
    // 32 slots: pieces of 4 KiB (64 a slot) and of 32 KiB, each size cutting at most 4 slots.
    let (_dir, store) = store_of(BLOCK, 32, 64).await;
    let small = |p: u32, n: u32| -> Vec<u8> { (0..300).map(|i| (i + p * 7 + n * 13) as u8).collect() };
    let any = pushed_by(0, 0, StorageClass::Any);
    for p in 0..200 {
        store.push(seg(1, p), any, &small(p, 0)).await.unwrap();
    }
    assert_eq!(blocks(&store), (4, 0), "200 partitions in pieces of 4 slots");
    // Partition 0 grows by 3000-byte batches: 1 more fits its 4 KiB piece, 10 a 32 KiB one, and
    // the rest go to a whole slot.
    let grow = |n: u32| -> Vec<u8> { (0..3000).map(|i| (i * 3 + n) as u8).collect() };
    for n in 0..12 {
        store.push(seg(1, 0), any, &grow(n)).await.unwrap();
    }
    assert_eq!(blocks(&store), (6, 0), "one slot cut into 32 KiB pieces, one whole");
    // An `nvme` segment takes a whole slot, which the mover writes down whole.
    let nvme = pushed_by(0, 0, StorageClass::Nvme);
    store.push(seg(2, 0), nvme, &small(0, 0)).await.unwrap();
    assert_eq!(blocks(&store), (7, 0));
    // Past the high watermark whole slots move and pieces stay.
    for n in 0..24 {
        store.push(seg(3, n), any, &data(0, n)).await.unwrap();
        store.push(seg(3, n), any, &vec![n as u8; 200_000]).await.unwrap();
    }
    // Still past the high watermark, a new small partition takes a piece, not an NVMe slot.
    let before = blocks(&store);
    assert!(before.0 as f64 >= HIGH_WATERMARK * 32.0 && before.1 > 0, "{before:?}");
    store.push(seg(4, 0), any, &small(0, 0)).await.unwrap();
    assert_eq!(blocks(&store), before);
    store.move_shuffles_down().await;
    let (dram, disk) = blocks(&store);
    assert!((dram as f64) < LOW_WATERMARK * 32.0 && dram + disk == 7 + 24, "{dram} slots in DRAM, {disk} on NVMe");
    assert_eq!(store.shuffles().slots_cut(), [4, 1], "every piece still in DRAM");
    for p in 0..200 {
        let mut want = vec![(0, small(p, 0))];
        if p == 0 {
            want.extend((0..12).map(|n| (0, grow(n))));
        }
        assert_eq!(fetch_all(&store, seg(1, p), 1, u32::MAX).await, want, "partition {p}");
    }
    let all = [1, 2, 3, 4].map(ShuffleId::from_wire);
    assert_eq!(store.free_shuffles(all), 200 + 1 + 24 + 1, "segments freed");
    assert_eq!(blocks(&store), (0, 0));
}

#[tokio::test]
async fn any_segments_move_down_only_past_the_high_watermark_until_the_low_one() {
    let (_dir, store) = store(20, 32).await;
    // 12 slots of 20 (60%): below the high watermark, nothing moves.
    for p in 0..4 {
        for n in 0..9 {
            push(&store, seg(2, p), StorageClass::Any, 0, n).await.unwrap();
        }
    }
    assert_eq!(blocks(&store), (12, 0));
    assert_eq!(store.move_shuffles_down().await, 0);
    // Up to 17 of 20 (85%) in DRAM, then new slots come from NVMe; full slots move, oldest
    // first, until under 70%.
    for p in 0..2 {
        for n in 9..18 {
            push(&store, seg(2, p), StorageClass::Any, 0, n).await.unwrap();
        }
    }
    let high = (HIGH_WATERMARK * 20.0).ceil() as u64;
    assert_eq!(blocks(&store), (high, 18 - high));
    let moved = store.move_shuffles_down().await;
    let (dram, nvme) = blocks(&store);
    assert_eq!((dram + nvme, nvme as usize), (18, 18 - high as usize + moved));
    assert!((dram as f64) < LOW_WATERMARK * 20.0 && (dram as f64 + 1.0) >= LOW_WATERMARK * 20.0, "{dram} in DRAM");
    for p in 0..4 {
        let pushed = if p < 2 { 18 } else { 9 };
        let want: Vec<_> = (0..pushed).map(|n| (0, data(0, n))).collect();
        assert_eq!(fetch_all(&store, seg(2, p), 1, u32::MAX).await, want, "partition {p}");
    }
}

#[tokio::test]
async fn dram_segments_never_move_and_are_refused_at_once_when_dram_is_full() {
    let (_dir, store) = store(4, 8).await;
    for n in 0..12 {
        push(&store, seg(3, 0), StorageClass::Dram, 0, n).await.unwrap();
    }
    assert_eq!(store.move_shuffles_down().await, 0);
    let started = std::time::Instant::now();
    let err = push(&store, seg(3, 0), StorageClass::Dram, 0, 12).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfSpace);
    assert!(started.elapsed() < std::time::Duration::from_secs(1), "a dram push does not wait for the mover");
    assert_eq!(blocks(&store), (4, 0));
}

#[tokio::test]
async fn pushes_past_dram_go_down_and_lose_nothing() {
    let (_dir, store) = store(4, 64).await;
    let mover = tokio::spawn(store.clone().run_shuffle_mover());
    // 8 partitions, 3 maps each, writing 20 slots' worth through a DRAM of 4 slots.
    let mut writers = Vec::new();
    for p in 0..8 {
        let store = store.clone();
        writers.push(tokio::spawn(async move {
            for n in 0..8 {
                push(&store, seg(4, p), StorageClass::Any, n % 3, n).await.unwrap();
            }
        }));
    }
    for writer in writers {
        writer.await.unwrap();
    }
    assert!(blocks(&store).1 > 0, "data went down to NVMe");
    for p in 0..8 {
        let mut want: Vec<_> = (0..8).map(|n| (n % 3, data(n % 3, n))).collect();
        want.sort_by_key(|(map, _)| *map);
        assert_eq!(fetch_all(&store, seg(4, p), 3, 100_000).await, want, "partition {p}");
    }
    let bytes = store.shuffle_bytes();
    assert_eq!(bytes.dram + bytes.nvme, 64 * (BATCH as u64 + 16));
    mover.abort();
}

#[tokio::test]
async fn a_server_with_both_tiers_full_refuses_pushes_out_of_space_and_recovers_after_a_free() {
    let (_dir, store) = store(2, 2).await;
    let mover = tokio::spawn(store.clone().run_shuffle_mover());
    let mut pushed = 0;
    let err = loop {
        match push(&store, seg(5, pushed % 2), StorageClass::Any, 0, pushed).await {
            Ok(_) => pushed += 1,
            Err(e) => break e,
        }
        assert!(pushed < 100, "both tiers hold 4 slots of 3 batches");
    };
    assert_eq!(err.kind(), ErrorKind::OutOfSpace, "{err}");
    assert!(err.to_string().contains("both tiers are full: dram 2 of 2 blocks in use, nvme 2 of 2"), "{err}");
    assert!(pushed >= 9, "{pushed} batches before the refusal");
    assert_eq!(blocks(&store), (2, 2));
    store.free_shuffles([ShuffleId::from_wire(5)]);
    assert_eq!(blocks(&store), (0, 0));
    assert_eq!(store.shuffle_bytes(), ShuffleBytes::default());
    push(&store, seg(6, 0), StorageClass::Any, 0, 0).await.unwrap();
    mover.abort();
}

/// Writes `bytes` as DRAM block `block` the way the block service does.
async fn write_block(store: &BlockStore, block: u64, bytes: &[u8]) -> Result<u32, crate::block_table::StoreError> {
    let id = tern_proto::BlockId::new(tern_proto::Tier::Dram, block);
    let mut write = store.begin_dram_write(id, 0, bytes.len() as u32).await?;
    write.buf().copy_from_slice(bytes);
    write.commit(crc32c::crc32c(bytes))
}

#[tokio::test]
async fn a_file_block_written_while_any_shuffle_data_fills_dram_makes_room_on_nvme() {
    // The mover is behind (not running at all here): `any` shuffle data holds every DRAM slot.
    let (_dir, store) = store(4, 16).await;
    let mut pushed = 0;
    while store.dram().usage().used_blocks < 4 {
        push(&store, seg(8, pushed % 2), StorageClass::Any, 0, pushed).await.unwrap();
        pushed += 1;
    }
    assert_eq!(blocks(&store), (4, 0));
    // A file block placed in DRAM goes in: a shuffle slot moves down to make room, rather than
    // the write be refused with NVMe free.
    assert_eq!(write_block(&store, 1, b"file bytes").await, Ok(10));
    assert_eq!(blocks(&store), (4, 1), "one shuffle slot moved down for the block");
    for p in 0..2 {
        let want: Vec<_> = (0..pushed).filter(|n| n % 2 == p).map(|n| (0, data(0, n))).collect();
        assert_eq!(fetch_all(&store, seg(8, p), 1, u32::MAX).await, want, "partition {p}");
    }
    // Only `dram` shuffle data left in DRAM, beside the blocks: nothing may move, the write is
    // refused, naming the tier.
    store.free_shuffles([ShuffleId::from_wire(8)]);
    while store.dram().usage().used_blocks < 4 {
        push(&store, seg(9, 0), StorageClass::Dram, 0, pushed).await.unwrap();
        pushed += 1;
    }
    let err = write_block(&store, 2, b"file bytes").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfSpace);
    assert!(err.to_string().contains("dram tier full"), "{err}");
}

#[tokio::test]
async fn with_dram_full_of_blocks_pushes_append_to_nvme_in_any_size() {
    let (_dir, store) = store(4, 8).await;
    for block in 0..4 {
        let mut write = store.dram().begin_write(tern_proto::BlockId::from_wire(block), 0, 10).unwrap();
        write.buf().copy_from_slice(b"file bytes");
        write.commit(crc32c::crc32c(b"file bytes")).unwrap();
    }
    // A dram shuffle has nowhere to go.
    let err = push(&store, seg(7, 0), StorageClass::Dram, 0, 0).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfSpace);
    assert_eq!(store.shuffle_segments(), 0, "a refused first push creates nothing");
    // An any shuffle goes to NVMe: batches of odd sizes, appended at unaligned offsets.
    let mut want = Vec::new();
    for n in 0..60u32 {
        let (map, len) = (n % 3, 1 + (n as usize * 977) % 9000);
        let batch: Vec<u8> = (0..len).map(|i| (i as u32 * 13 + n) as u8).collect();
        store.push(seg(7, 1), pushed_by(map, 0, StorageClass::Any), &batch).await.unwrap();
        want.push((map, batch));
    }
    want.sort_by_key(|(map, _)| *map);
    assert_eq!(store.dram().usage().used_blocks, 4, "nothing of it in DRAM");
    let nvme = store.nvme().unwrap().usage().used_blocks;
    assert!((4..=6).contains(&nvme), "{nvme} NVMe slots for 60 batches of 4.5 KiB on average");
    assert_eq!(store.shuffle_bytes().dram, 0);
    for max_bytes in [1, 5000, u32::MAX] {
        assert_eq!(fetch_all(&store, seg(7, 1), 3, max_bytes).await, want, "pages of {max_bytes} bytes");
    }
    // Freed DRAM takes pushes again; the segment goes on in both tiers.
    store.free((0..4).map(tern_proto::BlockId::from_wire));
    push(&store, seg(7, 1), StorageClass::Any, 0, 99).await.unwrap();
    assert_eq!(store.dram().usage().used_blocks, 1);
    want.insert(want.iter().position(|(map, _)| *map == 1).unwrap(), (0, data(0, 99)));
    assert_eq!(fetch_all(&store, seg(7, 1), 3, u32::MAX).await, want);
}

#[tokio::test]
async fn quota_stops_keep_a_shuffles_batches_off_the_closed_tier_and_usage_counts_each_shuffle() {
    use tern_proto::v1::QuotaStop;
    let (_dir, store) = store(16, 16).await;
    let stored = |batches: u64| batches * (BATCH as u64 + 16);
    push(&store, seg(1, 0), StorageClass::Any, 0, 0).await.unwrap();
    push(&store, seg(2, 0), StorageClass::Any, 0, 0).await.unwrap();
    let stop =
        |shuffle_id, dram, nvme| QuotaStop { shuffle_id, dram, nvme, reason: format!("tenant t{shuffle_id} at quota") };

    // Past its DRAM quota, a shuffle that may use NVMe goes there, also its open segment's batches.
    store.set_quota_stops(&[stop(1, true, false)]);
    push(&store, seg(1, 0), StorageClass::Any, 0, 1).await.unwrap();
    push(&store, seg(1, 1), StorageClass::Any, 0, 2).await.unwrap();
    push(&store, seg(2, 0), StorageClass::Any, 0, 1).await.unwrap();
    let usage: Vec<(u64, u64, u64)> =
        store.shuffle_usage().iter().map(|u| (u.shuffle_id, u.dram_bytes, u.nvme_bytes)).collect();
    assert_eq!(usage, [(1, stored(1), stored(2)), (2, stored(2), 0)]);

    // With no tier left (a `dram` shuffle past its DRAM quota, or both closed) a push is refused
    // with the tenant's reason; other shuffles push on.
    store.set_quota_stops(&[stop(1, true, true), stop(3, true, false)]);
    for (id, class) in [(seg(1, 0), StorageClass::Any), (seg(3, 0), StorageClass::Dram)] {
        let err = push(&store, id, class, 0, 3).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::QuotaExceeded);
        let want = format!("tenant t{} at quota", id.shuffle.get());
        assert!(err.to_string().contains(&want), "{err}");
    }
    push(&store, seg(2, 0), StorageClass::Any, 0, 2).await.unwrap();
    // The next reply's list replaces the last.
    store.set_quota_stops(&[]);
    push(&store, seg(1, 0), StorageClass::Any, 0, 3).await.unwrap();
    assert_eq!(fetch_all(&store, seg(1, 0), 1, 1 << 20).await.len(), 3);
}

/// Map `map`'s batches in push order, as (partition, bytes): 6 rounds over 200 partitions, of
/// 1 B to 3 KB, and to 60 KB for every 7th partition.
fn map_batches(map: u32) -> impl Iterator<Item = (u32, Vec<u8>)> {
    let mut rng = u64::from(map) * 7919 + 1;
    (0..6u32).flat_map(|round| (0..200u32).map(move |p| (round, p))).map(move |(round, p)| {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let len = 1 + (rng >> 33) as usize % if p % 7 == 0 { 60_000 } else { 3_000 };
        let seed = (map * 31) ^ (p * 7) ^ (round * 13);
        (p, (0..len).map(|i| (i as u32 ^ seed) as u8).collect())
    })
}

/// 24 maps pushing at once to 200 partitions (partitions growing through both piece sizes into
/// whole slots, pieces of many segments sharing slots): every partition reads back exactly, by
/// map then arrival.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_maps_across_pieces_and_slots_read_back_exactly() {
    const MAPS: u32 = 24;
    let (_dir, store) = store_of(1 << 20, 1024, 64).await;
    let pushing = (0..MAPS).map(|map| {
        let store = store.clone();
        tokio::spawn(async move {
            for (p, bytes) in map_batches(map) {
                let from = pushed_by(map, 0, StorageClass::Any);
                store.push(seg(9, p), from, &bytes).await.unwrap();
            }
        })
    });
    for task in pushing.collect::<Vec<_>>() {
        task.await.unwrap();
    }
    assert!(store.shuffles().slots_cut().iter().all(|&cut| cut > 0), "both piece sizes in use");
    for p in 0..200 {
        let want: Vec<(u32, Vec<u8>)> = (0..MAPS)
            .flat_map(|map| map_batches(map).filter(|(q, _)| *q == p).map(move |(_, bytes)| (map, bytes)))
            .collect();
        assert!(fetch_all(&store, seg(9, p), MAPS, 1 << 20).await == want, "partition {p} differs");
    }
}
