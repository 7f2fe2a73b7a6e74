//! Which blocks need a copy and where it goes (re-replication and drains; the table, the rate
//! limit and why copies go server to server are in `copies`), and settling copies the storage
//! servers report.

use std::collections::HashMap;
use std::time::Instant;

use tern_proto::token::{GrantKind, VOLUME_SERIAL};
use tern_proto::v1::log_record::Change;
use tern_proto::v1::{CopyBlock, CopyDone, LogCounters, LogMoveBlock};
use tern_proto::{ServerId, Tier};
use tracing::{info, warn};

use super::State;
use crate::copies::{Task, Why};
use crate::namespace::BlockRef;
use crate::path::Place;

impl State {
    /// Chooses copies for blocks that need one, up to the table's bound: a sealed 2-copy file's
    /// block with a copy that cannot be read (its server died, or lost the block) gets it back
    /// from a readable copy; a block on a draining server that no copy elsewhere backs is copied
    /// off it. A target is a server taking placements that holds no copy of the block, with room
    /// in the source's tier (the most room first). Runs at each reap after something changed,
    /// every 10 s while blocks wait for room, and at every reap while a drain is under way: one
    /// pass over the files.
    pub(super) fn plan_copies(&mut self, now: Instant) {
        let draining: Vec<ServerId> = self.servers.drains().iter().map(|d| d.server_id).collect();
        if !self.copies.take_wake(now) && draining.is_empty() {
            return;
        }
        let servers = &self.servers;
        let dropped = self.copies.drop_where(|task| {
            servers.is_placeable(task.source.server_id) && servers.is_placeable(task.target.server_id)
        });
        for task in &dropped {
            self.servers.free(&[task.target]);
        }
        let mut room = self.copies.room();
        if room == 0 {
            return;
        }
        let mut free: HashMap<(ServerId, Tier), u64> = HashMap::new();
        for server in self.servers.rooms() {
            for tier in [Tier::Dram, Tier::Nvme] {
                let r = match tier {
                    Tier::Dram => &server.dram,
                    Tier::Nvme => &server.nvme,
                };
                free.insert((server.server_id, tier), r.capacity_blocks.saturating_sub(r.used_blocks));
            }
        }
        let block_size = u64::from(self.block_size);
        let mut chosen: Vec<(u64, u32, BlockRef, BlockRef, ServerId, u32, Why)> = Vec::new();
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
        if unplaceable > 0 && unplaceable != self.copies.unplaceable {
            warn!("{unplaceable} blocks need a copy and no server taking placements has room for one; waiting");
        }
        self.copies.unplaceable = unplaceable;
        if unplaceable > 0 {
            // Look again later (or when a server registers): room may come.
            self.copies.retry_later(now);
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
            self.copies.add(Task::new(file_id, copy, old, source, target, length, why));
        }
        // The ids are logged as taken before any copy is handed out: after a restart none of them
        // is named again, so a copy stored but never logged cannot be mistaken for a new block.
        let (next_server_id, _) = self.servers.counters();
        self.commit_own(
            Change::Counters(LogCounters {
                next_file_id: 0,
                next_block_id: highest + 1,
                next_server_id,
                next_shuffle_id: 0,
            }),
            now,
        );
        info!("chose {rereplicate} block copies to restore second copies and {drain} to move off draining servers");
    }

    /// Settles the copies a storage server reports: a stored copy replaces the old one in its
    /// file (logged), unless the file changed meanwhile; a failed one frees what it left on the
    /// target and is chosen again at the next reap.
    pub(super) fn take_copies_done(&mut self, server_id: ServerId, done: &[CopyDone], now: Instant) {
        for report in done {
            let ok = report.error.is_empty();
            let Some(task) = self.copies.finish(report.copy_id, server_id, ok, now) else {
                continue;
            };
            if !ok {
                warn!(
                    "copying block {} from storage server {server_id} to {} failed: {}",
                    task.source.block_id.get(),
                    self.servers.address(task.target.server_id),
                    report.error
                );
                self.servers.free(&[task.target]);
                continue;
            }
            let current = self
                .namespace
                .file_mut(task.file_id)
                .ok()
                .and_then(|file| file.blocks.get(task.copy as usize).copied());
            if current != Some(task.old) {
                // Deleted, or its copy replaced meanwhile: the new copy is not needed.
                self.servers.free(&[task.target]);
                continue;
            }
            let change = Change::MoveBlock(LogMoveBlock {
                file_id: task.file_id,
                copy: task.copy,
                old_block_id: task.old.block_id.get(),
                new_block_id: task.target.block_id.get(),
                new_server_id: task.target.server_id.get(),
            });
            self.commit_own(change, now);
        }
    }

    /// The copies to hand to `server_id` in its heartbeat reply, each with the target block's
    /// grant and its file owner's token.
    pub(super) fn hand_out_copies(&mut self, server_id: ServerId, now: Instant) -> Vec<CopyBlock> {
        let (servers, namespace, jobs, key) = (&self.servers, &self.namespace, &self.jobs, &self.key);
        self.copies.hand_out(server_id, now, |copy_id, task| {
            let job =
                namespace.file_path(task.file_id).ok().and_then(|path| Place::of(&path).job().map(str::to_string));
            let (serial, token) = match job.as_deref().and_then(|job| Some((job, jobs.lease_of(job, now)?))) {
                Some((job, (serial, lease, left))) => {
                    let expires = tern_common::unix_ms().saturating_add(left.as_millis() as u64);
                    (serial, key.issue(job, serial, expires, lease.as_millis() as u64).encode())
                }
                // A job that is gone: a serial no token carries (the copy fails and is dropped
                // with the file).
                None if job.is_some() => (u64::MAX, Vec::new()),
                None => (VOLUME_SERIAL, Vec::new()),
            };
            CopyBlock {
                copy_id,
                block_id: task.source.block_id.get(),
                length: task.length,
                target_address: servers.address(task.target.server_id),
                target_block_id: task.target.block_id.get(),
                grant: key.grant(GrantKind::Block, task.target.block_id.get(), serial).to_vec(),
                token,
            }
        })
    }
}
