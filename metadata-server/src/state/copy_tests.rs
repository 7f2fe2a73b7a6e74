//! Re-replication and drain copies through the state's methods: what is chosen, what a heartbeat
//! hands out, what a report settles, and that only stored copies reach the log.

use std::time::Duration;

use super::tests::{add_server, allocate, config, create, state, BLOCK};
use super::*;

fn beat(state: &mut State, server_id: u64, done: Vec<CopyDone>, now: Instant) -> HeartbeatResponse {
    state.heartbeat(HeartbeatRequest { server_id, copies_done: done, ..Default::default() }, now).unwrap()
}

fn placed(state: &mut State, path: &str, now: Instant) -> Vec<(u64, u64)> {
    let opened = state.open(OpenRequest { path: path.into() }, now).unwrap();
    opened.blocks.iter().map(|b| (b.block_id, b.server_id)).collect()
}

/// A sealed 2-copy file of 3 blocks on servers a and b, with c empty: returns (a, b, c, file).
fn two_copies_on_a_and_b(state: &mut State, now: Instant) -> (u64, u64, u64, u64) {
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
        CopyDone { copy_id: copies[0].copy_id, error: String::new() },
        CopyDone { copy_id: copies[1].copy_id, error: "target full".into() },
        CopyDone { copy_id: copies[2].copy_id, error: String::new() },
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
    beat(&mut state, b, vec![CopyDone { copy_id: copies[0].copy_id, error: String::new() }], later);
    let mut before = placed(&mut state, "/r/f", later);
    let mut rebuilt = State::new(&config());
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
    let highest = copies.iter().map(|c| BlockId::from(c.target_block_id).index()).max().unwrap();
    assert!(BlockId::from(fresh[0].block_id).index() > highest, "{fresh:?} reuses an id of {copies:?}");
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
    beat(&mut state, a, vec![CopyDone { copy_id: copies[0].copy_id, error: String::new() }], now);
    // The file goes before the second copy is reported: the copy is not needed, and is freed.
    state.delete(DeleteRequest { path: "/one".into(), recursive: false }, now).unwrap();
    beat(&mut state, a, vec![CopyDone { copy_id: copies[1].copy_id, error: String::new() }], now);
    let freed = beat(&mut state, b, vec![], now).free_block_ids;
    assert!(freed.contains(&copies[1].target_block_id) && freed.contains(&copies[0].target_block_id), "{freed:?}");
    state.reap(now);
    assert!(beat(&mut state, a, vec![], now).drained, "nothing left on the draining server");
}
