//! The shuffle registry through the state's RPC methods, with time moved by hand.

use std::collections::BTreeMap;

use super::tests::{add_server, allocate, create, refused, register_job, state, BLOCK};
use super::*;
use crate::servers::DRAM_TIER;
use crate::shuffles::{DEFAULT_SPLIT_SIZE_BYTES, MAX_LOCATE_ENTRIES, MAX_SEGMENTS_PER_PARTITION};

fn register_request(job: &str, partitions: u32, maps: u32) -> RegisterShuffleRequest {
    RegisterShuffleRequest { job_id: job.into(), partitions, maps, ..RegisterShuffleRequest::default() }
}

fn register(state: &mut State, job: &str, partitions: u32, maps: u32, now: Now) -> RegisterShuffleResponse {
    state.register_shuffle(register_request(job, partitions, maps), now).unwrap()
}

fn advance(state: &mut State, shuffle_id: u64, partition: u32, full_segment: u32, now: Now) -> Segment {
    let request = AdvanceSegmentRequest { shuffle_id, partition, full_segment };
    state.advance_segment(request, now).unwrap().segment.unwrap()
}

fn commit_request(shuffle_id: u64, map_index: u32, attempt: u32, partition_bytes: Vec<u64>) -> CommitMapRequest {
    CommitMapRequest { shuffle_id, map_index, attempt, partition_bytes, ..CommitMapRequest::default() }
}

/// Commits a map attempt; returns (committed, winning attempt).
fn commit(state: &mut State, shuffle_id: u64, map: u32, attempt: u32, bytes: Vec<u64>, now: Now) -> (bool, u32) {
    let reply = state.commit_map(commit_request(shuffle_id, map, attempt, bytes), now).unwrap();
    (reply.committed, reply.winning_attempt)
}

fn locate(
    state: &mut State,
    shuffle_id: u64,
    partitions: (u32, u32),
    maps: (u32, u32),
    now: Now,
) -> LocateShuffleResponse {
    let request = LocateShuffleRequest {
        shuffle_id,
        start_partition: partitions.0,
        end_partition: partitions.1,
        start_map: maps.0,
        end_map: maps.1,
    };
    state.locate_shuffle(request, now).unwrap()
}

/// (map, attempt, bytes) of each output.
fn outputs(reply: &LocateShuffleResponse) -> Vec<(u32, u32, Vec<u64>)> {
    reply.outputs.iter().map(|o| (o.map_index, o.attempt, o.partition_bytes.clone())).collect()
}

/// Heartbeats as `server_id`, acknowledging through `freed_through_seq`.
fn beat(state: &mut State, server_id: u64, freed_through_seq: u64, now: Now) -> HeartbeatResponse {
    state.heartbeat(HeartbeatRequest { server_id, freed_through_seq, ..Default::default() }, now).unwrap()
}

fn per_server(segments: &[Segment]) -> BTreeMap<u64, usize> {
    let mut counts = BTreeMap::new();
    for segment in segments {
        *counts.entry(segment.server_id).or_default() += 1;
    }
    counts
}

#[test]
fn registration_checks_its_arguments() {
    let (mut state, now) = state();
    let (kind, message) = refused(state.register_shuffle(register_request("ghost", 4, 0), now));
    assert_eq!(kind, ErrorKind::NotFound);
    assert!(message.contains("job ghost is not registered"), "{message}");
    register_job(&mut state, "j", 100, now);
    let (kind, message) = refused(state.register_shuffle(register_request("j", 4, 0), now));
    assert_eq!(
        (kind, message.as_str()),
        (ErrorKind::Unavailable, "register a shuffle of 4 partitions for job j: no live storage server takes new data (dead, cordoned and draining ones take none: see tern admin servers)")
    );
    add_server(&mut state, "10.0.0.1:7000", 100, now);
    let bad: [(RegisterShuffleRequest, &str); 6] = [
        (register_request("j", 0, 0), "partitions must be 1 to 1000000"),
        (register_request("j", 1_000_001, 0), "partitions must be 1 to 1000000"),
        (register_request("j", 4, 10_000_001), "maps must be at most 10000000"),
        (
            RegisterShuffleRequest { storage_class: "ssd".into(), ..register_request("j", 4, 0) },
            "storage class \"ssd\"",
        ),
        (
            RegisterShuffleRequest { split_size_bytes: BLOCK - 1, ..register_request("j", 4, 0) },
            "below the cluster block size",
        ),
        (register_request("", 4, 0), "job  is not registered"),
    ];
    for (request, expected) in bad {
        let (kind, message) = refused(state.register_shuffle(request, now));
        assert!(message.contains(expected), "{message}");
        let expected_kind = if expected.starts_with("job") { ErrorKind::NotFound } else { ErrorKind::Invalid };
        assert_eq!(kind, expected_kind, "{message}");
    }
    let first = register(&mut state, "j", 4, 0, now);
    assert_eq!((first.segments.len(), first.split_size_bytes), (4, DEFAULT_SPLIT_SIZE_BYTES));
    for class in ["any", "dram", "nvme"] {
        let request = RegisterShuffleRequest {
            storage_class: class.into(),
            split_size_bytes: BLOCK,
            ..register_request("j", 1, 0)
        };
        let reply = state.register_shuffle(request, now).unwrap();
        assert_eq!(reply.split_size_bytes, BLOCK);
        assert!(reply.shuffle_id > first.shuffle_id);
    }
    // A lapsed job takes no new shuffles, even before the reaper ends it.
    let (kind, _) = refused(state.register_shuffle(register_request("j", 1, 0), now + Duration::from_millis(100)));
    assert_eq!(kind, ErrorKind::NotFound);
    assert_eq!(state.gauges().shuffles, 4);
    // Every first segment must fit in the reply: a million do not, and leave nothing behind.
    let (kind, message) = refused(state.register_shuffle(register_request("j", 1_000_000, 0), now));
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("register fewer partitions"), "{message}");
    assert_eq!(state.gauges().shuffles, 4);
    assert_eq!(register(&mut state, "j", 500_000, 0, now).segments.len(), 500_000);
}

#[test]
fn first_segments_spread_over_servers_by_load() {
    let (mut state, now) = state();
    for host in 1..=3 {
        add_server(&mut state, &format!("10.0.0.{host}:7000"), 1000, now);
    }
    // Server 1 holds file blocks: it is the most loaded, so it comes last in the rotation.
    let file_id = create(&mut state, "/f", now);
    allocate(&mut state, file_id, 5, now);
    let status = state.status(StatusRequest {}, now).unwrap();
    assert_eq!(status.servers.iter().map(|s| s.allocated_blocks).collect::<Vec<_>>(), [2, 2, 1]);
    register_job(&mut state, "j", 0, now);
    let reply = register(&mut state, "j", 7, 0, now);
    let servers: Vec<u64> = reply.segments.iter().map(|s| s.server_id).collect();
    assert_eq!(servers, [3, 1, 2, 3, 1, 2, 3]);
    for (p, segment) in reply.segments.iter().enumerate() {
        assert_eq!((segment.partition, segment.index, segment.lost), (p as u32, 0, false));
        assert_eq!(segment.address, format!("10.0.0.{}:7000", segment.server_id));
    }
    // Segments placed count as load: the next shuffle starts with the servers holding fewest.
    let reply = register(&mut state, "j", 3, 0, now);
    assert_eq!(per_server(&reply.segments), BTreeMap::from([(1, 1), (2, 1), (3, 1)]));
    let reply = register(&mut state, "j", 300, 0, now);
    assert_eq!(per_server(&reply.segments), BTreeMap::from([(1, 100), (2, 100), (3, 100)]));
}

#[test]
fn advancing_a_segment_is_idempotent_and_moves_to_another_server() {
    let (mut state, now) = state();
    add_server(&mut state, "10.0.0.1:7000", 1000, now);
    register_job(&mut state, "j", 0, now);
    let shuffle = register(&mut state, "j", 2, 0, now).shuffle_id;
    // Alone, a server takes its own next segment.
    let next = advance(&mut state, shuffle, 0, 0, now);
    assert_eq!((next.partition, next.index, next.server_id), (0, 1, 1));
    add_server(&mut state, "10.0.0.2:7000", 1000, now);
    add_server(&mut state, "10.0.0.3:7000", 1000, now);
    let next = advance(&mut state, shuffle, 0, 1, now);
    assert_eq!((next.index, next.server_id != 1), (2, true));
    // Every writer that saw segment 1 fill gets the same successor.
    for _ in 0..3 {
        assert_eq!(advance(&mut state, shuffle, 0, 1, now), next);
        assert_eq!(advance(&mut state, shuffle, 0, 0, now), next);
    }
    // Partition 1 is untouched.
    assert_eq!(advance(&mut state, shuffle, 1, 0, now).index, 1);
    let ask = |partition, full_segment| AdvanceSegmentRequest { shuffle_id: shuffle, partition, full_segment };
    let (kind, message) = refused(state.advance_segment(ask(0, 5), now));
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("segment 5 does not exist yet: partition 0's last segment is 2"), "{message}");
    let (kind, message) = refused(state.advance_segment(ask(2, 0), now));
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("partition 2 is out of range: the shuffle has 2"), "{message}");
    let unknown = AdvanceSegmentRequest { shuffle_id: shuffle + 100, partition: 0, full_segment: 0 };
    assert_eq!(refused(state.advance_segment(unknown, now)).0, ErrorKind::NotFound);
    // A partition's segments are bounded.
    for full in 1..MAX_SEGMENTS_PER_PARTITION - 1 {
        advance(&mut state, shuffle, 1, full, now);
    }
    let (kind, message) = refused(state.advance_segment(ask(1, MAX_SEGMENTS_PER_PARTITION - 1), now));
    assert_eq!(kind, ErrorKind::OutOfSpace);
    assert!(message.contains("larger split size"), "{message}");
    let located = locate(&mut state, shuffle, (0, 2), (0, 0), now);
    let indexes: Vec<(u32, u32)> = located.segments.iter().take(4).map(|s| (s.partition, s.index)).collect();
    assert_eq!(indexes, [(0, 0), (0, 1), (0, 2), (1, 0)]);
    assert_eq!(located.segments.len(), 3 + MAX_SEGMENTS_PER_PARTITION as usize);
}

#[test]
fn each_map_commits_exactly_once() {
    let (mut state, now) = state();
    add_server(&mut state, "10.0.0.1:7000", 1000, now);
    register_job(&mut state, "j", 0, now);
    let shuffle = register(&mut state, "j", 3, 4, now).shuffle_id;
    // Attempt 0 of map 0 failed before committing: nothing of it is visible.
    assert!(locate(&mut state, shuffle, (0, 3), (0, 4), now).outputs.is_empty());
    // Attempt 1 commits; a speculative duplicate (attempt 2) loses; attempt 1's retry succeeds.
    assert_eq!(commit(&mut state, shuffle, 0, 1, vec![10, 0, 30], now), (true, 1));
    assert_eq!(commit(&mut state, shuffle, 0, 2, vec![11, 1, 31], now), (false, 1));
    assert_eq!(commit(&mut state, shuffle, 0, 1, vec![10, 0, 30], now), (true, 1));
    assert_eq!(outputs(&locate(&mut state, shuffle, (0, 3), (0, 4), now)), [(0, 1, vec![10, 0, 30])]);
    // Malformed commits are refused, and leave no trace.
    let mut bad = vec![
        (commit_request(shuffle, 1, 0, vec![1, 2]), "2 partition lengths given; the shuffle has 3 partitions"),
        (commit_request(shuffle, 4, 0, vec![1, 2, 3]), "map index 4 is not below 4"),
        (
            CommitMapRequest { first_segment: vec![0, 0], ..commit_request(shuffle, 1, 0, vec![1, 2, 3]) },
            "2 first_segment entries given",
        ),
        (
            CommitMapRequest { last_segment: vec![0, 1, 0], ..commit_request(shuffle, 1, 0, vec![1, 2, 3]) },
            "partition 1: segments 0 to 1 are not a range of its segments 0 to 0",
        ),
    ];
    advance(&mut state, shuffle, 2, 0, now);
    bad.push((
        CommitMapRequest {
            first_segment: vec![0, 0, 1],
            last_segment: vec![0, 0, 0],
            ..commit_request(shuffle, 1, 0, vec![1, 2, 3])
        },
        "partition 2: segments 1 to 0",
    ));
    for (request, expected) in bad {
        let (kind, message) = refused(state.commit_map(request, now));
        assert_eq!(kind, ErrorKind::Invalid, "{message}");
        assert!(message.starts_with("commit map ") && message.contains(expected), "{message}");
    }
    let unknown = commit_request(shuffle + 100, 0, 0, vec![1, 2, 3]);
    assert_eq!(refused(state.commit_map(unknown, now)).0, ErrorKind::NotFound);
    assert_eq!(outputs(&locate(&mut state, shuffle, (0, 3), (0, 4), now)).len(), 1);
    // Segment ranges are kept per partition, and read back as given.
    let split = CommitMapRequest {
        first_segment: vec![0, 0, 0],
        last_segment: vec![0, 0, 1],
        ..commit_request(shuffle, 3, 0, vec![5, 6, 7])
    };
    assert!(state.commit_map(split, now).unwrap().committed);
    let located = locate(&mut state, shuffle, (1, 3), (0, 4), now);
    let ranges: Vec<_> = located.outputs.iter().map(|o| (o.first_segment.clone(), o.last_segment.clone())).collect();
    assert_eq!(ranges, [(vec![0, 0], vec![0, 0]), (vec![0, 0], vec![0, 1])]);
}

#[test]
fn locate_returns_exact_lengths_for_partition_and_map_ranges() {
    let (mut state, now) = state();
    add_server(&mut state, "10.0.0.1:7000", 1000, now);
    add_server(&mut state, "10.0.0.2:7000", 1000, now);
    register_job(&mut state, "j", 0, now);
    let shuffle = register(&mut state, "j", 4, 0, now).shuffle_id;
    let bytes = |map: u64| (0..4).map(|p| map * 100 + p).collect::<Vec<u64>>();
    for map in [0, 2, 5] {
        commit(&mut state, shuffle, map, 0, bytes(u64::from(map)), now);
    }
    let next = advance(&mut state, shuffle, 2, 0, now);
    let reply = locate(&mut state, shuffle, (1, 3), (1, 5), now);
    assert_eq!((reply.partitions, reply.maps, reply.start_partition, reply.end_partition), (4, 0, 1, 3));
    assert_eq!(outputs(&reply), [(2, 0, vec![201, 202])]);
    let segments: Vec<(u32, u32, u64)> = reply.segments.iter().map(|s| (s.partition, s.index, s.server_id)).collect();
    assert_eq!(segments, [(1, 0, 2), (2, 0, 1), (2, 1, next.server_id)]);
    // Ends past the shuffle mean "to the end": maps end after the last commit while maps are unknown.
    let reply = locate(&mut state, shuffle, (3, u32::MAX), (0, u32::MAX), now);
    assert_eq!((reply.start_partition, reply.end_partition), (3, 4));
    assert_eq!(outputs(&reply), [(0, 0, vec![3]), (2, 0, vec![203]), (5, 0, vec![503])]);
    assert!(locate(&mut state, shuffle, (0, 4), (6, 9), now).outputs.is_empty());
    assert!(locate(&mut state, shuffle, (4, 4), (0, 9), now).segments.is_empty());
    let ask = |start_partition, end_partition, start_map, end_map| LocateShuffleRequest {
        shuffle_id: shuffle,
        start_partition,
        end_partition,
        start_map,
        end_map,
    };
    for (request, expected) in [
        (ask(2, 1, 0, 1), "not a range"),
        (ask(0, 1, 3, 2), "not a range"),
        (ask(5, 9, 0, 1), "partition 5 is out of range: the shuffle has 4"),
    ] {
        let (kind, message) = refused(state.locate_shuffle(request, now));
        assert_eq!(kind, ErrorKind::Invalid, "{message}");
        assert!(message.contains(expected), "{message}");
    }
    // Declared maps bound the map range; too large a range asks for a smaller one.
    let wide = register(&mut state, "j", 1 << 11, 1 << 10, now).shuffle_id;
    let request =
        LocateShuffleRequest { shuffle_id: wide, end_partition: u32::MAX, end_map: u32::MAX, ..Default::default() };
    let (kind, message) = refused(state.locate_shuffle(request, now));
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains(&format!("more than one reply may carry ({MAX_LOCATE_ENTRIES})")), "{message}");
    let half = LocateShuffleRequest { end_partition: 1 << 10, ..request };
    assert_eq!(state.locate_shuffle(half, now).unwrap().maps, 1 << 10);
    let beyond = LocateShuffleRequest { shuffle_id: wide, start_map: 1025, end_map: 1026, ..Default::default() };
    assert_eq!(refused(state.locate_shuffle(beyond, now)).0, ErrorKind::Invalid);
}

#[test]
fn invalidated_maps_can_be_committed_again() {
    let (mut state, now) = state();
    add_server(&mut state, "10.0.0.1:7000", 1000, now);
    register_job(&mut state, "j", 0, now);
    let shuffle = register(&mut state, "j", 2, 3, now).shuffle_id;
    for map in 0..3 {
        commit(&mut state, shuffle, map, 0, vec![1, 2], now);
    }
    let request = InvalidateMapsRequest { shuffle_id: shuffle, map_indexes: vec![1, 2, 2, 7] };
    assert_eq!(state.invalidate_maps(request, now).unwrap().invalidated, 2);
    assert_eq!(outputs(&locate(&mut state, shuffle, (0, 2), (0, 3), now)), [(0, 0, vec![1, 2])]);
    assert_eq!(commit(&mut state, shuffle, 1, 1, vec![3, 4], now), (true, 1));
    assert_eq!(commit(&mut state, shuffle, 1, 0, vec![1, 2], now), (false, 1));
    let located = locate(&mut state, shuffle, (0, 2), (0, 3), now);
    assert_eq!(outputs(&located), [(0, 0, vec![1, 2]), (1, 1, vec![3, 4])]);
    let unknown = InvalidateMapsRequest { shuffle_id: shuffle + 1, map_indexes: vec![0] };
    assert_eq!(refused(state.invalidate_maps(unknown, now)).0, ErrorKind::NotFound);
}

#[test]
fn unregistering_frees_the_shuffle_on_its_servers_through_heartbeats() {
    let (mut state, now) = state();
    let (one, two, three) = (
        add_server(&mut state, "10.0.0.1:7000", 1000, now),
        add_server(&mut state, "10.0.0.2:7000", 1000, now),
        add_server(&mut state, "10.0.0.3:7000", 1000, now),
    );
    register_job(&mut state, "j", 0, now);
    // Two partitions: on servers 1 and 2; server 3 holds nothing of it.
    let shuffle = register(&mut state, "j", 2, 0, now).shuffle_id;
    let file_id = create(&mut state, "/jobs/j/f", now);
    let blocks = allocate(&mut state, file_id, 3, now);
    state.delete(DeleteRequest { path: "/jobs/j/f".into(), recursive: false }, now).unwrap();
    state.unregister_shuffle(UnregisterShuffleRequest { shuffle_id: shuffle }, now).unwrap();
    let (kind, message) = refused(state.unregister_shuffle(UnregisterShuffleRequest { shuffle_id: shuffle }, now));
    assert_eq!(kind, ErrorKind::NotFound);
    assert!(message.contains(&format!("shuffle {shuffle} is not registered")), "{message}");
    // Block frees and the shuffle free share server 1's queue, in order, until acknowledged.
    let on_one: Vec<u64> = blocks.iter().filter(|b| b.server_id == one).map(|b| b.block_id).collect();
    for _ in 0..2 {
        let reply = beat(&mut state, one, 0, now);
        assert_eq!((reply.free_block_ids, reply.free_shuffle_ids, reply.free_seq), (on_one.clone(), vec![shuffle], 2));
    }
    let reply = beat(&mut state, two, 0, now);
    assert_eq!(reply.free_shuffle_ids, [shuffle]);
    assert!(beat(&mut state, three, 0, now).free_shuffle_ids.is_empty());
    // Acknowledged: gone; the shuffle free did not touch the allocated block count.
    let reply = beat(&mut state, one, 2, now);
    assert!(reply.free_block_ids.is_empty() && reply.free_shuffle_ids.is_empty());
    assert_eq!(reply.free_seq, 2);
    let status = state.status(StatusRequest {}, now).unwrap();
    assert_eq!(status.servers.iter().map(|s| s.allocated_blocks).collect::<Vec<_>>(), [0, 1, 1]);
    assert_eq!(state.gauges().shuffles, 0);
    let gone = LocateShuffleRequest { shuffle_id: shuffle, ..Default::default() };
    assert_eq!(refused(state.locate_shuffle(gone, now)).0, ErrorKind::NotFound);
}

#[test]
fn ending_a_job_or_its_lease_frees_its_shuffles() {
    let (mut state, start) = state();
    let server = add_server(&mut state, "10.0.0.1:7000", 1000, start);
    register_job(&mut state, "ended", 0, start);
    register_job(&mut state, "lapsed", 100, start);
    register_job(&mut state, "kept", 0, start);
    let ended: Vec<u64> = (0..2).map(|_| register(&mut state, "ended", 2, 0, start).shuffle_id).collect();
    let lapsed = register(&mut state, "lapsed", 1, 0, start).shuffle_id;
    let kept = register(&mut state, "kept", 1, 0, start).shuffle_id;
    state.end_job(EndJobRequest { job_id: "ended".into(), ..Default::default() }, start).unwrap();
    assert_eq!(beat(&mut state, server, 0, start).free_shuffle_ids, ended);
    let after = start + Duration::from_millis(200);
    state.heartbeat(HeartbeatRequest { server_id: server, ..Default::default() }, after).unwrap();
    state.reap(after);
    let reply = beat(&mut state, server, 0, after);
    assert_eq!(reply.free_shuffle_ids, [ended[0], ended[1], lapsed]);
    for shuffle_id in [ended[0], lapsed] {
        let request = LocateShuffleRequest { shuffle_id, ..Default::default() };
        assert_eq!(refused(state.locate_shuffle(request, after)).0, ErrorKind::NotFound);
    }
    assert_eq!(locate(&mut state, kept, (0, 1), (0, 0), after).partitions, 1);
    assert_eq!(state.gauges().shuffles, 1);
    // The job's name is free again, with none of the old shuffles.
    register_job(&mut state, "ended", 0, after);
    state.end_job(EndJobRequest { job_id: "ended".into(), ..Default::default() }, after).unwrap();
    assert_eq!(beat(&mut state, server, reply.free_seq, after).free_shuffle_ids, Vec::<u64>::new());
}

#[test]
fn a_dead_server_loses_its_segments_and_partitions_move_on() {
    let (mut state, start) = state();
    let doomed = add_server(&mut state, "10.0.0.1:7000", 1000, start);
    let healthy = add_server(&mut state, "10.0.0.2:7000", 1000, start);
    register_job(&mut state, "j", 60_000, start);
    let shuffle = register(&mut state, "j", 4, 0, start).shuffle_id;
    // Partition 1 already split from the healthy server onto the doomed one; 3 split away from it.
    assert_eq!(advance(&mut state, shuffle, 1, 0, start).server_id, doomed);
    assert_eq!(advance(&mut state, shuffle, 2, 0, start).server_id, healthy);
    let later = start + Duration::from_secs(6);
    beat(&mut state, healthy, 0, later);
    state.reap(later);
    let reply = locate(&mut state, shuffle, (0, 4), (0, 0), later);
    let segments: Vec<(u32, u32, u64, bool)> =
        reply.segments.iter().map(|s| (s.partition, s.index, s.server_id, s.lost)).collect();
    assert_eq!(
        segments,
        [
            (0, 0, doomed, true),
            (0, 1, healthy, false),
            (1, 0, healthy, false),
            (1, 1, doomed, true),
            (1, 2, healthy, false),
            (2, 0, doomed, true),
            (2, 1, healthy, false),
            (3, 0, healthy, false),
        ]
    );
    // A writer that saw the lost segment is sent on to its successor.
    let next = advance(&mut state, shuffle, 0, 0, later);
    assert_eq!((next.index, next.server_id, next.lost), (1, healthy, false));
    // With no live server left, nothing can move: segments stay lost, and advancing is Unavailable.
    let all_dead = later + Duration::from_secs(6);
    state.reap(all_dead);
    assert!(advance(&mut state, shuffle, 0, 0, all_dead).lost, "answers name lost segments as lost");
    let reply = locate(&mut state, shuffle, (3, 4), (0, 0), all_dead);
    assert!(reply.segments.iter().all(|s| s.lost));
    let ask = AdvanceSegmentRequest { shuffle_id: shuffle, partition: 3, full_segment: 0 };
    let (kind, message) = refused(state.advance_segment(ask, all_dead));
    assert_eq!(kind, ErrorKind::Unavailable, "{message}");
    // A new server takes the next segment; when it restarts (same id, a new process), that
    // segment is lost with its DRAM, and the next one goes to it again once it is back.
    let first = add_server(&mut state, "10.0.0.3:7000", 1000, all_dead);
    assert_eq!(advance(&mut state, shuffle, 3, 0, all_dead).server_id, first);
    assert_eq!(add_server(&mut state, "10.0.0.3:7000", 1000, all_dead), first);
    let reply = locate(&mut state, shuffle, (3, 4), (0, 0), all_dead);
    let segments: Vec<(u32, u64, bool)> = reply.segments.iter().map(|s| (s.index, s.server_id, s.lost)).collect();
    assert_eq!(segments, [(0, healthy, true), (1, first, true)]);
    let next = advance(&mut state, shuffle, 3, 1, all_dead);
    assert_eq!((next.index, next.server_id, next.lost), (2, first, false));
}

#[test]
fn file_placement_counts_the_shuffle_data_servers_report() {
    let (mut state, now) = state();
    let server = add_server(&mut state, "10.0.0.1:7000", 10, now);
    let file_id = create(&mut state, "/f", now);
    allocate(&mut state, file_id, 2, now);
    // The server reports 8 blocks in use: 2 of them the file's, the rest shuffle data. The 2 blocks
    // placed after the report count at once.
    let tiers = vec![TierUsage { tier: DRAM_TIER.into(), capacity_blocks: 10, used_blocks: 8, ..TierUsage::default() }];
    state.heartbeat(HeartbeatRequest { server_id: server, tiers, ..Default::default() }, now).unwrap();
    allocate(&mut state, file_id, 2, now);
    let ask = AllocateBlocksRequest { file_id, count: 1, client_host: String::new() };
    let (kind, message) = refused(state.allocate_blocks(ask.clone(), now));
    assert_eq!(kind, ErrorKind::OutOfSpace, "{message}");
    // Once a shuffle free is queued, the space it holds is worth waiting for.
    register_job(&mut state, "j", 0, now);
    let shuffle = register(&mut state, "j", 1, 0, now).shuffle_id;
    state.unregister_shuffle(UnregisterShuffleRequest { shuffle_id: shuffle }, now).unwrap();
    let (kind, message) = refused(state.allocate_blocks(ask.clone(), now));
    assert_eq!(kind, ErrorKind::Unavailable, "{message}");
    assert!(message.contains("being freed"), "{message}");
    let reply = beat(&mut state, server, 0, now);
    assert_eq!(reply.free_shuffle_ids, [shuffle]);
    // Done: the server holds the file's 4 blocks and no shuffle data.
    let tiers = vec![TierUsage { tier: DRAM_TIER.into(), capacity_blocks: 10, used_blocks: 4, ..TierUsage::default() }];
    state
        .heartbeat(
            HeartbeatRequest { server_id: server, tiers, freed_through_seq: reply.free_seq, ..Default::default() },
            now,
        )
        .unwrap();
    assert_eq!(state.allocate_blocks(ask, now).unwrap().blocks.len(), 1);
    let status = state.status(StatusRequest {}, now).unwrap();
    assert_eq!((status.servers[0].allocated_blocks, status.servers[0].tiers[0].used_blocks), (5, 4));
}

/// 1000 maps x 1000 partitions: register, 1000 commits of 1000 lengths, 1000 single-partition
/// locates. Asserts the answers; prints the time (well under a second in a release build).
#[test]
fn a_thousand_by_thousand_shuffle_is_cheap() {
    const N: u32 = 1000;
    let (mut state, now) = state();
    for host in 1..=8 {
        add_server(&mut state, &format!("10.0.0.{host}:7000"), 1 << 20, now);
    }
    register_job(&mut state, "j", 0, now);
    let lengths: Vec<Vec<u64>> =
        (0..N).map(|map| (0..N).map(|p| u64::from(map) * u64::from(N) + u64::from(p)).collect()).collect();
    let started = Instant::now();
    let shuffle = register(&mut state, "j", N, N, now).shuffle_id;
    for (map, bytes) in (0..N).zip(lengths) {
        assert_eq!(commit(&mut state, shuffle, map, 0, bytes, now), (true, 0));
    }
    let mut checked = 0u64;
    for partition in 0..N {
        let reply = locate(&mut state, shuffle, (partition, partition + 1), (0, N), now);
        assert_eq!((reply.segments.len(), reply.outputs.len()), (1, N as usize));
        for (map, output) in (0..N).zip(&reply.outputs) {
            let expected = u64::from(map) * u64::from(N) + u64::from(partition);
            assert_eq!((output.map_index, output.partition_bytes.as_slice()), (map, &[expected][..]));
            checked += 1;
        }
    }
    let elapsed = started.elapsed();
    assert_eq!(checked, u64::from(N) * u64::from(N));
    println!("{N} maps x {N} partitions: register, {N} commits, {N} locates in {elapsed:?}");
}

#[test]
fn segment_copies_land_on_distinct_servers_and_a_map_is_lost_only_with_both() {
    let (mut state, start) = state();
    register_job(&mut state, "j", 60_000, start);
    let a = add_server(&mut state, "10.0.0.1:7000", 1000, start);
    let two = RegisterShuffleRequest { replicas: 2, ..register_request("j", 3, 2) };
    let (kind, message) = refused(state.register_shuffle(two.clone(), start));
    assert_eq!(kind, ErrorKind::Unavailable);
    assert!(message.contains("2 copies of each segment need 2 live storage servers"), "{message}");
    let three = RegisterShuffleRequest { replicas: 3, ..register_request("j", 3, 2) };
    assert_eq!(refused(state.register_shuffle(three, start)).0, ErrorKind::Invalid);
    let b = add_server(&mut state, "10.0.0.2:7000", 1000, start);
    let c = add_server(&mut state, "10.0.0.3:7000", 1000, start);
    let registered = state.register_shuffle(two, start).unwrap();
    for segment in &registered.segments {
        assert!(segment.replica_server_id != 0 && segment.replica_server_id != segment.server_id, "{segment:?}");
        assert!(!segment.replica_address.is_empty() && !segment.lost && !segment.replica_lost);
    }
    let shuffle = registered.shuffle_id;
    // Both copies count in the servers' load: 6 copies over 3 servers.
    let mut load = BTreeMap::new();
    for s in &registered.segments {
        *load.entry(s.server_id).or_insert(0) += 1;
        *load.entry(s.replica_server_id).or_insert(0) += 1;
    }
    assert_eq!(load, BTreeMap::from([(a, 2), (b, 2), (c, 2)]));
    commit(&mut state, shuffle, 0, 0, vec![10, 10, 10], start);
    commit(&mut state, shuffle, 1, 0, vec![10, 10, 10], start);
    // Server a dies: every segment keeps a live copy, shown first; nothing is lost.
    let later = start + Duration::from_secs(6);
    beat(&mut state, b, 0, later);
    beat(&mut state, c, 0, later);
    state.reap(later);
    let reply = locate(&mut state, shuffle, (0, 3), (0, 2), later);
    let first_segments: Vec<&Segment> = reply.segments.iter().filter(|s| s.index == 0).collect();
    assert!(first_segments.iter().all(|s| !s.lost && s.server_id != a), "{:?}", reply.segments);
    assert_eq!(first_segments.iter().filter(|s| s.replica_lost).count(), 2, "two segments had a copy on a");
    // Partitions whose last segment had a copy on a moved on to two live copies.
    let tails: Vec<&Segment> = reply.segments.iter().filter(|s| s.index == 1).collect();
    assert_eq!(tails.len(), 2);
    assert!(tails
        .iter()
        .all(|s| [s.server_id, s.replica_server_id] == [b, c] || [s.server_id, s.replica_server_id] == [c, b]));
    // Server b dies too: the first segment that had its copies on a and b is lost, and so are
    // exactly the maps with bytes there.
    let much_later = later + Duration::from_secs(6);
    beat(&mut state, c, 0, much_later);
    state.reap(much_later);
    let reply = locate(&mut state, shuffle, (0, 3), (0, 2), much_later);
    let lost: Vec<(u32, u32)> = reply.segments.iter().filter(|s| s.lost).map(|s| (s.partition, s.index)).collect();
    assert_eq!(lost.len(), 1, "{:?}", reply.segments);
    // Unregistering frees the shuffle on every server holding a copy that is still alive.
    state.unregister_shuffle(UnregisterShuffleRequest { shuffle_id: shuffle }, much_later).unwrap();
    assert_eq!(beat(&mut state, c, 0, much_later).free_shuffle_ids, [shuffle]);
}

#[test]
fn replicated_segments_survive_a_log_replay() {
    let (mut state, now) = state();
    register_job(&mut state, "j", 60_000, now);
    for i in 1..=3 {
        add_server(&mut state, &format!("10.0.0.{i}:7000"), 1000, now);
    }
    let two = RegisterShuffleRequest { replicas: 2, ..register_request("j", 2, 1) };
    let shuffle = state.register_shuffle(two, now).unwrap().shuffle_id;
    advance(&mut state, shuffle, 1, 0, now);
    let before = locate(&mut state, shuffle, (0, 2), (0, 1), now);
    let mut rebuilt = State::new(&super::tests::config(), Now::read());
    for record in state.take_journal() {
        rebuilt.replay(&record, now).unwrap();
    }
    let after = locate(&mut rebuilt, shuffle, (0, 2), (0, 1), now);
    assert_eq!(after.segments, before.segments);
    assert!(after.segments.iter().all(|s| s.replica_server_id != 0));
}

/// Heartbeats as `server_id` reporting one shuffle's bytes (DRAM, NVMe).
fn report(state: &mut State, server_id: u64, shuffle_id: u64, bytes: (u64, u64), now: Now) -> HeartbeatResponse {
    let shuffles = vec![ShuffleUsage { shuffle_id, dram_bytes: bytes.0, nvme_bytes: bytes.1 }];
    state.heartbeat(HeartbeatRequest { server_id, shuffles, ..Default::default() }, now).unwrap()
}

#[test]
fn shuffle_bytes_count_against_the_tenants_quotas_per_tier() {
    let quota = crate::config::TenantQuota { dram_bytes: tern_common::ByteSize(10 * BLOCK), ..Default::default() };
    let config = Config { tenants: BTreeMap::from([("etl".to_string(), quota)]), ..super::tests::config() };
    let now = Now::read();
    let mut state = State::new(&config, now);
    let server = add_server(&mut state, "10.0.0.1:7000", 100, now);
    let other = add_server(&mut state, "10.0.0.2:7000", 100, now);
    state
        .register_job(RegisterJobRequest { name: "a".into(), tenant: "etl".into(), ..Default::default() }, now)
        .unwrap();
    register_job(&mut state, "free", 0, now);
    let shuffle = register(&mut state, "a", 2, 0, now).shuffle_id;
    let unlimited = register(&mut state, "free", 2, 0, now).shuffle_id;
    let etl = |state: &State| {
        let t = state.jobs.tenants().into_iter().find(|t| t.tenant == "etl").unwrap();
        (t.dram_bytes, t.dram_shuffle_bytes, t.nvme_bytes, t.nvme_shuffle_bytes)
    };

    // Each server's report replaces its last one: repeated, nothing is counted twice.
    for _ in 0..2 {
        assert!(report(&mut state, server, shuffle, (4 * BLOCK, 100), now).quota_stops.is_empty());
    }
    assert!(report(&mut state, other, shuffle, (2 * BLOCK, 0), now).quota_stops.is_empty());
    report(&mut state, other, unlimited, (50 * BLOCK, 0), now);
    assert_eq!(etl(&state), (4 * BLOCK, 4 * BLOCK, 100, 100));
    report(&mut state, server, shuffle, (4 * BLOCK, 100), now);
    assert_eq!(etl(&state), (4 * BLOCK, 4 * BLOCK, 100, 100), "the other server's report was replaced");

    // Files and shuffles share the DRAM quota: 4 blocks of shuffle data leave room for 6 of files.
    let file = create(&mut state, "/jobs/a/f", now);
    allocate(&mut state, file, 6, now);
    let (kind, message) = refused(
        state.allocate_blocks(AllocateBlocksRequest { file_id: file, count: 1, client_host: String::new() }, now),
    );
    assert_eq!(kind, ErrorKind::QuotaExceeded);
    assert!(message.contains("tenant etl: dram bytes quota exceeded") && message.contains("of shuffles"), "{message}");

    // At the quota: every heartbeat reply names the tenant's shuffles, DRAM closed, NVMe open.
    let stops = report(&mut state, server, shuffle, (4 * BLOCK, 100), now).quota_stops;
    assert_eq!(stops.len(), 1);
    assert_eq!((stops[0].shuffle_id, stops[0].dram, stops[0].nvme), (shuffle, true, false));
    assert!(stops[0].reason.contains("tenant etl: dram bytes quota exceeded"), "{}", stops[0].reason);
    // New segments: a `dram` shuffle has no tier left; an `any` one may still go to NVMe.
    let dram_only = RegisterShuffleRequest { storage_class: "dram".into(), ..register_request("a", 2, 0) };
    let (kind, message) = refused(state.register_shuffle(dram_only, now));
    assert_eq!(kind, ErrorKind::QuotaExceeded);
    assert!(message.contains("(job a)"), "{message}");
    let second = register(&mut state, "a", 1, 0, now).shuffle_id;
    assert_eq!(report(&mut state, server, shuffle, (4 * BLOCK, 100), now).quota_stops.len(), 2);
    assert!(state.register_shuffle(register_request("free", 1, 0), now).is_ok(), "other tenants are not held");

    // A dead server's shuffles stop counting; the tenant is under its quota again.
    let later = now + Duration::from_secs(6);
    state.heartbeat(HeartbeatRequest { server_id: other, ..Default::default() }, later).unwrap();
    state.reap(later);
    assert_eq!(etl(&state), (6 * BLOCK, 0, 0, 0));
    let stops = report(&mut state, other, second, (0, 0), later).quota_stops;
    assert!(stops.is_empty(), "{stops:?}");
}

#[test]
fn a_restarted_server_keeps_the_segments_it_reports_and_loses_the_rest() {
    let (mut state, now) = state();
    let server = add_server(&mut state, "10.0.0.1:7000", 1000, now);
    register_job(&mut state, "j", 60_000, now);
    let shuffle = register(&mut state, "j", 3, 0, now).shuffle_id;
    assert_eq!(advance(&mut state, shuffle, 1, 0, now).server_id, server, "partition 1 continues in segment 1");
    // A new process at the same address took back partition 0's segment and partition 1's first
    // from NVMe (and reports a segment the registry never had, which changes nothing).
    let tiers = vec![TierUsage { tier: DRAM_TIER.into(), capacity_blocks: 1000, ..TierUsage::default() }];
    let request =
        RegisterServerRequest { address: "10.0.0.1:7000".into(), tiers, instance_id: u64::MAX, ..Default::default() };
    assert_eq!(state.register_server(request, now).unwrap().server_id, server);
    let held = |partition, index| HeldSegment { shuffle_id: shuffle, partition, index };
    let inventory = ReportInventoryRequest {
        server_id: server,
        shuffle_ids: vec![shuffle],
        segments: vec![held(0, 0), held(1, 0), held(7, 3)],
        last: true,
        ..Default::default()
    };
    state.report_inventory(inventory, now).unwrap();
    let reply = locate(&mut state, shuffle, (0, 3), (0, 0), now);
    let segments: Vec<(u32, u32, bool)> = reply.segments.iter().map(|s| (s.partition, s.index, s.lost)).collect();
    assert_eq!(segments, [(0, 0, false), (1, 0, false), (1, 1, true), (2, 0, true)]);
    // The same process registering again (the metadata server lost track of it) loses nothing,
    // whatever it reports.
    let tiers = vec![TierUsage { tier: DRAM_TIER.into(), capacity_blocks: 1000, ..TierUsage::default() }];
    let again =
        RegisterServerRequest { address: "10.0.0.1:7000".into(), tiers, instance_id: u64::MAX, ..Default::default() };
    state.register_server(again, now).unwrap();
    state
        .report_inventory(ReportInventoryRequest { server_id: server, last: true, ..Default::default() }, now)
        .unwrap();
    let reply = locate(&mut state, shuffle, (0, 3), (0, 0), now);
    assert_eq!(reply.segments.iter().filter(|s| s.lost).count(), 2);
}
