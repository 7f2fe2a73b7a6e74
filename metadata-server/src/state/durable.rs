//! The state as log records: replaying them ([`State::restore`], each record through the one
//! [`State::apply`] live calls commit through, see `commit`) and writing the state out as the
//! records that rebuild it ([`State::snapshot`]).
//!
//! Each live method records what it changed, with whatever it chose (file and shuffle ids,
//! placements, a generated job name), so a replay makes the same changes without choosing
//! anything.

use tern_common::Now;
use tern_proto::v1::log_record::Change;
use tern_proto::v1::*;

use super::State;
use crate::error::{invalid, Refusal};

impl State {
    /// Replays one logged change: made at the time the record carries, applied at `now` (the
    /// replay's time, passed in: leases and deadlines count from it).
    pub fn replay(&mut self, record: &LogRecord, now: Now) -> Result<(), Refusal> {
        let Some(change) = &record.change else {
            return Err(invalid("a log record without a change"));
        };
        self.apply(change, record.unix_ms, now).map(drop)
    }

    /// Replays `records` into this (fresh) state, naming the first that does not apply.
    pub fn restore(&mut self, records: &[LogRecord], now: Now) -> anyhow::Result<()> {
        for (index, record) in records.iter().enumerate() {
            if let Err(refusal) = self.replay(record, now) {
                anyhow::bail!(
                    "metadata log record {index} ({:?}) does not apply: {} ({:?})",
                    record.change,
                    refusal.reason,
                    refusal.kind
                );
            }
        }
        Ok(())
    }

    /// The records that rebuild this state, taken at `now`: counters, servers, jobs, the
    /// namespace (parents first), the shuffles, then the calls remembered by request id.
    pub fn snapshot(&self, now: Now) -> Vec<LogRecord> {
        let mut changes = Vec::new();
        let (next_server_id, next_block_id) = self.servers.counters();
        changes.push(Change::Counters(LogCounters {
            next_file_id: self.namespace.next_file_id().get(),
            next_block_id,
            next_server_id: next_server_id.get(),
            next_shuffle_id: self.shuffles.next_shuffle_id().get(),
        }));
        changes.extend(self.key_record());
        changes.extend(self.servers.identities().into_iter().map(Change::Server));
        changes.extend(self.servers.modes(now).into_iter().map(Change::ServerMode));
        let mut records: Vec<LogRecord> =
            changes.drain(..).map(|change| LogRecord { unix_ms: 0, change: Some(change) }).collect();
        // Directories first (with their creation times), then the jobs (whose directories exist
        // by then), then the files, which count in their jobs' usage.
        let entries = self.namespace.walk();
        for (path, unix_ms, owner, _) in entries.iter().filter(|(_, _, _, file)| file.is_none()) {
            let change = Change::Mkdir(MkdirRequest { path: path.clone(), parents: true, owner: owner.to_string() });
            records.push(LogRecord { unix_ms: *unix_ms, change: Some(change) });
        }
        for (name, lease_ms, tenant, serial) in self.jobs.registrations() {
            let change = Change::RegisterJob(RegisterJobRequest { name, lease_ms, tenant, serial });
            records.push(LogRecord { unix_ms: 0, change: Some(change) });
        }
        for (path, unix_ms, owner, file) in entries {
            let Some(file) = file else {
                continue;
            };
            let request = CreateRequest {
                path,
                parents: false,
                sealed: false,
                storage_class: file.storage_class.to_string(),
                replicas: file.replicas,
                owner: owner.to_string(),
            };
            let change = Change::Create(LogCreate { request: Some(request), file_id: file.file_id.get() });
            records.push(LogRecord { unix_ms, change: Some(change) });
            if !file.blocks.is_empty() {
                let change = Change::Allocate(LogAllocate {
                    file_id: file.file_id.get(),
                    block_ids: file.blocks.iter().map(|b| b.block_id.get()).collect(),
                    server_ids: file.blocks.iter().map(|b| b.server_id.get()).collect(),
                });
                records.push(LogRecord { unix_ms, change: Some(change) });
            }
            if file.sealed {
                let change = Change::Seal(SealRequest { file_id: file.file_id.get(), length: file.length });
                records.push(LogRecord { unix_ms, change: Some(change) });
            }
        }
        self.shuffles.snapshot(&mut changes);
        records.extend(changes.into_iter().map(|change| LogRecord { unix_ms: 0, change: Some(change) }));
        // Last, the calls remembered by request id, oldest first, each at its log time.
        records.extend(self.requests.snapshot());
        records
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods, reason = "tests may read the clock")]
mod tests {
    use std::time::Duration;

    use super::super::tests::{add_server, config, state, BLOCK};
    use super::*;

    /// A replay takes its time from the records and from the `now` it is given, never from the
    /// clock: creation times are the records', and a drain's deadline (wall-clock in its record)
    /// counts down from the replay's time, so an hour later it has passed.
    #[test]
    fn a_replay_takes_its_time_from_the_records_and_its_caller() {
        let (mut state, now) = state();
        add_server(&mut state, "10.0.0.1:7000", 64, now);
        state.mkdir(MkdirRequest { path: "/d".into(), parents: false, ..Default::default() }, now).unwrap();
        let drain = SetServerModeRequest {
            server: "10.0.0.1:7000".into(),
            mode: ServerMode::Draining as i32,
            drain_timeout_ms: 60_000,
        };
        state.set_server_mode(drain, now).unwrap();
        let journal = state.take_journal();
        for later in [Duration::ZERO, Duration::from_secs(30), Duration::from_secs(3600)] {
            let at = now + later;
            let mut replayed = State::new(&config(), at);
            replayed.restore(&journal, at).unwrap();
            let stat = replayed.stat(StatRequest { path: "/d".into(), ..Default::default() }, at).unwrap();
            assert_eq!(stat.info.unwrap().created_unix_ms, now.unix_ms, "replayed {later:?} later");
            let servers = replayed.status(StatusRequest {}, at).unwrap().servers;
            let left_ms = 60_000u64.saturating_sub(later.as_millis() as u64);
            assert_eq!(servers[0].drain_deadline_ms, left_ms, "replayed {later:?} later");
        }
    }

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
        state.mkdir(MkdirRequest { path: format!("{root}/a/b"), parents: true, ..Default::default() }, now).unwrap();
        state.mkdir(MkdirRequest { path: "/vol".into(), parents: false, ..Default::default() }, now).unwrap();
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
        let expected = state.snapshot(now);
        let mut replayed = State::new(&super::super::tests::config(), Now::read());
        replayed.restore(&journal, now).unwrap();
        // The counters come first; a later start may only raise the shuffle id's (it starts from
        // the clock).
        let same = |rebuilt: &State| {
            let snapshot = rebuilt.snapshot(now);
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
        let mut from_snapshot = State::new(&super::super::tests::config(), Now::read());
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
