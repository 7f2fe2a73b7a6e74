//! One storage server as the registry keeps it: whether it is alive, restored or reconciled, its
//! mode, its tiers as last reported and what placement counts of them, its free queue.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use tern_proto::v1::{ServerMode, TierUsage};
use tern_proto::{BlockId, ServerId, StorageClass, Tier};

use super::frees::Free;
use super::inventory::Inventory;
use super::DRAM_TIER;
use crate::planner::SegmentLoad;

#[derive(Debug)]
pub(super) struct Server {
    pub(super) address: String,
    /// host:port of its QUIC endpoint; empty if it has none.
    pub(super) quic_address: String,
    /// The address's host, compared with clients' hosts for locality.
    pub(super) host: String,
    pub(super) alive: bool,
    /// Restored from the log after the metadata server restarted, and not registered again yet:
    /// its blocks are read (the server is likely still up), nothing new is placed there, and it
    /// is declared dead if it stays silent for the server timeout.
    pub(super) restored: bool,
    /// Its inventory was reconciled since it registered: only now is anything placed there.
    pub(super) reconciled: bool,
    /// The process instance it registered with (see RegisterServerRequest.instance_id).
    pub(super) instance_id: u64,
    /// Its last registration came from a new process (its DRAM is gone).
    pub(super) restarted: bool,
    /// Inventory pages received since it registered.
    pub(super) inventory: Option<Inventory>,
    /// Blocks referenced here that its last inventory did not report, and why they are lost.
    pub(super) lost_blocks: HashMap<BlockId, String>,
    /// Why the server was declared dead (empty while alive).
    pub(super) death: String,
    pub(super) tiers: Vec<TierUsage>,
    pub(super) last_seen: Instant,
    /// DRAM blocks placed here and not yet acknowledged as freed: what placement balances.
    pub(super) allocated: u64,
    /// The same for NVMe blocks.
    pub(super) nvme_allocated: u64,
    /// DRAM blocks in use at the last report beyond `allocated`: shuffle data.
    pub(super) unplaced_used: u64,
    /// Segments of registered shuffles placed here: shuffle load not yet visible in reports.
    pub(super) segments: u64,
    pub(super) frees: VecDeque<(u64, Free)>,
    /// How many of `frees` are shuffles (the rest are blocks, each still counted in `allocated` or
    /// `nvme_allocated`).
    pub(super) shuffle_frees: u64,
    /// How many of `frees` are NVMe blocks.
    pub(super) nvme_frees: u64,
    pub(super) next_free_seq: u64,
    /// What an operator allows the planner to do here (logged: survives restarts).
    pub(super) mode: ServerMode,
    /// Draining: when the server is told to exit even if data it holds is still needed.
    pub(super) drain_deadline: Option<Instant>,
    /// Draining: what the drain still waits for, as last checked ("" = nothing).
    pub(super) drain_waiting_for: String,
    /// Draining, and nothing is needed here any more (or the deadline passed): heartbeat replies
    /// tell the server to exit.
    pub(super) drained: bool,
    /// Blocks here that no other readable copy backs, as last counted.
    pub(super) sole_copy_blocks: u64,
    /// A client reported it cannot reach the server (while it heartbeats here, a partition the
    /// metadata server cannot see): nothing new is placed there until then.
    pub(super) unreachable_until: Option<Instant>,
}

impl Server {
    /// Blocks and segments may be read from it.
    pub(super) fn readable(&self) -> bool {
        self.alive || self.restored
    }

    /// Up and reconciled: could take new blocks and segments.
    pub(super) fn placeable(&self) -> bool {
        self.alive && self.reconciled
    }

    /// New blocks and segments go there: placeable, and not cordoned or draining.
    pub(super) fn takes_placements(&self) -> bool {
        self.placeable() && self.mode == ServerMode::Active && self.unreachable_until.is_none()
    }

    /// "alive", "registering" (alive, its inventory not yet reconciled: it takes no
    /// placements), "dead", "cordoned" or "draining".
    pub(super) fn state_name(&self) -> &'static str {
        match (self.readable(), self.mode) {
            (false, _) => "dead",
            (true, ServerMode::Active) if !self.reconciled => "registering",
            (true, ServerMode::Active) if self.unreachable_until.is_some() => "unreachable",
            (true, ServerMode::Active) => "alive",
            (true, ServerMode::Cordoned) => "cordoned",
            (true, ServerMode::Draining) => "draining",
        }
    }

    pub(super) fn tier(&self, tier: &str) -> Option<&TierUsage> {
        self.tiers.iter().find(|t| t.tier == tier)
    }

    pub(super) fn capacity_blocks(&self) -> u64 {
        self.tier(DRAM_TIER).map_or(0, |t| t.capacity_blocks)
    }

    /// Blocks the tier holds, as last reported (0 for a tier the server does not have).
    pub(super) fn tier_capacity(&self, tier: Tier) -> u64 {
        self.tier(tier.name()).map_or(0, |t| t.capacity_blocks)
    }

    /// Blocks of the tier in use as far as placement can tell (see [`Server::used_blocks`]).
    pub(super) fn tier_used(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Dram => self.used_blocks(),
            Tier::Nvme => self.nvme_allocated,
        }
    }

    /// Blocks of the tier that queued frees give back once carried out.
    pub(super) fn tier_being_freed(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Dram => self.being_freed(),
            Tier::Nvme => self.nvme_frees,
        }
    }

    pub(super) fn allocated_mut(&mut self, tier: Tier) -> &mut u64 {
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
    pub(super) fn used_blocks(&self) -> u64 {
        self.allocated + self.unplaced_used
    }

    /// Takes in a usage report (a registration's or a heartbeat's, after its acknowledged frees).
    pub(super) fn take_report(&mut self, tiers: Vec<TierUsage>) {
        self.tiers = tiers;
        let reported = self.tier(DRAM_TIER).map_or(0, |t| t.used_blocks);
        self.unplaced_used = reported.saturating_sub(self.allocated);
    }

    /// DRAM blocks in use that queued frees will give back once carried out: the blocks among
    /// them, and, when a shuffle free is queued, the shuffle data as far as it can be told apart.
    pub(super) fn being_freed(&self) -> u64 {
        let blocks = self.frees.len() as u64 - self.shuffle_frees - self.nvme_frees;
        let shuffles = if self.shuffle_frees > 0 { self.unplaced_used } else { 0 };
        blocks + shuffles
    }

    /// What segment placement orders servers by: full ones last, then blocks in use plus the
    /// segments placed here.
    /// How loaded the server is for a new segment of `class`: full when no tier the class may
    /// use has room (servers move `any` and `nvme` segments from DRAM to NVMe themselves).
    pub(super) fn segment_load(&self, server_id: ServerId, class: StorageClass) -> SegmentLoad {
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

    pub(super) fn new(address: &str, host: String, instance_id: u64, now: Instant) -> Server {
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

    pub(super) fn set_mode(&mut self, mode: ServerMode, drain_deadline: Option<Instant>) {
        self.mode = mode;
        self.drain_deadline = drain_deadline.filter(|_| mode == ServerMode::Draining);
        self.drain_waiting_for.clear();
        self.drained = false;
    }

    pub(super) fn describe(&self, server_id: ServerId) -> String {
        format!("storage server {server_id} ({})", self.address)
    }
}
