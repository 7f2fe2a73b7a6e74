//! Power-loss tests of Raft's files (`store.rs`), as `wal/power_loss.rs` does for the WAL: the
//! store appends entries, saves votes and purges (rewriting the log) on a [`SimFs`] that records
//! its state after every file operation; a power cut at each of those points, in each of
//! [`Keep::battery`]'s modes, must leave files the store opens without a corruption error, with
//! every entry and the vote whose call had returned before the cut.

use std::path::Path;

use openraft::storage::{RaftLogReader, RaftStorage};
use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, Vote};
use tern_common::durable::sim::{Keep, SimFs};
use tern_common::Now;

use super::store::Store;
use super::Batch;
use crate::config::Config;

fn entry(index: u64) -> Entry<super::TypeConfig> {
    let batch = Batch { last_seq: index, records: vec![index as u8; 100] };
    Entry { log_id: LogId::new(CommittedLeaderId::new(1, 1), index), payload: EntryPayload::Normal(batch) }
}

#[tokio::test]
#[allow(clippy::disallowed_methods, reason = "tests may read the clock")]
async fn raft_files_keep_every_acknowledged_entry_and_vote_through_a_power_cut() {
    let config = Config::default();
    let dir = Path::new("/meta");
    let fs = SimFs::new();
    fs.record();
    let mut store = Store::open(fs.shared(), dir, &config, Now::read()).unwrap();
    // (ops done when the call returned, last index that must survive, vote that must survive)
    let mut acks: Vec<(u64, u64, Option<Vote<u64>>)> = vec![(fs.ops(), 0, None)];
    let mut vote = None;
    for index in 1..=12 {
        if index % 5 == 0 {
            let v = Vote::new(index, 1);
            store.save_vote(&v).await.unwrap();
            vote = Some(v);
        }
        store.append_to_log([entry(index)]).await.unwrap();
        if index % 4 == 0 {
            store.purge_logs_upto(entry(index - 2).log_id).await.unwrap();
        }
        acks.push((fs.ops(), index, vote));
    }
    let mut checked = 0;
    for point in fs.points() {
        let (_, must_index, must_vote) =
            acks.iter().rfind(|(ops, _, _)| *ops <= point.ops).cloned().unwrap_or((0, 0, None));
        for keep in Keep::battery() {
            let crashed = point.crash_with(keep);
            let mut reopened = Store::open(crashed.shared(), dir, &config, Now::read())
                .unwrap_or_else(|e| panic!("after operation {} ({keep:?}): {e:#}", point.ops));
            let state = reopened.get_log_state().await.unwrap();
            let last = state.last_log_id.map_or(0, |id| id.index);
            assert!(
                last >= must_index,
                "after operation {} ({keep:?}): log ends at {last}, {must_index} acknowledged",
                point.ops
            );
            let entries = reopened.try_get_log_entries(..).await.unwrap();
            let first = state.last_purged_log_id.map_or(1, |id| id.index + 1);
            for (i, e) in entries.iter().enumerate() {
                assert_eq!(e, &entry(first + i as u64), "after operation {} ({keep:?})", point.ops);
            }
            let read = reopened.read_vote().await.unwrap();
            if must_vote.is_some() {
                assert!(
                    read >= must_vote,
                    "after operation {} ({keep:?}): vote {read:?}, {must_vote:?} saved",
                    point.ops
                );
            }
            checked += 1;
        }
    }
    assert!(checked > 100, "{checked} crash points checked");
}
