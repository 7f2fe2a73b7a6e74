//! Completed mutating calls by their client request id (`tern_proto::request_id`), so that a call
//! retried after its answer was lost (a failover, a dropped connection) is answered with the
//! first answer instead of being done again.
//!
//! The table is replicated state: `Service::call` appends a `LogRequestDone` record (the id, the
//! method, the caller and the encoded response) after a call's own records when the call had an
//! id, succeeded and changed something; [`State::apply`] inserts it here, in live calls, replay
//! and on Raft followers alike, and snapshots carry the table as those records. Nothing here
//! reads a clock: entries expire by log time, the `unix_ms` of the records that insert them
//! ([`REMEMBER_FOR_MS`] behind the newest, never going back), and the table is bounded in entries
//! ([`MAX_REMEMBERED_REQUESTS`]) and bytes ([`MAX_REMEMBERED_BYTES`]), the oldest going first. An
//! answer over [`MAX_REMEMBERED_ANSWER_BYTES`] is remembered as done only: a retry is told it
//! was done and that its answer cannot be given again, rather than done twice.
//!
//! Refusals are not remembered: a refused call changed nothing, so a retry is decided afresh.

use std::collections::{HashMap, VecDeque};

use prost::Message;
use tern_common::Now;
use tern_proto::request_id::RequestId;
use tern_proto::v1::log_record::Change;
use tern_proto::v1::{LogRecord, LogRequestDone};
use tern_proto::ErrorKind;
use tonic::Status;
use tracing::error;

use super::State;
use crate::error::{invalid, Refusal};

/// How long a completed call is remembered, in log time: well over a client's retries (at most
/// 5 tries per address, each within the 10 s a replicated call waits to commit).
pub const REMEMBER_FOR_MS: u64 = 10 * 60 * 1000;
/// Most calls remembered at once.
pub const MAX_REMEMBERED_REQUESTS: usize = 100_000;
/// Most bytes of remembered calls (answers, methods, callers and a fixed cost per entry).
pub const MAX_REMEMBERED_BYTES: usize = 64 << 20;
/// Largest encoded answer kept; a larger one is remembered as done only.
pub const MAX_REMEMBERED_ANSWER_BYTES: usize = 64 << 10;
/// What an entry costs beside its strings: the id, times, sizes and the table's own slots.
const ENTRY_OVERHEAD_BYTES: usize = 96;

/// The bounds of a table (the constants above, smaller in tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub entries: usize,
    pub bytes: usize,
    pub answer_bytes: usize,
    pub remember_for_ms: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            entries: MAX_REMEMBERED_REQUESTS,
            bytes: MAX_REMEMBERED_BYTES,
            answer_bytes: MAX_REMEMBERED_ANSWER_BYTES,
            remember_for_ms: REMEMBER_FOR_MS,
        }
    }
}

/// One remembered call.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Done {
    /// Its place in insertion order (an id inserted again replaces its older entry).
    inserted: u64,
    /// Log time it was inserted at (never before an older entry's).
    unix_ms: u64,
    method: String,
    caller: String,
    /// The encoded answer; empty when it was too large to keep.
    response: Vec<u8>,
    response_bytes: u64,
}

impl Done {
    fn cost(&self) -> usize {
        ENTRY_OVERHEAD_BYTES + self.method.len() + self.caller.len() + self.response.len()
    }
}

/// The remembered calls, oldest first.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Requests {
    limits: Limits,
    by_id: HashMap<RequestId, Done>,
    /// Insertion order; an entry whose number no longer matches `by_id`'s was replaced.
    order: VecDeque<(RequestId, u64)>,
    inserted: u64,
    bytes: usize,
    /// The newest insertion's log time: entry times never go back, so the oldest are in front.
    latest_unix_ms: u64,
}

impl Requests {
    #[cfg(test)]
    pub fn with_limits(limits: Limits) -> Requests {
        Requests { limits, ..Requests::default() }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Remembers a logged call at log time `unix_ms`, then forgets what is too old or over the
    /// bounds, oldest first. Deterministic: it depends only on the records, in order.
    pub fn insert(&mut self, log: &LogRequestDone, unix_ms: u64) {
        let unix_ms = unix_ms.max(self.latest_unix_ms);
        self.latest_unix_ms = unix_ms;
        let id = RequestId::new(log.client, log.sequence);
        if let Some(old) = self.by_id.remove(&id) {
            self.bytes -= old.cost();
        }
        self.inserted += 1;
        // A record is trusted as logged, but the bound holds whatever it says.
        let response = if log.response.len() <= self.limits.answer_bytes { log.response.clone() } else { Vec::new() };
        let done = Done {
            inserted: self.inserted,
            unix_ms,
            method: log.method.clone(),
            caller: log.caller.clone(),
            response_bytes: log.response_bytes.max(log.response.len() as u64),
            response,
        };
        self.bytes += done.cost();
        self.by_id.insert(id, done);
        self.order.push_back((id, self.inserted));
        self.evict(unix_ms);
    }

    fn evict(&mut self, now_unix_ms: u64) {
        while let Some(&(id, inserted)) = self.order.front() {
            let Some(done) = self.by_id.get(&id).filter(|done| done.inserted == inserted) else {
                self.order.pop_front();
                continue;
            };
            let expired = done.unix_ms.saturating_add(self.limits.remember_for_ms) < now_unix_ms;
            if !expired && self.by_id.len() <= self.limits.entries && self.bytes <= self.limits.bytes {
                break;
            }
            self.bytes -= done.cost();
            self.by_id.remove(&id);
            self.order.pop_front();
        }
    }

    /// The records that rebuild this table, oldest first, each at its log time.
    pub fn snapshot(&self) -> Vec<LogRecord> {
        self.order
            .iter()
            .filter_map(|(id, inserted)| {
                let done = self.by_id.get(id).filter(|done| done.inserted == *inserted)?;
                let log = LogRequestDone {
                    client: id.client(),
                    sequence: id.sequence(),
                    method: done.method.clone(),
                    caller: done.caller.clone(),
                    response: done.response.clone(),
                    response_bytes: done.response_bytes,
                };
                Some(LogRecord { unix_ms: done.unix_ms, change: Some(Change::RequestDone(log)) })
            })
            .collect()
    }
}

impl State {
    /// What call `id` was answered, when it was made and is still remembered: `None` when not
    /// (a new call, or one forgotten: it is done as a new one), the answer, or a refusal when the
    /// id was used for another call or caller, or its answer was too large to keep.
    pub fn answered<T: Message + Default>(
        &self,
        id: RequestId,
        method: &str,
        caller: &str,
    ) -> Option<Result<T, Status>> {
        let done = self.requests.by_id.get(&id)?;
        let context = format!("{method} (request {id})");
        if done.method != method || done.caller != caller {
            let why = format!(
                "the request id was used already, for {} by {}: each call needs its own id",
                done.method, done.caller
            );
            return Some(Err(invalid(why).status(context)));
        }
        if done.response.len() as u64 != done.response_bytes {
            let why = format!(
                "it was done already; its answer ({} bytes) was over the {} bytes kept, so it cannot be \
                 given again: look at what it made",
                done.response_bytes, self.requests.limits.answer_bytes
            );
            return Some(Err(Refusal::new(ErrorKind::AlreadyExists, why).status(context)));
        }
        Some(T::decode(done.response.as_slice()).map_err(|e| {
            let why = format!("its remembered answer does not decode: {e}");
            Refusal::new(ErrorKind::Internal, why).status(context)
        }))
    }

    /// Remembers that call `id` (`method`, by `caller`) was answered `response`: a record after
    /// the call's own, for the log.
    pub fn remember<T: Message>(&mut self, id: RequestId, method: &str, caller: &str, response: &T, now: Now) {
        let encoded = response.encode_to_vec();
        let response_bytes = encoded.len() as u64;
        let response = if encoded.len() <= self.requests.limits.answer_bytes { encoded } else { Vec::new() };
        let log = LogRequestDone {
            client: id.client(),
            sequence: id.sequence(),
            method: method.to_string(),
            caller: caller.to_string(),
            response,
            response_bytes,
        };
        if let Err(refusal) = self.commit(Change::RequestDone(log), now) {
            // Inserting cannot fail; should it ever, the call stands and only its retry is not kept.
            error!("{method} (request {id}): its answer is not remembered: {}", refusal.reason);
        }
    }

    /// The table of remembered calls (tests compare replicas' and replays').
    #[cfg(test)]
    pub(crate) fn requests(&self) -> &Requests {
        &self.requests
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods, reason = "tests may read the clock")]
mod tests {
    use tern_proto::v1::*;

    use super::super::tests::{config, state};
    use super::*;

    fn done(client: u64, sequence: u64, response: Vec<u8>) -> LogRequestDone {
        LogRequestDone {
            client,
            sequence,
            method: "create".into(),
            caller: "client of tenant default".into(),
            response_bytes: response.len() as u64,
            response,
        }
    }

    /// The remembered calls come from the records alone: the journal replayed twice, or the
    /// snapshot replayed, rebuild the same table, and the state answers a retry from it.
    #[test]
    fn replaying_the_records_rebuilds_the_same_table() {
        let (mut state, now) = state();
        let caller = "client of tenant default";
        for i in 0..5u64 {
            let created = state.create(CreateRequest { path: format!("/f{i}"), ..Default::default() }, now).unwrap();
            state.remember(RequestId::new(7, i), "create", caller, &created, now);
        }
        let journal = state.take_journal();
        assert_eq!(state.requests().len(), 5);
        let replay = |records: &[LogRecord]| {
            let mut replayed = State::new(&config(), now);
            replayed.restore(records, now).unwrap();
            replayed
        };
        let (once, twice) = (replay(&journal), replay(&journal));
        assert_eq!(once.requests(), state.requests());
        assert_eq!(twice.requests(), state.requests());
        let from_snapshot = replay(&state.snapshot(now));
        assert_eq!(from_snapshot.requests().snapshot(), state.requests().snapshot());
        let again: CreateResponse = from_snapshot.answered(RequestId::new(7, 3), "create", caller).unwrap().unwrap();
        let first = state.answered::<CreateResponse>(RequestId::new(7, 3), "create", caller).unwrap().unwrap();
        assert_eq!(again, first);
        assert!(state.answered::<CreateResponse>(RequestId::new(7, 9), "create", caller).is_none());
        // The same id for another call, or from another caller, is refused, not answered.
        let other = state.answered::<CreateResponse>(RequestId::new(7, 3), "mkdir", caller).unwrap().unwrap_err();
        assert_eq!(ErrorKind::of_status(&other), ErrorKind::Invalid, "{other:?}");
        let stranger = state.answered::<CreateResponse>(RequestId::new(7, 3), "create", "operator").unwrap();
        assert!(stranger.is_err());
    }

    /// Entries expire by the records' time, not by any clock, and that time never goes back: a
    /// record from a slow clock does not make older entries look young.
    #[test]
    fn entries_expire_by_log_time() {
        let mut table = Requests::with_limits(Limits { remember_for_ms: 1_000, ..Limits::default() });
        table.insert(&done(1, 1, vec![1]), 10_000);
        table.insert(&done(1, 2, vec![2]), 10_500);
        table.insert(&done(1, 3, vec![3]), 11_000);
        assert_eq!(table.len(), 3, "1 s of log time keeps all three");
        table.insert(&done(1, 4, vec![4]), 11_200);
        assert_eq!(table.len(), 3, "the first is over 1 s behind the newest");
        assert!(!table.by_id.contains_key(&RequestId::new(1, 1)));
        // A record stamped earlier (another leader's clock) counts as the newest time seen.
        table.insert(&done(1, 5, vec![5]), 5_000);
        assert_eq!(table.by_id[&RequestId::new(1, 5)].unix_ms, 11_200);
        table.insert(&done(1, 6, vec![6]), 12_100);
        let left: Vec<(u64, u64)> = table
            .snapshot()
            .iter()
            .map(|r| match &r.change {
                Some(Change::RequestDone(log)) => (log.sequence, r.unix_ms),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(left, vec![(4, 11_200), (5, 11_200), (6, 12_100)]);
    }

    /// The table holds at most its count and its bytes, the oldest going first; an answer over
    /// the per-answer bound is remembered as done only, and a retry is told so.
    #[test]
    fn the_table_is_bounded() {
        let limits = Limits { entries: 3, bytes: 1_000, answer_bytes: 100, remember_for_ms: u64::MAX / 2 };
        let mut table = Requests::with_limits(limits);
        for sequence in 0..10 {
            table.insert(&done(2, sequence, vec![0; 10]), 1_000);
        }
        assert_eq!(table.len(), 3);
        let mut kept: Vec<u64> = table.by_id.keys().map(|id| id.sequence()).collect();
        kept.sort_unstable();
        assert_eq!(kept, vec![7, 8, 9]);
        assert!(table.order.len() <= 3);
        // Bytes: each entry of a 100-byte answer costs over 200, so 1,000 bytes hold four.
        let mut table = Requests::with_limits(Limits { entries: 1_000, ..limits });
        for sequence in 0..10 {
            table.insert(&done(3, sequence, vec![0; 100]), 1_000);
        }
        assert_eq!(table.by_id[&RequestId::new(3, 9)].cost(), 226);
        assert_eq!(table.len(), 4);
        assert!(table.bytes <= 1_000);
        // Too large to keep: remembered as done only.
        table.insert(&done(3, 99, vec![0; 101]), 1_000);
        let big = &table.by_id[&RequestId::new(3, 99)];
        assert_eq!((big.response.len(), big.response_bytes), (0, 101));

        let (mut state, now) = state();
        state.requests = Requests::with_limits(limits);
        let job = state.register_job(RegisterJobRequest::default(), now).unwrap();
        let padded = RegisterJobResponse { token: "t".repeat(200), ..job };
        state.remember(RequestId::new(4, 1), "register_job", "c", &padded, now);
        let retry = state.answered::<RegisterJobResponse>(RequestId::new(4, 1), "register_job", "c").unwrap();
        let refused = retry.unwrap_err();
        assert_eq!(ErrorKind::of_status(&refused), ErrorKind::AlreadyExists, "{refused:?}");
        assert!(refused.message().contains("was done already"), "{}", refused.message());
    }
}
