//! The one place the state changes: [`State::apply`] carries out a change as the log records it,
//! for a live call (through [`State::commit`], which also journals it for the write-ahead log)
//! and for a replay alike (see `durable`).
//!
//! A live method prepares: it checks its request and chooses what the change needs (file,
//! block, shuffle and server ids, placements, a generated job name) without changing anything,
//! then commits the change it built. The checks here are those that keep a change from corrupting
//! the state (the file exists, the path is free, a seal's length fits its blocks); the rules a
//! live call is held to at its time (leases, quotas, room, bounds) are the live method's, and a
//! replay skips them: they passed when the change was made. Time-bound state is not replayed:
//! jobs come back with fresh leases counted from `now`, storage servers come back restored,
//! awaiting their registration and inventory.

use tern_common::Now;
use tern_proto::v1::log_record::Change;
use tern_proto::v1::{LogRecord, ServerMode};
use tern_proto::{BlockId, FileId, ServerId, ShuffleId};

use super::State;
use crate::error::{invalid, Refusal};
use crate::jobs::Quota;
use crate::namespace::{BlockRef, Removed};
use crate::path::{self, Place, JOBS_DIR};
use crate::planner::{parse_storage_class, Copies};
use crate::shuffles::{SegmentChanges, SegmentCopy};

/// What applying a change released, for the live call's reply and log line.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub files_deleted: u64,
    pub blocks_freed: u64,
    pub shuffles_freed: usize,
}

impl State {
    /// Applies a change a live call prepared and journals it for the log; on a refusal nothing
    /// changed and nothing is journaled.
    pub(super) fn commit(&mut self, change: Change, now: Now) -> Result<Applied, Refusal> {
        // The change is made at the call's time; the record carries it, so a replay uses the
        // same creation times whenever it runs.
        let unix_ms = now.unix_ms;
        let applied = self.apply(&change, unix_ms, now)?;
        self.journal.push(LogRecord { unix_ms, change: Some(change) });
        Ok(applied)
    }

    /// Carries out one change, made at `unix_ms` (creation times: the record's time, not the
    /// clock) and applied at `now` (leases start, deadlines are counted down from it).
    /// Checks come before the first mutation, so a refusal changes nothing.
    pub fn apply(&mut self, change: &Change, unix_ms: u64, now: Now) -> Result<Applied, Refusal> {
        let mut applied = Applied::default();
        match change {
            Change::Mkdir(req) => self.namespace.mkdir(&req.path, req.parents, &req.owner, unix_ms)?,
            Change::Create(log) => {
                let req = log.request.as_ref().ok_or_else(|| invalid("a logged create without its request"))?;
                let class = parse_storage_class(&req.storage_class)?;
                let file_id = FileId::from_wire(log.file_id);
                self.namespace.create_file_as(file_id, &req.path, req.parents, class, &req.owner, unix_ms)?;
                let file = self.namespace.file_mut(file_id)?;
                file.sealed = req.sealed;
                file.replicas = req.replicas.max(1);
                if !req.sealed {
                    self.writers.insert(file_id, now.instant);
                }
                if let Some(job) = Place::of(&req.path).job() {
                    self.jobs.add_usage(job, 1, 0);
                }
            }
            Change::Allocate(log) => {
                if log.block_ids.len() != log.server_ids.len() {
                    return Err(invalid("a logged allocation with unpaired block and server ids"));
                }
                let blocks: Vec<BlockRef> = log
                    .block_ids
                    .iter()
                    .zip(&log.server_ids)
                    .map(|(&block_id, &server_id)| BlockRef {
                        block_id: BlockId::from_wire(block_id),
                        server_id: ServerId::from_wire(server_id),
                    })
                    .collect();
                let file_id = FileId::from_wire(log.file_id);
                let path = self.namespace.file_path(file_id)?;
                self.namespace.file_mut(file_id)?.blocks.extend(blocks.iter().copied());
                // Allocating is the writer at work: its lease starts again.
                self.writers.insert(file_id, now.instant);
                self.servers.count_placed(&blocks);
                if let Some(job) = Place::of(&path).job() {
                    self.jobs.count_blocks(job, blocks.iter().map(|b| b.block_id), 1);
                }
            }
            Change::Seal(req) => {
                let file_id = FileId::from_wire(req.file_id);
                let path = self.namespace.file_path(file_id)?;
                let block_size = self.block_size;
                let file = self.namespace.file_mut(file_id)?;
                if file.sealed {
                    return Err(invalid("the file is already sealed"));
                }
                let needed = req.length.div_ceil(u64::from(block_size));
                let allocated = file.block_count();
                if allocated < needed {
                    return Err(invalid(format!(
                        "length {} needs {needed} blocks of {block_size} bytes, but only {allocated} are allocated",
                        req.length
                    )));
                }
                // Writers allocate ahead; what they did not fill goes back to the servers.
                let unused = file.blocks.split_off(needed as usize * file.replicas.max(1) as usize);
                file.sealed = true;
                file.length = req.length;
                self.writers.remove(&file_id);
                self.servers.free(&unused);
                if let Some(job) = Place::of(&path).job() {
                    self.jobs.add_usage(job, 0, i64::try_from(req.length).unwrap_or(i64::MAX));
                    self.jobs.count_blocks(job, unused.iter().map(|b| b.block_id), -1);
                }
            }
            Change::Delete(req) => {
                let removed = self.namespace.remove(&req.path, req.recursive)?;
                if let Some(job) = Place::of(&req.path).job() {
                    self.jobs.add_usage(job, -(removed.files as i64), -(removed.sealed_bytes as i64));
                    self.jobs.count_blocks(job, removed.blocks.iter().map(|b| b.block_id), -1);
                }
                applied = self.release(removed);
            }
            Change::Rename(req) => self.namespace.rename(&req.from, &req.to)?,
            Change::RegisterJob(req) => {
                self.namespace.mkdir(JOBS_DIR, true, "", unix_ms)?;
                // Present already when a snapshot listed the job's directory first.
                self.namespace.mkdir(&path::job_root(&req.name), true, "", unix_ms)?;
                // Logs from before serials (0) get a new one: their tokens no longer verify. The
                // live call checked the tenant's quota; a replay does not (it may have been
                // lowered since).
                self.jobs.register(&req.name, req.lease_ms, &req.tenant, req.serial, Quota::Skip, now.instant)?;
            }
            // Ending a job that is gone already (a replayed end of a lapsed job) changes nothing.
            Change::EndJob(req) if !self.jobs.is_registered(&req.job_id) => {}
            Change::EndJob(req) => {
                let _ = self.jobs.remove(&req.job_id);
                // The directory exists while the job is registered; tolerate its absence all the same.
                let removed = self.namespace.remove(&path::job_root(&req.job_id), true).unwrap_or_default();
                applied = self.release(removed);
                let shuffles = self.shuffles.end_job(&req.job_id);
                applied.shuffles_freed = shuffles.freed.len();
                self.on_servers(shuffles);
            }
            Change::RegisterShuffle(log) => {
                let placed = self.shuffles.register(log)?;
                self.on_servers(placed);
            }
            Change::AddSegment(log) => {
                let copies = Copies::from_wire(log.server_id, log.replica_server_id);
                let placed = self.shuffles.push_segment(ShuffleId::from_wire(log.shuffle_id), log.partition, copies)?;
                self.on_servers(placed);
            }
            Change::CommitMap(req) => {
                self.shuffles.commit(req)?;
            }
            Change::InvalidateMaps(req) => {
                self.shuffles.invalidate(req)?;
            }
            Change::UnregisterShuffle(req) => {
                let freed = self.shuffles.unregister(ShuffleId::from_wire(req.shuffle_id))?;
                self.on_servers(freed);
            }
            Change::Server(log) => {
                let server_id = ServerId::from_wire(log.server_id);
                self.servers.record(server_id, &log.address, &log.quic_address, log.instance_id, now.instant)
            }
            Change::LostSegments(log) => self.shuffles.mark_lost(log),
            Change::ServerMode(log) => {
                let mode =
                    ServerMode::try_from(log.mode).map_err(|_| invalid(format!("unknown server mode {}", log.mode)))?;
                // The deadline is wall-clock in the log; a replay after it counts it as passed.
                let left = log.drain_deadline_unix_ms.saturating_sub(now.unix_ms);
                let deadline = now.instant.checked_add(std::time::Duration::from_millis(left)).unwrap_or(now.instant);
                self.servers.set_mode(ServerId::from_wire(log.server_id), mode, Some(deadline));
            }
            Change::MoveBlock(log) => {
                let file = self.namespace.file_mut(FileId::from_wire(log.file_id))?;
                let slot = file
                    .blocks
                    .get_mut(log.copy as usize)
                    .ok_or_else(|| invalid(format!("a moved block's copy {} is beyond the file's blocks", log.copy)))?;
                if slot.block_id.get() != log.old_block_id {
                    return Err(invalid(format!(
                        "a moved block's copy {} is block {}, not {}",
                        log.copy,
                        slot.block_id.get(),
                        log.old_block_id
                    )));
                }
                let new = BlockRef {
                    block_id: BlockId::from_wire(log.new_block_id),
                    server_id: ServerId::from_wire(log.new_server_id),
                };
                let old = std::mem::replace(slot, new);
                self.servers.count_placed(&[new]);
                // On a live (draining) server it is freed there; a dead server's is gone already.
                self.servers.free(&[old]);
            }
            Change::MoveSegment(log) => {
                self.shuffles.move_segment(log)?;
                let (old, new) = (ServerId::from_wire(log.old_server_id), ServerId::from_wire(log.new_server_id));
                self.servers.move_segment(old, new);
                // On a live server (healed, or draining) the old copy is dropped; a dead one's is
                // gone, and a server coming back frees it when it reconciles.
                let segment = SegmentCopy {
                    shuffle_id: ShuffleId::from_wire(log.shuffle_id),
                    partition: log.partition,
                    index: log.index,
                };
                self.servers.free_segment(old, segment);
            }
            Change::Counters(log) => {
                self.namespace.raise_next_file_id(FileId::from_wire(log.next_file_id));
                self.servers.raise_counters(ServerId::from_wire(log.next_server_id), log.next_block_id);
                self.shuffles.raise_next_shuffle_id(ShuffleId::from_wire(log.next_shuffle_id));
            }
            Change::TokenKey(log) => self.apply_key(log)?,
            Change::RequestDone(log) => self.requests.insert(log, unix_ms),
        }
        Ok(applied)
    }

    /// Queues the blocks of removed files for freeing.
    fn release(&mut self, removed: Removed) -> Applied {
        self.servers.free(&removed.blocks);
        Applied { files_deleted: removed.files, blocks_freed: removed.blocks.len() as u64, shuffles_freed: 0 }
    }

    /// Carries out on the storage-server registry what a shuffle change asks of it.
    fn on_servers(&mut self, changes: SegmentChanges) {
        self.servers.add_segments(&changes.placed);
        for freed in changes.freed {
            self.servers.free_shuffle(freed.shuffle_id, &freed.holders);
        }
    }
}
