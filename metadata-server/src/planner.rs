//! The placement planner: given a view of the storage servers' room, chooses where new blocks and
//! shuffle segments go. Pure: it changes nothing and does no I/O; the caller turns a plan into a
//! logged change, and the server registry counts the placements when that change is applied (see
//! `servers`). A refusal therefore leaves no trace.
//!
//! Blocks: tier by tier in the storage class's order (DRAM first for `any`, across the whole
//! cluster), on servers with room in that tier, those on the client's host first, then the least
//! used (so a batch spreads across equal servers round-robin); a block's copies go to different
//! servers. Segments: round-robin over the servers ordered by load, full ones last.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::IpAddr;

use tern_common::text;
use tern_proto::{ErrorKind, ServerId, StorageClass, Tier};

use crate::error::{invalid, Refusal};

/// Why nothing can be placed when no server is in the planner's rooms: the dead, the cordoned and
/// the draining are all left out, and the operator needs to know which it is.
pub const NO_SERVER_TAKES_DATA: &str =
    "no live storage server takes new data (dead, cordoned and draining ones take none: see tern admin servers)";

/// A storage class named in a request: "dram", "nvme" or "any" ("" = "any").
pub fn parse_storage_class(name: &str) -> Result<StorageClass, Refusal> {
    name.parse().map_err(|e: tern_proto::tier::BadStorageClass| invalid(e.to_string()))
}

/// The class a new file gets when `asked` for one: with `durable_files`, `any` becomes `nvme`
/// (logged so, so a replay and every later run place its blocks alike).
pub fn file_class(asked: StorageClass, durable_files: bool) -> StorageClass {
    match asked {
        StorageClass::Any if durable_files => StorageClass::Nvme,
        asked => asked,
    }
}

/// One tier of one server, as placement sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierRoom {
    /// Blocks the tier holds (0 for a tier the server does not have).
    pub capacity_blocks: u64,
    /// Blocks in use as far as the metadata server can tell.
    pub used_blocks: u64,
    /// Blocks in use that queued frees give back once the server carries them out.
    pub being_freed_blocks: u64,
}

/// A server new blocks may go to, and its room per tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Room {
    pub server_id: ServerId,
    /// The host of its address, compared with the client's for locality.
    pub host: String,
    pub dram: TierRoom,
    pub nvme: TierRoom,
}

impl Room {
    pub fn tier(&self, tier: Tier) -> &TierRoom {
        match tier {
            Tier::Dram => &self.dram,
            Tier::Nvme => &self.nvme,
        }
    }
}

/// Where one copy of one block goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockPlace {
    pub tier: Tier,
    pub server_id: ServerId,
}

/// A server placement may choose for a block; the smallest is the best.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Candidate {
    /// Not on the client's host.
    pub remote: bool,
    /// Blocks of the tier in use.
    pub used: u64,
    pub server_id: ServerId,
    /// The tier's capacity.
    pub capacity: u64,
}

/// The room blocks are placed by, as the server registry keeps it (in order, so that a
/// placement reads only the servers it may choose: `servers::index`), or as a list of [`Room`]s.
pub trait BlockRooms {
    /// How many servers take new blocks.
    fn servers(&self) -> u64;
    /// Blocks of `tier` free, and in use but being freed, over those servers.
    fn free(&self, tier: Tier) -> (u64, u64);
    /// The servers with room in `tier`, best first: those on `host` (normalized; "" for none),
    /// then the least used, ties by id. At least the first `n` of them; a list gives them all, so
    /// that placement over it is placement as it was before the index, for tests to compare.
    fn best(&self, tier: Tier, host: &str, n: usize) -> Vec<Candidate>;
}

/// The whole-list placement the index must agree with (`servers::tests`).
#[cfg(test)]
impl BlockRooms for [Room] {
    fn servers(&self) -> u64 {
        self.len() as u64
    }

    fn free(&self, tier: Tier) -> (u64, u64) {
        self.iter().map(|room| room.tier(tier)).fold((0, 0), |(free, freeing), room| {
            (free + room.capacity_blocks.saturating_sub(room.used_blocks), freeing + room.being_freed_blocks)
        })
    }

    fn best(&self, tier: Tier, host: &str, _n: usize) -> Vec<Candidate> {
        let mut candidates: Vec<Candidate> = self
            .iter()
            .filter(|room| room.tier(tier).used_blocks < room.tier(tier).capacity_blocks)
            .map(|room| Candidate {
                remote: host.is_empty() || room.host != host,
                used: room.tier(tier).used_blocks,
                server_id: room.server_id,
                capacity: room.tier(tier).capacity_blocks,
            })
            .collect();
        candidates.sort_unstable();
        candidates
    }
}

/// Places `count` new blocks of storage class `class`, `replicas` copies each (each copy on a
/// different server), on the servers in `rooms` (those that take new blocks), preferring
/// `client_host` ("" for none). The plan is grouped by block (block i's copies at
/// `i * replicas ..`). A batch may span tiers when the first fills up. Refused (`Unavailable`)
/// with fewer servers than copies or when the room missing is only being freed, and
/// `OutOfSpace` when the room left is not enough or not on enough different servers.
/// Refuses `replicas` copies of each block with fewer servers taking placements, naming how many
/// there are: at create as at allocation, so a write asking for more copies than there are live
/// servers fails at once instead of after the writer's allocation retries.
pub fn enough_live_for_copies(live: u64, replicas: u32) -> Result<(), Refusal> {
    if live < u64::from(replicas) {
        return Err(Refusal::new(
            ErrorKind::Unavailable,
            format!(
                "{replicas} copies of each block need {replicas} live storage servers, and only {live} is live and \
                 registered"
            ),
        ));
    }
    Ok(())
}

pub fn place_blocks(
    rooms: &(impl BlockRooms + ?Sized),
    count: u32,
    client_host: &str,
    class: StorageClass,
    replicas: u32,
) -> Result<Vec<BlockPlace>, Refusal> {
    let replicas = replicas.max(1);
    let client_host = normalize_host(client_host);
    let live = rooms.servers();
    if live == 0 {
        return Err(Refusal::new(ErrorKind::Unavailable, NO_SERVER_TAKES_DATA));
    }
    enough_live_for_copies(live, replicas)?;
    let tiers = class.tiers();
    let mut free = Vec::with_capacity(tiers.len());
    let mut being_freed: u64 = 0;
    for &tier in tiers {
        let (tier_free, tier_being_freed) = rooms.free(tier);
        being_freed += tier_being_freed;
        free.push((tier, tier_free));
    }
    let free_total: u64 = free.iter().map(|(_, f)| f).sum();
    // Every copy takes a block of room.
    let count64 = u64::from(count) * u64::from(replicas);
    let blocks = text::count(u64::from(count), "block");
    let asked = if replicas == 1 { blocks } else { format!("{blocks} x {replicas} copies") };
    let free_list = || free.iter().map(|(tier, f)| format!("{f} {tier}")).collect::<Vec<_>>().join(" and ");
    if free_total < count64 && free_total + being_freed >= count64 {
        // Space that deletes gave back is still held until the servers' next heartbeats carry
        // the frees out: worth a retry in a moment, unlike a full cluster.
        return Err(Refusal::new(
            ErrorKind::Unavailable,
            format!(
                "{asked} of class {class} asked; {} blocks free and {being_freed} being freed on {}: retry after \
                 their next heartbeat",
                free_list(),
                text::count(live, "live storage server")
            ),
        ));
    }
    if free_total < count64 {
        return Err(Refusal::new(
            ErrorKind::OutOfSpace,
            format!(
                "{asked} of class {class} asked, but {} taking new data have {} blocks free between them",
                text::count(live, "live storage server"),
                free_list()
            ),
        ));
    }
    // One heap of candidates per tier, ordered by (remote, used); a block's later copies skip
    // the servers its earlier copies took. Only the best N = `count x replicas + replicas - 1`
    // servers of each tier can be chosen: a server past them is the heap's smallest only when
    // each of them has been chosen before (so its key grew past the server's, or it filled up)
    // or holds another copy of the same block (at most `replicas - 1` do), which takes at least
    // N - replicas + 1 = `count x replicas` earlier choices, more than the batch makes. So a
    // batch reads the servers it may choose, not every server.
    let reach = (count64 + u64::from(replicas) - 1).try_into().unwrap_or(usize::MAX);
    let mut heaps: Vec<(Tier, BinaryHeap<Reverse<Candidate>>)> = free
        .iter()
        .map(|&(tier, _)| (tier, rooms.best(tier, &client_host, reach).into_iter().map(Reverse).collect()))
        .collect();
    let mut plan = Vec::with_capacity(count64 as usize);
    for block in 0..count {
        let mut taken: Vec<ServerId> = Vec::with_capacity(replicas as usize);
        for copy in 0..replicas {
            let mut placed = None;
            for (tier, candidates) in &mut heaps {
                let mut skipped = Vec::new();
                while let Some(Reverse(candidate)) = candidates.pop() {
                    if taken.contains(&candidate.server_id) {
                        skipped.push(Reverse(candidate));
                    } else {
                        placed = Some((*tier, candidate));
                        break;
                    }
                }
                candidates.extend(skipped);
                if placed.is_some() {
                    break;
                }
            }
            let Some((tier, candidate)) = placed else {
                if replicas == 1 {
                    return Err(Refusal::new(ErrorKind::Internal, "placement ran out of servers despite free space"));
                }
                return Err(Refusal::new(
                    ErrorKind::OutOfSpace,
                    format!(
                        "{asked} of class {class} asked: copy {} of block {block} has no room on a server other than \
                         storage server(s) {:?}, which hold its other copies",
                        copy + 1,
                        taken.iter().map(|id| id.get()).collect::<Vec<_>>()
                    ),
                ));
            };
            plan.push(BlockPlace { tier, server_id: candidate.server_id });
            taken.push(candidate.server_id);
            if candidate.used + 1 < candidate.capacity {
                let heap = &mut heaps.iter_mut().find(|(t, _)| *t == tier).expect("the tier's heap").1;
                heap.push(Reverse(Candidate { used: candidate.used + 1, ..candidate }));
            }
        }
    }
    Ok(plan)
}

/// A server new shuffle segments may go to, and its load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct SegmentLoad {
    /// No tier the shuffle's class may use has room (such servers come last, whatever their load).
    pub full: bool,
    /// Blocks in use plus the segments placed there.
    pub load: u64,
    pub server_id: ServerId,
}

/// The servers holding a segment's copies: the first, and the second when the shuffle keeps two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copies {
    pub first: ServerId,
    pub second: Option<ServerId>,
}

impl Copies {
    /// From the wire's pair, where a second server of 0 means no second copy.
    pub fn from_wire(first: u64, second: u64) -> Copies {
        Copies { first: ServerId::from_wire(first), second: (second != 0).then_some(ServerId::from_wire(second)) }
    }

    /// The second copy's server as the wire carries it (0 = none).
    pub fn second_on_wire(self) -> u64 {
        self.second.map_or(0, ServerId::get)
    }

    /// The servers of the copies.
    pub fn servers(self) -> impl Iterator<Item = ServerId> {
        std::iter::once(self.first).chain(self.second)
    }

    /// Whether one of the copies is on `server_id`.
    pub fn on(self, server_id: ServerId) -> bool {
        self.servers().any(|id| id == server_id)
    }
}

/// The servers segments are placed on, as the server registry keeps them (in order:
/// `servers::index`), or as a list of [`SegmentLoad`]s.
pub trait SegmentRooms {
    /// How many servers take new segments.
    fn servers(&self) -> usize;
    /// Whether `server_id` is one of them.
    fn takes(&self, server_id: ServerId) -> bool;
    /// Them in placement order (full ones last, then the least loaded, ties by id), leaving out
    /// those in `skip`: at least the first `n`; a list gives them all (see [`BlockRooms::best`]).
    fn least_loaded(&self, n: usize, skip: &[ServerId]) -> Vec<SegmentLoad>;
}

/// The whole-list placement the index must agree with (`servers::tests`).
#[cfg(test)]
impl SegmentRooms for [SegmentLoad] {
    fn servers(&self) -> usize {
        self.len()
    }

    fn takes(&self, server_id: ServerId) -> bool {
        self.iter().any(|load| load.server_id == server_id)
    }

    fn least_loaded(&self, _n: usize, skip: &[ServerId]) -> Vec<SegmentLoad> {
        let mut loads: Vec<SegmentLoad> = self.iter().copied().filter(|load| !skip.contains(&load.server_id)).collect();
        loads.sort_unstable();
        loads
    }
}

/// Chooses servers for `count` new segments of `replicas` copies (1 or 2): round-robin over the
/// servers in `loads` (those that take new segments) ordered by load, so the least loaded take
/// one more when `count` does not divide evenly; a second copy goes to the next server in the
/// same order, so never beside its first. The servers in `avoid` (those of a full or failed
/// segment) are skipped while enough others remain. Refused (`Unavailable`) with fewer servers
/// than copies. Which tier a segment's bytes live in is its server's business (DRAM first, moved
/// to NVMe as the shuffle's class allows); `loads` says which servers have room for it.
pub fn place_segments(
    loads: &(impl SegmentRooms + ?Sized),
    count: usize,
    avoid: &[ServerId],
    replicas: u32,
) -> Result<Vec<Copies>, Refusal> {
    let replicas = replicas.clamp(1, tern_proto::MAX_REPLICAS) as usize;
    let mut avoided: Vec<ServerId> = avoid.iter().copied().filter(|&id| loads.takes(id)).collect();
    avoided.sort_unstable();
    avoided.dedup();
    if loads.servers() - avoided.len() < replicas {
        avoided.clear();
    }
    let n = loads.servers() - avoided.len();
    if n == 0 {
        return Err(Refusal::new(ErrorKind::Unavailable, NO_SERVER_TAKES_DATA));
    }
    if n < replicas {
        return Err(Refusal::new(
            ErrorKind::Unavailable,
            format!("{replicas} copies of each segment need {replicas} live storage servers, and only {n} is live"),
        ));
    }
    // Fewer segments than servers reach only the first `count + 1`: a shuffle's registration
    // reads the servers it places on, not every server.
    let live = loads.least_loaded(n.min(count.saturating_add(replicas)), &avoided);
    Ok((0..count)
        .map(|i| Copies { first: live[i % n].server_id, second: (replicas > 1).then(|| live[(i + 1) % n].server_id) })
        .collect())
}

/// One spelling per host, so that "[::1]" and "::1", or "HOST" and "host", compare equal.
fn normalize_host(host: &str) -> String {
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    match bare.parse::<IpAddr>() {
        Ok(ip) => ip.to_string(),
        Err(_) => bare.to_ascii_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room(server_id: u64, host: &str, dram: u64, nvme: u64) -> Room {
        let tier = |capacity_blocks| TierRoom { capacity_blocks, ..TierRoom::default() };
        Room { server_id: ServerId::from_wire(server_id), host: host.into(), dram: tier(dram), nvme: tier(nvme) }
    }

    #[test]
    fn hosts_have_one_spelling() {
        assert_eq!(normalize_host("[::1]"), "::1");
        assert_eq!(normalize_host("HOST"), "host");
    }

    #[test]
    fn places_on_the_client_host_first_then_by_use_without_changing_anything() {
        let rooms = [room(1, "a", 2, 0), room(2, "b", 2, 0)];
        let plan = place_blocks(&rooms[..], 3, "b", StorageClass::Any, 1).unwrap();
        let servers: Vec<u64> = plan.iter().map(|p| p.server_id.get()).collect();
        assert_eq!(servers, [2, 2, 1]);
        // The view is not changed: the same question gets the same answer.
        assert_eq!(place_blocks(&rooms[..], 3, "b", StorageClass::Any, 1).unwrap(), plan);
    }

    #[test]
    fn nvme_only_when_dram_is_full_for_any() {
        let rooms = [room(1, "a", 1, 3)];
        let plan = place_blocks(&rooms[..], 3, "", StorageClass::Any, 1).unwrap();
        assert_eq!(plan.iter().map(|p| p.tier).collect::<Vec<_>>(), [Tier::Dram, Tier::Nvme, Tier::Nvme]);
        let refusal = place_blocks(&rooms[..], 2, "", StorageClass::Dram, 1).unwrap_err();
        assert_eq!(refusal.kind, ErrorKind::OutOfSpace);
    }

    #[test]
    fn segments_skip_full_servers_and_avoided_ones() {
        let load = |full, load, id| SegmentLoad { full, load, server_id: ServerId::from_wire(id) };
        let loads = [load(true, 0, 1), load(false, 5, 2), load(false, 1, 3)];
        let firsts = |plan: Vec<Copies>| plan.iter().map(|c| c.first.get()).collect::<Vec<_>>();
        assert_eq!(firsts(place_segments(&loads[..], 4, &[], 1).unwrap()), [3, 2, 1, 3]);
        assert_eq!(firsts(place_segments(&loads[..], 1, &[ServerId::from_wire(3)], 1).unwrap()), [2]);
        let pair = place_segments(&loads[..], 1, &[], 2).unwrap()[0];
        assert_eq!(pair, Copies::from_wire(3, 2));
        assert!(pair.on(ServerId::from_wire(2)) && !pair.on(ServerId::from_wire(1)));
    }
}
