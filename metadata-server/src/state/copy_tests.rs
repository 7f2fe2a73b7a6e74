//! Re-replication and drain copies through the state's methods: what is chosen, what a heartbeat
//! hands out, what a report settles, and that only stored copies reach the log.

use std::time::Duration;

use super::tests::{add_server, allocate, config, create, state, BLOCK};
use super::*;

fn beat(state: &mut State, server_id: u64, done: Vec<CopyDone>, now: Now) -> HeartbeatResponse {
    state.heartbeat(HeartbeatRequest { server_id, copies_done: done, ..Default::default() }, now).unwrap()
}

fn placed(state: &mut State, path: &str, now: Now) -> Vec<(u64, u64)> {
    let opened = state.open(OpenRequest { path: path.into() }, now).unwrap();
    opened.blocks.iter().map(|b| (b.block_id, b.server_id)).collect()
}

/// A sealed 2-copy file of 3 blocks on servers a and b, with c empty: returns (a, b, c, file).
fn two_copies_on_a_and_b(state: &mut State, now: Now) -> (u64, u64, u64, u64) {
    let a = add_server(state, "10.0.0.1:7000", 100, now);
    let b = add_server(state, "10.0.0.2:7000", 100, now);
    let request = CreateRequest { path: "/r/f".into(), parents: true, replicas: 2, ..Default::default() };
    let file_id = state.create(request, now).unwrap().file_id;
    allocate(state, file_id, 3, now);
    state.seal(SealRequest { file_id, length: 2 * BLOCK + 7 }, now).unwrap();
    let c = add_server(state, "10.0.0.3:7000", 100, now);
    (a, b, c, file_id)
}

#[test]
fn a_dead_servers_copies_come_back_from_the_other_copy_and_only_stored_ones_are_logged() {
    let (mut state, start) = state();
    let (a, b, c, _) = two_copies_on_a_and_b(&mut state, start);
    state.take_journal();
    // a goes silent and is declared dead; b and c keep beating.
    let later = start + Duration::from_secs(6);
    beat(&mut state, b, vec![], later);
    beat(&mut state, c, vec![], later);
    state.reap(later);
    let copies = beat(&mut state, b, vec![], later).copy_blocks;
    assert_eq!(copies.len(), 3, "every block's copy on a, from b: {copies:?}");
    assert!(copies.iter().all(|copy| copy.target_address == "10.0.0.3:7000"), "{copies:?}");
    assert_eq!(copies.iter().map(|c| c.length).collect::<Vec<_>>(), [BLOCK as u32, BLOCK as u32, 7]);
    assert!(beat(&mut state, c, vec![], later).copy_blocks.is_empty(), "c holds nothing to copy");
    assert!(beat(&mut state, b, vec![], later).copy_blocks.is_empty(), "not handed out twice at once");
    let status = state.status(StatusRequest {}, later).unwrap();
    assert_eq!(status.copies.unwrap().pending_blocks, 3);
    // Chosen, not stored: nothing but the target ids' counter is logged.
    let journal = state.take_journal();
    assert!(journal.iter().all(|r| matches!(r.change, Some(Change::Counters(_)))), "{journal:?}");
    // One copy fails, two are stored.
    let done = vec![
        CopyDone { copy_id: copies[0].copy_id, error: String::new(), bytes: 0 },
        CopyDone { copy_id: copies[1].copy_id, error: "target full".into(), bytes: 0 },
        CopyDone { copy_id: copies[2].copy_id, error: String::new(), bytes: 0 },
    ];
    beat(&mut state, b, done, later);
    let now_placed = placed(&mut state, "/r/f", later);
    let on = |server: u64| now_placed.iter().filter(|(_, s)| *s == server).count();
    assert_eq!((on(a), on(b), on(c)), (1, 3, 2), "{now_placed:?}");
    let moved = state.take_journal();
    assert_eq!(moved.iter().filter(|r| matches!(r.change, Some(Change::MoveBlock(_)))).count(), 2);
    // The failed one is chosen again at the next reap and handed out at once.
    state.reap(later);
    let again = beat(&mut state, b, vec![], later).copy_blocks;
    assert_eq!(again.len(), 1);
    assert_ne!(again[0].target_block_id, copies[1].target_block_id, "a new id for the new attempt");
    let status = state.status(StatusRequest {}, later).unwrap().copies.unwrap();
    assert_eq!((status.copied_blocks, status.failed_blocks, status.copied_bytes), (2, 1, BLOCK + 7));
}

#[test]
fn a_restart_replays_stored_copies_and_forgets_the_rest() {
    let (mut state, start) = state();
    let (_, b, c, _) = two_copies_on_a_and_b(&mut state, start);
    let later = start + Duration::from_secs(6);
    beat(&mut state, b, vec![], later);
    beat(&mut state, c, vec![], later);
    state.reap(later);
    let copies = beat(&mut state, b, vec![], later).copy_blocks;
    beat(&mut state, b, vec![CopyDone { copy_id: copies[0].copy_id, error: String::new(), bytes: 0 }], later);
    let mut before = placed(&mut state, "/r/f", later);
    let mut rebuilt = State::new(&config(), Now::read());
    for record in state.take_journal() {
        rebuilt.replay(&record, later).unwrap();
    }
    // The same copies (listed in another order: after a restart every server is readable).
    let mut after = placed(&mut rebuilt, "/r/f", later);
    before.sort_unstable();
    after.sort_unstable();
    assert_eq!(after, before);
    assert!(after.iter().any(|&(_, server)| server == c), "the stored copy is on c: {after:?}");
    // The ids handed to copies not stored are never handed out again.
    add_server(&mut rebuilt, "10.0.0.4:7000", 100, later);
    let file_id = create(&mut rebuilt, "/new", later);
    let fresh = allocate(&mut rebuilt, file_id, 1, later);
    let highest = copies.iter().map(|c| BlockId::from_wire(c.target_block_id).index()).max().unwrap();
    assert!(BlockId::from_wire(fresh[0].block_id).index() > highest, "{fresh:?} reuses an id of {copies:?}");
}

#[test]
fn a_drain_copies_sole_copies_off_and_a_report_of_a_deleted_file_frees_the_copy() {
    let (mut state, now) = state();
    let a = add_server(&mut state, "10.0.0.1:7000", 100, now);
    let file_id = create(&mut state, "/one", now);
    allocate(&mut state, file_id, 2, now);
    state.seal(SealRequest { file_id, length: BLOCK + 1 }, now).unwrap();
    let b = add_server(&mut state, "10.0.0.2:7000", 100, now);
    let request = SetServerModeRequest {
        server: "10.0.0.1:7000".into(),
        mode: ServerMode::Draining as i32,
        drain_timeout_ms: 60_000,
    };
    state.set_server_mode(request, now).unwrap();
    state.reap(now);
    let copies = beat(&mut state, a, vec![], now).copy_blocks;
    assert_eq!(copies.len(), 2, "{copies:?}");
    assert!(copies.iter().all(|copy| copy.target_address == "10.0.0.2:7000" && copy.token.is_empty()));
    let waiting = state.status(StatusRequest {}, now).unwrap().servers.into_iter().find(|s| s.server_id == a).unwrap();
    assert_eq!(waiting.copies_pending, 2);
    assert!(waiting.drain_waiting_for.contains("2 being copied off"), "{waiting:?}");
    beat(&mut state, a, vec![CopyDone { copy_id: copies[0].copy_id, error: String::new(), bytes: 0 }], now);
    // The file goes before the second copy is reported: the copy is not needed, and is freed.
    state.delete(DeleteRequest { path: "/one".into(), recursive: false }, now).unwrap();
    beat(&mut state, a, vec![CopyDone { copy_id: copies[1].copy_id, error: String::new(), bytes: 0 }], now);
    let freed = beat(&mut state, b, vec![], now).free_block_ids;
    assert!(freed.contains(&copies[1].target_block_id) && freed.contains(&copies[0].target_block_id), "{freed:?}");
    state.reap(now);
    assert!(beat(&mut state, a, vec![], now).drained, "nothing left on the draining server");
}

/// The copies of each segment of `shuffle_id`, as locate lists them: (partition, index) → the two
/// servers (sorted) and whether either copy is lost.
fn segment_copies(state: &mut State, shuffle_id: u64, now: Now) -> Vec<((u32, u32), [u64; 2], bool)> {
    let request = LocateShuffleRequest { shuffle_id, end_partition: u32::MAX, end_map: u32::MAX, ..Default::default() };
    let located = state.locate_shuffle(request, now).unwrap();
    let mut out: Vec<_> = located
        .segments
        .iter()
        .map(|s| {
            let mut servers = [s.server_id, s.replica_server_id];
            servers.sort_unstable();
            ((s.partition, s.index), servers, s.lost || s.replica_lost)
        })
        .collect();
    out.sort_unstable();
    out
}

/// A 2-copy shuffle of 2 partitions with both first segments on servers a and b, a map committed
/// (100 and 200 bytes), and c empty: returns (a, b, c, shuffle id).
fn two_copy_shuffle_on_a_and_b(state: &mut State, now: Now) -> (u64, u64, u64, u64) {
    let a = add_server(state, "10.0.0.1:7000", 100, now);
    let b = add_server(state, "10.0.0.2:7000", 100, now);
    super::tests::register_job(state, "j", 100_000, now);
    let request = RegisterShuffleRequest { job_id: "j".into(), partitions: 2, replicas: 2, ..Default::default() };
    let shuffle_id = state.register_shuffle(request, now).unwrap().shuffle_id;
    let commit = CommitMapRequest {
        shuffle_id,
        map_index: 0,
        attempt: 0,
        partition_bytes: vec![100, 200],
        ..Default::default()
    };
    state.commit_map(commit, now).unwrap();
    let c = add_server(state, "10.0.0.3:7000", 100, now);
    (a, b, c, shuffle_id)
}

#[test]
fn a_dead_servers_closed_segments_come_back_from_the_live_copy_and_only_stored_ones_are_logged() {
    let (mut state, start) = state();
    let (a, b, c, shuffle_id) = two_copy_shuffle_on_a_and_b(&mut state, start);
    assert_eq!(segment_copies(&mut state, shuffle_id, start), [((0, 0), [a, b], false), ((1, 0), [a, b], false)]);
    state.take_journal();
    // a goes silent and is declared dead: each partition moves on to a new last segment on b and
    // c, and the closed first segments are copied from b to c.
    let later = start + Duration::from_secs(6);
    beat(&mut state, b, vec![], later);
    beat(&mut state, c, vec![], later);
    state.reap(later);
    let reply = beat(&mut state, b, vec![], later);
    let copies = reply.copy_segments;
    assert!(reply.copy_blocks.is_empty());
    assert_eq!(copies.iter().map(|c| (c.partition, c.index)).collect::<Vec<_>>(), [(0, 0), (1, 0)]);
    for copy in &copies {
        assert_eq!(
            (copy.shuffle_id, copy.target_address.as_str(), copy.storage_class.as_str()),
            (shuffle_id, "10.0.0.3:7000", "any")
        );
        assert!(!copy.grant.is_empty() && !copy.token.is_empty(), "{copy:?}");
    }
    assert!(beat(&mut state, b, vec![], later).copy_segments.is_empty(), "not handed out twice at once");
    let status = state.status(StatusRequest {}, later).unwrap().copies.unwrap();
    assert_eq!((status.pending_segments, status.pending_blocks, status.pending_bytes), (2, 0, 300), "{status:?}");
    let journal = state.take_journal();
    assert!(!journal.iter().any(|r| matches!(r.change, Some(Change::MoveSegment(_)))), "{journal:?}");
    // One is stored, one fails: only the stored one is logged, and locate shows it on c.
    let done = vec![
        CopyDone { copy_id: copies[0].copy_id, error: String::new(), bytes: 96 },
        CopyDone { copy_id: copies[1].copy_id, error: "target full".into(), bytes: 0 },
    ];
    beat(&mut state, b, done, later);
    let located = segment_copies(&mut state, shuffle_id, later);
    assert_eq!(located[0], ((0, 0), [b, c], false), "{located:?}");
    assert_eq!(located[2], ((1, 0), [a, b], true), "{located:?}");
    let moved: Vec<_> = state
        .take_journal()
        .into_iter()
        .filter_map(|r| match r.change {
            Some(Change::MoveSegment(m)) => Some(m),
            _ => None,
        })
        .collect();
    assert_eq!(moved, [LogMoveSegment { shuffle_id, partition: 0, index: 0, old_server_id: a, new_server_id: c }]);
    let status = state.status(StatusRequest {}, later).unwrap().copies.unwrap();
    assert_eq!((status.copied_segments, status.failed_segments, status.copied_bytes), (1, 1, 96), "{status:?}");
    // What the failed copy left on c is freed there; until c has done so, c is no target for it.
    let freed = beat(&mut state, c, vec![], later);
    assert_eq!(freed.free_segments, [HeldSegment { shuffle_id, partition: 1, index: 0 }]);
    state.reap(later);
    assert!(beat(&mut state, b, vec![], later).copy_segments.is_empty(), "c still has the free pending");
    let acknowledged = HeartbeatRequest { server_id: c, freed_through_seq: freed.free_seq, ..Default::default() };
    state.heartbeat(acknowledged, later).unwrap();
    let retry = later + crate::copies::RETRY_UNPLACEABLE;
    beat(&mut state, b, vec![], retry);
    beat(&mut state, c, vec![], retry);
    state.reap(retry);
    let again = beat(&mut state, b, vec![], retry).copy_segments;
    assert_eq!(again.iter().map(|c| (c.partition, c.index)).collect::<Vec<_>>(), [(1, 0)]);
    beat(&mut state, b, vec![CopyDone { copy_id: again[0].copy_id, error: String::new(), bytes: 192 }], retry);
    let located = segment_copies(&mut state, shuffle_id, retry);
    assert!(located.iter().all(|(_, servers, lost)| !lost && !servers.contains(&a)), "{located:?}");
}

#[test]
fn a_restart_replays_moved_segments_and_a_returning_server_frees_its_old_copies() {
    let (mut state, start) = state();
    let (a, b, c, shuffle_id) = two_copy_shuffle_on_a_and_b(&mut state, start);
    let later = start + Duration::from_secs(6);
    beat(&mut state, b, vec![], later);
    beat(&mut state, c, vec![], later);
    state.reap(later);
    let copies = beat(&mut state, b, vec![], later).copy_segments;
    let done = copies.iter().map(|copy| CopyDone { copy_id: copy.copy_id, error: String::new(), bytes: 1 }).collect();
    beat(&mut state, b, done, later);
    let before = segment_copies(&mut state, shuffle_id, later);
    let mut rebuilt = State::new(&config(), Now::read());
    for record in state.take_journal() {
        rebuilt.replay(&record, later).unwrap();
    }
    assert_eq!(segment_copies(&mut rebuilt, shuffle_id, later), before);
    assert_eq!(before[..2], [((0, 0), [b, c], false), ((0, 1), [b, c], false)]);
    // A snapshot of the replayed state says the same.
    let mut from_snapshot = State::new(&config(), Now::read());
    from_snapshot.restore(&rebuilt.snapshot(later), later).unwrap();
    assert_eq!(segment_copies(&mut from_snapshot, shuffle_id, later), before);
    // a comes back with its old copies: the chains no longer name them there, so they are freed
    // (segments the chains do name stay).
    let register = RegisterServerRequest { address: "10.0.0.1:7000".into(), instance_id: 1, ..Default::default() };
    assert_eq!(state.register_server(register, later).unwrap().server_id, a);
    let held = |partition| HeldSegment { shuffle_id, partition, index: 0 };
    let inventory =
        ReportInventoryRequest { server_id: a, segments: vec![held(0), held(1)], last: true, ..Default::default() };
    state.report_inventory(inventory, later).unwrap();
    let mut freed = beat(&mut state, a, vec![], later).free_segments;
    freed.sort_unstable_by_key(|s| s.partition);
    assert_eq!(freed, [held(0), held(1)]);
}

#[test]
fn a_drain_copies_closed_segments_off_and_waits_out_the_last_ones() {
    let (mut state, now) = state();
    let a = add_server(&mut state, "10.0.0.1:7000", 100, now);
    super::tests::register_job(&mut state, "j", 100_000, now);
    let request = RegisterShuffleRequest { job_id: "j".into(), partitions: 2, ..Default::default() };
    let shuffle_id = state.register_shuffle(request, now).unwrap().shuffle_id;
    let b = add_server(&mut state, "10.0.0.2:7000", 100, now);
    // Partition 0 moves on to a segment on b: its first segment on a is closed.
    let advance = AdvanceSegmentRequest { shuffle_id, partition: 0, full_segment: 0 };
    assert_eq!(state.advance_segment(advance, now).unwrap().segment.unwrap().server_id, b);
    let drain = SetServerModeRequest {
        server: "10.0.0.1:7000".into(),
        mode: ServerMode::Draining as i32,
        drain_timeout_ms: 60_000,
    };
    state.set_server_mode(drain, now).unwrap();
    state.reap(now);
    let copies = beat(&mut state, a, vec![], now).copy_segments;
    assert_eq!(
        copies.iter().map(|c| (c.partition, c.index, c.target_address.as_str())).collect::<Vec<_>>(),
        [(0, 0, "10.0.0.2:7000")]
    );
    let waiting = |state: &mut State| {
        let status = state.status(StatusRequest {}, now).unwrap();
        status.servers.into_iter().find(|s| s.server_id == a).unwrap().drain_waiting_for
    };
    assert_eq!(waiting(&mut state), "2 segments of registered shuffles (1 being copied off)");
    beat(&mut state, a, vec![CopyDone { copy_id: copies[0].copy_id, error: String::new(), bytes: 5 }], now);
    let moved = segment_copies(&mut state, shuffle_id, now);
    assert_eq!(moved[0], ((0, 0), [0, b], false), "{moved:?}");
    // Its old copy is freed on a; the open last segment of partition 1 is waited out.
    assert_eq!(beat(&mut state, a, vec![], now).free_segments, [HeldSegment { shuffle_id, partition: 0, index: 0 }]);
    state.reap(now);
    assert_eq!(waiting(&mut state), "1 segments of registered shuffles");
    assert!(beat(&mut state, a, vec![], now).copy_segments.is_empty());
}
