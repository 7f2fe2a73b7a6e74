//! The shuffle rules seen through the server's router, as the service sees them: push, pages,
//! copy, free and the bounds, in DRAM. (Tiering is in `tiering_tests`, restarts in
//! `durable_tests`.)

use std::sync::Arc;

use tern_proto::frame::MAX_PAYLOAD_BYTES;
use tern_proto::shuffle::{batches, FetchRequest, BATCH_HEADER_LEN, FETCH_DONE};
use tern_proto::{ErrorKind, MapIndex, PartitionIndex, ServerId, ShuffleId, StorageClass};

use super::free::FREED_REMEMBERED;
use super::push::MIN_BYTES_PER_BATCH;
use super::test_wire::{pushed_by, wanted, written_by};
use super::{max_batch_bytes, FetchPage, PageLayout, SegmentId, ShuffleError};
use crate::store::BlockStore;

const BS: u32 = 4096;

fn seg(shuffle: u64, partition: u32, index: u32) -> SegmentId {
    SegmentId { shuffle: ShuffleId::from_wire(shuffle), partition: PartitionIndex::from_wire(partition), index }
}

fn data(map: u32, attempt: u32, n: u32, len: usize) -> Vec<u8> {
    (0..len).map(|i| (map as usize * 131 + attempt as usize * 31 + n as usize * 7 + i) as u8).collect()
}

fn push(store: &BlockStore, id: SegmentId, map: u32, attempt: u32, batch: &[u8]) -> Result<u64, ShuffleError> {
    futures::executor::block_on(store.push(id, pushed_by(map, attempt, StorageClass::Any), batch))
}

fn fetch(store: &BlockStore, id: SegmentId, request: &FetchRequest) -> Result<FetchPage, ShuffleError> {
    futures::executor::block_on(store.fetch(id, request))
}

fn request(cursor: u32, max_bytes: u32, maps: &[(u32, u32)]) -> FetchRequest {
    FetchRequest { cursor, max_bytes, maps: wanted(maps) }
}

/// Every batch of a page, checked against its crc.
fn parse(page: &FetchPage) -> Vec<(u32, u32, Vec<u8>)> {
    let parsed: Vec<_> = batches(page.payload.clone())
        .map(|batch| {
            let (header, bytes) = batch.unwrap();
            assert_eq!(header.crc, crc32c::crc32c(&bytes));
            assert_eq!(header.len as usize, bytes.len());
            let (map, attempt) = written_by(&header);
            (map, attempt, bytes.to_vec())
        })
        .collect();
    assert_eq!(parsed.len(), page.batches as usize);
    parsed
}

/// Pages through the whole of `maps`' batches, `max_bytes` at a time.
fn fetch_all(store: &BlockStore, id: SegmentId, maps: &[(u32, u32)], max_bytes: u32) -> Vec<(u32, u32, Vec<u8>)> {
    let mut cursor = 0;
    let mut all = Vec::new();
    for _ in 0..10_000 {
        let page = fetch(store, id, &request(cursor, max_bytes, maps)).unwrap();
        let parsed = parse(&page);
        assert!(!parsed.is_empty() || page.next_cursor == FETCH_DONE, "an empty page must end the fetch");
        all.extend(parsed);
        if page.next_cursor == FETCH_DONE {
            return all;
        }
        assert_eq!(page.next_cursor, cursor + page.batches);
        cursor = page.next_cursor;
    }
    panic!("fetch never finished");
}

/// A segment whose partition moved on before any push reached it (its placement was replaced
/// when a server was lost) is copied as what it is, empty: closing it succeeds and says nothing
/// is held, and a late push is refused as by a closed segment, so the empty copy stays the same
/// segment.
#[test]
fn a_segment_never_pushed_to_closes_empty_and_refuses_late_pushes() {
    let store = BlockStore::new(BS, 8 * BS as u64).unwrap();
    let id = seg(4, 1, 0);
    assert!(!futures::executor::block_on(store.close_segment_for_copy(id)).unwrap(), "nothing was pushed");
    let refused = push(&store, id, 0, 0, &data(0, 0, 1, 10)).unwrap_err();
    assert!(matches!(refused, ShuffleError::Closed { .. }) && refused.kind() == ErrorKind::OutOfSpace, "{refused}");
    // Other segments of the shuffle take pushes as before.
    push(&store, seg(4, 1, 1), 0, 0, &data(0, 0, 1, 10)).unwrap();
    store.free_shuffles([ShuffleId::from_wire(4)]);
    let err = futures::executor::block_on(store.close_segment_for_copy(id)).unwrap_err();
    assert!(matches!(err, ShuffleError::NotHeld { .. }), "a freed shuffle's segment is not closed anew: {err}");
}

/// What a segment copy does (see `crate::copier`), in process: close, page through every
/// batch, push each to another server's segment. The copy serves the same pages at the same
/// cursors for any committed attempts, and freeing the original drops only that segment.
#[test]
fn a_closed_segment_refuses_pushes_and_its_copy_serves_the_same_pages() {
    let (source, target) = (BlockStore::new(BS, 8 * BS as u64).unwrap(), BlockStore::new(BS, 8 * BS as u64).unwrap());
    let (id, other) = (seg(3, 1, 0), seg(3, 2, 0));
    for (n, (map, attempt)) in [(0, 0), (1, 0), (0, 1), (0, 0), (1, 0), (0, 1)].into_iter().enumerate() {
        push(&source, id, map, attempt, &data(map, attempt, n as u32, 700 + n * 10)).unwrap();
    }
    push(&source, other, 0, 0, &data(0, 0, 9, 10)).unwrap();
    assert!(futures::executor::block_on(source.close_segment_for_copy(id)).unwrap(), "the segment is held");
    let refused = push(&source, id, 1, 0, &data(1, 0, 9, 10)).unwrap_err();
    assert!(matches!(refused, ShuffleError::Closed { .. }) && refused.kind() == ErrorKind::OutOfSpace, "{refused}");
    let mut cursor = 0;
    let mut pushed = 0;
    loop {
        let page = futures::executor::block_on(source.copy_page(id, cursor, 1500)).unwrap();
        for (map, attempt, bytes) in parse(&page) {
            pushed += bytes.len() as u64;
            assert_eq!(push(&target, id, map, attempt, &bytes).unwrap(), pushed);
        }
        if page.next_cursor == FETCH_DONE {
            break;
        }
        cursor = page.next_cursor;
    }
    assert_eq!(pushed, (0..6).map(|n| 700 + n * 10).sum::<u64>(), "every attempt's batches");
    for committed in [&[(0, 1), (1, 0)][..], &[(0, 0)][..]] {
        assert_eq!(fetch_all(&target, id, committed, 1000), fetch_all(&source, id, committed, 1000));
        let (a, b) = (fetch(&source, id, &request(1, 800, committed)), fetch(&target, id, &request(1, 800, committed)));
        assert_eq!(a.unwrap(), b.unwrap(), "the same cursor means the same page on either copy");
    }
    assert_eq!(source.free_segments([id, seg(3, 5, 0)]), 1);
    assert!(matches!(fetch(&source, id, &request(0, 800, &[(0, 0)])), Err(ShuffleError::NotHeld { .. })));
    assert_eq!(fetch_all(&source, other, &[(0, 0)], 1000).len(), 1, "the shuffle's other segments stay");
}

#[test]
fn batches_append_across_blocks() {
    let store = BlockStore::new(BS, 4 * BS as u64).unwrap();
    let id = seg(1, 2, 0);
    let batch = |n| data(0, 0, n, 1500);
    // Two batches (each behind its 16-byte header) fit a block; the third starts the next one,
    // leaving 1064 bytes unused.
    assert_eq!(push(&store, id, 0, 0, &batch(0)).unwrap(), 1500);
    assert_eq!(push(&store, id, 0, 0, &batch(1)).unwrap(), 3000);
    assert_eq!(store.dram().usage().used_blocks, 1);
    assert_eq!(push(&store, id, 0, 0, &batch(2)).unwrap(), 4500);
    assert_eq!(store.dram().usage().used_blocks, 2);
    assert_eq!(store.dram().usage().used_bytes, 4500 + 3 * 16);
    // The largest batch, with its header, takes a block of its own.
    let whole = data(0, 0, 3, BS as usize - 16);
    assert_eq!(push(&store, id, 0, 0, &whole).unwrap(), 4500 + u64::from(BS) - 16);
    assert_eq!(store.dram().usage().used_blocks, 3);
    assert_eq!(store.shuffle_segments(), 1);

    let page = fetch(&store, id, &request(0, u32::MAX, &[(0, 0)])).unwrap();
    assert_eq!((page.batches, page.next_cursor), (4, FETCH_DONE));
    let got = parse(&page);
    let want: Vec<_> = [batch(0), batch(1), batch(2), whole].into_iter().map(|b| (0, 0, b)).collect();
    assert_eq!(got, want);
}

#[test]
fn batches_come_by_map_then_arrival() {
    let store = BlockStore::new(BS, 8 * BS as u64).unwrap();
    let id = seg(1, 0, 0);
    let pushes = [(2, 0), (0, 0), (2, 1), (1, 0), (0, 0), (2, 0), (1, 0)];
    for (n, (map, attempt)) in pushes.iter().enumerate() {
        push(&store, id, *map, *attempt, &data(*map, *attempt, n as u32, 100 + n)).unwrap();
    }
    let got = fetch_all(&store, id, &[(0, 0), (1, 0), (2, 0)], u32::MAX);
    let want = vec![
        (0, 0, data(0, 0, 1, 101)),
        (0, 0, data(0, 0, 4, 104)),
        (1, 0, data(1, 0, 3, 103)),
        (1, 0, data(1, 0, 6, 106)),
        (2, 0, data(2, 0, 0, 100)),
        (2, 0, data(2, 0, 5, 105)),
    ];
    assert_eq!(got, want);
    // Later pushes of an uncommitted attempt do not move what the cursor points at.
    let first = fetch(&store, id, &request(0, 1, &[(0, 0), (1, 0), (2, 0)])).unwrap();
    push(&store, id, 0, 7, b"late attempt").unwrap();
    push(&store, id, 1, 1, b"another").unwrap();
    let mut got = parse(&first);
    got.extend(fetch_all_from(&store, id, first.next_cursor, &[(0, 0), (1, 0), (2, 0)]));
    assert_eq!(got, want);
}

fn fetch_all_from(store: &BlockStore, id: SegmentId, cursor: u32, maps: &[(u32, u32)]) -> Vec<(u32, u32, Vec<u8>)> {
    let page = fetch(store, id, &request(cursor, u32::MAX, maps)).unwrap();
    assert_eq!(page.next_cursor, FETCH_DONE);
    parse(&page)
}

#[test]
fn only_committed_attempts_are_served() {
    let store = BlockStore::new(BS, 8 * BS as u64).unwrap();
    let id = seg(4, 1, 3);
    push(&store, id, 0, 0, b"map 0 attempt 0, lost executor").unwrap();
    push(&store, id, 0, 1, b"map 0 attempt 1").unwrap();
    push(&store, id, 1, 0, b"map 1").unwrap();
    push(&store, id, 0, 1, b"map 0 attempt 1, more").unwrap();
    push(&store, id, 5, 0, b"map 5, not committed").unwrap();
    let got = fetch_all(&store, id, &[(0, 1), (1, 0), (3, 0)], u32::MAX);
    let want =
        vec![(0, 1, b"map 0 attempt 1".to_vec()), (0, 1, b"map 0 attempt 1, more".to_vec()), (1, 0, b"map 1".to_vec())];
    assert_eq!(got, want);
    // Nothing committed: an empty page that says done.
    let page = fetch(&store, id, &request(0, u32::MAX, &[])).unwrap();
    assert_eq!((page.payload.len(), page.batches, page.next_cursor), (0, 0, FETCH_DONE));
    let page = fetch(&store, id, &request(0, u32::MAX, &[(0, 2)])).unwrap();
    assert_eq!((page.batches, page.next_cursor), (0, FETCH_DONE));
    // A cursor at the end is done; past it, refused.
    let page = fetch(&store, id, &request(3, u32::MAX, &[(0, 1), (1, 0)])).unwrap();
    assert_eq!((page.batches, page.next_cursor), (0, FETCH_DONE));
    let err = fetch(&store, id, &request(4, u32::MAX, &[(0, 1), (1, 0)])).unwrap_err();
    assert_eq!(err, ShuffleError::CursorPastEnd { segment: id, cursor: 4, held: 3 });
    assert_eq!(err.kind(), ErrorKind::Invalid);
}

#[test]
fn small_pages_return_every_batch_exactly_once() {
    let store = BlockStore::new(BS, 32 * BS as u64).unwrap();
    let id = seg(9, 0, 1);
    let mut pushed = Vec::new();
    for n in 0..60u32 {
        let (map, attempt) = (n * 7 % 5, n % 2);
        let batch = data(map, attempt, n, 1 + (n as usize * 97) % 1500);
        push(&store, id, map, attempt, &batch).unwrap();
        pushed.push((map, attempt, batch));
    }
    let maps = [(0, 0), (1, 1), (2, 0), (3, 1), (4, 0)];
    let whole = fetch_all(&store, id, &maps, u32::MAX);
    // Exactly the committed ones, by map then arrival.
    let mut want: Vec<_> = pushed.iter().filter(|(m, a, _)| maps.contains(&(*m, *a))).cloned().collect();
    want.sort_by_key(|(map, _, _)| *map);
    assert_eq!(whole, want);
    for max_bytes in [0, 1, 100, 1000, 2000, 5000] {
        assert_eq!(fetch_all(&store, id, &maps, max_bytes), whole, "pages of {max_bytes} bytes");
    }
    // Pages hold whole batches up to the limit (one alone may exceed it), and stop only where
    // the next would not fit.
    let (mut cursor, mut served) = (0, 0);
    let mut pages_of_many = 0;
    while cursor != FETCH_DONE {
        let page = fetch(&store, id, &request(cursor, 2000, &maps)).unwrap();
        served += page.batches as usize;
        assert!(page.payload.len() <= 2000 || page.batches == 1, "{} bytes", page.payload.len());
        pages_of_many += usize::from(page.batches > 1);
        if page.next_cursor != FETCH_DONE {
            let next = &whole[served];
            assert!(page.payload.len() + BATCH_HEADER_LEN + next.2.len() > 2000);
        }
        cursor = page.next_cursor;
    }
    assert_eq!(served, whole.len());
    assert!(pages_of_many > 0);
}

#[test]
fn a_full_tier_refuses_pushes_naming_the_segment() {
    let store = BlockStore::new(BS, 2 * BS as u64).unwrap();
    let id = seg(3, 7, 1);
    push(&store, id, 0, 0, &[1; 3000]).unwrap();
    push(&store, id, 0, 0, &[2; 3000]).unwrap();
    let err = push(&store, id, 0, 0, &[3; 3000]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfSpace);
    assert_eq!(
        err.to_string(),
        "push to shuffle 3 partition 7 segment 1 refused: dram tier full: 2 of 2 blocks in use"
    );
    // What fits in the last block still goes in; a new segment has nowhere to go.
    assert_eq!(push(&store, id, 0, 0, &[4; 1000]).unwrap(), 7000);
    let err = push(&store, seg(3, 8, 0), 0, 0, b"x").unwrap_err();
    assert!(matches!(err, ShuffleError::Full { in_use: 2, total: 2, .. }), "{err}");
    assert_eq!(store.shuffle_segments(), 1);
    // File blocks and shuffles share the arena.
    assert!(store.dram().begin_write(tern_proto::BlockId::from_wire(1), 0, 1).is_err());
    assert_eq!(fetch_all(&store, id, &[(0, 0)], u32::MAX).len(), 3);
}

#[test]
fn freeing_a_shuffle_returns_its_slots() {
    let store = BlockStore::new(BS, 5 * BS as u64).unwrap();
    store.set_server_id(ServerId::from_wire(5));
    for partition in 0..2 {
        push(&store, seg(1, partition, 0), 0, 0, &[7; 3000]).unwrap();
        push(&store, seg(1, partition, 0), 1, 0, &[8; 3000]).unwrap();
    }
    push(&store, seg(2, 0, 0), 0, 0, b"other shuffle").unwrap();
    assert!(push(&store, seg(2, 0, 1), 0, 0, b"no room").is_err());
    assert_eq!(store.dram().usage().used_blocks, 5);
    assert_eq!(store.dram().usage().used_bytes, 12013 + 5 * 16);
    assert_eq!(store.shuffle_segments(), 3);
    assert_eq!(store.free_shuffles([1, 99].map(ShuffleId::from_wire)), 2);
    assert_eq!(store.shuffle_segments(), 1);
    assert_eq!(store.dram().usage().used_blocks, 1);
    assert_eq!(store.dram().usage().used_bytes, 13 + 16);
    let err = fetch(&store, seg(1, 0, 0), &request(0, u32::MAX, &[(0, 0)])).unwrap_err();
    assert_eq!(err.to_string(), "shuffle 1 partition 0 segment 0 is not held by storage server 5");
    assert_eq!(err.kind(), ErrorKind::NotFound);
    // A straggler's push cannot bring a freed shuffle back.
    let err = push(&store, seg(1, 0, 0), 2, 0, b"late").unwrap_err();
    assert_eq!(err, ShuffleError::Freed { segment: seg(1, 0, 0), server: ServerId::from_wire(5) });
    assert_eq!(err.kind(), ErrorKind::NotFound);
    let err = push(&store, seg(99, 0, 0), 0, 0, b"freed before its first push").unwrap_err();
    assert!(matches!(err, ShuffleError::Freed { .. }), "{err}");
    assert_eq!(fetch_all(&store, seg(2, 0, 0), &[(0, 0)], u32::MAX), vec![(0, 0, b"other shuffle".to_vec())]);
    // Freeing again is a no-op.
    assert_eq!(store.free_shuffles([ShuffleId::from_wire(1)]), 0);
    // A re-registration drops everything and forgets the freed ids.
    assert_eq!(store.clear(), (0, 1));
    assert_eq!(
        (store.dram().usage().used_blocks, store.dram().usage().used_bytes, store.shuffle_segments()),
        (0, 0, 0)
    );
    push(&store, seg(1, 0, 0), 0, 0, b"a new shuffle 1").unwrap();
}

#[test]
fn freed_ids_are_remembered_within_a_bound() {
    let store = BlockStore::new(BS, BS as u64).unwrap();
    let ids: Vec<ShuffleId> = (0..FREED_REMEMBERED as u64 + 1).map(ShuffleId::from_wire).collect();
    store.free_shuffles(ids.iter().copied());
    store.free_shuffles(ids[1..].iter().copied());
    // Shuffle 0 was forgotten first.
    push(&store, seg(0, 0, 0), 0, 0, b"x").unwrap();
    assert!(push(&store, seg(1, 0, 0), 0, 0, b"x").is_err());
    assert!(push(&store, seg(FREED_REMEMBERED as u64, 0, 0), 0, 0, b"x").is_err());
}

#[test]
fn a_page_of_batches_back_to_back_in_one_extent_is_one_view_of_the_arena() {
    let store = BlockStore::new(BS, 8 * BS as u64).unwrap();
    let id = seg(7, 0, 0);
    for map in 0..3 {
        push(&store, id, map, 0, &data(map, 0, 0, 1000)).unwrap();
    }
    // Too big for the rest of the first slot: map 3 starts a second extent.
    push(&store, id, 3, 0, &data(3, 0, 0, 2000)).unwrap();
    let layout_of = |maps: &[(u32, u32)]| {
        let page = fetch(&store, id, &request(0, u32::MAX, maps)).unwrap();
        assert_eq!(page.crc, crc32c::crc32c(&page.payload), "{maps:?}: the combined crc is the payload's");
        assert_eq!(parse(&page).len(), maps.len(), "{maps:?}");
        page.layout
    };
    assert_eq!(layout_of(&[(0, 0), (1, 0), (2, 0)]), PageLayout::Arena);
    assert_eq!(layout_of(&[(1, 0), (2, 0)]), PageLayout::Arena);
    assert_eq!(layout_of(&[(3, 0)]), PageLayout::Arena);
    assert_eq!(layout_of(&[(0, 0), (2, 0)]), PageLayout::Gathered, "not back to back");
    assert_eq!(layout_of(&[(2, 0), (3, 0)]), PageLayout::Gathered, "two extents");
}

#[test]
fn corruption_at_rest_names_the_map() {
    let store = BlockStore::new(BS, 4 * BS as u64).unwrap();
    let id = seg(6, 2, 0);
    push(&store, id, 0, 0, b"map zero").unwrap();
    push(&store, id, 1, 3, b"map one").unwrap();
    push(&store, id, 2, 0, b"map two").unwrap();
    store.shuffles().corrupt(id, MapIndex::from_wire(1));
    let err = fetch(&store, id, &request(0, u32::MAX, &[(0, 0), (1, 3), (2, 0)])).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt);
    assert!(matches!(err, ShuffleError::Corrupt { map, attempt, .. } if (map.get(), attempt.get()) == (1, 3)), "{err}");
    let message = err.to_string();
    assert!(message.contains("shuffle 6 partition 2 segment 0") && message.contains("recompute map 1"), "{message}");
    // The rest of the segment is still served.
    assert_eq!(fetch_all(&store, id, &[(0, 0), (2, 0)], u32::MAX).len(), 2);
    assert!(fetch(&store, id, &request(0, 1, &[(0, 0), (1, 3)])).is_ok(), "the first page holds only map 0");
}

#[test]
fn batch_sizes_and_counts_are_bounded() {
    let store = BlockStore::new(BS, 4 * BS as u64).unwrap();
    let id = seg(1, 0, 0);
    let err = push(&store, id, 0, 0, b"").unwrap_err();
    assert_eq!(err, ShuffleError::BatchSize { segment: id, len: 0, max: BS - 16 });
    let err = push(&store, id, 0, 0, &vec![0; BS as usize + 1]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Invalid);
    assert_eq!(store.shuffle_segments(), 0, "a refused first push creates nothing");
    // Tiny batches fill a slot only up to its batch budget (16 for 4 KiB blocks).
    for n in 0..BS / MIN_BYTES_PER_BATCH {
        push(&store, id, 0, 0, &[n as u8]).unwrap();
    }
    assert_eq!(store.dram().usage().used_blocks, 1);
    push(&store, id, 0, 0, b"next slot").unwrap();
    assert_eq!(store.dram().usage().used_blocks, 2);
    assert_eq!(max_batch_bytes(tern_proto::MAX_BLOCK_SIZE), MAX_PAYLOAD_BYTES - BATCH_HEADER_LEN as u32);
}

#[test]
fn concurrent_pushes_lose_nothing() {
    let store = Arc::new(BlockStore::new(BS, 256 * BS as u64).unwrap());
    let threads: Vec<_> = (0..4u32)
        .map(|map| {
            let store = store.clone();
            std::thread::spawn(move || {
                for n in 0..200u32 {
                    // Every thread pushes to the shared segment and to one of its own.
                    let batch = data(map, 0, n, 1 + (n as usize * 13) % 700);
                    push(&store, seg(1, 0, 0), map, 0, &batch).unwrap();
                    push(&store, seg(1, 1 + map, 0), map, 0, &batch).unwrap();
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    let maps: Vec<_> = (0..4).map(|map| (map, 0)).collect();
    let shared = fetch_all(&store, seg(1, 0, 0), &maps, 4096);
    assert_eq!(shared.len(), 800);
    for map in 0..4u32 {
        let want: Vec<_> = (0..200u32).map(|n| (map, 0, data(map, 0, n, 1 + (n as usize * 13) % 700))).collect();
        let of_map: Vec<_> = shared.iter().filter(|(m, _, _)| *m == map).cloned().collect();
        assert_eq!(of_map, want, "map {map}, in push order");
        assert_eq!(fetch_all(&store, seg(1, 1 + map, 0), &maps, 4096), want);
    }
}
