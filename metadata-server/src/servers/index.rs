//! The servers, kept with an index of what placement reads: the servers that take placements in
//! order of room per tier and of segment load, by host, and the totals of free room. Each server
//! is re-indexed as it changes, so that placing a batch of blocks or a shuffle's segments reads
//! O(log S) plus the servers it may choose instead of every server: a room built for each of
//! 10,000 servers made one allocation 12x slower than at 10 servers (BENCHMARKS, "Metadata
//! server at scale").
//!
//! The map is reachable mutably only through [`Indexed::get_mut`] (a guard that re-indexes its
//! server when dropped), [`Indexed::for_each_mut`], [`Indexed::insert`] and [`Indexed::retain`],
//! so the index cannot fall out of step with a server; in tests every placement checks it
//! against one rebuilt from the servers.

use std::collections::{btree_map, BTreeMap, BTreeSet, HashMap};
use std::ops::{Deref, DerefMut};

use tern_proto::{ServerId, StorageClass, Tier};

use super::server::Server;
use crate::planner::{BlockRooms, Candidate, SegmentLoad, SegmentRooms, TierRoom};

/// Tiers in the index's arrays.
const TIERS: [Tier; 2] = [Tier::Dram, Tier::Nvme];

fn tier_slot(tier: Tier) -> usize {
    match tier {
        Tier::Dram => 0,
        Tier::Nvme => 1,
    }
}

/// Segment placement has two orders: for DRAM shuffles (full when DRAM is), and for NVMe and
/// `any` ones (full when both tiers are), which a server's load gives alike.
const SEGMENT_CLASSES: [StorageClass; 2] = [StorageClass::Dram, StorageClass::Any];

fn segment_slot(class: StorageClass) -> usize {
    match class {
        StorageClass::Dram => 0,
        StorageClass::Nvme | StorageClass::Any => 1,
    }
}

/// The storage servers by id, with the placement index kept in step.
#[derive(Debug, Default)]
pub(super) struct Indexed {
    map: BTreeMap<ServerId, Server>,
    index: Index,
}

/// What placement reads, over the servers that take placements.
#[derive(Debug, Default, PartialEq, Eq)]
struct Index {
    /// What each server contributes, to take it out again when it changes.
    entries: HashMap<ServerId, Entry>,
    /// Per tier: (blocks used, id) of the servers with room in it.
    with_room: [BTreeSet<(u64, ServerId)>; 2],
    /// Per tier: blocks free over the servers.
    free: [u64; 2],
    /// Per tier: blocks in use that queued frees give back.
    being_freed: [u64; 2],
    /// Per segment order ([`SEGMENT_CLASSES`]): the servers in placement order.
    segment_order: [BTreeSet<SegmentLoad>; 2],
    /// The servers on each host.
    on_host: HashMap<String, BTreeSet<ServerId>>,
}

/// One server as the index counts it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    host: String,
    rooms: [TierRoom; 2],
    segments: [SegmentLoad; 2],
}

impl Entry {
    /// The server's entry, if it takes placements.
    fn of(server_id: ServerId, server: &Server) -> Option<Entry> {
        server.takes_placements().then(|| Entry {
            host: server.host.clone(),
            rooms: TIERS.map(|tier| TierRoom {
                capacity_blocks: server.tier_capacity(tier),
                used_blocks: server.tier_used(tier),
                being_freed_blocks: server.tier_being_freed(tier),
            }),
            segments: SEGMENT_CLASSES.map(|class| server.segment_load(server_id, class)),
        })
    }
}

impl Index {
    fn update(&mut self, server_id: ServerId, server: Option<&Server>) {
        let entry = server.and_then(|server| Entry::of(server_id, server));
        if self.entries.get(&server_id) == entry.as_ref() {
            return;
        }
        if let Some(old) = self.entries.remove(&server_id) {
            self.take_out(server_id, &old);
        }
        if let Some(entry) = entry {
            self.put_in(server_id, &entry);
            self.entries.insert(server_id, entry);
        }
    }

    fn put_in(&mut self, server_id: ServerId, entry: &Entry) {
        for (slot, room) in entry.rooms.iter().enumerate() {
            if room.used_blocks < room.capacity_blocks {
                self.with_room[slot].insert((room.used_blocks, server_id));
            }
            self.free[slot] += room.capacity_blocks.saturating_sub(room.used_blocks);
            self.being_freed[slot] += room.being_freed_blocks;
        }
        for (slot, load) in entry.segments.iter().enumerate() {
            self.segment_order[slot].insert(*load);
        }
        self.on_host.entry(entry.host.clone()).or_default().insert(server_id);
    }

    fn take_out(&mut self, server_id: ServerId, entry: &Entry) {
        for (slot, room) in entry.rooms.iter().enumerate() {
            self.with_room[slot].remove(&(room.used_blocks, server_id));
            self.free[slot] -= room.capacity_blocks.saturating_sub(room.used_blocks);
            self.being_freed[slot] -= room.being_freed_blocks;
        }
        for (slot, load) in entry.segments.iter().enumerate() {
            self.segment_order[slot].remove(load);
        }
        if let Some(on_host) = self.on_host.get_mut(&entry.host) {
            on_host.remove(&server_id);
            if on_host.is_empty() {
                self.on_host.remove(&entry.host);
            }
        }
    }

    fn candidate(&self, slot: usize, server_id: ServerId, remote: bool) -> Candidate {
        let room = self.entries[&server_id].rooms[slot];
        Candidate { remote, used: room.used_blocks, server_id, capacity: room.capacity_blocks }
    }
}

/// A server borrowed to change: re-indexed when dropped.
pub(super) struct ServerMut<'a> {
    server_id: ServerId,
    server: &'a mut Server,
    index: &'a mut Index,
}

impl Deref for ServerMut<'_> {
    type Target = Server;

    fn deref(&self) -> &Server {
        self.server
    }
}

impl DerefMut for ServerMut<'_> {
    fn deref_mut(&mut self) -> &mut Server {
        self.server
    }
}

impl Drop for ServerMut<'_> {
    fn drop(&mut self) {
        self.index.update(self.server_id, Some(self.server));
    }
}

impl Indexed {
    pub(super) fn get(&self, server_id: &ServerId) -> Option<&Server> {
        self.map.get(server_id)
    }

    pub(super) fn get_mut(&mut self, server_id: &ServerId) -> Option<ServerMut<'_>> {
        let server = self.map.get_mut(server_id)?;
        Some(ServerMut { server_id: *server_id, server, index: &mut self.index })
    }

    pub(super) fn contains_key(&self, server_id: &ServerId) -> bool {
        self.map.contains_key(server_id)
    }

    pub(super) fn keys(&self) -> btree_map::Keys<'_, ServerId, Server> {
        self.map.keys()
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn iter(&self) -> btree_map::Iter<'_, ServerId, Server> {
        self.map.iter()
    }

    pub(super) fn values(&self) -> btree_map::Values<'_, ServerId, Server> {
        self.map.values()
    }

    /// Changes every server.
    pub(super) fn for_each_mut(&mut self, mut change: impl FnMut(ServerId, &mut Server)) {
        for (&server_id, server) in &mut self.map {
            change(server_id, server);
            self.index.update(server_id, Some(server));
        }
    }

    pub(super) fn insert(&mut self, server_id: ServerId, server: Server) {
        self.index.update(server_id, Some(&server));
        self.map.insert(server_id, server);
    }

    pub(super) fn remove(&mut self, server_id: &ServerId) {
        self.map.remove(server_id);
        self.index.update(*server_id, None);
    }

    /// Keeps the servers `keep` is true of.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(ServerId, &Server) -> bool) {
        let gone: Vec<ServerId> = self.map.iter().filter(|(&id, s)| !keep(id, s)).map(|(&id, _)| id).collect();
        for server_id in gone {
            self.remove(&server_id);
        }
    }

    /// The room blocks are placed by.
    pub(super) fn block_rooms(&self) -> &(impl BlockRooms + '_) {
        #[cfg(test)]
        self.check();
        self
    }

    /// The servers segments of `class` are placed on.
    pub(super) fn segment_rooms(&self, class: StorageClass) -> SegmentOrder<'_> {
        #[cfg(test)]
        self.check();
        SegmentOrder { index: &self.index, slot: segment_slot(class) }
    }

    /// Panics unless the index is the one the servers make.
    #[cfg(test)]
    fn check(&self) {
        let mut rebuilt = Index::default();
        for (&server_id, server) in &self.map {
            rebuilt.update(server_id, Some(server));
        }
        assert_eq!(self.index, rebuilt, "the placement index fell out of step with the servers");
    }
}

impl<'a> IntoIterator for &'a Indexed {
    type Item = (&'a ServerId, &'a Server);
    type IntoIter = btree_map::Iter<'a, ServerId, Server>;

    fn into_iter(self) -> Self::IntoIter {
        self.map.iter()
    }
}

impl std::ops::Index<&ServerId> for Indexed {
    type Output = Server;

    fn index(&self, server_id: &ServerId) -> &Server {
        &self.map[server_id]
    }
}

impl BlockRooms for Indexed {
    fn servers(&self) -> u64 {
        self.index.entries.len() as u64
    }

    fn free(&self, tier: Tier) -> (u64, u64) {
        let slot = tier_slot(tier);
        (self.index.free[slot], self.index.being_freed[slot])
    }

    fn best(&self, tier: Tier, host: &str, n: usize) -> Vec<Candidate> {
        let (index, slot) = (&self.index, tier_slot(tier));
        let local = if host.is_empty() { None } else { index.on_host.get(host) };
        let mut best: Vec<Candidate> = local
            .into_iter()
            .flatten()
            .filter(|id| {
                let room = index.entries[id].rooms[slot];
                room.used_blocks < room.capacity_blocks
            })
            .map(|&id| index.candidate(slot, id, false))
            .collect();
        best.sort_unstable();
        best.truncate(n);
        let remote = index.with_room[slot]
            .iter()
            .filter(|(_, id)| local.is_none_or(|local| !local.contains(id)))
            .map(|&(_, id)| index.candidate(slot, id, true));
        best.extend(remote.take(n - best.len()));
        best
    }
}

/// The servers that take segments of one class, in placement order.
pub struct SegmentOrder<'a> {
    index: &'a Index,
    slot: usize,
}

impl SegmentRooms for SegmentOrder<'_> {
    fn servers(&self) -> usize {
        self.index.entries.len()
    }

    fn takes(&self, server_id: ServerId) -> bool {
        self.index.entries.contains_key(&server_id)
    }

    fn least_loaded(&self, n: usize, skip: &[ServerId]) -> Vec<SegmentLoad> {
        self.index.segment_order[self.slot]
            .iter()
            .filter(|load| !skip.contains(&load.server_id))
            .take(n)
            .copied()
            .collect()
    }
}
