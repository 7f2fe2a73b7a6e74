//! The registry's own tests: registrations, placement over its view of room, frees, liveness.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use tern_proto::v1::{ServerMode, TierUsage};
use tern_proto::{BlockId, ShuffleId, StorageClass, NVME_BLOCK_BIT};

use super::inventory::Reconciled;
use super::registration::host_of_address;
use super::*;
use crate::planner::{place_blocks, place_segments};

/// What the state does with the registry and the planner, for tests of what the registry
/// counts: a registration, allocations and segment plans.
trait Placement {
    fn register(
        &mut self,
        address: &str,
        tiers: Vec<TierUsage>,
        instance_id: u64,
        now: Instant,
    ) -> Result<(ServerId, Option<u64>), Refusal>;
    fn allocate(&mut self, count: u32, client_host: &str, class: StorageClass) -> Result<Vec<BlockRef>, Refusal>;
    fn allocate_copies(
        &mut self,
        count: u32,
        client_host: &str,
        class: StorageClass,
        replicas: u32,
    ) -> Result<Vec<BlockRef>, Refusal>;
    fn plan_segments(&self, count: usize, avoid: Option<u64>) -> Result<Vec<u64>, Refusal>;
}

impl Placement for Servers {
    fn register(
        &mut self,
        address: &str,
        tiers: Vec<TierUsage>,
        instance_id: u64,
        now: Instant,
    ) -> Result<(ServerId, Option<u64>), Refusal> {
        let (id, previous) = self.check_registration(address, "")?;
        self.record(id, address, "", instance_id, now);
        self.take_registration(id, tiers, previous != Some(instance_id), now);
        Ok((id, previous))
    }

    fn allocate(&mut self, count: u32, client_host: &str, class: StorageClass) -> Result<Vec<BlockRef>, Refusal> {
        self.allocate_copies(count, client_host, class, 1)
    }

    fn allocate_copies(
        &mut self,
        count: u32,
        client_host: &str,
        class: StorageClass,
        replicas: u32,
    ) -> Result<Vec<BlockRef>, Refusal> {
        let plan = place_blocks(self.block_rooms(), count, client_host, class, replicas)?;
        let blocks = self.name_blocks(&plan);
        self.count_placed(&blocks);
        Ok(blocks)
    }

    fn plan_segments(&self, count: usize, avoid: Option<u64>) -> Result<Vec<u64>, Refusal> {
        let avoid: Vec<ServerId> = avoid.into_iter().map(ServerId::from_wire).collect();
        Ok(place_segments(&self.segment_rooms(StorageClass::Any), count, &avoid, 1)?
            .into_iter()
            .map(|c| c.first.get())
            .collect())
    }
}

fn dram(capacity_blocks: u64) -> Vec<TierUsage> {
    vec![TierUsage { tier: DRAM_TIER.into(), capacity_blocks, ..TierUsage::default() }]
}

/// Registers a server (as instance 1) and reconciles its empty inventory: ready for placement.
fn join(servers: &mut Servers, address: &str, tiers: Vec<TierUsage>, now: Instant) -> ServerId {
    let (id, _) = servers.register(address, tiers, 1, now).unwrap();
    servers.inventory_page(id, &[], &[], &[], 4096).unwrap();
    servers.reconcile(id, &HashMap::new(), false, |_| false, |_| true);
    id
}

fn servers(addresses: &[&str], capacity_blocks: u64) -> (Servers, Instant) {
    let now = Instant::now();
    let mut servers = Servers::default();
    for address in addresses {
        join(&mut servers, address, dram(capacity_blocks), now);
    }
    (servers, now)
}

fn per_server(blocks: &[BlockRef]) -> BTreeMap<u64, usize> {
    let mut counts = BTreeMap::new();
    for block in blocks {
        *counts.entry(block.server_id.get()).or_default() += 1;
    }
    counts
}

#[test]
fn validates_addresses() {
    assert_eq!(host_of_address("127.0.0.1:9000").unwrap(), "127.0.0.1");
    assert_eq!(host_of_address("[::1]:9000").unwrap(), "::1");
    assert_eq!(host_of_address("Node-1.example:9000").unwrap(), "node-1.example");
    for bad in ["", "127.0.0.1", "host:", "host:0", "host:99999", ":9000", "a b:1", "::1"] {
        assert_eq!(host_of_address(bad).unwrap_err().kind, ErrorKind::Invalid, "{bad:?}");
    }
}

#[test]
fn spreads_evenly_across_equal_servers() {
    let (mut servers, _) = servers(&["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"], 1000);
    let blocks = servers.allocate(6, "", StorageClass::Any).unwrap();
    let order: Vec<u64> = blocks.iter().map(|b| b.server_id.get()).collect();
    assert_eq!(order, [1, 2, 3, 1, 2, 3]);
    let ids: Vec<u64> = blocks.iter().map(|b| b.block_id.get()).collect();
    assert_eq!(ids, [1, 2, 3, 4, 5, 6]);
    let blocks = servers.allocate(1024, "", StorageClass::Any).unwrap();
    let counts = per_server(&blocks);
    assert_eq!(counts.values().copied().collect::<Vec<_>>(), [342, 341, 341]);
    assert_eq!(servers.allocated_blocks(), 1030);
}

#[test]
fn prefers_the_client_host_then_spills() {
    let (mut servers, _) = servers(&["10.0.0.1:1", "10.0.0.2:1", "10.0.0.2:2"], 4);
    let blocks = servers.allocate(8, "10.0.0.2", StorageClass::Any).unwrap();
    let order: Vec<u64> = blocks.iter().map(|b| b.server_id.get()).collect();
    assert_eq!(order, [2, 3, 2, 3, 2, 3, 2, 3]);
    // The local servers are full now: the remote one takes the rest.
    let blocks = servers.allocate(2, "10.0.0.2", StorageClass::Any).unwrap();
    assert_eq!(per_server(&blocks), BTreeMap::from([(1, 2)]));
}

#[test]
fn skips_dead_and_full_servers() {
    let (mut servers, start) = servers(&["10.0.0.1:1", "10.0.0.2:1"], 2);
    join(&mut servers, "10.0.0.3:1", dram(0), start);
    servers.allocate(2, "", StorageClass::Any).unwrap();
    // Server 2 keeps heartbeating; server 1 (and 3) go silent.
    let later = start + Duration::from_secs(10);
    servers.heartbeat(ServerId::from_wire(2), Vec::new(), 0, later);
    let dead = servers.expire(later, Duration::from_secs(5));
    assert_eq!(dead.len(), 2);
    assert!(dead[0].1.contains("storage server 1 (10.0.0.1:1): server missed heartbeats for 10.0s"), "{dead:?}");
    let blocks = servers.allocate(1, "10.0.0.1", StorageClass::Any).unwrap();
    assert_eq!(blocks[0].server_id, ServerId::from_wire(2));
    let refusal = servers.allocate(1, "", StorageClass::Any).unwrap_err();
    assert_eq!(refusal.kind, ErrorKind::OutOfSpace);
    assert_eq!((servers.live_count(), servers.dead_count()), (1, 2));
    // Server 2 is full; it dies too and then nothing is live.
    servers.expire(later + Duration::from_secs(10), Duration::from_secs(5));
    let refusal = servers.allocate(1, "", StorageClass::Any).unwrap_err();
    assert_eq!((refusal.kind, refusal.reason.as_str()), (ErrorKind::Unavailable, crate::planner::NO_SERVER_TAKES_DATA));
}

#[test]
fn copies_of_a_block_land_on_distinct_servers_or_not_at_all() {
    let (mut servers, _) = servers(&["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"], 4);
    // Local server first for each block's first copy, the rest spread by load; never two
    // copies of one block on one server.
    let blocks = servers.allocate_copies(4, "10.0.0.1", StorageClass::Any, 2).unwrap();
    assert_eq!(blocks.len(), 8);
    for copies in blocks.chunks(2) {
        assert_ne!(copies[0].server_id, copies[1].server_id, "{blocks:?}");
    }
    assert_eq!(per_server(&blocks).values().sum::<usize>(), 8);
    assert_eq!(servers.allocated_blocks(), 8);
    // 12 blocks of room, 8 taken: 4 left between the servers.
    let left: Vec<u64> = (1..=3).map(|id| 4 - *per_server(&blocks).get(&id).unwrap_or(&0) as u64).collect();
    assert_eq!(left.iter().sum::<u64>(), 4, "{left:?}");
    // More copies than room: refused, nothing placed.
    assert_eq!(servers.allocate_copies(3, "", StorageClass::Any, 2).unwrap_err().kind, ErrorKind::OutOfSpace);
    assert_eq!(servers.allocated_blocks(), 8);
}

#[test]
fn copies_need_as_many_servers_with_room() {
    let (mut servers, _) = servers(&["10.0.0.1:1", "10.0.0.2:1"], 3);
    // Fill server 2 but for one block: then only one server has room for most blocks.
    servers.allocate_copies(2, "10.0.0.2", StorageClass::Any, 1).unwrap();
    let refusal = servers.allocate_copies(2, "", StorageClass::Any, 2).unwrap_err();
    assert_eq!(refusal.kind, ErrorKind::OutOfSpace, "{}", refusal.reason);
    assert!(refusal.reason.contains("copy 2 of block 1"), "{}", refusal.reason);
    assert_eq!(servers.allocated_blocks(), 2, "a refusal places nothing");
    assert_eq!(servers.allocate_copies(1, "", StorageClass::Any, 2).unwrap().len(), 2);
    // One live server cannot hold two copies.
    servers.mark_dead(ServerId::from_wire(1), "test".into());
    let refusal = servers.allocate_copies(1, "", StorageClass::Any, 2).unwrap_err();
    assert_eq!(refusal.kind, ErrorKind::Unavailable);
    assert!(refusal.reason.contains("need 2 live storage servers"), "{}", refusal.reason);
}

#[test]
fn refuses_a_batch_that_does_not_fit_without_placing_any() {
    let (mut servers, _) = servers(&["10.0.0.1:1", "10.0.0.2:1"], 512);
    assert_eq!(servers.allocate(1025, "", StorageClass::Any).unwrap_err().kind, ErrorKind::OutOfSpace);
    assert_eq!(servers.allocated_blocks(), 0);
    assert_eq!(servers.allocate(1024, "", StorageClass::Any).unwrap().len(), 1024);
}

#[test]
fn space_being_freed_is_worth_a_retry_not_out_of_space() {
    let (mut servers, now) = servers(&["10.0.0.1:1"], 4);
    let blocks = servers.allocate(4, "", StorageClass::Any).unwrap();
    servers.free(&blocks[..2]);
    let refusal = servers.allocate(2, "", StorageClass::Any).unwrap_err();
    assert_eq!(refusal.kind, ErrorKind::Unavailable, "{}", refusal.reason);
    assert!(refusal.reason.contains("being freed"), "{}", refusal.reason);
    assert_eq!(servers.allocate(3, "", StorageClass::Any).unwrap_err().kind, ErrorKind::OutOfSpace);
    // Once the server acknowledges the frees, the space is there.
    let reply = servers.heartbeat(ServerId::from_wire(1), Vec::new(), 0, now);
    servers.heartbeat(ServerId::from_wire(1), Vec::new(), reply.free_seq, now);
    assert_eq!(servers.allocate(2, "", StorageClass::Any).unwrap().len(), 2);
}

#[test]
fn frees_are_delivered_until_acknowledged() {
    let (mut servers, now) = servers(&["10.0.0.1:1"], 10);
    let blocks = servers.allocate(3, "", StorageClass::Any).unwrap();
    servers.free(&blocks[..2]);
    let reply = servers.heartbeat(ServerId::from_wire(1), Vec::new(), 0, now);
    assert_eq!((reply.free_block_ids.clone(), reply.free_seq, reply.reregister), (vec![1, 2], 2, false));
    // Not acknowledged: sent again, and new frees follow.
    servers.free(&blocks[2..]);
    let reply = servers.heartbeat(ServerId::from_wire(1), Vec::new(), 0, now);
    assert_eq!((reply.free_block_ids.clone(), reply.free_seq), (vec![1, 2, 3], 3));
    assert_eq!(servers.allocated_blocks(), 3);
    // Acknowledged in part, then in full.
    let reply = servers.heartbeat(ServerId::from_wire(1), Vec::new(), 2, now);
    assert_eq!((reply.free_block_ids.clone(), reply.free_seq), (vec![3], 3));
    assert_eq!(servers.allocated_blocks(), 1);
    let reply = servers.heartbeat(ServerId::from_wire(1), Vec::new(), 3, now);
    assert_eq!((reply.free_block_ids.len(), reply.free_seq), (0, 3));
    assert_eq!(servers.allocated_blocks(), 0);
}

#[test]
fn shuffle_frees_share_the_queue_but_not_the_block_count() {
    let (mut servers, now) = servers(&["10.0.0.1:1", "10.0.0.2:1"], 10);
    let blocks = servers.allocate(4, "", StorageClass::Any).unwrap();
    servers.add_segments(&[ServerId::from_wire(1), ServerId::from_wire(1), ServerId::from_wire(2)]);
    servers.free(&blocks[..1]);
    servers.free_shuffle(
        ShuffleId::from_wire(7),
        &BTreeMap::from([(ServerId::from_wire(1), 2), (ServerId::from_wire(2), 1)]),
    );
    servers.free(&blocks[2..3]);
    let reply = servers.heartbeat(ServerId::from_wire(1), Vec::new(), 0, now);
    assert_eq!((reply.free_block_ids, reply.free_shuffle_ids, reply.free_seq), (vec![1, 3], vec![7], 3));
    assert_eq!(servers.heartbeat(ServerId::from_wire(2), Vec::new(), 0, now).free_shuffle_ids, [7]);
    // Acknowledging the first two frees gives back one block; the shuffle's space shows in reports.
    let reply = servers.heartbeat(ServerId::from_wire(1), Vec::new(), 2, now);
    assert_eq!((reply.free_block_ids, reply.free_shuffle_ids, reply.free_seq), (vec![3], vec![], 3));
    assert_eq!(servers.allocated_blocks(), 3);
    // A server that dies with frees queued drops them, and the freed blocks from its count.
    servers.free(&blocks[1..2]);
    servers.mark_dead(ServerId::from_wire(2), "test".into());
    assert_eq!(servers.status(now)[1].allocated_blocks, 1);
}

#[test]
fn a_server_clients_cannot_reach_takes_no_placements_until_the_report_lapses() {
    let (mut servers, now) = servers(&["10.0.0.1:1", "10.0.0.2:1"], 10);
    let until = now + Duration::from_secs(5);
    assert_eq!(servers.report_unreachable("10.0.0.2:1", until), Some((ServerId::from_wire(2), true)));
    assert_eq!(servers.report_unreachable("10.0.0.9:1", until), None);
    assert_eq!(servers.plan_segments(3, None).unwrap(), [1, 1, 1]);
    assert!(servers.allocate(4, "", StorageClass::Any).unwrap().iter().all(|b| b.server_id == ServerId::from_wire(1)));
    // Still alive (readable), shown as unreachable.
    assert!(servers.is_alive(ServerId::from_wire(2)));
    assert_eq!(servers.servers[&ServerId::from_wire(2)].state_name(), "unreachable");
    // The report lapses with the reaper's next pass after `until`.
    assert!(servers.expire(until - Duration::from_millis(1), Duration::from_secs(60)).is_empty());
    assert_eq!(servers.plan_segments(1, None).unwrap(), [1]);
    servers.expire(until, Duration::from_secs(60));
    assert_eq!(servers.servers[&ServerId::from_wire(2)].state_name(), "alive");
    assert!(servers.plan_segments(2, None).unwrap().contains(&2));
    // A dead server's report changes nothing: it says so.
    servers.mark_dead(ServerId::from_wire(2), "test".into());
    assert_eq!(servers.report_unreachable("10.0.0.2:1", until), Some((ServerId::from_wire(2), false)));
}

#[test]
fn segments_go_round_robin_by_load_avoiding_a_full_segments_server() {
    let (mut servers, now) = servers(&["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"], 10);
    servers.allocate(1, "", StorageClass::Any).unwrap();
    assert_eq!(servers.plan_segments(5, None).unwrap(), [2, 3, 1, 2, 3]);
    servers.add_segments(&[ServerId::from_wire(2), ServerId::from_wire(2)]);
    assert_eq!(servers.plan_segments(1, None).unwrap(), [3]);
    assert_eq!(servers.plan_segments(1, Some(3)).unwrap(), [1]);
    // Full servers come last, whatever their segments.
    let full = vec![TierUsage { tier: DRAM_TIER.into(), capacity_blocks: 10, used_blocks: 10, ..TierUsage::default() }];
    servers.heartbeat(ServerId::from_wire(3), full, 0, now);
    assert_eq!(servers.plan_segments(3, None).unwrap(), [1, 2, 3]);
    // The only live server takes even its own full segment's successor.
    servers.mark_dead(ServerId::from_wire(1), "test".into());
    servers.mark_dead(ServerId::from_wire(2), "test".into());
    assert_eq!(servers.plan_segments(2, Some(3)).unwrap(), [3, 3]);
    servers.mark_dead(ServerId::from_wire(3), "test".into());
    assert_eq!(servers.plan_segments(1, None).unwrap_err().kind, ErrorKind::Unavailable);
}

fn tiers(dram_blocks: u64, nvme_blocks: u64) -> Vec<TierUsage> {
    let mut tiers = dram(dram_blocks);
    tiers.push(TierUsage {
        tier: Tier::Nvme.name().into(),
        capacity_blocks: nvme_blocks,
        engine: "uring".into(),
        ..TierUsage::default()
    });
    tiers
}

fn tiers_of(blocks: &[BlockRef]) -> Vec<Tier> {
    blocks.iter().map(|b| b.block_id.tier()).collect()
}

#[test]
fn any_fills_dram_cluster_wide_before_nvme() {
    let now = Instant::now();
    let mut servers = Servers::default();
    join(&mut servers, "10.0.0.1:1", tiers(2, 4), now);
    join(&mut servers, "10.0.0.2:1", dram(1), now);
    // Three DRAM blocks in the cluster: all go to DRAM, on both servers, before any NVMe.
    let blocks = servers.allocate(3, "10.0.0.1", StorageClass::Any).unwrap();
    assert_eq!(tiers_of(&blocks), [Tier::Dram; 3]);
    assert_eq!(per_server(&blocks), BTreeMap::from([(1, 2), (2, 1)]));
    // A batch spans tiers once DRAM is full; NVMe ids carry the tier bit.
    let blocks = servers.allocate(2, "", StorageClass::Any).unwrap();
    assert_eq!(tiers_of(&blocks), [Tier::Nvme; 2]);
    assert!(blocks.iter().all(|b| b.block_id.get() & NVME_BLOCK_BIT != 0 && b.server_id == ServerId::from_wire(1)));
    assert_eq!(blocks[0].block_id.get() & !NVME_BLOCK_BIT, 4);
    assert_eq!(servers.allocated_blocks(), 5);
    // Only DRAM asked: none left, so OutOfSpace naming the class and free counts.
    let refusal = servers.allocate(1, "", StorageClass::Dram).unwrap_err();
    assert_eq!(refusal.kind, ErrorKind::OutOfSpace);
    assert!(refusal.reason.contains("class dram") && refusal.reason.contains("0 dram"), "{}", refusal.reason);
    // Two NVMe blocks remain: three is too many for any class.
    let refusal = servers.allocate(3, "", StorageClass::Any).unwrap_err();
    assert_eq!(refusal.kind, ErrorKind::OutOfSpace);
    assert!(refusal.reason.contains("0 dram and 2 nvme"), "{}", refusal.reason);
    assert_eq!(servers.allocate(2, "", StorageClass::Nvme).unwrap().len(), 2);
    let refusal = servers.allocate(1, "", StorageClass::Nvme).unwrap_err();
    assert!(refusal.reason.contains("class nvme") && refusal.reason.contains("0 nvme"), "{}", refusal.reason);
}

#[test]
fn nvme_class_skips_servers_without_nvme() {
    let now = Instant::now();
    let mut servers = Servers::default();
    join(&mut servers, "10.0.0.1:1", dram(10), now);
    let refusal = servers.allocate(1, "", StorageClass::Nvme).unwrap_err();
    assert_eq!(refusal.kind, ErrorKind::OutOfSpace);
    join(&mut servers, "10.0.0.2:1", tiers(10, 3), now);
    let blocks = servers.allocate(3, "10.0.0.1", StorageClass::Nvme).unwrap();
    assert_eq!(per_server(&blocks), BTreeMap::from([(2, 3)]));
    assert_eq!(tiers_of(&blocks), [Tier::Nvme; 3]);
    // DRAM class leaves NVMe alone.
    assert_eq!(tiers_of(&servers.allocate(2, "", StorageClass::Dram).unwrap()), [Tier::Dram; 2]);
}

#[test]
fn nvme_frees_count_per_tier() {
    let now = Instant::now();
    let mut servers = Servers::default();
    join(&mut servers, "10.0.0.1:1", tiers(1, 2), now);
    let dram_block = servers.allocate(1, "", StorageClass::Dram).unwrap();
    let nvme_blocks = servers.allocate(2, "", StorageClass::Nvme).unwrap();
    servers.free(&nvme_blocks);
    // NVMe space being freed is a retry for nvme, but dram has simply no room.
    let refusal = servers.allocate(1, "", StorageClass::Nvme).unwrap_err();
    assert_eq!(refusal.kind, ErrorKind::Unavailable, "{}", refusal.reason);
    assert!(refusal.reason.contains("being freed"), "{}", refusal.reason);
    assert_eq!(servers.allocate(1, "", StorageClass::Dram).unwrap_err().kind, ErrorKind::OutOfSpace);
    let reply = servers.heartbeat(ServerId::from_wire(1), Vec::new(), 0, now);
    assert_eq!(reply.free_block_ids, nvme_blocks.iter().map(|b| b.block_id.get()).collect::<Vec<_>>());
    servers.heartbeat(ServerId::from_wire(1), Vec::new(), reply.free_seq, now);
    assert_eq!(servers.allocated_blocks(), 1);
    assert_eq!(servers.allocate(2, "", StorageClass::Nvme).unwrap().len(), 2);
    // A server that dies with NVMe and DRAM frees queued drops both from its counts.
    servers.free(&dram_block);
    servers.mark_dead(ServerId::from_wire(1), "test".into());
    assert_eq!(servers.status(now)[0].allocated_blocks, 2);
}

#[test]
fn caps_frees_per_heartbeat() {
    let (mut servers, now) = servers(&["10.0.0.1:1"], 100_000);
    let mut blocks = Vec::new();
    for _ in 0..70 {
        blocks.extend(servers.allocate(1024, "", StorageClass::Any).unwrap());
    }
    servers.free(&blocks);
    let reply = servers.heartbeat(ServerId::from_wire(1), Vec::new(), 0, now);
    assert_eq!(reply.free_block_ids.len(), MAX_FREES_PER_HEARTBEAT);
    assert_eq!(reply.free_seq, MAX_FREES_PER_HEARTBEAT as u64);
    let reply = servers.heartbeat(ServerId::from_wire(1), Vec::new(), reply.free_seq, now);
    assert_eq!(reply.free_block_ids.len(), 70 * 1024 - MAX_FREES_PER_HEARTBEAT);
}

#[test]
fn a_server_registering_again_keeps_its_id_and_its_reported_blocks() {
    let (mut servers, now) = servers(&["10.0.0.1:1"], 10);
    let blocks = servers.allocate(3, "", StorageClass::Any).unwrap();
    // The same process again (the metadata server lost track of it): nothing placed there
    // until its inventory is in.
    let (id, previous) = servers.register("10.0.0.1:1", dram(10), 1, now).unwrap();
    assert_eq!((id, previous), (ServerId::from_wire(1), Some(1)));
    assert!(servers.allocate(1, "", StorageClass::Any).is_err());
    let page = [blocks[0].block_id, blocks[1].block_id, BlockId::from_wire(99)];
    servers.inventory_page(ServerId::from_wire(1), &page, &[ShuffleId::from_wire(7)], &[], 4096).unwrap();
    // Blocks 1 and 2 belong to sealed files, block 3 to a file still being written.
    let referenced =
        HashMap::from([(blocks[0].block_id, true), (blocks[1].block_id, true), (blocks[2].block_id, false)]);
    let (done, _) = servers.reconcile(
        ServerId::from_wire(1),
        &referenced,
        servers.restarted_since_log(ServerId::from_wire(1)),
        |_| false,
        |_| true,
    );
    assert_eq!(done, Reconciled { unreferenced: 1, lost: 0, unknown_shuffles: 1, unreferenced_segments: 0 });
    assert!(blocks.iter().all(|b| servers.lost(b).is_none()));
    let reply = servers.heartbeat(ServerId::from_wire(1), Vec::new(), 0, now);
    assert_eq!((reply.free_block_ids, reply.free_shuffle_ids), (vec![99], vec![7]));
    assert_eq!(servers.allocate(1, "", StorageClass::Any).unwrap()[0].server_id, ServerId::from_wire(1));

    // A new process (it restarted): what it does not report is lost, even unsealed.
    let (id, previous) = servers.register("10.0.0.1:1", dram(10), 2, now).unwrap();
    assert_eq!((id, previous), (ServerId::from_wire(1), Some(1)));
    assert!(servers.restarted_since_log(ServerId::from_wire(1)));
    servers.inventory_page(ServerId::from_wire(1), &[blocks[1].block_id], &[], &[], 4096).unwrap();
    let (done, _) = servers.reconcile(ServerId::from_wire(1), &referenced, true, |_| false, |_| true);
    assert_eq!(done, Reconciled { unreferenced: 0, lost: 2, unknown_shuffles: 0, unreferenced_segments: 0 });
    let lost = servers.lost(&blocks[0]).unwrap();
    assert!(lost.contains("registered again without it"), "{lost}");
    assert!(servers.lost(&blocks[1]).is_none() && servers.lost(&blocks[2]).is_some());
    // Freeing a lost block queues nothing: the server does not have it.
    servers.free(&[blocks[0]]);
    assert!(servers.heartbeat(ServerId::from_wire(1), Vec::new(), 0, now).free_block_ids.is_empty());
    // An inventory is taken once per registration, and bounded.
    assert!(servers.inventory_page(ServerId::from_wire(1), &[BlockId::from_wire(1)], &[], &[], 4096).is_err());
    assert!(servers.heartbeat(ServerId::from_wire(99), Vec::new(), 0, now).reregister);
}

#[test]
fn restored_servers_are_readable_until_the_timeout_then_dead() {
    let now = Instant::now();
    let mut servers = Servers::default();
    servers.record(ServerId::from_wire(4), "10.0.0.1:1", "", 9, now);
    let block = BlockRef { block_id: BlockId::from_wire(1), server_id: ServerId::from_wire(4) };
    servers.count_placed(&[block]);
    assert!(servers.lost(&block).is_none() && servers.is_alive(ServerId::from_wire(4)));
    assert_eq!(servers.live_count(), 0, "nothing is placed on a server before it registers again");
    assert!(servers.heartbeat(ServerId::from_wire(4), Vec::new(), 0, now).reregister);
    let dead = servers.expire(now + Duration::from_secs(10), Duration::from_secs(5));
    assert!(dead[0].1.contains("did not register again"), "{dead:?}");
    assert!(servers.lost(&block).is_some());
    // Ids continue past the restored ones.
    assert_eq!(servers.counters(), (ServerId::from_wire(5), 2));
}

#[test]
fn forgets_the_oldest_dead_servers() {
    let (mut servers, now) = servers(&[], 1);
    for i in 0..MAX_DEAD_SERVERS + 2 {
        join(&mut servers, &format!("10.0.{}.{}:1", i / 200, i % 200 + 1), dram(1), now);
    }
    servers.expire(now + Duration::from_secs(10), Duration::from_secs(1));
    assert_eq!((servers.live_count(), servers.dead_count()), (0, MAX_DEAD_SERVERS as u64));
    let lost = servers.lost(&BlockRef { block_id: BlockId::from_wire(5), server_id: ServerId::from_wire(1) }).unwrap();
    assert!(lost.contains("no longer known"), "{lost}");
}

/// Placement read from the index (the servers it may choose, in order) chooses as placement over
/// a room for every server does, through a long run of random changes to the servers: heartbeats
/// with new use, allocations, frees, cordons, unreachable reports and their lapse, deaths and
/// registrations again, segments placed; clients on a server's host and elsewhere, every class
/// and one or two copies. (Every placement in these tests also checks the index against one
/// rebuilt from the servers.)
#[test]
fn placement_from_the_index_is_placement_over_every_server() {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |below: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % below
    };
    let now = Instant::now();
    let mut servers = Servers::default();
    let addresses: Vec<String> = (0..24).map(|i| format!("10.0.{}.{}:{}", i % 5, i % 7, 9000 + i)).collect();
    let mut ids = Vec::new();
    for address in &addresses {
        ids.push(join(&mut servers, address, tiers(next(40), next(3) * 20), now));
    }
    let mut placed: Vec<BlockRef> = Vec::new();
    let classes = [StorageClass::Any, StorageClass::Dram, StorageClass::Nvme];
    for step in 0..3000 {
        let id = ids[next(ids.len() as u64) as usize];
        let address = servers.address(id);
        match next(9) {
            0 => {
                let used = next(45);
                let mut usage = tiers(40, 40);
                usage[0].used_blocks = used;
                servers.heartbeat(id, usage, 0, now);
            }
            1 if !placed.is_empty() => {
                let at = next(placed.len() as u64) as usize;
                servers.free(&[placed.swap_remove(at)]);
            }
            2 => servers.set_mode(id, [ServerMode::Active, ServerMode::Cordoned][next(2) as usize], None),
            3 => {
                servers.report_unreachable(&address, now + Duration::from_secs(next(3)));
                servers.expire(now + Duration::from_secs(1), Duration::from_secs(3600));
            }
            4 if next(4) == 0 => {
                servers.mark_dead(id, "test".into());
                if next(2) == 0 {
                    join(&mut servers, &address, tiers(next(40), next(3) * 20), now);
                }
            }
            5 => servers.add_segments(&[id]),
            _ => {}
        }
        let count = 1 + next(6) as u32;
        let host = ["", "10.0.1.1", "10.0.3.6", "10.0.9.9"][next(4) as usize];
        let class = classes[next(3) as usize];
        let replicas = 1 + next(2) as u32;
        let from_index = place_blocks(servers.block_rooms(), count, host, class, replicas);
        let from_all = place_blocks(&servers.rooms()[..], count, host, class, replicas);
        assert_eq!(from_index, from_all, "step {step}: {count} blocks of {class} x{replicas} from {host:?}");
        if let Ok(plan) = from_index {
            let blocks = servers.name_blocks(&plan);
            servers.count_placed(&blocks);
            placed.extend(blocks);
        }
        let segments = 1 + next(30) as usize;
        let avoid: Vec<ServerId> = (0..next(3)).map(|_| ids[next(ids.len() as u64) as usize]).collect();
        let from_index = place_segments(&servers.segment_rooms(class), segments, &avoid, replicas);
        let from_all = place_segments(&servers.segment_loads(class)[..], segments, &avoid, replicas);
        assert_eq!(from_index, from_all, "step {step}: {segments} segments of {class} x{replicas} avoiding {avoid:?}");
    }
    assert!(placed.len() > 1000, "the run placed {} blocks: too few to have tried much", placed.len());
}
