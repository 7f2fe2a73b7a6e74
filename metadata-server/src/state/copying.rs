//! Which blocks and shuffle segments need a copy and where it goes (re-replication and drains;
//! the table, the rate limit and why copies go server to server are in `copies`), and settling
//! copies the storage servers report.

use std::collections::HashMap;

use tern_common::Now;
use tern_proto::token::{GrantKind, VOLUME_SERIAL};
use tern_proto::v1::log_record::Change;
use tern_proto::v1::{CopyBlock, CopyDone, CopySegment, LogCounters, LogMoveBlock, LogMoveSegment};
use tern_proto::{FileId, ServerId, Tier};
use tracing::{info, warn};

use super::State;
use crate::copies::{Task, What, Why, Wire};
use crate::namespace::BlockRef;
use crate::path::Place;

impl State {
    /// Chooses copies for blocks that need one, up to the table's bound: a sealed 2-copy file's
    /// block with a copy that cannot be read (its server died, or lost the block) gets it back
    /// from a readable copy; a block on a draining server that no copy elsewhere backs is copied
    /// off it. A target is a server taking placements that holds no copy of the block, with room
    /// in the source's tier (the most room first). Then closed shuffle segments with a copy gone
    /// (`plan_segment_copies`). Runs at each reap after something changed, every 10 s while
    /// copies wait for room, and at every reap while a drain is under way: one pass over the
    /// files and the shuffles' segments.
    pub(super) fn plan_copies(&mut self, now: Now) {
        let draining: Vec<ServerId> = self.servers.draining();
        if !self.copies.take_wake(now.instant) && draining.is_empty() {
            return;
        }
        let servers = &self.servers;
        let dropped =
            self.copies.drop_where(|task| servers.is_placeable(task.source()) && servers.is_placeable(task.target()));
        for task in &dropped {
            self.free_target(task);
        }
        let mut room = self.copies.room();
        if room == 0 {
            return;
        }
        let mut free: HashMap<(ServerId, Tier), u64> = HashMap::new();
        for server in self.servers.rooms() {
            for tier in [Tier::Dram, Tier::Nvme] {
                let r = server.tier(tier);
                free.insert((server.server_id, tier), r.capacity_blocks.saturating_sub(r.used_blocks));
            }
        }
        let block_size = u64::from(self.block_size);
        let mut chosen: Vec<(FileId, u32, BlockRef, BlockRef, ServerId, u32, Why)> = Vec::new();
        let mut unplaceable = 0u64;
        'files: for file in self.namespace.file_metas() {
            if !file.sealed {
                continue;
            }
            let replicas = file.replicas.max(1) as usize;
            let count = file.block_count();
            for (index, copies) in file.copies().enumerate() {
                for (c, &block) in copies.iter().enumerate() {
                    let copy = (index * replicas + c) as u32;
                    if self.copies.is_busy(file.file_id, copy) {
                        continue;
                    }
                    let others = || copies.iter().filter(move |other| **other != block);
                    let (why, source) = if !self.servers.block_readable(&block) {
                        let source =
                            others().find(|o| self.servers.block_readable(o) && self.servers.is_placeable(o.server_id));
                        match source {
                            Some(&source) => (Why::Rereplicate, source),
                            None => continue,
                        }
                    } else if draining.contains(&block.server_id)
                        && self.servers.is_placeable(block.server_id)
                        && !others().any(|o| !draining.contains(&o.server_id) && self.servers.block_readable(o))
                    {
                        (Why::Drain, block)
                    } else {
                        continue;
                    };
                    let tier = source.block_id.tier();
                    let target = free
                        .iter()
                        .filter(|(&(server, t), &left)| {
                            t == tier && left > 0 && !copies.iter().any(|o| o.server_id == server)
                        })
                        .max_by_key(|(&(server, _), &left)| (left, std::cmp::Reverse(server.get())))
                        .map(|(&(server, _), _)| server);
                    let Some(target) = target else {
                        unplaceable += 1;
                        continue;
                    };
                    *free.get_mut(&(target, tier)).expect("chosen from it") -= 1;
                    let length = if index as u64 + 1 == count {
                        file.length.saturating_sub((count - 1) * block_size)
                    } else {
                        block_size
                    };
                    chosen.push((file.file_id, copy, block, source, target, length as u32, why));
                    room -= 1;
                    if room == 0 {
                        break 'files;
                    }
                }
            }
        }
        let (segments, no_room) = self.plan_segment_copies(room);
        unplaceable += no_room;
        if segments > 0 {
            info!("chose {segments} shuffle segment copies to restore second copies or move off draining servers");
        }
        if unplaceable > 0 && unplaceable != self.copies.unplaceable {
            warn!(
                "{unplaceable} blocks or segments need a copy and no server taking placements has room for one; waiting"
            );
        }
        self.copies.unplaceable = unplaceable;
        if unplaceable > 0 {
            // Look again later (or when a server registers): room may come.
            self.copies.retry_later(now.instant);
        }
        if chosen.is_empty() {
            return;
        }
        let (mut rereplicate, mut drain) = (0, 0);
        let mut highest = 0;
        for (file_id, copy, old, source, target, length, why) in chosen {
            let block_id = self.servers.take_block_id(source.block_id.tier());
            highest = highest.max(block_id.index());
            let target = BlockRef { block_id, server_id: target };
            match why {
                Why::Rereplicate => rereplicate += 1,
                Why::Drain => drain += 1,
            }
            let what = What::Block { file_id, copy, old, source, target };
            self.copies.add(Task::new(what, u64::from(length), why));
        }
        // The ids are logged as taken before any copy is handed out: after a restart none of them
        // is named again, so a copy stored but never logged cannot be mistaken for a new block.
        let (next_server_id, _) = self.servers.counters();
        self.commit_own(
            Change::Counters(LogCounters {
                next_file_id: 0,
                next_block_id: highest + 1,
                next_server_id: next_server_id.get(),
                next_shuffle_id: 0,
            }),
            now,
        );
        info!("chose {rereplicate} block copies to restore second copies and {drain} to move off draining servers");
    }

    /// Chooses copies for closed segments of 2-copy shuffles with one copy gone, and for closed
    /// segments on draining servers that nothing else backs, up to `room`: the target is a server
    /// taking segments of the shuffle's class that holds no copy of it and has no free of it
    /// pending, the least loaded first. Returns how many were chosen and how many
    /// found no target. Segment copies take no ids: a segment keeps its id on every server.
    fn plan_segment_copies(&mut self, room: usize) -> (u64, u64) {
        if room == 0 {
            return (0, 0);
        }
        let servers = &self.servers;
        let copies = &self.copies;
        let draining: Vec<ServerId> = servers.draining();
        let needs = self.shuffles.segments_to_copy(
            |server| servers.is_alive(server),
            |server| draining.contains(&server),
            |segment| copies.is_segment_busy(segment),
            room,
        );
        if needs.is_empty() {
            return (0, 0);
        }
        let pending_frees = self.servers.pending_segment_frees();
        let mut loads: HashMap<tern_proto::StorageClass, Vec<crate::planner::SegmentLoad>> = HashMap::new();
        let (mut chosen, mut unplaceable) = (0, 0);
        for need in needs {
            if !self.servers.is_placeable(need.live) {
                continue;
            }
            let loads = loads.entry(need.class).or_insert_with(|| self.servers.segment_loads(need.class));
            let target = loads
                .iter_mut()
                .filter(|l| {
                    !l.full
                        && l.server_id != need.lost
                        && l.server_id != need.live
                        && !pending_frees.contains(&(l.server_id, need.segment))
                })
                .min_by_key(|l| (l.load, l.server_id));
            let Some(target) = target else {
                unplaceable += 1;
                continue;
            };
            target.load += 1;
            let what = What::Segment {
                segment: need.segment,
                old: need.lost,
                source: need.live,
                target: target.server_id,
                class: need.class,
            };
            let why = if need.drain { Why::Drain } else { Why::Rereplicate };
            self.copies.add(Task::new(what, need.bytes, why));
            chosen += 1;
        }
        (chosen, unplaceable)
    }

    /// Frees what a task that will not be logged left on its target.
    fn free_target(&mut self, task: &Task) {
        match task.what {
            What::Block { target, .. } => self.servers.free(&[target]),
            What::Segment { segment, target, .. } => self.servers.free_segment(target, segment),
        }
    }

    /// Settles the copies a storage server reports: a stored copy replaces the old one in its
    /// file or segment chain (logged), unless that changed meanwhile; a failed one frees what it
    /// left on the target and is chosen again at the next reap.
    pub(super) fn take_copies_done(&mut self, server_id: ServerId, done: &[CopyDone], now: Now) {
        for report in done {
            let ok = report.error.is_empty();
            let Some(task) = self.copies.finish(report.copy_id, server_id, ok, report.bytes, now.instant) else {
                continue;
            };
            if !ok {
                let what = match &task.what {
                    What::Block { source, .. } => format!("block {}", source.block_id.get()),
                    What::Segment { segment, .. } => format!(
                        "segment {} of partition {} of shuffle {}",
                        segment.index, segment.partition, segment.shuffle_id
                    ),
                };
                warn!(
                    "copying {what} from storage server {server_id} to {} failed: {}",
                    self.servers.address(task.target()),
                    report.error
                );
                self.free_target(&task);
                continue;
            }
            let change = match task.what {
                What::Block { file_id, copy, old, target, .. } => {
                    let current =
                        self.namespace.file_mut(file_id).ok().and_then(|file| file.blocks.get(copy as usize).copied());
                    if current != Some(old) {
                        // Deleted, or its copy replaced meanwhile: the new copy is not needed.
                        self.free_target(&task);
                        continue;
                    }
                    Change::MoveBlock(LogMoveBlock {
                        file_id: file_id.get(),
                        copy,
                        old_block_id: old.block_id.get(),
                        new_block_id: target.block_id.get(),
                        new_server_id: target.server_id.get(),
                    })
                }
                What::Segment { segment, old, target, .. } => {
                    if !self.shuffles.holds(segment, old) || self.shuffles.holds(segment, target) {
                        // Freed, or its copies changed meanwhile: the new copy is not needed.
                        self.free_target(&task);
                        continue;
                    }
                    Change::MoveSegment(LogMoveSegment {
                        shuffle_id: segment.shuffle_id.get(),
                        partition: segment.partition,
                        index: segment.index,
                        old_server_id: old.get(),
                        new_server_id: target.get(),
                    })
                }
            };
            self.commit_own(change, now);
        }
    }

    /// The copies to hand to `server_id` in its heartbeat reply: blocks, each with the target
    /// block's grant and its file owner's token, and segments, each with its shuffle's grant and
    /// its job's token.
    pub(super) fn hand_out_copies(&mut self, server_id: ServerId, now: Now) -> (Vec<CopyBlock>, Vec<CopySegment>) {
        let (servers, namespace, jobs, key, shuffles) =
            (&self.servers, &self.namespace, &self.jobs, &self.key.0, &self.shuffles);
        // The owner's serial and a fresh token: a job's, or the volume principal's (no token).
        let credentials = |job: Option<&str>| match job.and_then(|job| Some((job, jobs.lease_of(job, now.instant)?))) {
            Some((job, (serial, lease, left))) => {
                let expires = now.unix_ms.saturating_add(left.as_millis() as u64);
                (serial, key.issue(job, serial, expires, lease.as_millis() as u64).encode())
            }
            // A job that is gone: a serial no token carries (the copy fails and is dropped
            // with the file or shuffle).
            None if job.is_some() => (u64::MAX, Vec::new()),
            None => (VOLUME_SERIAL, Vec::new()),
        };
        let wires = self.copies.hand_out(server_id, now.instant, |copy_id, task| match task.what {
            What::Block { file_id, source, target, .. } => {
                let job = namespace.file_path(file_id).ok().and_then(|path| Place::of(&path).job().map(str::to_string));
                let (serial, token) = credentials(job.as_deref());
                Wire::Block(CopyBlock {
                    copy_id,
                    block_id: source.block_id.get(),
                    length: task.bytes as u32,
                    target_address: servers.address(target.server_id),
                    target_block_id: target.block_id.get(),
                    grant: key.grant(GrantKind::Block, target.block_id.get(), serial).to_vec(),
                    token,
                })
            }
            What::Segment { segment, target, class, .. } => {
                // A shuffle is always a job's: an unregistered one's copy fails and is freed.
                let job = shuffles.job_of(segment.shuffle_id).unwrap_or("(unregistered)");
                let (serial, token) = credentials(Some(job));
                Wire::Segment(CopySegment {
                    copy_id,
                    shuffle_id: segment.shuffle_id.get(),
                    partition: segment.partition,
                    index: segment.index,
                    storage_class: class.to_string(),
                    target_address: servers.address(target),
                    grant: key.grant(GrantKind::Shuffle, segment.shuffle_id.get(), serial).to_vec(),
                    token,
                })
            }
        });
        let (mut blocks, mut segments) = (Vec::new(), Vec::new());
        for wire in wires {
            match wire {
                Wire::Block(block) => blocks.push(block),
                Wire::Segment(segment) => segments.push(segment),
            }
        }
        (blocks, segments)
    }
}
