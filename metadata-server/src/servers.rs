//! The storage-server registry: registrations, heartbeats and liveness, inventory
//! reconciliation, and the queues of blocks and shuffles waiting to be freed. Where new blocks and
//! segments go is the planner's choice (`planner`), over the view of room this registry gives.
//!
//! Storage servers register, then heartbeat. A server whose heartbeats stop is declared dead: the
//! blocks on it are lost (files keep them, and reading them reports DataLost) and nothing more is
//! placed there. Dead servers are remembered, up to a bound, so that messages can say why a block
//! was lost.
//!
//! Which servers exist (id, address, instance) is logged state, changed through
//! [`Servers::record`]; liveness, reports and free queues are rebuilt by registrations and
//! heartbeats, and are not logged.
//!
//! Frees travel on heartbeat replies: each server has one queue of (seq, block or shuffle) with
//! its own increasing sequence numbers; a reply carries a prefix of the queue, and the next
//! heartbeat acknowledges it with `freed_through_seq`. Unacknowledged frees are sent again, so a
//! lost reply costs nothing but a repeat (frees are idempotent on the storage server).
//!
//! Each server has a DRAM tier and may have an NVMe tier; the registry counts capacity and blocks
//! placed per tier. Block ids name their tier ([`BlockId`]), so a storage server knows a block's
//! tier from its id.
//!
//! A server's DRAM holds file blocks and shuffle segments side by side, and the server reports
//! only the total in use. The metadata server knows the blocks it placed there; shuffle data
//! grows as maps push, so it is known only through those reports (see `Server::used_blocks`).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tern_proto::v1::{
    BlockLocation, HeartbeatResponse, HeldSegment, LogServer, LogServerMode, ServerMode, ServerStatus, TierUsage,
};
use tern_proto::{BlockId, ErrorKind, ServerId, ShuffleId, StorageClass, Tier};

use crate::error::{invalid, Refusal};
use crate::namespace::BlockRef;
use crate::planner::{BlockPlace, Room, SegmentLoad, TierRoom};
use crate::shuffles::SegmentCopy;

/// Most frees one heartbeat reply carries (8 bytes each: 512 KiB, well under a gRPC message).
pub const MAX_FREES_PER_HEARTBEAT: usize = 65536;
/// Dead servers remembered for status and DataLost messages; the oldest beyond this are forgotten.
pub const MAX_DEAD_SERVERS: usize = 1024;
/// The DRAM tier's name in usage reports.
pub const DRAM_TIER: &str = Tier::Dram.name();

/// One entry of a server's free queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Free {
    Block(BlockId),
    /// Every segment the server holds of this shuffle.
    Shuffle(ShuffleId),
    /// One segment copy the chain does not name there (a copy not stored whole, or moved off).
    Segment(SegmentCopy),
}

#[derive(Debug)]
struct Server {
    address: String,
    /// host:port of its QUIC endpoint; empty if it has none.
    quic_address: String,
    /// The address's host, compared with clients' hosts for locality.
    host: String,
    alive: bool,
    /// Restored from the log after the metadata server restarted, and not registered again yet:
    /// its blocks are read (the server is likely still up), nothing new is placed there, and it
    /// is declared dead if it stays silent for the server timeout.
    restored: bool,
    /// Its inventory was reconciled since it registered: only now is anything placed there.
    reconciled: bool,
    /// The process instance it registered with (see RegisterServerRequest.instance_id).
    instance_id: u64,
    /// Its last registration came from a new process (its DRAM is gone).
    restarted: bool,
    /// Inventory pages received since it registered.
    inventory: Option<Inventory>,
    /// Blocks referenced here that its last inventory did not report, and why they are lost.
    lost_blocks: HashMap<BlockId, String>,
    /// Why the server was declared dead (empty while alive).
    death: String,
    tiers: Vec<TierUsage>,
    last_seen: Instant,
    /// DRAM blocks placed here and not yet acknowledged as freed: what placement balances.
    allocated: u64,
    /// The same for NVMe blocks.
    nvme_allocated: u64,
    /// DRAM blocks in use at the last report beyond `allocated`: shuffle data.
    unplaced_used: u64,
    /// Segments of registered shuffles placed here: shuffle load not yet visible in reports.
    segments: u64,
    frees: VecDeque<(u64, Free)>,
    /// How many of `frees` are shuffles (the rest are blocks, each still counted in `allocated` or
    /// `nvme_allocated`).
    shuffle_frees: u64,
    /// How many of `frees` are NVMe blocks.
    nvme_frees: u64,
    next_free_seq: u64,
    /// What an operator allows the planner to do here (logged: survives restarts).
    mode: ServerMode,
    /// Draining: when the server is told to exit even if data it holds is still needed.
    drain_deadline: Option<Instant>,
    /// Draining: what the drain still waits for, as last checked ("" = nothing).
    drain_waiting_for: String,
    /// Draining, and nothing is needed here any more (or the deadline passed): heartbeat replies
    /// tell the server to exit.
    drained: bool,
    /// Blocks here that no other readable copy backs, as last counted.
    sole_copy_blocks: u64,
    /// A client reported it cannot reach the server (while it heartbeats here, a partition the
    /// metadata server cannot see): nothing new is placed there until then.
    unreachable_until: Option<Instant>,
}

/// A storage server's drain as the registry sees it, for the state to check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drain {
    pub server_id: ServerId,
    pub deadline: Instant,
}

/// What a storage server reported holding, gathered over its inventory pages.
#[derive(Debug, Default)]
struct Inventory {
    blocks: HashSet<BlockId>,
    shuffles: HashSet<ShuffleId>,
    segments: HashSet<SegmentCopy>,
}

/// What reconciling an inventory did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reconciled {
    pub unreferenced: u64,
    pub lost: u64,
    pub unknown_shuffles: u64,
    /// Segments of registered shuffles the chains do not name there (copies never logged).
    pub unreferenced_segments: u64,
}

impl Server {
    /// Blocks and segments may be read from it.
    fn readable(&self) -> bool {
        self.alive || self.restored
    }

    /// Up and reconciled: could take new blocks and segments.
    fn placeable(&self) -> bool {
        self.alive && self.reconciled
    }

    /// New blocks and segments go there: placeable, and not cordoned or draining.
    fn takes_placements(&self) -> bool {
        self.placeable() && self.mode == ServerMode::Active && self.unreachable_until.is_none()
    }

    /// "alive", "registering" (alive, its inventory not yet reconciled: it takes no
    /// placements), "dead", "cordoned" or "draining".
    fn state_name(&self) -> &'static str {
        match (self.readable(), self.mode) {
            (false, _) => "dead",
            (true, ServerMode::Active) if !self.reconciled => "registering",
            (true, ServerMode::Active) if self.unreachable_until.is_some() => "unreachable",
            (true, ServerMode::Active) => "alive",
            (true, ServerMode::Cordoned) => "cordoned",
            (true, ServerMode::Draining) => "draining",
        }
    }

    fn tier(&self, tier: &str) -> Option<&TierUsage> {
        self.tiers.iter().find(|t| t.tier == tier)
    }

    fn capacity_blocks(&self) -> u64 {
        self.tier(DRAM_TIER).map_or(0, |t| t.capacity_blocks)
    }

    /// Blocks the tier holds, as last reported (0 for a tier the server does not have).
    fn tier_capacity(&self, tier: Tier) -> u64 {
        self.tier(tier.name()).map_or(0, |t| t.capacity_blocks)
    }

    /// Blocks of the tier in use as far as placement can tell (see [`Server::used_blocks`]).
    fn tier_used(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Dram => self.used_blocks(),
            Tier::Nvme => self.nvme_allocated,
        }
    }

    /// Blocks of the tier that queued frees give back once carried out.
    fn tier_being_freed(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Dram => self.being_freed(),
            Tier::Nvme => self.nvme_frees,
        }
    }

    fn allocated_mut(&mut self, tier: Tier) -> &mut u64 {
        match tier {
            Tier::Dram => &mut self.allocated,
            Tier::Nvme => &mut self.nvme_allocated,
        }
    }

    /// DRAM blocks in use as far as placement can tell: the blocks placed here, plus what else the
    /// server's last report counted (shuffle data). The report counts written file blocks and
    /// shuffle slots together; at that moment no more file blocks than those placed could have been
    /// written, so the rest is at least the shuffle data. Blocks placed but not yet written when the
    /// report was made hide some shuffle data until the next report; blocks placed since are
    /// counted at once.
    fn used_blocks(&self) -> u64 {
        self.allocated + self.unplaced_used
    }

    /// Takes in a usage report (a registration's or a heartbeat's, after its acknowledged frees).
    fn take_report(&mut self, tiers: Vec<TierUsage>) {
        self.tiers = tiers;
        let reported = self.tier(DRAM_TIER).map_or(0, |t| t.used_blocks);
        self.unplaced_used = reported.saturating_sub(self.allocated);
    }

    /// DRAM blocks in use that queued frees will give back once carried out: the blocks among
    /// them, and, when a shuffle free is queued, the shuffle data as far as it can be told apart.
    fn being_freed(&self) -> u64 {
        let blocks = self.frees.len() as u64 - self.shuffle_frees - self.nvme_frees;
        let shuffles = if self.shuffle_frees > 0 { self.unplaced_used } else { 0 };
        blocks + shuffles
    }

    /// What segment placement orders servers by: full ones last, then blocks in use plus the
    /// segments placed here.
    /// How loaded the server is for a new segment of `class`: full when no tier the class may
    /// use has room (servers move `any` and `nvme` segments from DRAM to NVMe themselves).
    fn segment_load(&self, server_id: ServerId, class: StorageClass) -> SegmentLoad {
        let used = self.used_blocks();
        let dram_full = used >= self.capacity_blocks();
        let nvme = self.tier(Tier::Nvme.name());
        let nvme_full = nvme.is_none_or(|t| t.used_blocks >= t.capacity_blocks);
        let full = match class {
            StorageClass::Dram => dram_full,
            StorageClass::Nvme | StorageClass::Any => dram_full && nvme_full,
        };
        SegmentLoad { full, load: used + self.segments, server_id }
    }

    fn queue_free(&mut self, free: Free) {
        self.frees.push_back((self.next_free_seq, free));
        self.next_free_seq += 1;
        match free {
            Free::Shuffle(_) => self.shuffle_frees += 1,
            Free::Block(id) if id.tier() == Tier::Nvme => self.nvme_frees += 1,
            Free::Block(_) | Free::Segment(_) => {}
        }
    }

    fn new(address: &str, host: String, instance_id: u64, now: Instant) -> Server {
        Server {
            address: address.to_string(),
            quic_address: String::new(),
            host,
            alive: false,
            restored: false,
            reconciled: false,
            instance_id,
            restarted: true,
            inventory: None,
            lost_blocks: HashMap::new(),
            death: String::new(),
            tiers: Vec::new(),
            last_seen: now,
            allocated: 0,
            nvme_allocated: 0,
            unplaced_used: 0,
            segments: 0,
            frees: VecDeque::new(),
            shuffle_frees: 0,
            nvme_frees: 0,
            next_free_seq: 1,
            mode: ServerMode::Active,
            drain_deadline: None,
            drain_waiting_for: String::new(),
            drained: false,
            sole_copy_blocks: 0,
            unreachable_until: None,
        }
    }

    fn set_mode(&mut self, mode: ServerMode, drain_deadline: Option<Instant>) {
        self.mode = mode;
        self.drain_deadline = drain_deadline.filter(|_| mode == ServerMode::Draining);
        self.drain_waiting_for.clear();
        self.drained = false;
    }

    fn describe(&self, server_id: ServerId) -> String {
        format!("storage server {server_id} ({})", self.address)
    }
}

#[derive(Debug)]
pub struct Servers {
    servers: BTreeMap<ServerId, Server>,
    next_server_id: u64,
    next_block_id: u64,
}

impl Default for Servers {
    fn default() -> Servers {
        // Ids start at 1 so that 0 can never name a server or block by accident.
        Servers { servers: BTreeMap::new(), next_server_id: 1, next_block_id: 1 }
    }
}

impl Servers {
    /// Checks a registration from `address` (and `quic_address`, "" for none) and chooses its
    /// id: a server registering from the address of a known one (alive, dead, or restored from
    /// the log) is that server again and keeps its id, so the blocks the namespace places there
    /// stay its own. Returns the id and the instance id it had before (`None` for a new server).
    /// Changes nothing: see [`Servers::record`] and [`Servers::take_registration`].
    pub fn check_registration(&self, address: &str, quic_address: &str) -> Result<(ServerId, Option<u64>), Refusal> {
        host_of_address(address)?;
        if !quic_address.is_empty() {
            host_of_address(quic_address)?;
        }
        Ok(match self.servers.iter().find(|(_, s)| s.address == address) {
            Some((&server_id, server)) => (server_id, Some(server.instance_id)),
            None => (ServerId(self.next_server_id), None),
        })
    }

    /// Records a server's identity (a registration, live or replayed). A server new to this
    /// registry comes in restored: readable, but nothing is placed there until it registers (see
    /// [`Servers::take_registration`]), and declared dead if it does not within the server
    /// timeout. A known one keeps its state and counts.
    pub fn record(&mut self, server_id: ServerId, address: &str, quic_address: &str, instance_id: u64, now: Instant) {
        let host = host_of_address(address).unwrap_or_default();
        // Another server known at this address is an older record of the same one.
        self.servers.retain(|&id, s| id == server_id || s.address != address);
        let server = self.servers.entry(server_id).or_insert_with(|| {
            let mut server = Server::new(address, host.clone(), instance_id, now);
            server.restored = true;
            server
        });
        // A drained server that comes back as a new process (a restarted pod) is not drained
        // again: the drain was of the process that exited. A cordon is the operator's and stays.
        if server.instance_id != instance_id && server.mode == ServerMode::Draining {
            server.set_mode(ServerMode::Active, None);
        }
        server.address = address.to_string();
        server.host = host;
        server.quic_address = quic_address.to_string();
        server.instance_id = instance_id;
        self.next_server_id = self.next_server_id.max(server_id.get() + 1);
    }

    /// A recorded server registered (not logged: liveness is rebuilt by registrations): alive
    /// with the usage it reported, and awaiting its inventory; nothing is placed there until the
    /// inventory is reconciled. `restarted`: the registration came from a new process.
    pub fn take_registration(&mut self, server_id: ServerId, tiers: Vec<TierUsage>, restarted: bool, now: Instant) {
        let Some(server) = self.servers.get_mut(&server_id) else {
            return;
        };
        server.alive = true;
        server.restored = false;
        server.reconciled = false;
        server.restarted = restarted;
        server.inventory = Some(Inventory::default());
        server.death.clear();
        server.last_seen = now;
        server.unreachable_until = None;
        server.take_report(tiers);
    }

    /// A client cannot reach the server at `address` (its block or QUIC address): if it is
    /// alive, nothing new is placed there until `until` (see [`Servers::expire`]). Returns
    /// whether it is alive, or `None` for an address no server has.
    pub fn report_unreachable(&mut self, address: &str, until: Instant) -> Option<(ServerId, bool)> {
        let (&id, server) = self
            .servers
            .iter_mut()
            .find(|(_, s)| s.address == address || (!s.quic_address.is_empty() && s.quic_address == address))?;
        if server.alive {
            server.unreachable_until = Some(server.unreachable_until.map_or(until, |t| t.max(until)));
        }
        Some((id, server.alive))
    }

    /// Names the blocks of a placement plan, in order, from the next block ids. Changes nothing:
    /// [`Servers::count_placed`] does, when the allocation is applied.
    pub fn name_blocks(&self, plan: &[BlockPlace]) -> Vec<BlockRef> {
        (self.next_block_id..)
            .zip(plan)
            .map(|(index, place)| BlockRef { block_id: BlockId::new(place.tier, index), server_id: place.server_id })
            .collect()
    }

    /// Takes the next block id for a copy (re-replication, drain) without counting it anywhere:
    /// the copy is counted on its server when it is stored and logged (`count_placed`).
    pub fn take_block_id(&mut self, tier: Tier) -> BlockId {
        let id = BlockId::new(tier, self.next_block_id);
        self.next_block_id += 1;
        id
    }

    /// Whether the server heartbeats and is reconciled (copies may be made from it, or to it).
    pub fn is_placeable(&self, server_id: ServerId) -> bool {
        self.servers.get(&server_id).is_some_and(|s| s.placeable())
    }

    /// Counts placed blocks on their servers, and moves the block ids past them.
    pub fn count_placed(&mut self, blocks: &[BlockRef]) {
        for block in blocks {
            self.next_block_id = self.next_block_id.max(block.block_id.index() + 1);
            if let Some(server) = self.servers.get_mut(&block.server_id) {
                *server.allocated_mut(block.block_id.tier()) += 1;
            }
        }
    }

    /// What the planner places blocks by: the room of each server that takes new blocks.
    pub fn rooms(&self) -> Vec<Room> {
        let room = |server: &Server, tier| TierRoom {
            capacity_blocks: server.tier_capacity(tier),
            used_blocks: server.tier_used(tier),
            being_freed_blocks: server.tier_being_freed(tier),
        };
        self.servers
            .iter()
            .filter(|(_, s)| s.takes_placements())
            .map(|(&server_id, s)| Room {
                server_id,
                host: s.host.clone(),
                dram: room(s, Tier::Dram),
                nvme: room(s, Tier::Nvme),
            })
            .collect()
    }

    /// What the planner places segments by: the load of each server that takes new segments.
    pub fn segment_loads(&self, class: StorageClass) -> Vec<SegmentLoad> {
        self.servers
            .iter()
            .filter(|(_, s)| s.takes_placements())
            .map(|(&server_id, s)| s.segment_load(server_id, class))
            .collect()
    }

    /// The id counters (next server id, next block id), for snapshots.
    pub fn counters(&self) -> (u64, u64) {
        (self.next_server_id, self.next_block_id)
    }

    /// Raises the id counters to at least the given values.
    pub fn raise_counters(&mut self, next_server_id: u64, next_block_id: u64) {
        self.next_server_id = self.next_server_id.max(next_server_id);
        self.next_block_id = self.next_block_id.max(next_block_id);
    }

    /// Every known server's identity, as the log records it.
    pub fn identities(&self) -> Vec<LogServer> {
        self.servers
            .iter()
            .map(|(&id, s)| LogServer {
                server_id: id.get(),
                address: s.address.clone(),
                quic_address: s.quic_address.clone(),
                instance_id: s.instance_id,
            })
            .collect()
    }

    /// The servers not active (cordoned or draining), as the log records them.
    pub fn modes(&self) -> Vec<LogServerMode> {
        self.servers
            .iter()
            .filter(|(_, s)| s.mode != ServerMode::Active)
            .map(|(&id, s)| LogServerMode {
                server_id: id.get(),
                mode: s.mode as i32,
                drain_deadline_unix_ms: s.drain_deadline.map_or(0, |deadline| {
                    let left = deadline.saturating_duration_since(Instant::now());
                    tern_common::unix_ms().saturating_add(left.as_millis() as u64)
                }),
            })
            .collect()
    }

    /// The server `name` names: its id ("7") or its block-service address ("host:port").
    pub fn find(&self, name: &str) -> Result<ServerId, Refusal> {
        let name = name.trim();
        let found = match name.parse::<u64>() {
            Ok(id) => self.servers.contains_key(&ServerId(id)).then_some(ServerId(id)),
            Err(_) => self.servers.iter().find(|(_, s)| s.address == name).map(|(&id, _)| id),
        };
        found.ok_or_else(|| {
            Refusal::new(
                ErrorKind::NotFound,
                format!("no storage server {name:?} (give its id or its address host:port, as `tern admin servers` lists them)"),
            )
        })
    }

    /// Sets a server's mode (a logged change, live or replayed). A server no longer known (long
    /// dead, forgotten) is left alone.
    pub fn set_mode(&mut self, server_id: ServerId, mode: ServerMode, drain_deadline: Option<Instant>) {
        if let Some(server) = self.servers.get_mut(&server_id) {
            server.set_mode(mode, drain_deadline);
        }
    }

    /// Servers draining and still up, with their deadlines.
    pub fn drains(&self) -> Vec<Drain> {
        self.servers
            .iter()
            .filter(|(_, s)| s.mode == ServerMode::Draining && s.readable())
            .map(|(&server_id, s)| Drain { server_id, deadline: s.drain_deadline.unwrap_or_else(Instant::now) })
            .collect()
    }

    /// Records how a drain stands: what it still waits for ("" = nothing), and whether the
    /// server is to exit now. Returns true when the server was newly told to exit.
    pub fn settle_drain(&mut self, server_id: ServerId, waiting_for: String, exit: bool) -> bool {
        let Some(server) = self.servers.get_mut(&server_id) else {
            return false;
        };
        server.drain_waiting_for = waiting_for;
        let newly = exit && !server.drained;
        server.drained = exit;
        newly
    }

    /// Records how many blocks on the server no other readable copy backs.
    pub fn set_sole_copy_blocks(&mut self, server_id: ServerId, blocks: u64) {
        if let Some(server) = self.servers.get_mut(&server_id) {
            server.sole_copy_blocks = blocks;
        }
    }

    /// Shuffle segments placed on the server (of registered shuffles).
    pub fn segments_on(&self, server_id: ServerId) -> u64 {
        self.servers.get(&server_id).map_or(0, |s| s.segments)
    }

    /// Whether the server's last registration came from a new process.
    pub fn restarted_since_log(&self, server_id: ServerId) -> bool {
        self.servers.get(&server_id).is_none_or(|s| s.restarted)
    }

    /// Takes one page of a server's inventory; `Ok(true)` when the server awaits its
    /// reconciliation (the caller runs it on the last page).
    pub fn inventory_page(
        &mut self,
        server_id: ServerId,
        blocks: &[BlockId],
        shuffles: &[ShuffleId],
        segments: &[SegmentCopy],
        block_size: u32,
    ) -> Result<(), Refusal> {
        let Some(server) = self.servers.get_mut(&server_id).filter(|s| s.alive) else {
            return Err(Refusal::new(
                ErrorKind::NotFound,
                format!("storage server {server_id} is not registered; register again"),
            ));
        };
        let Some(inventory) = server.inventory.as_mut() else {
            return Err(invalid(format!("storage server {server_id} already reported its inventory; register again")));
        };
        let entries = blocks.len() + shuffles.len() + segments.len();
        if entries > tern_proto::MAX_INVENTORY_PAGE {
            return Err(invalid(format!(
                "an inventory page of {entries} entries; at most {} per page",
                tern_proto::MAX_INVENTORY_PAGE
            )));
        }
        // No server holds more blocks than its tiers have room for (a registration at start-up
        // names bytes only: its block counts come with the first heartbeat).
        let capacity: u64 =
            server.tiers.iter().map(|t| t.capacity_blocks.max(t.capacity_bytes / u64::from(block_size.max(1)))).sum();
        if (inventory.blocks.len() + blocks.len()) as u64 > capacity {
            return Err(invalid(format!(
                "the inventory reports {} blocks, more than the {capacity} the server's tiers hold",
                inventory.blocks.len() + blocks.len()
            )));
        }
        if inventory.shuffles.len() + shuffles.len() > crate::shuffles::MAX_SHUFFLES {
            return Err(invalid(format!("the inventory reports more than {} shuffles", crate::shuffles::MAX_SHUFFLES)));
        }
        if (inventory.segments.len() + segments.len()) as u64 > crate::shuffles::MAX_SEGMENTS {
            return Err(invalid(format!("the inventory reports more than {} segments", crate::shuffles::MAX_SEGMENTS)));
        }
        inventory.blocks.extend(blocks);
        inventory.shuffles.extend(shuffles);
        inventory.segments.extend(segments);
        Ok(())
    }

    /// Settles a server's complete inventory against what the namespace and the shuffle registry
    /// reference there: `referenced` (block id → its file is sealed) and `shuffles` (registered
    /// shuffles with segments there). Blocks held but unreferenced, and unknown shuffles, are
    /// queued for freeing; referenced blocks it did not report are lost (those of unsealed files
    /// only when the server restarted: otherwise they may simply not be written yet). From now
    /// on, blocks and segments may be placed there. Returns what it did, and the segments the
    /// server reported (for the shuffle registry to settle: see `Shuffles::lost_on`).
    pub fn reconcile(
        &mut self,
        server_id: ServerId,
        referenced: &HashMap<BlockId, bool>,
        restarted: bool,
        registered_shuffle: impl Fn(ShuffleId) -> bool,
        needed_segment: impl Fn(SegmentCopy) -> bool,
    ) -> (Reconciled, HashSet<SegmentCopy>) {
        let Some(server) = self.servers.get_mut(&server_id) else {
            return (Reconciled::default(), HashSet::new());
        };
        let inventory = server.inventory.take().unwrap_or_default();
        let mut done = Reconciled::default();
        server.frees = VecDeque::new();
        server.shuffle_frees = 0;
        server.nvme_frees = 0;
        server.allocated = 0;
        server.nvme_allocated = 0;
        server.lost_blocks.clear();
        let describe = server.describe(server_id);
        for (&block_id, &sealed) in referenced {
            if inventory.blocks.contains(&block_id) {
                *server.allocated_mut(block_id.tier()) += 1;
            } else if sealed || restarted {
                let why =
                    format!("block {} on {describe} is lost: the server registered again without it", block_id.get());
                server.lost_blocks.insert(block_id, why);
                done.lost += 1;
            } else {
                // Placed for a file still being written, and not written yet.
                *server.allocated_mut(block_id.tier()) += 1;
            }
        }
        let mut unreferenced: Vec<BlockId> =
            inventory.blocks.iter().copied().filter(|id| !referenced.contains_key(id)).collect();
        unreferenced.sort_unstable();
        for block_id in unreferenced {
            *server.allocated_mut(block_id.tier()) += 1;
            server.queue_free(Free::Block(block_id));
            done.unreferenced += 1;
        }
        let mut unknown: Vec<ShuffleId> =
            inventory.shuffles.iter().copied().filter(|&id| !registered_shuffle(id)).collect();
        unknown.sort_unstable();
        for shuffle_id in unknown {
            server.queue_free(Free::Shuffle(shuffle_id));
            done.unknown_shuffles += 1;
        }
        let mut orphans: Vec<SegmentCopy> = inventory
            .segments
            .iter()
            .copied()
            .filter(|s| registered_shuffle(s.shuffle_id) && !needed_segment(*s))
            .collect();
        orphans.sort_unstable_by_key(|s| (s.shuffle_id, s.partition, s.index));
        for segment in orphans {
            server.queue_free(Free::Segment(segment));
            done.unreferenced_segments += 1;
        }
        server.reconciled = true;
        (done, inventory.segments)
    }

    /// Records a heartbeat, drops the frees it acknowledges, and answers with the frees still due.
    pub fn heartbeat(
        &mut self,
        server_id: ServerId,
        tiers: Vec<TierUsage>,
        freed_through_seq: u64,
        now: Instant,
    ) -> HeartbeatResponse {
        let Some(server) = self.servers.get_mut(&server_id).filter(|s| s.alive) else {
            return HeartbeatResponse { reregister: true, ..HeartbeatResponse::default() };
        };
        server.last_seen = now;
        while let Some(&(seq, free)) = server.frees.front() {
            if seq > freed_through_seq {
                break;
            }
            server.frees.pop_front();
            // A freed shuffle gives its space back through the server's usage reports instead.
            match free {
                Free::Block(id) => {
                    let tier = id.tier();
                    if tier == Tier::Nvme {
                        server.nvme_frees -= 1;
                    }
                    let allocated = server.allocated_mut(tier);
                    *allocated = allocated.saturating_sub(1);
                }
                Free::Shuffle(_) => server.shuffle_frees -= 1,
                Free::Segment(_) => {}
            }
        }
        // A heartbeat without tiers says nothing about capacity; keep the last report.
        if !tiers.is_empty() {
            server.take_report(tiers);
        }
        let mut reply =
            HeartbeatResponse { free_seq: freed_through_seq, drained: server.drained, ..HeartbeatResponse::default() };
        for &(seq, free) in server.frees.iter().take(MAX_FREES_PER_HEARTBEAT) {
            match free {
                Free::Block(block_id) => reply.free_block_ids.push(block_id.get()),
                Free::Shuffle(shuffle_id) => reply.free_shuffle_ids.push(shuffle_id.get()),
                Free::Segment(s) => reply.free_segments.push(HeldSegment {
                    shuffle_id: s.shuffle_id.get(),
                    partition: s.partition,
                    index: s.index,
                }),
            }
            reply.free_seq = seq;
        }
        reply
    }

    /// Declares dead every live server silent for longer than `timeout`; returns their ids and
    /// descriptions.
    pub fn expire(&mut self, now: Instant, timeout: Duration) -> Vec<(ServerId, String)> {
        // Reports of unreachability lapse: the server takes placements again (a client that
        // still cannot reach it reports again).
        for server in self.servers.values_mut() {
            server.unreachable_until = server.unreachable_until.filter(|&until| until > now);
        }
        let silent: Vec<(ServerId, Duration)> = self
            .servers
            .iter()
            .filter(|(_, s)| s.alive || s.restored)
            .map(|(&id, s)| (id, now.saturating_duration_since(s.last_seen)))
            .filter(|&(_, silence)| silence > timeout)
            .collect();
        silent
            .into_iter()
            .map(|(id, silence)| {
                let reason = if self.servers[&id].restored {
                    format!(
                        "server did not register again within {:.1}s of the metadata server's restart",
                        silence.as_secs_f64()
                    )
                } else {
                    format!("server missed heartbeats for {:.1}s", silence.as_secs_f64())
                };
                (id, self.mark_dead(id, reason))
            })
            .collect()
    }

    /// Queues blocks the namespace no longer references for freeing on their servers. Blocks on
    /// dead or forgotten servers are gone already and are simply dropped.
    pub fn free(&mut self, blocks: &[BlockRef]) {
        for block in blocks {
            let Some(server) = self.servers.get_mut(&block.server_id) else {
                continue;
            };
            if server.lost_blocks.remove(&block.block_id).is_some() {
                // Not there to free, and not counted.
                continue;
            }
            if server.alive {
                server.queue_free(Free::Block(block.block_id));
            } else {
                let allocated = server.allocated_mut(block.block_id.tier());
                *allocated = allocated.saturating_sub(1);
            }
        }
    }

    /// Counts newly placed segments in their servers' load.
    pub fn add_segments(&mut self, server_ids: &[ServerId]) {
        for id in server_ids {
            if let Some(server) = self.servers.get_mut(id) {
                server.segments += 1;
            }
        }
    }

    /// Queues a shuffle free on each live server holding segments of it (`holders`: server id →
    /// segments there), and takes those segments out of the servers' load.
    pub fn free_shuffle(&mut self, shuffle_id: ShuffleId, holders: &BTreeMap<ServerId, u64>) {
        for (id, &segments) in holders {
            let Some(server) = self.servers.get_mut(id) else {
                continue;
            };
            server.segments = server.segments.saturating_sub(segments);
            // On a dead server the segments are gone already.
            if server.alive {
                server.queue_free(Free::Shuffle(shuffle_id));
            }
        }
    }

    /// Queues a single segment copy's free on its server, if it is alive (a dead one's is gone).
    pub fn free_segment(&mut self, server_id: ServerId, segment: SegmentCopy) {
        if let Some(server) = self.servers.get_mut(&server_id).filter(|s| s.alive) {
            server.queue_free(Free::Segment(segment));
        }
    }

    /// A segment copy moved from `old` to `new`: counts it in `new`'s load, not in `old`'s.
    pub fn move_segment(&mut self, old: ServerId, new: ServerId) {
        if let Some(server) = self.servers.get_mut(&old) {
            server.segments = server.segments.saturating_sub(1);
        }
        self.add_segments(&[new]);
    }

    /// Segment frees queued and not yet acknowledged, by server: such a server takes no new copy
    /// of that segment until its free is done (it would drop the new copy).
    pub fn pending_segment_frees(&self) -> HashSet<(ServerId, SegmentCopy)> {
        let mut out = HashSet::new();
        for (&id, server) in &self.servers {
            for (_, free) in &server.frees {
                if let Free::Segment(segment) = free {
                    out.insert((id, *segment));
                }
            }
        }
        out
    }

    /// Why `block` cannot be read, or `None` when its server is alive.
    pub fn lost(&self, block: &BlockRef) -> Option<String> {
        match self.servers.get(&block.server_id) {
            Some(server) if server.readable() => server.lost_blocks.get(&block.block_id).cloned(),
            Some(server) => Some(format!(
                "block {} on {} is lost: {}",
                block.block_id.get(),
                server.describe(block.server_id),
                server.death
            )),
            None => Some(format!(
                "block {} on storage server {} is lost: the server is no longer known (long dead)",
                block.block_id.get(),
                block.server_id
            )),
        }
    }

    /// Whether blocks and segments there can be read: the server is alive, or restored from the
    /// log and not yet declared dead.
    pub fn is_alive(&self, server_id: ServerId) -> bool {
        self.servers.get(&server_id).is_some_and(|s| s.readable())
    }

    /// Whether the block can be read (its server readable, the block not reported missing).
    pub fn block_readable(&self, block: &BlockRef) -> bool {
        self.servers.get(&block.server_id).is_some_and(|s| s.readable() && !s.lost_blocks.contains_key(&block.block_id))
    }

    /// A server's block-service address; empty for a server no longer known.
    pub fn address(&self, server_id: ServerId) -> String {
        self.servers.get(&server_id).map(|s| s.address.clone()).unwrap_or_default()
    }

    /// A server's QUIC address; empty for a server without one or no longer known.
    pub fn quic_address(&self, server_id: ServerId) -> String {
        self.servers.get(&server_id).map(|s| s.quic_address.clone()).unwrap_or_default()
    }

    /// Where a block lives, for clients.
    pub fn location(&self, block: &BlockRef, length: u32) -> BlockLocation {
        let (address, quic_address) =
            self.servers.get(&block.server_id).map(|s| (s.address.clone(), s.quic_address.clone())).unwrap_or_default();
        BlockLocation {
            block_id: block.block_id.get(),
            server_id: block.server_id.get(),
            address,
            length,
            quic_address,
            grant: Vec::new(),
        }
    }

    pub fn status(&self, now: Instant) -> Vec<ServerStatus> {
        self.servers.keys().filter_map(|&id| self.status_of(id, now)).collect()
    }

    /// One server's status; `None` for a server not known.
    pub fn status_of(&self, server_id: ServerId, now: Instant) -> Option<ServerStatus> {
        self.servers.get(&server_id).map(|s| ServerStatus {
            server_id: server_id.get(),
            address: s.address.clone(),
            quic_address: s.quic_address.clone(),
            alive: s.alive,
            tiers: s.tiers.clone(),
            allocated_blocks: s.allocated + s.nvme_allocated,
            last_heartbeat_ms_ago: now.saturating_duration_since(s.last_seen).as_millis() as u64,
            state: s.state_name().to_string(),
            segments: s.segments,
            drain_waiting_for: s.drain_waiting_for.clone(),
            drain_deadline_ms: s.drain_deadline.map_or(0, |d| d.saturating_duration_since(now).as_millis() as u64),
            sole_copy_blocks: s.sole_copy_blocks,
            drained: s.drained,
            // Filled in by the state, which holds the copies.
            copies_pending: 0,
        })
    }

    /// Servers that take new blocks and segments.
    pub fn live_count(&self) -> u64 {
        self.servers.values().filter(|s| s.placeable()).count() as u64
    }

    pub fn dead_count(&self) -> u64 {
        self.servers.values().filter(|s| !s.readable()).count() as u64
    }

    /// Blocks placed on live servers (all tiers) and not yet acknowledged as freed.
    pub fn allocated_blocks(&self) -> u64 {
        self.servers.values().filter(|s| s.alive).map(|s| s.allocated + s.nvme_allocated).sum()
    }

    /// Marks a server dead, drops its pending frees, and forgets the oldest dead servers beyond
    /// the bound; returns a description for the log.
    fn mark_dead(&mut self, server_id: ServerId, reason: String) -> String {
        let mut description = String::new();
        if let Some(server) = self.servers.get_mut(&server_id) {
            description = format!("{}: {reason}", server.describe(server_id));
            server.alive = false;
            server.restored = false;
            server.reconciled = false;
            server.inventory = None;
            server.death = reason;
            // Its pending frees will never be carried out, and need not be: the data is gone.
            let dram_frees = server.frees.len() as u64 - server.shuffle_frees - server.nvme_frees;
            server.allocated = server.allocated.saturating_sub(dram_frees);
            server.nvme_allocated = server.nvme_allocated.saturating_sub(server.nvme_frees);
            server.frees = VecDeque::new();
            server.shuffle_frees = 0;
            server.nvme_frees = 0;
        }
        let dead: Vec<ServerId> = self.servers.iter().filter(|(_, s)| !s.readable()).map(|(&id, _)| id).collect();
        for id in dead.iter().take(dead.len().saturating_sub(MAX_DEAD_SERVERS)) {
            self.servers.remove(id);
        }
        description
    }
}

/// The host part of a `host:port` address, or why it is not one.
fn host_of_address(address: &str) -> Result<String, Refusal> {
    let refuse = |why: &str| invalid(format!("storage server address {address:?} is not host:port: {why}"));
    if let Ok(socket) = address.parse::<SocketAddr>() {
        if socket.port() == 0 {
            return Err(refuse("port 0"));
        }
        return Ok(socket.ip().to_string());
    }
    let (host, port) = address.rsplit_once(':').ok_or_else(|| refuse("no port"))?;
    match port.parse::<u16>() {
        Ok(0) => return Err(refuse("port 0")),
        Ok(_) => {}
        Err(_) => return Err(refuse("bad port")),
    }
    let hostname = !host.is_empty() && host.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
    if !hostname {
        return Err(refuse("bad host"));
    }
    Ok(host.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use tern_proto::{StorageClass, NVME_BLOCK_BIT};

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
            let plan = place_blocks(&self.rooms(), count, client_host, class, replicas)?;
            let blocks = self.name_blocks(&plan);
            self.count_placed(&blocks);
            Ok(blocks)
        }

        fn plan_segments(&self, count: usize, avoid: Option<u64>) -> Result<Vec<u64>, Refusal> {
            let avoid: Vec<ServerId> = avoid.into_iter().map(ServerId).collect();
            Ok(place_segments(&self.segment_loads(StorageClass::Any), count, &avoid, 1)?
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
        servers.heartbeat(ServerId(2), Vec::new(), 0, later);
        let dead = servers.expire(later, Duration::from_secs(5));
        assert_eq!(dead.len(), 2);
        assert!(dead[0].1.contains("storage server 1 (10.0.0.1:1): server missed heartbeats for 10.0s"), "{dead:?}");
        let blocks = servers.allocate(1, "10.0.0.1", StorageClass::Any).unwrap();
        assert_eq!(blocks[0].server_id, ServerId(2));
        let refusal = servers.allocate(1, "", StorageClass::Any).unwrap_err();
        assert_eq!(refusal.kind, ErrorKind::OutOfSpace);
        assert_eq!((servers.live_count(), servers.dead_count()), (1, 2));
        // Server 2 is full; it dies too and then nothing is live.
        servers.expire(later + Duration::from_secs(10), Duration::from_secs(5));
        let refusal = servers.allocate(1, "", StorageClass::Any).unwrap_err();
        assert_eq!((refusal.kind, refusal.reason.as_str()), (ErrorKind::Unavailable, "no live storage servers"));
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
        servers.mark_dead(ServerId(1), "test".into());
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
        let reply = servers.heartbeat(ServerId(1), Vec::new(), 0, now);
        servers.heartbeat(ServerId(1), Vec::new(), reply.free_seq, now);
        assert_eq!(servers.allocate(2, "", StorageClass::Any).unwrap().len(), 2);
    }

    #[test]
    fn frees_are_delivered_until_acknowledged() {
        let (mut servers, now) = servers(&["10.0.0.1:1"], 10);
        let blocks = servers.allocate(3, "", StorageClass::Any).unwrap();
        servers.free(&blocks[..2]);
        let reply = servers.heartbeat(ServerId(1), Vec::new(), 0, now);
        assert_eq!((reply.free_block_ids.clone(), reply.free_seq, reply.reregister), (vec![1, 2], 2, false));
        // Not acknowledged: sent again, and new frees follow.
        servers.free(&blocks[2..]);
        let reply = servers.heartbeat(ServerId(1), Vec::new(), 0, now);
        assert_eq!((reply.free_block_ids.clone(), reply.free_seq), (vec![1, 2, 3], 3));
        assert_eq!(servers.allocated_blocks(), 3);
        // Acknowledged in part, then in full.
        let reply = servers.heartbeat(ServerId(1), Vec::new(), 2, now);
        assert_eq!((reply.free_block_ids.clone(), reply.free_seq), (vec![3], 3));
        assert_eq!(servers.allocated_blocks(), 1);
        let reply = servers.heartbeat(ServerId(1), Vec::new(), 3, now);
        assert_eq!((reply.free_block_ids.len(), reply.free_seq), (0, 3));
        assert_eq!(servers.allocated_blocks(), 0);
    }

    #[test]
    fn shuffle_frees_share_the_queue_but_not_the_block_count() {
        let (mut servers, now) = servers(&["10.0.0.1:1", "10.0.0.2:1"], 10);
        let blocks = servers.allocate(4, "", StorageClass::Any).unwrap();
        servers.add_segments(&[ServerId(1), ServerId(1), ServerId(2)]);
        servers.free(&blocks[..1]);
        servers.free_shuffle(ShuffleId(7), &BTreeMap::from([(ServerId(1), 2), (ServerId(2), 1)]));
        servers.free(&blocks[2..3]);
        let reply = servers.heartbeat(ServerId(1), Vec::new(), 0, now);
        assert_eq!((reply.free_block_ids, reply.free_shuffle_ids, reply.free_seq), (vec![1, 3], vec![7], 3));
        assert_eq!(servers.heartbeat(ServerId(2), Vec::new(), 0, now).free_shuffle_ids, [7]);
        // Acknowledging the first two frees gives back one block; the shuffle's space shows in reports.
        let reply = servers.heartbeat(ServerId(1), Vec::new(), 2, now);
        assert_eq!((reply.free_block_ids, reply.free_shuffle_ids, reply.free_seq), (vec![3], vec![], 3));
        assert_eq!(servers.allocated_blocks(), 3);
        // A server that dies with frees queued drops them, and the freed blocks from its count.
        servers.free(&blocks[1..2]);
        servers.mark_dead(ServerId(2), "test".into());
        assert_eq!(servers.status(now)[1].allocated_blocks, 1);
    }

    #[test]
    fn a_server_clients_cannot_reach_takes_no_placements_until_the_report_lapses() {
        let (mut servers, now) = servers(&["10.0.0.1:1", "10.0.0.2:1"], 10);
        let until = now + Duration::from_secs(5);
        assert_eq!(servers.report_unreachable("10.0.0.2:1", until), Some((ServerId(2), true)));
        assert_eq!(servers.report_unreachable("10.0.0.9:1", until), None);
        assert_eq!(servers.plan_segments(3, None).unwrap(), [1, 1, 1]);
        assert!(servers.allocate(4, "", StorageClass::Any).unwrap().iter().all(|b| b.server_id == ServerId(1)));
        // Still alive (readable), shown as unreachable.
        assert!(servers.is_alive(ServerId(2)));
        assert_eq!(servers.servers[&ServerId(2)].state_name(), "unreachable");
        // The report lapses with the reaper's next pass after `until`.
        assert!(servers.expire(until - Duration::from_millis(1), Duration::from_secs(60)).is_empty());
        assert_eq!(servers.plan_segments(1, None).unwrap(), [1]);
        servers.expire(until, Duration::from_secs(60));
        assert_eq!(servers.servers[&ServerId(2)].state_name(), "alive");
        assert!(servers.plan_segments(2, None).unwrap().contains(&2));
        // A dead server's report changes nothing: it says so.
        servers.mark_dead(ServerId(2), "test".into());
        assert_eq!(servers.report_unreachable("10.0.0.2:1", until), Some((ServerId(2), false)));
    }

    #[test]
    fn segments_go_round_robin_by_load_avoiding_a_full_segments_server() {
        let (mut servers, now) = servers(&["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"], 10);
        servers.allocate(1, "", StorageClass::Any).unwrap();
        assert_eq!(servers.plan_segments(5, None).unwrap(), [2, 3, 1, 2, 3]);
        servers.add_segments(&[ServerId(2), ServerId(2)]);
        assert_eq!(servers.plan_segments(1, None).unwrap(), [3]);
        assert_eq!(servers.plan_segments(1, Some(3)).unwrap(), [1]);
        // Full servers come last, whatever their segments.
        let full =
            vec![TierUsage { tier: DRAM_TIER.into(), capacity_blocks: 10, used_blocks: 10, ..TierUsage::default() }];
        servers.heartbeat(ServerId(3), full, 0, now);
        assert_eq!(servers.plan_segments(3, None).unwrap(), [1, 2, 3]);
        // The only live server takes even its own full segment's successor.
        servers.mark_dead(ServerId(1), "test".into());
        servers.mark_dead(ServerId(2), "test".into());
        assert_eq!(servers.plan_segments(2, Some(3)).unwrap(), [3, 3]);
        servers.mark_dead(ServerId(3), "test".into());
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
        assert!(blocks.iter().all(|b| b.block_id.get() & NVME_BLOCK_BIT != 0 && b.server_id == ServerId(1)));
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
        let reply = servers.heartbeat(ServerId(1), Vec::new(), 0, now);
        assert_eq!(reply.free_block_ids, nvme_blocks.iter().map(|b| b.block_id.get()).collect::<Vec<_>>());
        servers.heartbeat(ServerId(1), Vec::new(), reply.free_seq, now);
        assert_eq!(servers.allocated_blocks(), 1);
        assert_eq!(servers.allocate(2, "", StorageClass::Nvme).unwrap().len(), 2);
        // A server that dies with NVMe and DRAM frees queued drops both from its counts.
        servers.free(&dram_block);
        servers.mark_dead(ServerId(1), "test".into());
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
        let reply = servers.heartbeat(ServerId(1), Vec::new(), 0, now);
        assert_eq!(reply.free_block_ids.len(), MAX_FREES_PER_HEARTBEAT);
        assert_eq!(reply.free_seq, MAX_FREES_PER_HEARTBEAT as u64);
        let reply = servers.heartbeat(ServerId(1), Vec::new(), reply.free_seq, now);
        assert_eq!(reply.free_block_ids.len(), 70 * 1024 - MAX_FREES_PER_HEARTBEAT);
    }

    #[test]
    fn a_server_registering_again_keeps_its_id_and_its_reported_blocks() {
        let (mut servers, now) = servers(&["10.0.0.1:1"], 10);
        let blocks = servers.allocate(3, "", StorageClass::Any).unwrap();
        // The same process again (the metadata server lost track of it): nothing placed there
        // until its inventory is in.
        let (id, previous) = servers.register("10.0.0.1:1", dram(10), 1, now).unwrap();
        assert_eq!((id, previous), (ServerId(1), Some(1)));
        assert!(servers.allocate(1, "", StorageClass::Any).is_err());
        let page = [blocks[0].block_id, blocks[1].block_id, BlockId::from(99)];
        servers.inventory_page(ServerId(1), &page, &[ShuffleId(7)], &[], 4096).unwrap();
        // Blocks 1 and 2 belong to sealed files, block 3 to a file still being written.
        let referenced =
            HashMap::from([(blocks[0].block_id, true), (blocks[1].block_id, true), (blocks[2].block_id, false)]);
        let (done, _) =
            servers.reconcile(ServerId(1), &referenced, servers.restarted_since_log(ServerId(1)), |_| false, |_| true);
        assert_eq!(done, Reconciled { unreferenced: 1, lost: 0, unknown_shuffles: 1, unreferenced_segments: 0 });
        assert!(blocks.iter().all(|b| servers.lost(b).is_none()));
        let reply = servers.heartbeat(ServerId(1), Vec::new(), 0, now);
        assert_eq!((reply.free_block_ids, reply.free_shuffle_ids), (vec![99], vec![7]));
        assert_eq!(servers.allocate(1, "", StorageClass::Any).unwrap()[0].server_id, ServerId(1));

        // A new process (it restarted): what it does not report is lost, even unsealed.
        let (id, previous) = servers.register("10.0.0.1:1", dram(10), 2, now).unwrap();
        assert_eq!((id, previous), (ServerId(1), Some(1)));
        assert!(servers.restarted_since_log(ServerId(1)));
        servers.inventory_page(ServerId(1), &[blocks[1].block_id], &[], &[], 4096).unwrap();
        let (done, _) = servers.reconcile(ServerId(1), &referenced, true, |_| false, |_| true);
        assert_eq!(done, Reconciled { unreferenced: 0, lost: 2, unknown_shuffles: 0, unreferenced_segments: 0 });
        let lost = servers.lost(&blocks[0]).unwrap();
        assert!(lost.contains("registered again without it"), "{lost}");
        assert!(servers.lost(&blocks[1]).is_none() && servers.lost(&blocks[2]).is_some());
        // Freeing a lost block queues nothing: the server does not have it.
        servers.free(&[blocks[0]]);
        assert!(servers.heartbeat(ServerId(1), Vec::new(), 0, now).free_block_ids.is_empty());
        // An inventory is taken once per registration, and bounded.
        assert!(servers.inventory_page(ServerId(1), &[BlockId::from(1)], &[], &[], 4096).is_err());
        assert!(servers.heartbeat(ServerId(99), Vec::new(), 0, now).reregister);
    }

    #[test]
    fn restored_servers_are_readable_until_the_timeout_then_dead() {
        let now = Instant::now();
        let mut servers = Servers::default();
        servers.record(ServerId(4), "10.0.0.1:1", "", 9, now);
        let block = BlockRef { block_id: BlockId::from(1), server_id: ServerId(4) };
        servers.count_placed(&[block]);
        assert!(servers.lost(&block).is_none() && servers.is_alive(ServerId(4)));
        assert_eq!(servers.live_count(), 0, "nothing is placed on a server before it registers again");
        assert!(servers.heartbeat(ServerId(4), Vec::new(), 0, now).reregister);
        let dead = servers.expire(now + Duration::from_secs(10), Duration::from_secs(5));
        assert!(dead[0].1.contains("did not register again"), "{dead:?}");
        assert!(servers.lost(&block).is_some());
        // Ids continue past the restored ones.
        assert_eq!(servers.counters(), (5, 2));
    }

    #[test]
    fn forgets_the_oldest_dead_servers() {
        let (mut servers, now) = servers(&[], 1);
        for i in 0..MAX_DEAD_SERVERS + 2 {
            join(&mut servers, &format!("10.0.{}.{}:1", i / 200, i % 200 + 1), dram(1), now);
        }
        servers.expire(now + Duration::from_secs(10), Duration::from_secs(1));
        assert_eq!((servers.live_count(), servers.dead_count()), (0, MAX_DEAD_SERVERS as u64));
        let lost = servers.lost(&BlockRef { block_id: BlockId::from(5), server_id: ServerId(1) }).unwrap();
        assert!(lost.contains("no longer known"), "{lost}");
    }
}
