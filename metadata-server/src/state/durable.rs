//! The state as log records: replaying them ([`State::apply`]) and writing the state out as the
//! records that rebuild it ([`State::snapshot`]).
//!
//! Each live method records what it changed, with whatever it chose (file and shuffle ids,
//! placements, a generated job name), so a replay makes the same changes without choosing
//! anything. A replay skips the checks the live call made (they passed then) and time-bound rules:
//! jobs come back with fresh leases, counted from the restart; storage servers come back
//! restored, awaiting their registration and inventory.

use std::time::Instant;

use tern_proto::v1::log_record::Change;
use tern_proto::v1::*;

use super::State;
use crate::error::{invalid, Refusal};
use crate::jobs::Quota;
use crate::namespace::BlockRef;
use crate::path::{self, Place, JOBS_DIR};
use crate::placement::parse_storage_class;

impl State {
    /// Replays one logged change.
    pub fn apply(&mut self, record: &LogRecord, now: Instant) -> Result<(), Refusal> {
        let ms = record.unix_ms;
        let Some(change) = &record.change else {
            return Err(invalid("a log record without a change"));
        };
        match change {
            Change::Mkdir(req) => self.namespace.mkdir(&req.path, req.parents, ms)?,
            Change::Create(log) => {
                let req = log.request.clone().unwrap_or_default();
                let class = parse_storage_class(&req.storage_class)?;
                self.namespace.create_file_as(log.file_id, &req.path, req.parents, class, ms)?;
                let file = self.namespace.file_mut(log.file_id)?;
                file.sealed = req.sealed;
                file.replicas = req.replicas.max(1);
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
                    .map(|(&block_id, &server_id)| BlockRef { block_id, server_id })
                    .collect();
                self.namespace.file_mut(log.file_id)?.blocks.extend(blocks.iter().copied());
                self.servers.restore_blocks(&blocks);
                let path = self.namespace.file_path(log.file_id)?;
                if let Some(job) = Place::of(&path).job() {
                    self.jobs.count_blocks(job, log.block_ids.iter().copied(), 1);
                }
            }
            Change::Seal(req) => {
                let path = self.namespace.file_path(req.file_id)?;
                let block_size = u64::from(self.block_size);
                let file = self.namespace.file_mut(req.file_id)?;
                let needed = req.length.div_ceil(block_size) as usize * file.replicas.max(1) as usize;
                let unused = file.blocks.split_off(needed.min(file.blocks.len()));
                file.sealed = true;
                file.length = req.length;
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
                self.release(removed);
            }
            Change::Rename(req) => self.namespace.rename(&req.from, &req.to)?,
            Change::RegisterJob(req) => {
                // Logs from before serials (0) get a new one: their tokens no longer verify.
                self.jobs.register(&req.name, req.lease_ms, &req.tenant, req.serial, Quota::Skip, now)?;
                self.namespace.mkdir(JOBS_DIR, true, ms)?;
                // Present already when a snapshot listed the job's directory first.
                self.namespace.mkdir(&path::job_root(&req.name), true, ms)?;
            }
            Change::EndJob(req) => {
                if self.jobs.is_registered(&req.job_id) {
                    self.end(&req.job_id, "ended (replayed)");
                }
            }
            Change::RegisterShuffle(log) => self.shuffles.restore(log, &mut self.servers)?,
            Change::AddSegment(log) => self.shuffles.push_segment(
                log.shuffle_id,
                log.partition,
                (log.server_id, log.replica_server_id),
                &mut self.servers,
            )?,
            Change::CommitMap(req) => {
                self.shuffles.commit(req.clone())?;
            }
            Change::InvalidateMaps(req) => {
                self.shuffles.invalidate(req)?;
            }
            Change::UnregisterShuffle(req) => self.shuffles.unregister(req.shuffle_id, &mut self.servers)?,
            Change::Server(log) => {
                self.servers.restore(log.server_id, &log.address, &log.quic_address, log.instance_id, now)
            }
            Change::LostSegments(log) => self.shuffles.restore_lost(log),
            Change::Counters(log) => {
                self.namespace.raise_next_file_id(log.next_file_id);
                self.servers.raise_counters(log.next_server_id, log.next_block_id);
                self.shuffles.raise_next_shuffle_id(log.next_shuffle_id);
            }
        }
        Ok(())
    }

    /// Replays `records` into this (fresh) state, naming the first that does not apply.
    pub fn restore(&mut self, records: &[LogRecord], now: Instant) -> anyhow::Result<()> {
        for (index, record) in records.iter().enumerate() {
            if let Err(refusal) = self.apply(record, now) {
                anyhow::bail!(
                    "metadata log record {index} ({:?}) does not apply: {} ({:?})",
                    record.change,
                    refusal.reason,
                    refusal.kind
                );
            }
        }
        // Replays record again what they replay; none of it is new.
        self.journal.clear();
        Ok(())
    }

    /// The records that rebuild this state: counters, servers, jobs, the namespace (parents
    /// first), then the shuffles.
    pub fn snapshot(&self) -> Vec<LogRecord> {
        let mut changes = Vec::new();
        let (next_server_id, next_block_id) = self.servers.counters();
        changes.push(Change::Counters(LogCounters {
            next_file_id: self.namespace.next_file_id(),
            next_block_id,
            next_server_id,
            next_shuffle_id: self.shuffles.next_shuffle_id(),
        }));
        for (server_id, address, quic_address, instance_id) in self.servers.identities() {
            changes.push(Change::Server(LogServer { server_id, address, quic_address, instance_id }));
        }
        let mut records: Vec<LogRecord> =
            changes.drain(..).map(|change| LogRecord { unix_ms: 0, change: Some(change) }).collect();
        // Directories first (with their creation times), then the jobs (whose directories exist
        // by then), then the files, which count in their jobs' usage.
        let entries = self.namespace.walk();
        for (path, unix_ms, _) in entries.iter().filter(|(_, _, file)| file.is_none()) {
            let change = Change::Mkdir(MkdirRequest { path: path.clone(), parents: true });
            records.push(LogRecord { unix_ms: *unix_ms, change: Some(change) });
        }
        for (name, lease_ms, tenant, serial) in self.jobs.registrations() {
            let change = Change::RegisterJob(RegisterJobRequest { name, lease_ms, tenant, serial });
            records.push(LogRecord { unix_ms: 0, change: Some(change) });
        }
        for (path, unix_ms, file) in entries {
            let Some(file) = file else {
                continue;
            };
            let request = CreateRequest {
                path,
                parents: false,
                sealed: false,
                storage_class: file.storage_class.to_string(),
                replicas: file.replicas,
            };
            let change = Change::Create(LogCreate { request: Some(request), file_id: file.file_id });
            records.push(LogRecord { unix_ms, change: Some(change) });
            if !file.blocks.is_empty() {
                let change = Change::Allocate(LogAllocate {
                    file_id: file.file_id,
                    block_ids: file.blocks.iter().map(|b| b.block_id).collect(),
                    server_ids: file.blocks.iter().map(|b| b.server_id).collect(),
                });
                records.push(LogRecord { unix_ms, change: Some(change) });
            }
            if file.sealed {
                let change = Change::Seal(SealRequest { file_id: file.file_id, length: file.length });
                records.push(LogRecord { unix_ms, change: Some(change) });
            }
        }
        self.shuffles.snapshot(&mut changes);
        records.extend(changes.into_iter().map(|change| LogRecord { unix_ms: 0, change: Some(change) }));
        records
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{add_server, state, BLOCK};
    use super::*;

    /// The changes a mix of every kind of call made, replayed into a fresh state, rebuild it:
    /// the same snapshot, the same answers.
    #[test]
    fn replaying_the_journal_or_the_snapshot_rebuilds_the_state() {
        let (mut state, now) = state();
        add_server(&mut state, "10.0.0.1:7000", 64, now);
        add_server(&mut state, "10.0.0.2:7000", 64, now);
        let job = state
            .register_job(RegisterJobRequest { name: "j".into(), lease_ms: 0, ..Default::default() }, now)
            .unwrap();
        let root = job.root.clone();
        state.mkdir(MkdirRequest { path: format!("{root}/a/b"), parents: true }, now).unwrap();
        state.mkdir(MkdirRequest { path: "/vol".into(), parents: false }, now).unwrap();
        let mut files = Vec::new();
        for (i, length) in [0, 10, BLOCK * 3 + 1].into_iter().enumerate() {
            let path = format!("{root}/a/b/f{i}");
            let created = state.create(CreateRequest { path, ..Default::default() }, now).unwrap();
            if length > 0 {
                let ask = AllocateBlocksRequest { file_id: created.file_id, count: 5, client_host: String::new() };
                state.allocate_blocks(ask, now).unwrap();
                state.seal(SealRequest { file_id: created.file_id, length }, now).unwrap();
            }
            files.push(created.file_id);
        }
        let open = state.create(CreateRequest { path: "/vol/open".into(), ..Default::default() }, now).unwrap();
        let ask = AllocateBlocksRequest { file_id: open.file_id, count: 2, client_host: String::new() };
        state.allocate_blocks(ask, now).unwrap();
        state.rename(RenameRequest { from: format!("{root}/a/b/f0"), to: format!("{root}/a/g") }, now).unwrap();
        state.delete(DeleteRequest { path: format!("{root}/a/b/f1"), recursive: false }, now).unwrap();
        let ask = RegisterShuffleRequest { job_id: "j".into(), partitions: 3, ..Default::default() };
        let shuffle = state.register_shuffle(ask, now).unwrap().shuffle_id;
        state
            .advance_segment(AdvanceSegmentRequest { shuffle_id: shuffle, partition: 1, full_segment: 0 }, now)
            .unwrap();
        for map_index in 0..3 {
            let commit = CommitMapRequest {
                shuffle_id: shuffle,
                map_index,
                attempt: 1,
                partition_bytes: vec![1, 2, 3],
                first_segment: vec![0, 0, 0],
                last_segment: vec![0, 1, 0],
            };
            state.commit_map(commit, now).unwrap();
        }
        state.invalidate_maps(InvalidateMapsRequest { shuffle_id: shuffle, map_indexes: vec![2] }, now).unwrap();
        let other = state
            .register_job(RegisterJobRequest { name: String::new(), lease_ms: 0, ..Default::default() }, now)
            .unwrap();
        let ask = RegisterShuffleRequest { job_id: other.job_id.clone(), partitions: 1, ..Default::default() };
        state.register_shuffle(ask, now).unwrap();
        state
            .create(CreateRequest { path: format!("{}/x", other.root), sealed: true, ..Default::default() }, now)
            .unwrap();
        state.end_job(EndJobRequest { job_id: other.job_id, ..Default::default() }, now).unwrap();

        let journal = state.take_journal();
        let expected = state.snapshot();
        let mut replayed = State::new(&super::super::tests::config());
        replayed.restore(&journal, now).unwrap();
        // The counters come first; a later start may only raise the shuffle id's (it starts from
        // the clock).
        let same = |rebuilt: &State| {
            let snapshot = rebuilt.snapshot();
            assert_eq!(snapshot[1..], expected[1..]);
            let counters = |records: &[LogRecord]| match &records[0].change {
                Some(Change::Counters(c)) => *c,
                other => panic!("{other:?}"),
            };
            let (now, then) = (counters(&snapshot), counters(&expected));
            assert_eq!(
                (now.next_file_id, now.next_block_id, now.next_server_id),
                (then.next_file_id, then.next_block_id, then.next_server_id)
            );
            assert!(now.next_shuffle_id >= then.next_shuffle_id);
        };
        same(&replayed);
        let mut from_snapshot = State::new(&super::super::tests::config());
        from_snapshot.restore(&expected, now).unwrap();
        same(&from_snapshot);

        // The rebuilt state answers as the original does, tenants' use included.
        let tenants = state.status(StatusRequest {}, now).unwrap().tenants;
        assert_eq!(tenants[0].dram_bytes, 4 * BLOCK);
        for rebuilt in [&mut replayed, &mut from_snapshot] {
            assert_eq!(rebuilt.status(StatusRequest {}, now).unwrap().tenants, tenants);
            let opened = rebuilt.open(OpenRequest { path: format!("{root}/a/b/f2") }, now).unwrap();
            assert_eq!((opened.blocks.len(), opened.info.unwrap().length), (4, BLOCK * 3 + 1));
            let located =
                LocateShuffleRequest { shuffle_id: shuffle, end_partition: 9, end_map: 9, ..Default::default() };
            let located = rebuilt.locate_shuffle(located, now).unwrap();
            assert_eq!((located.segments.len(), located.outputs.len()), (4, 2));
            // The file being written can still be sealed by its writer.
            rebuilt.seal(SealRequest { file_id: open.file_id, length: 5 }, now).unwrap();
            // New ids never repeat old ones.
            let again = rebuilt.create(CreateRequest { path: "/vol/new".into(), ..Default::default() }, now).unwrap();
            assert!(again.file_id > open.file_id);
        }
    }
}
