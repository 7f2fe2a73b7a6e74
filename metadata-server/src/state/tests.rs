//! The state machine through its RPC methods, with time moved by hand.

use std::fmt::Debug;

use tern_common::ByteSize;

use super::*;
use crate::servers::DRAM_TIER;

pub(super) const BLOCK: u64 = 4096;

pub(super) fn config() -> Config {
    Config { block_size: ByteSize(BLOCK), max_list_entries: 3, ..Config::default() }
}

pub(super) fn state() -> (State, Now) {
    let now = Now::read();
    (State::new(&config(), now), now)
}

/// The kind and message of a refused call.
pub(super) fn refused<T: Debug>(result: Result<T, Status>) -> (ErrorKind, String) {
    let status = result.expect_err("the call should have been refused");
    (ErrorKind::of_status(&status), status.message().to_string())
}

/// Registers a storage server process (each call a new one: registering an address again is a
/// restart) with an empty inventory.
pub(super) fn add_server(state: &mut State, address: &str, capacity_blocks: u64, now: Now) -> u64 {
    static INSTANCES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let instance_id = INSTANCES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tiers = vec![TierUsage { tier: DRAM_TIER.into(), capacity_blocks, ..TierUsage::default() }];
    let request = RegisterServerRequest { address: address.into(), tiers, instance_id, ..Default::default() };
    let reply = state.register_server(request, now).unwrap();
    assert_eq!(reply.block_size as u64, BLOCK);
    let inventory = ReportInventoryRequest { server_id: reply.server_id, last: true, ..Default::default() };
    state.report_inventory(inventory, now).unwrap();
    reply.server_id
}

pub(super) fn create(state: &mut State, path: &str, now: Now) -> u64 {
    state.create(CreateRequest { path: path.into(), parents: true, ..Default::default() }, now).unwrap().file_id
}

pub(super) fn allocate(state: &mut State, file_id: u64, count: u32, now: Now) -> Vec<BlockLocation> {
    let request = AllocateBlocksRequest { file_id, count, client_host: String::new() };
    state.allocate_blocks(request, now).unwrap().blocks
}

fn seal(state: &mut State, file_id: u64, length: u64, now: Now) -> FileInfo {
    state.seal(SealRequest { file_id, length }, now).unwrap().info.unwrap()
}

/// Creates, fills and seals a file of `length` bytes; returns its file id.
fn write(state: &mut State, path: &str, length: u64, now: Now) -> u64 {
    let file_id = create(state, path, now);
    let blocks = length.div_ceil(BLOCK) as u32;
    if blocks > 0 {
        allocate(state, file_id, blocks, now);
    }
    seal(state, file_id, length, now);
    file_id
}

fn open(state: &mut State, path: &str, now: Now) -> Result<OpenResponse, Status> {
    state.open(OpenRequest { path: path.into() }, now)
}

fn delete(state: &mut State, path: &str, recursive: bool, now: Now) -> Result<DeleteResponse, Status> {
    state.delete(DeleteRequest { path: path.into(), recursive }, now)
}

fn rename(state: &mut State, from: &str, to: &str, now: Now) -> Result<RenameResponse, Status> {
    state.rename(RenameRequest { from: from.into(), to: to.into() }, now)
}

fn list(state: &mut State, path: &str, start_after: &str, limit: u32, now: Now) -> (Vec<String>, bool) {
    let request = ListRequest { path: path.into(), start_after: start_after.into(), limit };
    let reply = state.list(request, now).unwrap();
    (reply.entries.into_iter().map(|e| e.path).collect(), reply.truncated)
}

/// The frees a server is told about on its next heartbeat (acknowledging none).
fn frees(state: &mut State, server_id: u64, now: Now) -> Vec<u64> {
    let request = HeartbeatRequest { server_id, ..Default::default() };
    let mut ids = state.heartbeat(request, now).unwrap().free_block_ids;
    ids.sort_unstable();
    ids
}

pub(super) fn register_job(state: &mut State, name: &str, lease_ms: u64, now: Now) -> RegisterJobResponse {
    state.register_job(RegisterJobRequest { name: name.into(), lease_ms, ..Default::default() }, now).unwrap()
}

#[test]
fn writes_then_reads_a_file() {
    let (mut state, now) = state();
    let server = add_server(&mut state, "10.0.0.1:7000", 100, now);
    let file_id = create(&mut state, "/data/f", now);
    let placed = allocate(&mut state, file_id, 3, now);
    assert!(placed.iter().all(|b| b.server_id == server && b.address == "10.0.0.1:7000" && b.length == 0));
    let info = seal(&mut state, file_id, 2 * BLOCK + 100, now);
    assert_eq!((info.path.as_str(), info.sealed, info.length, info.block_count), ("/data/f", true, 2 * BLOCK + 100, 3));
    let opened = open(&mut state, "/data/f", now).unwrap();
    assert_eq!(opened.block_size as u64, BLOCK);
    let lengths: Vec<u32> = opened.blocks.iter().map(|b| b.length).collect();
    assert_eq!(lengths, [BLOCK as u32, BLOCK as u32, 100]);
    let ids: Vec<u64> = opened.blocks.iter().map(|b| b.block_id).collect();
    assert_eq!(ids, placed.iter().map(|b| b.block_id).collect::<Vec<_>>());
    // An empty file has no blocks.
    write(&mut state, "/data/empty", 0, now);
    assert!(open(&mut state, "/data/empty", now).unwrap().blocks.is_empty());
    // ... and can be created sealed in one call.
    state
        .create(CreateRequest { path: "/data/marker".into(), parents: false, sealed: true, ..Default::default() }, now)
        .unwrap();
    let marker = open(&mut state, "/data/marker", now).unwrap();
    assert_eq!((marker.info.unwrap().length, marker.blocks.len()), (0, 0));
    let stat = state.stat(StatRequest { path: "/data".into(), with_blocks: true }, now).unwrap();
    let info = stat.info.unwrap();
    assert_eq!((info.kind, info.sealed, stat.blocks.len()), (EntryKind::Directory as i32, true, 0));
}

#[test]
fn refuses_what_the_namespace_forbids() {
    let (mut state, now) = state();
    let file_id = create(&mut state, "/a/b", now);
    let (kind, message) = refused(
        state.create(CreateRequest { path: "/a/b".into(), parents: false, sealed: false, ..Default::default() }, now),
    );
    assert_eq!((kind, message.as_str()), (ErrorKind::AlreadyExists, "create /a/b: already exists"));
    let (kind, message) =
        refused(state.mkdir(MkdirRequest { path: "/a".into(), parents: false, ..Default::default() }, now));
    assert_eq!(kind, ErrorKind::AlreadyExists, "{message}");
    state.mkdir(MkdirRequest { path: "/a".into(), parents: true, ..Default::default() }, now).unwrap();
    let (kind, message) = refused(open(&mut state, "/a/b", now));
    assert_eq!((kind, message.as_str()), (ErrorKind::NotFound, "open /a/b: is not sealed yet"));
    let (kind, message) = refused(open(&mut state, "/a", now));
    assert_eq!((kind, message.as_str()), (ErrorKind::Invalid, "open /a: is a directory"));
    let (kind, message) = refused(open(&mut state, "/nope", now));
    assert_eq!(kind, ErrorKind::NotFound, "{message}");
    for bad in ["relative", "/a//b", "/a/../b", "/x\0"] {
        let (kind, message) = refused(state.stat(StatRequest { path: bad.into(), with_blocks: false }, now));
        assert_eq!(kind, ErrorKind::Invalid, "{bad:?}");
        assert!(message.starts_with(&format!("stat {bad}: ")), "{message}");
    }
    let (kind, message) = refused(
        state.create(CreateRequest { path: "/c/d".into(), parents: false, sealed: false, ..Default::default() }, now),
    );
    assert_eq!((kind, message.as_str()), (ErrorKind::NotFound, "create /c/d: parent directory /c does not exist"));
    seal(&mut state, file_id, 0, now);
    let (kind, message) = refused(state.seal(SealRequest { file_id, length: 0 }, now));
    assert_eq!((kind, message.as_str()), (ErrorKind::Invalid, "seal /a/b: the file is already sealed"));
    let (kind, _) =
        refused(state.allocate_blocks(AllocateBlocksRequest { file_id, count: 1, ..Default::default() }, now));
    assert_eq!(kind, ErrorKind::Invalid);
    let (kind, _) = refused(state.seal(SealRequest { file_id: 999, length: 0 }, now));
    assert_eq!(kind, ErrorKind::NotFound);
}

#[test]
fn allocation_checks_its_arguments_and_the_servers() {
    let (mut state, now) = state();
    let file_id = create(&mut state, "/f", now);
    let ask = |count| AllocateBlocksRequest { file_id, count, client_host: String::new() };
    let (kind, message) = refused(state.allocate_blocks(ask(1), now));
    assert_eq!((kind, message.as_str()), (ErrorKind::Unavailable, "allocate 1 block for /f: no live storage server takes new data (dead, cordoned and draining ones take none: see tern admin servers)"));
    add_server(&mut state, "10.0.0.1:7000", 2048, now);
    add_server(&mut state, "10.0.0.2:7000", 2048, now);
    assert_eq!(refused(state.allocate_blocks(ask(0), now)).0, ErrorKind::Invalid);
    assert_eq!(refused(state.allocate_blocks(ask(1025), now)).0, ErrorKind::Invalid);
    let blocks = state.allocate_blocks(ask(1024), now).unwrap().blocks;
    assert_eq!(blocks.iter().filter(|b| b.server_id == 1).count(), 512);
    let (kind, _) = refused(state.allocate_blocks(ask(1), now).and_then(|_| {
        state.allocate_blocks(AllocateBlocksRequest { file_id: 42, count: 1, client_host: String::new() }, now)
    }));
    assert_eq!(kind, ErrorKind::NotFound);
    for _ in 0..2 {
        state.allocate_blocks(ask(1024), now).unwrap();
    }
    let (kind, message) = refused(state.allocate_blocks(ask(1024), now));
    assert_eq!(kind, ErrorKind::OutOfSpace, "{message}");
    let status = state.status(StatusRequest {}, now).unwrap();
    assert_eq!(status.servers.iter().map(|s| s.allocated_blocks).collect::<Vec<_>>(), [1537, 1536]);
}

#[test]
fn seal_frees_the_blocks_it_does_not_need() {
    let (mut state, now) = state();
    let server = add_server(&mut state, "10.0.0.1:7000", 100, now);
    let file_id = create(&mut state, "/f", now);
    let placed = allocate(&mut state, file_id, 4, now);
    let (kind, message) = refused(state.seal(SealRequest { file_id, length: 5 * BLOCK }, now));
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("needs 5 blocks") && message.contains("only 4"), "{message}");
    let info = seal(&mut state, file_id, BLOCK + 1, now);
    assert_eq!(info.block_count, 2);
    assert_eq!(frees(&mut state, server, now), [placed[2].block_id, placed[3].block_id]);
}

#[test]
fn lists_in_pages_capped_by_the_server() {
    let (mut state, now) = state();
    for name in ["e", "a", "d", "c", "b"] {
        create(&mut state, &format!("/dir/{name}"), now);
    }
    // max_list_entries is 3 in these tests: it caps both "no limit" and a larger limit.
    assert_eq!(list(&mut state, "/dir", "", 0, now), (vec!["/dir/a".into(), "/dir/b".into(), "/dir/c".into()], true));
    assert_eq!(list(&mut state, "/dir", "", 10, now).0.len(), 3);
    assert_eq!(list(&mut state, "/dir", "c", 10, now), (vec!["/dir/d".into(), "/dir/e".into()], false));
    assert_eq!(list(&mut state, "/dir", "a", 1, now), (vec!["/dir/b".into()], true));
    assert_eq!(list(&mut state, "/dir/b", "", 0, now), (vec!["/dir/b".into()], false));
    let (kind, _) = refused(state.list(ListRequest { path: "/none".into(), ..Default::default() }, now));
    assert_eq!(kind, ErrorKind::NotFound);
}

#[test]
fn delete_frees_blocks_and_refuses_non_empty_directories() {
    let (mut state, now) = state();
    let server = add_server(&mut state, "10.0.0.1:7000", 100, now);
    write(&mut state, "/d/a", 2 * BLOCK, now);
    write(&mut state, "/d/sub/b", BLOCK, now);
    let unsealed = create(&mut state, "/d/sub/unsealed", now);
    allocate(&mut state, unsealed, 1, now);
    let (kind, message) = refused(delete(&mut state, "/d", false, now));
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.starts_with("delete /d: directory not empty"), "{message}");
    let (kind, _) = refused(delete(&mut state, "/", true, now));
    assert_eq!(kind, ErrorKind::Invalid);
    let reply = delete(&mut state, "/d", true, now).unwrap();
    assert_eq!((reply.files_deleted, reply.blocks_freed), (3, 4));
    assert_eq!(frees(&mut state, server, now), [1, 2, 3, 4]);
    assert_eq!(refused(delete(&mut state, "/d", true, now)).0, ErrorKind::NotFound);
    let status = state.status(StatusRequest {}, now).unwrap();
    assert_eq!((status.files, status.directories), (0, 0));
}

/// A writer that failed gives its file up: the unsealed file goes at once with its blocks (the
/// path is free for a retry), and asking again, or for a sealed file, does nothing.
#[test]
fn abort_deletes_an_unsealed_file_at_once_and_only_that() {
    let (mut state, now) = state();
    let server = add_server(&mut state, "10.0.0.1:7000", 100, now);
    let failed = create(&mut state, "/d/f", now);
    allocate(&mut state, failed, 2, now);
    let abort = |state: &mut State, file_id| state.abort(AbortRequest { file_id }, now).unwrap();
    assert_eq!(abort(&mut state, failed), AbortResponse { aborted: true, blocks_freed: 2 });
    assert_eq!(frees(&mut state, server, now), [1, 2]);
    assert_eq!(abort(&mut state, failed), AbortResponse { aborted: false, blocks_freed: 0 }, "asked twice");
    // The retry writes the same path; the first writer's late abort cannot touch it.
    let retry = write(&mut state, "/d/f", BLOCK, now);
    assert_ne!(retry, failed);
    assert_eq!(abort(&mut state, failed), AbortResponse { aborted: false, blocks_freed: 0 });
    assert_eq!(abort(&mut state, retry), AbortResponse { aborted: false, blocks_freed: 0 }, "sealed files stay");
    assert!(open(&mut state, "/d/f", now).is_ok());
}

#[test]
fn rename_moves_subtrees_within_bounds() {
    let (mut state, now) = state();
    add_server(&mut state, "10.0.0.1:7000", 100, now);
    let file_id = write(&mut state, "/a/b/f", 10, now);
    state.mkdir(MkdirRequest { path: "/z".into(), parents: false, ..Default::default() }, now).unwrap();
    rename(&mut state, "/a/b", "/z/b2", now).unwrap();
    let info = state.stat(StatRequest { path: "/z/b2/f".into(), with_blocks: false }, now).unwrap().info.unwrap();
    assert_eq!((info.file_id, info.length), (file_id, 10));
    let (kind, message) = refused(rename(&mut state, "/z", "/z/b2/inner", now));
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("into itself"), "{message}");
    assert_eq!(refused(rename(&mut state, "/z", "/a", now)).0, ErrorKind::AlreadyExists);
    assert_eq!(refused(rename(&mut state, "/", "/x", now)).0, ErrorKind::Invalid);
    // Across job boundaries, and job roots themselves, are refused.
    let job = register_job(&mut state, "j1", 0, now);
    register_job(&mut state, "j2", 0, now);
    write(&mut state, "/jobs/j1/out", 1, now);
    let (kind, message) = refused(rename(&mut state, "/jobs/j1/out", "/jobs/j2/out", now));
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("across jobs (job j1 to job j2)"), "{message}");
    assert_eq!(refused(rename(&mut state, "/jobs/j1/out", "/out", now)).0, ErrorKind::Invalid);
    assert_eq!(refused(rename(&mut state, "/z", "/jobs/j1/z", now)).0, ErrorKind::Invalid);
    assert_eq!(refused(rename(&mut state, &job.root, "/j1", now)).0, ErrorKind::Invalid);
    assert_eq!(refused(rename(&mut state, "/jobs", "/j", now)).0, ErrorKind::Invalid);
    rename(&mut state, "/jobs/j1/out", "/jobs/j1/renamed", now).unwrap();
    open(&mut state, "/jobs/j1/renamed", now).unwrap();
}

#[test]
fn a_dead_server_loses_its_blocks_but_not_the_files_which_say_so() {
    let (mut state, start) = state();
    let doomed = add_server(&mut state, "10.0.0.1:7000", 100, start);
    let healthy = add_server(&mut state, "10.0.0.2:7000", 100, start);
    // Two blocks: one lands on each server.
    write(&mut state, "/jobless/spread", 2 * BLOCK, start);
    let later = start + Duration::from_secs(6);
    state.heartbeat(HeartbeatRequest { server_id: healthy, ..Default::default() }, later).unwrap();
    state.reap(later);
    let (kind, message) = refused(open(&mut state, "/jobless/spread", later));
    assert_eq!(kind, ErrorKind::DataLost);
    assert_eq!(
        message,
        "open /jobless/spread: block 1 on storage server 1 (10.0.0.1:7000) is lost: server missed heartbeats for 6.0s"
    );
    let stat = state.stat(StatRequest { path: "/jobless/spread".into(), with_blocks: true }, later).unwrap();
    assert_eq!(stat.blocks_alive, [false, true]);
    // Lost is visible: in stat, in listings and in the status's count.
    assert_eq!(stat.info.unwrap().lost_blocks, 1);
    let listed = state.list(ListRequest { path: "/jobless".into(), ..Default::default() }, later).unwrap();
    assert_eq!(listed.entries.iter().map(|e| e.lost_blocks).collect::<Vec<_>>(), [1]);
    assert_eq!(state.status(StatusRequest {}, later).unwrap().lost_files, 1);
    // New files go to the live server only, and open.
    write(&mut state, "/jobless/after", 3 * BLOCK, later);
    let opened = open(&mut state, "/jobless/after", later).unwrap();
    assert!(opened.blocks.iter().all(|b| b.server_id == healthy));
    // The dead server is told to re-register; deleting the lost file queues frees only on the live one.
    let reply = state.heartbeat(HeartbeatRequest { server_id: doomed, ..Default::default() }, later).unwrap();
    assert!(reply.reregister);
    assert_eq!(state.status(StatusRequest {}, later).unwrap().lost_files, 1, "the new file is whole");
    delete(&mut state, "/jobless/spread", false, later).unwrap();
    assert_eq!(frees(&mut state, healthy, later), [2]);
    let status = state.status(StatusRequest {}, later).unwrap();
    assert_eq!(status.lost_files, 0, "the lost file is removed");
    assert_eq!(
        status.servers.iter().map(|s| (s.alive, s.allocated_blocks)).collect::<Vec<_>>(),
        [(false, 0), (true, 4)]
    );
}

#[test]
fn a_restarted_server_keeps_its_id_and_loses_the_blocks_it_does_not_report() {
    let (mut state, now) = state();
    add_server(&mut state, "10.0.0.1:7000", 100, now);
    write(&mut state, "/f", 1, now);
    write(&mut state, "/kept", 1, now);
    let kept = open(&mut state, "/kept", now).unwrap().blocks[0].block_id;
    // The new process reports /kept's block (NVMe survives a restart), not /f's.
    let tiers = vec![TierUsage { tier: DRAM_TIER.into(), capacity_blocks: 100, ..TierUsage::default() }];
    let request =
        RegisterServerRequest { address: "10.0.0.1:7000".into(), tiers, instance_id: 999, ..Default::default() };
    assert_eq!(state.register_server(request, now).unwrap().server_id, 1);
    let inventory =
        ReportInventoryRequest { server_id: 1, block_ids: vec![kept, 777], last: true, ..Default::default() };
    let done = state.report_inventory(inventory, now).unwrap();
    assert_eq!((done.blocks_lost, done.blocks_unreferenced), (1, 1));
    let (kind, message) = refused(open(&mut state, "/f", now));
    assert_eq!(kind, ErrorKind::DataLost);
    assert!(message.contains("open /f") && message.contains("storage server 1 (10.0.0.1:7000) is lost"), "{message}");
    assert!(open(&mut state, "/kept", now).is_ok());
    assert_eq!(frees(&mut state, 1, now), [777]);
    let (kind, _) =
        refused(state.register_server(RegisterServerRequest { address: "nope".into(), ..Default::default() }, now));
    assert_eq!(kind, ErrorKind::Invalid);
}

#[test]
fn jobs_own_their_directory() {
    let (mut state, now) = state();
    add_server(&mut state, "10.0.0.1:7000", 100, now);
    let job = register_job(&mut state, "j1", 0, now);
    assert_eq!((job.job_id.as_str(), job.root.as_str(), job.lease_ms), ("j1", "/jobs/j1", 30_000));
    assert_eq!(
        refused(state.register_job(RegisterJobRequest { name: "j1".into(), lease_ms: 0, ..Default::default() }, now)).0,
        { ErrorKind::AlreadyExists }
    );
    assert_eq!(
        refused(state.register_job(RegisterJobRequest { name: "a/b".into(), lease_ms: 0, ..Default::default() }, now))
            .0,
        { ErrorKind::Invalid }
    );
    let long = register_job(&mut state, "", 10 * 3_600_000, now);
    assert!(long.job_id.starts_with("job-"), "{}", long.job_id);
    assert_eq!(long.lease_ms, 3_600_000);
    // Inside a live job: fine. Under an unknown one, or a job root by hand: refused.
    write(&mut state, "/jobs/j1/x/y", 1, now);
    state.mkdir(MkdirRequest { path: "/jobs/j1".into(), parents: true, ..Default::default() }, now).unwrap();
    let (kind, message) = refused(state.create(
        CreateRequest { path: "/jobs/ghost/f".into(), parents: true, sealed: false, ..Default::default() },
        now,
    ));
    assert_eq!(
        (kind, message.as_str()),
        (ErrorKind::NotFound, "create /jobs/ghost/f: job ghost is not registered (ended or lease lapsed)")
    );
    assert_eq!(
        refused(state.mkdir(MkdirRequest { path: "/jobs/ghost".into(), parents: true, ..Default::default() }, now)).0,
        { ErrorKind::Invalid }
    );
    assert_eq!(
        refused(
            state.create(
                CreateRequest { path: "/jobs".into(), parents: false, sealed: false, ..Default::default() },
                now
            )
        )
        .0,
        { ErrorKind::Invalid }
    );
    let (kind, message) = refused(delete(&mut state, "/jobs/j1", true, now));
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("end the job instead"), "{message}");
    assert_eq!(refused(delete(&mut state, "/jobs", true, now)).0, ErrorKind::Invalid);
    // Deleting inside a job is fine.
    delete(&mut state, "/jobs/j1/x", true, now).unwrap();
    let info = state.stat(StatRequest { path: "/jobs/j1".into(), with_blocks: false }, now).unwrap().info.unwrap();
    assert_eq!(info.job, "j1");
}

#[test]
fn ending_a_job_deletes_its_files_and_frees_their_blocks() {
    let (mut state, now) = state();
    let server = add_server(&mut state, "10.0.0.1:7000", 100, now);
    register_job(&mut state, "j1", 0, now);
    write(&mut state, "/jobs/j1/a", 2 * BLOCK, now);
    write(&mut state, "/jobs/j1/d/b", 10, now);
    write(&mut state, "/kept", 10, now);
    let status = state.status(StatusRequest {}, now).unwrap();
    assert_eq!((status.jobs[0].files, status.jobs[0].bytes), (2, 2 * BLOCK + 10));
    let reply = state.end_job(EndJobRequest { job_id: "j1".into(), ..Default::default() }, now).unwrap();
    assert_eq!((reply.files_deleted, reply.blocks_freed), (2, 3));
    assert_eq!(frees(&mut state, server, now), [1, 2, 3]);
    assert_eq!(refused(state.stat(StatRequest { path: "/jobs/j1".into(), with_blocks: false }, now)).0, {
        ErrorKind::NotFound
    });
    assert_eq!(
        refused(state.end_job(EndJobRequest { job_id: "j1".into(), ..Default::default() }, now)).0,
        ErrorKind::NotFound
    );
    assert_eq!(
        refused(state.renew_job(RenewJobRequest { job_id: "j1".into(), ..Default::default() }, now)).0,
        ErrorKind::NotFound
    );
    open(&mut state, "/kept", now).unwrap();
    // The name is free again.
    register_job(&mut state, "j1", 0, now);
}

#[test]
fn lapsed_leases_end_jobs_unless_renewed() {
    let (mut state, start) = state();
    let server = add_server(&mut state, "10.0.0.1:7000", 100, start);
    register_job(&mut state, "short", 100, start);
    register_job(&mut state, "renewed", 100, start);
    write(&mut state, "/jobs/short/f", BLOCK, start);
    write(&mut state, "/jobs/renewed/f", BLOCK, start);
    let mid = start + Duration::from_millis(80);
    let renewed = state.renew_job(RenewJobRequest { job_id: "renewed".into(), ..Default::default() }, mid).unwrap();
    assert_eq!(renewed.lease_ms, 100);
    let after = start + Duration::from_millis(150);
    // Lapsed but not yet reaped: no new entries, and no renewal.
    let (kind, _) = refused(state.create(
        CreateRequest { path: "/jobs/short/g".into(), parents: false, sealed: false, ..Default::default() },
        after,
    ));
    assert_eq!(kind, ErrorKind::NotFound);
    assert_eq!(
        refused(state.renew_job(RenewJobRequest { job_id: "short".into(), ..Default::default() }, after)).0,
        ErrorKind::NotFound
    );
    state.reap(after);
    assert_eq!(refused(open(&mut state, "/jobs/short/f", after)).0, ErrorKind::NotFound);
    open(&mut state, "/jobs/renewed/f", after).unwrap();
    assert_eq!(frees(&mut state, server, after), [1]);
    let status = state.status(StatusRequest {}, after).unwrap();
    assert_eq!(status.jobs.iter().map(|j| j.job_id.as_str()).collect::<Vec<_>>(), ["renewed"]);
    state.reap(start + Duration::from_millis(300));
    assert!(state.status(StatusRequest {}, after).unwrap().jobs.is_empty());
    assert_eq!(frees(&mut state, server, after), [1, 2]);
}

#[test]
fn a_lapsed_job_name_can_be_registered_again_before_the_reaper_runs() {
    let (mut state, start) = state();
    register_job(&mut state, "j", 100, start);
    write(&mut state, "/jobs/j/old", 0, start);
    let after = start + Duration::from_millis(200);
    register_job(&mut state, "j", 100, after);
    assert_eq!(refused(open(&mut state, "/jobs/j/old", after)).0, ErrorKind::NotFound);
}

#[test]
fn status_reports_servers_jobs_and_totals() {
    let (mut state, start) = state();
    add_server(&mut state, "10.0.0.2:7000", 10, start);
    add_server(&mut state, "10.0.0.1:7000", 10, start);
    register_job(&mut state, "j", 1000, start);
    write(&mut state, "/jobs/j/f", 5, start);
    let later = start + Duration::from_millis(400);
    let status = state.status(StatusRequest {}, later).unwrap();
    assert_eq!(status.block_size as u64, BLOCK);
    let servers: Vec<_> = status.servers.iter().map(|s| (s.server_id, s.address.as_str(), s.alive)).collect();
    assert_eq!(servers, [(1, "10.0.0.2:7000", true), (2, "10.0.0.1:7000", true)]);
    assert_eq!(status.servers[0].last_heartbeat_ms_ago, 400);
    assert_eq!(status.servers[0].tiers[0].capacity_blocks, 10);
    assert_eq!((status.jobs[0].expires_in_ms, status.jobs[0].files, status.jobs[0].bytes), (600, 1, 5));
    // /jobs and /jobs/j; one file.
    assert_eq!((status.files, status.directories), (1, 2));
    let gauges = state.gauges();
    assert_eq!((gauges.files, gauges.jobs, gauges.live_servers, gauges.allocated_blocks), (1, 1, 2, 1));
}

#[test]
fn storage_classes_steer_placement() {
    let (mut state, now) = state();
    let tiers = vec![
        TierUsage { tier: DRAM_TIER.into(), capacity_blocks: 2, ..TierUsage::default() },
        TierUsage {
            tier: tern_proto::Tier::Nvme.name().into(),
            capacity_blocks: 3,
            engine: "psync".into(),
            ..TierUsage::default()
        },
    ];
    state
        .register_server(RegisterServerRequest { address: "10.0.0.1:7000".into(), tiers, ..Default::default() }, now)
        .unwrap();
    state.report_inventory(ReportInventoryRequest { server_id: 1, last: true, ..Default::default() }, now).unwrap();
    let create_class = |state: &mut State, path: &str, class: &str| {
        let request =
            CreateRequest { path: path.into(), parents: true, storage_class: class.into(), ..Default::default() };
        state.create(request, now)
    };
    let (kind, message) = refused(create_class(&mut state, "/bad", "ssd"));
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("create /bad") && message.contains("\"ssd\"") && message.contains("\"any\""), "{message}");

    let nvme = create_class(&mut state, "/n", "nvme").unwrap().file_id;
    let placed = allocate(&mut state, nvme, 1, now);
    assert_eq!(tern_proto::Tier::of_block(placed[0].block_id), tern_proto::Tier::Nvme);
    // "" is any: DRAM first, then NVMe once DRAM is full.
    let any = create_class(&mut state, "/a", "").unwrap().file_id;
    let placed = allocate(&mut state, any, 3, now);
    let tiers: Vec<_> = placed.iter().map(|b| tern_proto::Tier::of_block(b.block_id).name()).collect();
    assert_eq!(tiers, ["dram", "dram", "nvme"]);
    let dram = create_class(&mut state, "/d", "dram").unwrap().file_id;
    let request = AllocateBlocksRequest { file_id: dram, count: 1, client_host: String::new() };
    let (kind, message) = refused(state.allocate_blocks(request, now));
    assert_eq!(kind, ErrorKind::OutOfSpace);
    assert!(message.contains("class dram") && message.contains("0 dram"), "{message}");
    let request = AllocateBlocksRequest { file_id: any, count: 2, client_host: String::new() };
    let (kind, message) = refused(state.allocate_blocks(request, now));
    assert_eq!(kind, ErrorKind::OutOfSpace);
    assert!(message.contains("0 dram and 1 nvme"), "{message}");
    for (path, class) in [("/n", "nvme"), ("/a", "any"), ("/d", "dram")] {
        let info = state.stat(StatRequest { path: path.into(), with_blocks: false }, now).unwrap().info.unwrap();
        assert_eq!(info.storage_class, class, "{path}");
    }
}

/// Creates a file with `replicas` copies of each block.
fn create_replicated(state: &mut State, path: &str, replicas: u32, now: Now) -> Result<u64, Status> {
    let request = CreateRequest { path: path.into(), parents: true, replicas, ..Default::default() };
    state.create(request, now).map(|r| r.file_id)
}

#[test]
fn two_copies_go_to_different_servers_and_need_two_live_servers() {
    let (mut state, now) = state();
    assert_eq!(refused(create_replicated(&mut state, "/r/bad", 3, now)).0, ErrorKind::Invalid);
    let only = add_server(&mut state, "10.0.0.1:7000", 100, now);
    // Refused at create, naming how many servers are live, before any block is asked for.
    let (kind, message) = refused(create_replicated(&mut state, "/r/f", 2, now));
    assert_eq!(kind, ErrorKind::Unavailable);
    assert!(message.contains("2 copies of each block need 2 live storage servers, and only 1 is live"), "{message}");
    let other = add_server(&mut state, "10.0.0.2:7000", 100, now);
    let file_id = create_replicated(&mut state, "/r/f", 2, now).unwrap();
    let request = AllocateBlocksRequest { file_id, count: 2, client_host: String::new() };
    add_server(&mut state, "10.0.0.3:7000", 100, now);
    let placed = state.allocate_blocks(request, now).unwrap().blocks;
    assert_eq!(placed.len(), 4, "two copies of two blocks");
    for copies in placed.chunks(2) {
        assert_ne!(copies[0].server_id, copies[1].server_id, "{placed:?}");
    }
    let info = seal(&mut state, file_id, BLOCK + 1, now);
    assert_eq!((info.replicas, info.block_count), (2, 2));
    let opened = open(&mut state, "/r/f", now).unwrap();
    assert_eq!(opened.blocks.iter().map(|b| b.length).collect::<Vec<_>>(), [BLOCK as u32, BLOCK as u32, 1, 1]);
    // Capacity counts both copies: 4 blocks placed.
    let status = state.status(StatusRequest {}, now).unwrap();
    assert_eq!(status.servers.iter().map(|s| s.allocated_blocks).sum::<u64>(), 4);
    // Seal gives back both copies of an unused block.
    let file_id = create_replicated(&mut state, "/r/short", 2, now).unwrap();
    allocate(&mut state, file_id, 3, now);
    seal(&mut state, file_id, 10, now);
    let status = state.status(StatusRequest {}, now).unwrap();
    let freeing: usize = [only, other, 3].iter().map(|&s| frees(&mut state, s, now).len()).sum();
    assert_eq!(freeing, 4, "two unused blocks of two copies each: {status:?}");
}

#[test]
fn a_replicated_file_is_lost_only_when_every_copy_is() {
    let (mut state, start) = state();
    let a = add_server(&mut state, "10.0.0.1:7000", 100, start);
    let b = add_server(&mut state, "10.0.0.2:7000", 100, start);
    let c = add_server(&mut state, "10.0.0.3:7000", 100, start);
    let file_id = create_replicated(&mut state, "/r/f", 2, start).unwrap();
    let placed = allocate(&mut state, file_id, 3, start);
    seal(&mut state, file_id, 3 * BLOCK, start);
    // A single-copy file on every server, for contrast.
    write(&mut state, "/r/single", 3 * BLOCK, start);
    // Server a dies: every block still has a copy, and the live copy is listed first.
    let later = start + Duration::from_secs(6);
    for server_id in [b, c] {
        state.heartbeat(HeartbeatRequest { server_id, ..Default::default() }, later).unwrap();
    }
    state.reap(later);
    let opened = open(&mut state, "/r/f", later).unwrap();
    assert!(opened.blocks.chunks(2).all(|copies| copies[0].server_id != a), "{:?}", opened.blocks);
    let stat = state.stat(StatRequest { path: "/r/f".into(), with_blocks: true }, later).unwrap();
    let dead_copies = placed.iter().filter(|p| p.server_id == a).count();
    assert_eq!(stat.blocks_alive.iter().filter(|alive| !**alive).count(), dead_copies);
    assert_eq!(refused(open(&mut state, "/r/single", later)).0, ErrorKind::DataLost);
    // Server b dies too: some block had its copies on a and b, so the file is lost, and the
    // message names both copies.
    let much_later = later + Duration::from_secs(6);
    state.heartbeat(HeartbeatRequest { server_id: c, ..Default::default() }, much_later).unwrap();
    state.reap(much_later);
    let (kind, message) = refused(open(&mut state, "/r/f", much_later));
    assert_eq!(kind, ErrorKind::DataLost);
    assert!(message.contains("every copy of a block is lost") && message.contains("storage server 1"), "{message}");
    assert!(message.contains("storage server 2"), "{message}");
    // Deleting it frees the copies on the live server (besides what re-replication had begun
    // copying there from b, given up when b died).
    delete(&mut state, "/r/f", false, much_later).unwrap();
    let freed = frees(&mut state, c, much_later);
    assert!(placed.iter().filter(|p| p.server_id == c).all(|p| freed.contains(&p.block_id)), "{freed:?}");
}

#[test]
fn replicas_survive_a_log_replay() {
    let (mut state, now) = state();
    for i in 1..=2 {
        add_server(&mut state, &format!("10.0.0.{i}:7000"), 100, now);
    }
    let file_id = create_replicated(&mut state, "/r/f", 2, now).unwrap();
    allocate(&mut state, file_id, 4, now);
    seal(&mut state, file_id, BLOCK + 5, now);
    let before = open(&mut state, "/r/f", now).unwrap();
    let mut rebuilt = State::new(&config(), Now::read());
    for record in state.take_journal() {
        rebuilt.replay(&record, now).unwrap();
    }
    let after = open(&mut rebuilt, "/r/f", now).unwrap();
    assert_eq!(after.info.as_ref().unwrap().replicas, 2);
    // The same copies in the same places (grants are signed with each state's own key).
    let placed =
        |blocks: &[BlockLocation]| blocks.iter().map(|b| (b.block_id, b.server_id, b.length)).collect::<Vec<_>>();
    assert_eq!(placed(&after.blocks), placed(&before.blocks));
}

#[test]
fn tokens_and_grants_name_the_job_and_its_registration() {
    let (mut state, now) = state();
    add_server(&mut state, "10.0.0.1:7000", 64, now);
    let key = TokenKey::generate();
    state.set_key(key.clone());
    let a = register_job(&mut state, "a", 0, now);
    let token = JobToken::from_text(&a.token).unwrap();
    key.verify(&token).unwrap();
    assert_eq!((token.job.as_str(), token.lease_ms), ("a", 30_000));
    state.check_job_token("a", &a.token, "end").unwrap();
    let b = register_job(&mut state, "b", 0, now);
    assert_eq!(refused(state.check_job_token("b", &a.token, "end")).0, ErrorKind::PermissionDenied);
    assert_eq!(refused(state.check_job_token("b", "", "end")).0, ErrorKind::PermissionDenied);
    let forged = TokenKey::generate().issue("b", token.serial, token.expires_unix_ms, token.lease_ms).to_text();
    assert_eq!(refused(state.check_job_token("b", &forged, "end")).0, ErrorKind::PermissionDenied);

    // Blocks of a job's file are granted to the job's serial; volume files to serial 0.
    let file = create(&mut state, "/jobs/a/f", now);
    let blocks = allocate(&mut state, file, 2, now);
    let grant =
        |location: &BlockLocation| -> tern_proto::token::Grant { location.grant.as_slice().try_into().unwrap() };
    assert!(key.check_grant(GrantKind::Block, blocks[0].block_id, token.serial, &grant(&blocks[0])));
    let b_serial = JobToken::from_text(&b.token).unwrap().serial;
    assert!(!key.check_grant(GrantKind::Block, blocks[0].block_id, b_serial, &grant(&blocks[0])));
    let volume = create(&mut state, "/v", now);
    let blocks = allocate(&mut state, volume, 1, now);
    assert!(key.check_grant(GrantKind::Block, blocks[0].block_id, VOLUME_SERIAL, &grant(&blocks[0])));

    // A new registration under an ended job's name does not honour the old token.
    let fresh = state.refresh_token(RefreshTokenRequest { token: a.token.clone() }, now).unwrap().token;
    key.verify(&JobToken::from_text(&fresh).unwrap()).unwrap();
    state.end_job(EndJobRequest { job_id: "a".into(), ..Default::default() }, now).unwrap();
    register_job(&mut state, "a", 0, now);
    assert_eq!(refused(state.check_job_token("a", &a.token, "end")).0, ErrorKind::PermissionDenied);
    let (kind, _) = refused(state.refresh_token(RefreshTokenRequest { token: a.token.clone() }, now));
    assert_eq!(kind, ErrorKind::PermissionDenied);
}

fn set_mode(state: &mut State, server: &str, mode: ServerMode, timeout_ms: u64, now: Now) -> ServerStatus {
    let request = SetServerModeRequest { server: server.into(), mode: mode as i32, drain_timeout_ms: timeout_ms };
    state.set_server_mode(request, now).unwrap().server.unwrap()
}

fn heartbeat_says_drained(state: &mut State, server_id: u64, now: Now) -> bool {
    state.heartbeat(HeartbeatRequest { server_id, ..Default::default() }, now).unwrap().drained
}

#[test]
fn cordoned_and_draining_servers_take_no_placements_and_the_modes_replay() {
    let (mut state, now) = state();
    let a = add_server(&mut state, "10.0.0.1:7000", 64, now);
    let b = add_server(&mut state, "10.0.0.2:7000", 64, now);
    let cordoned = set_mode(&mut state, "10.0.0.1:7000", ServerMode::Cordoned, 0, now);
    assert_eq!((cordoned.server_id, cordoned.state.as_str()), (a, "cordoned"));
    let file = create(&mut state, "/f", now);
    assert!(allocate(&mut state, file, 8, now).iter().all(|block| block.server_id == b));
    // The mode is logged: a replay of the journal, and a snapshot, bring it back.
    let mut replayed = State::new(&config(), Now::read());
    replayed.restore(&state.take_journal(), now).unwrap();
    let mut from_snapshot = State::new(&config(), Now::read());
    from_snapshot.restore(&replayed.snapshot(now), now).unwrap();
    for restored in [&mut replayed, &mut from_snapshot] {
        let servers = restored.status(StatusRequest {}, now).unwrap().servers;
        assert_eq!(servers.iter().find(|s| s.server_id == a).unwrap().state, "cordoned");
    }
    set_mode(&mut state, &a.to_string(), ServerMode::Active, 0, now);
    let mut placed = allocate(&mut state, file, 8, now).iter().map(|block| block.server_id).collect::<Vec<_>>();
    placed.dedup();
    assert!(placed.contains(&a), "uncordoned, it takes blocks again: {placed:?}");
    let (kind, message) = refused(state.set_server_mode(
        SetServerModeRequest { server: "10.9.9.9:1".into(), mode: ServerMode::Cordoned as i32, drain_timeout_ms: 0 },
        now,
    ));
    assert_eq!(kind, ErrorKind::NotFound, "{message}");
}

#[test]
fn a_drain_waits_for_needed_data_then_says_exit() {
    let (mut state, now) = state();
    let a = add_server(&mut state, "10.0.0.1:7000", 64, now);
    add_server(&mut state, "10.0.0.2:7000", 64, now);
    set_mode(&mut state, "10.0.0.2:7000", ServerMode::Cordoned, 0, now);
    let job = state.register_job(RegisterJobRequest { name: "j".into(), ..Default::default() }, now).unwrap();
    write(&mut state, &format!("{}/out", job.root), 3 * BLOCK, now);
    set_mode(&mut state, "10.0.0.2:7000", ServerMode::Active, 0, now);
    let draining = set_mode(&mut state, "10.0.0.1:7000", ServerMode::Draining, 60_000, now);
    assert_eq!((draining.state.as_str(), draining.drained), ("draining", false));
    assert!(draining.drain_waiting_for.contains("3 blocks"), "{}", draining.drain_waiting_for);
    assert!(!heartbeat_says_drained(&mut state, a, now));
    state.end_job(EndJobRequest { job_id: "j".into(), token: String::new() }, now).unwrap();
    state.reap(now);
    assert!(heartbeat_says_drained(&mut state, a, now), "nothing needed is left: the server exits");

    // A file only there keeps a drain waiting until its deadline.
    let (mut state, now) = self::state();
    let a = add_server(&mut state, "10.0.0.1:7000", 64, now);
    write(&mut state, "/only-here", BLOCK, now);
    let draining = set_mode(&mut state, "10.0.0.1:7000", ServerMode::Draining, 1000, now);
    assert_eq!(draining.sole_copy_blocks, 1);
    state.reap(now + Duration::from_millis(500));
    assert!(!heartbeat_says_drained(&mut state, a, now + Duration::from_millis(500)));
    state.reap(now + Duration::from_millis(1500));
    assert!(heartbeat_says_drained(&mut state, a, now + Duration::from_millis(1500)), "the deadline passed");
    // The same address back as a new process is not drained again.
    add_server(&mut state, "10.0.0.1:7000", 64, now + Duration::from_secs(2));
    let servers = state.status(StatusRequest {}, now + Duration::from_secs(2)).unwrap().servers;
    assert_eq!(servers[0].state, "alive");
}

#[test]
fn an_unsealed_file_whose_writer_stopped_renewing_is_deleted() {
    let (mut state, now) = state();
    add_server(&mut state, "10.0.0.1:7000", 64, now);
    let lease = config().writer_lease();
    let kept = create(&mut state, "/kept", now);
    let dead = create(&mut state, "/dead", now);
    allocate(&mut state, dead, 2, now);
    let sealed = write(&mut state, "/sealed", BLOCK, now);
    let later = now + lease * 2 / 3;
    state.renew_writer(RenewWriterRequest { file_id: kept }, later).unwrap();
    state.reap(now + lease + Duration::from_millis(1));
    assert!(state.stat(StatRequest { path: "/kept".into(), with_blocks: false }, now).is_ok(), "renewed");
    let (kind, _) = refused(state.stat(StatRequest { path: "/dead".into(), with_blocks: false }, now));
    assert_eq!(kind, ErrorKind::NotFound, "the dead writer's file is reaped");
    assert!(state.stat(StatRequest { path: "/sealed".into(), with_blocks: false }, now).is_ok());
    let (kind, _) = refused(state.renew_writer(RenewWriterRequest { file_id: sealed }, now));
    assert_eq!(kind, ErrorKind::Invalid, "a sealed file has no writer");
}
