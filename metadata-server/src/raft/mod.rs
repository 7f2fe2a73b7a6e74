//! Replicated metadata on openraft (issue 34): the metadata log's records are Raft entries and
//! [`State::apply`] (through `State::replay`) is the state machine (`store`); Raft's messages go
//! over the `Raft` gRPC service (`net`).
//!
//! The leader runs calls on its live state as a single server does (speculative apply, under the
//! state's lock), queues each call's records as a proposal, and a proposer task packs the queued
//! proposals into one entry (group commit: up to [`MAX_BATCH_CALLS`] calls and
//! [`MAX_ENTRY_BYTES`]) and hands it to openraft in order (at most [`MAX_IN_FLIGHT`] entries
//! uncommitted). A call is answered once its entry is committed (a majority has it durable);
//! a read waits for what it may have seen to commit and then confirms the leadership with
//! openraft's read index (`ensure_linearizable`: a heartbeat round to a majority).
//!
//! A node serves only while it leads and has applied everything committed before its term
//! (openraft's blank entry of the term, awaited with `ensure_linearizable`). A leader that loses
//! its leadership discards its live state and rebuilds it from the snapshot and the committed log
//! (`store::Machine::rebuild`). Other nodes refuse calls with `not the leader; the leader is ADDR`.

mod codec;
mod net;
#[cfg(test)]
mod power_loss;
mod store;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::io::Cursor;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use openraft::{BasicNode, Raft, ServerState};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tern_common::durable::Fs;
use tern_common::Now;
use tern_proto::identity::ClusterSecret;
use tern_proto::v1::LogRecord;
use tern_proto::ErrorKind;
use tokio::sync::{watch, Notify, Semaphore};
use tonic::Status;
use tracing::{error, info, warn};

pub use net::RaftService;

use crate::config::Config;
use crate::state::State;
use crate::wal;

/// Most calls' records in one entry.
pub const MAX_BATCH_CALLS: usize = 1024;
/// Most bytes of records in one entry (a bigger call goes alone).
pub const MAX_ENTRY_BYTES: usize = 4 << 20;
/// Most entries proposed and not yet committed. openraft 0.9's core appends one entry at a time
/// and waits for its fsync before replicating it, so entries beyond a pipeline's two only queue
/// there one call each: with 64, 32 concurrent map commits went in 1.1 calls an entry at 0.28x a
/// single server's rate; with 2 they gather 4.6 to an entry, at 0.49x (`tern bench replicas`).
pub const MAX_IN_FLIGHT: usize = 2;
/// Longest wait for a proposal to commit, or for the leadership to be confirmed.
pub const COMMIT_DEADLINE: Duration = Duration::from_secs(10);
/// Deadline of one Raft RPC to a peer (openraft's own TTLs are shorter for heartbeats).
pub const RPC_DEADLINE: Duration = Duration::from_secs(5);

/// One entry's payload: the records of one or more calls, in `wal`'s frame format, and the
/// last proposal sequence number among them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    pub last_seq: u64,
    #[serde(with = "serde_bytes")]
    pub records: Vec<u8>,
}

openraft::declare_raft_types!(
    /// The metadata service's Raft types.
    pub TypeConfig:
        D = Batch,
        R = (),
        NodeId = u64,
        Node = BasicNode,
);

/// What became of the proposals: committed up to `committed`; `failed` ones (from, to) were not.
#[derive(Debug, Clone, Copy, Default)]
struct Outcome {
    committed: u64,
    failed: (u64, u64),
}

/// A replica of the metadata service: its Raft node and its proposals.
pub struct Replica {
    pub raft: Raft<TypeConfig>,
    me: u64,
    peers: BTreeMap<u64, String>,
    store: store::Store,
    queue: Mutex<Vec<(u64, Vec<LogRecord>)>>,
    wake: Notify,
    outcome: watch::Sender<Outcome>,
    key_file: std::path::PathBuf,
}

/// A replica's place in Raft (`Replica::place`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    /// Whether it leads and serves (it has applied every entry of earlier terms).
    pub serving: bool,
    pub term: u64,
    pub last_log_index: u64,
    pub applied_index: u64,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica").field("me", &self.me).field("peers", &self.peers).finish()
    }
}

/// openraft's settings: heartbeats every 100 ms, election timeouts of 600-1200 ms, a snapshot
/// every `raft_snapshot_entries` entries (a fifth of that kept behind it), entries sent in bounded
/// batches.
///
/// A follower that has seen a leader waits out that leader's lease (openraft 0.9: the maximum
/// election timeout) and then its own election timeout before it stands, 1.2 + 0.6-1.2 s after
/// the last heartbeat here; and one that was refused a vote by a replica with a longer log waits
/// another 2x the maximum. Timeouts of 1.5-3 s made that 4.5-6 s, and `tern bench failover` timed
/// a write 5.7-13.7 s after the leader's SIGKILL (6 kills, 2026-12-03), against a target of
/// p50 <= 3 s and max <= 6 s. etcd's defaults (100 ms, 1 s) are the model: a heartbeat is one
/// small message per follower, so 100 ms costs nothing, and 1.2 s leaves twelve heartbeats of
/// room for a busy machine before a follower stands.
fn raft_config(snapshot_entries: u64) -> anyhow::Result<Arc<openraft::Config>> {
    let config = openraft::Config {
        cluster_name: "tern-metadata".into(),
        heartbeat_interval: 100,
        election_timeout_min: 600,
        election_timeout_max: 1200,
        max_payload_entries: 64,
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(snapshot_entries),
        max_in_snapshot_log_to_keep: snapshot_entries / 5,
        purge_batch_size: 1,
        ..Default::default()
    };
    Ok(Arc::new(config.validate()?))
}

impl Replica {
    /// Opens this node's Raft files in `config.dir`, starts its Raft node, and (on a fresh
    /// cluster) initializes the membership from `peers`. Returns the replica and the state it
    /// serves (shared with the state machine).
    #[expect(clippy::disallowed_methods, reason = "the edge: recovery reads the clock once and passes it in")]
    pub async fn start(
        config: &Config,
        fs: Arc<dyn Fs>,
        secret: &ClusterSecret,
    ) -> anyhow::Result<(Arc<Replica>, Arc<Mutex<State>>)> {
        let peers = config.peer_map()?;
        let me = config.node_id(&peers)?;
        let store = store::Store::open(fs, &config.dir, config, Now::read())?;
        tracing::debug!("Raft files in {}", dir(config).display());
        let state = store.machine.state.clone();
        let (log, sm) = openraft::storage::Adaptor::new(store.clone());
        let tls = config.serve.tls_dir.as_deref().map(tern_transport::tls::TlsMaterial::load).transpose()?;
        let network = net::Network::new(secret, me, config.max_message_size.bytes() as usize, tls)?;
        let raft = Raft::new(me, raft_config(config.raft_snapshot_entries)?, network, log, sm).await?;
        // On a fresh cluster only the replica with the smallest id founds the membership; the
        // others learn it from its first entries. (openraft's `initialize` starts an election at
        // once: when every replica did, one that voted for the first leader before receiving
        // its entries could still initialize and call a second election, deposing the leader
        // within a second of its winning; raft::tests caught it in CI.)
        if peers.keys().next() == Some(&me) && !raft.is_initialized().await? {
            let members: BTreeMap<u64, BasicNode> =
                peers.iter().map(|(&id, addr)| (id, BasicNode::new(addr.clone()))).collect();
            if let Err(e) = raft.initialize(members).await {
                info!("Raft membership not initialized here: {e}");
            }
        }
        let replica = Arc::new(Replica {
            raft,
            me,
            peers,
            store,
            queue: Mutex::new(Vec::new()),
            wake: Notify::new(),
            outcome: watch::channel(Outcome::default()).0,
            key_file: config.dir.clone(),
        });
        tokio::spawn(replica.clone().propose_loop());
        tokio::spawn(replica.clone().lead_loop());
        Ok((replica, state))
    }

    /// Where this replica stands, for its metrics.
    pub fn place(&self) -> Place {
        let metrics = self.raft.metrics().borrow().clone();
        Place {
            serving: self.store.machine.meta.lock().serving.is_some(),
            term: metrics.current_term,
            last_log_index: metrics.last_log_index.unwrap_or(0),
            applied_index: metrics.last_applied.map_or(0, |id| id.index),
        }
    }

    /// Ok while this node serves (leads, caught up); the refusal naming the leader otherwise.
    /// Called under the state's lock.
    pub fn check_serving(&self) -> Result<(), Status> {
        if self.store.machine.meta.lock().serving.is_some() {
            return Ok(());
        }
        let metrics = self.raft.metrics().borrow().clone();
        Err(match metrics.current_leader {
            Some(leader) if leader != self.me => {
                let address = self.peers.get(&leader).cloned().unwrap_or_else(|| format!("node {leader}"));
                ErrorKind::Unavailable.status(format!("not the leader; the leader is {address}"))
            }
            _ => ErrorKind::Unavailable
                .status("not the leader; no leader is known yet (an election is under way): retry shortly"),
        })
    }

    /// Queues a call's records (under the state's lock, so proposals keep the state's order);
    /// returns the sequence number to wait for (the last one handed out when there are none).
    pub fn propose(&self, records: Vec<LogRecord>) -> u64 {
        let mut meta = self.store.machine.meta.lock();
        if records.is_empty() {
            return meta.proposed_seq;
        }
        meta.proposed_seq += 1;
        let seq = meta.proposed_seq;
        drop(meta);
        self.queue.lock().push((seq, records));
        self.wake.notify_one();
        seq
    }

    /// Waits until proposal `seq` is committed; a read (`read`) also confirms the leadership.
    /// Every refusal is `unavailable`; one for a lost leadership says "not the leader", so the
    /// failover channel asks the new leader (a change retried with its request id is answered,
    /// not made twice, should the new leader have committed it after all).
    pub async fn wait(&self, seq: u64, read: bool) -> Result<(), Status> {
        let unavailable = |why: String| ErrorKind::Unavailable.status(why);
        let mut outcome = self.outcome.subscribe();
        let waited = tokio::time::timeout(COMMIT_DEADLINE, async {
            loop {
                let now = *outcome.borrow_and_update();
                if seq >= now.failed.0 && seq <= now.failed.1 && now.failed.1 > 0 {
                    return Err(unavailable(
                        "not the leader any more: the leadership was lost before the change was known to commit"
                            .to_string(),
                    ));
                }
                if now.committed >= seq {
                    return Ok(());
                }
                if outcome.changed().await.is_err() {
                    return Err(unavailable("the Raft node stopped".to_string()));
                }
            }
        })
        .await
        .map_err(|_| unavailable(format!("not committed within {COMMIT_DEADLINE:?} (no majority reachable?)")))?;
        waited?;
        if read {
            match tokio::time::timeout(COMMIT_DEADLINE, self.raft.ensure_linearizable()).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) if e.forward_to_leader().is_some() => {
                    return Err(unavailable(format!(
                        "not the leader any more: the leadership could not be confirmed ({e})"
                    )))
                }
                Ok(Err(e)) => return Err(unavailable(format!("the leadership could not be confirmed: {e}"))),
                Err(_) => {
                    return Err(unavailable(format!("the leadership was not confirmed within {COMMIT_DEADLINE:?}")))
                }
            }
        }
        Ok(())
    }

    /// Packs queued proposals into entries and hands them to openraft in order. A permit is
    /// taken before the queue is, so calls arriving while the entries in flight commit gather
    /// into the next one (each entry costs a log fsync on every replica, one after another in
    /// openraft's core).
    async fn propose_loop(self: Arc<Self>) {
        let in_flight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
        loop {
            let Ok(permit) = in_flight.clone().acquire_owned().await else { return };
            let taken: Vec<(u64, Vec<LogRecord>)> = loop {
                let taken: Vec<_> = {
                    let mut queue = self.queue.lock();
                    let mut bytes = 0;
                    let mut n = 0;
                    while n < queue.len() && n < MAX_BATCH_CALLS && (n == 0 || bytes < MAX_ENTRY_BYTES) {
                        bytes += queue[n].1.iter().map(prost::Message::encoded_len).sum::<usize>();
                        n += 1;
                    }
                    queue.drain(..n).collect()
                };
                if !taken.is_empty() {
                    break taken;
                }
                self.wake.notified().await;
            };
            let (first, last) = (taken[0].0, taken[taken.len() - 1].0);
            let mut batch = Batch { last_seq: last, records: Vec::new() };
            for record in taken.iter().flat_map(|(_, records)| records) {
                wal::encode_frame(record, &mut batch.records);
            }
            let outcome = self.outcome.clone();
            let fail = move |why: String| {
                warn!("Raft proposals {first}..={last} failed: {why}");
                outcome.send_modify(|o| {
                    o.failed = if o.failed.1 == 0 { (first, last) } else { (o.failed.0.min(first), last) };
                });
            };
            match self.raft.client_write_ff(batch).await {
                Err(e) => fail(e.to_string()),
                Ok(rx) => {
                    let outcome = self.outcome.clone();
                    tokio::spawn(async move {
                        let _permit = permit;
                        match tokio::time::timeout(COMMIT_DEADLINE, rx).await {
                            Ok(Ok(Ok(_))) => outcome.send_modify(|o| o.committed = o.committed.max(last)),
                            Ok(Ok(Err(e))) => fail(e.to_string()),
                            Ok(Err(e)) => fail(e.to_string()),
                            Err(_) => fail(format!("not committed within {COMMIT_DEADLINE:?}")),
                        }
                    });
                }
            }
        }
    }

    /// Follows the leadership: starts serving once leading and caught up, and on losing it
    /// discards the live state for the committed one.
    #[expect(clippy::disallowed_methods, reason = "the edge: a rebuild's replay time is read here")]
    async fn lead_loop(self: Arc<Self>) {
        let mut metrics = self.raft.metrics();
        loop {
            let m = metrics.borrow_and_update().clone();
            let leading = m.state == ServerState::Leader && m.current_leader == Some(self.me);
            let serving = self.store.machine.meta.lock().serving;
            if leading && serving.is_none() {
                // Apply everything committed before this term (its blank entry) first.
                match tokio::time::timeout(COMMIT_DEADLINE, self.raft.ensure_linearizable()).await {
                    Ok(Ok(_)) => {
                        let mut state = self.store.machine.state.lock();
                        let mut meta = self.store.machine.meta.lock();
                        meta.serving = Some(*m.vote.leader_id());
                        meta.applied_seq = meta.proposed_seq;
                        drop(meta);
                        // Leases count from the failover.
                        state.count_leases_from(Now::read().instant);
                        info!("metadata node {} leads (term {}) and serves", self.me, m.current_term);
                        if !state.key_logged() {
                            // The cluster's first leader chooses the token key, once.
                            match crate::keyfile::load_or_create(&self.key_file) {
                                Ok(key) => {
                                    if let Err(e) = state.log_key(&key, Now::read()) {
                                        error!("logging the token key: {e}");
                                    }
                                    let records = state.take_journal();
                                    self.propose(records);
                                }
                                Err(e) => error!("the token key: {e:#}"),
                            }
                        }
                        continue;
                    }
                    Ok(Err(e)) => warn!("leading but not confirmed: {e}"),
                    Err(_) => warn!("leading but not confirmed within {COMMIT_DEADLINE:?}"),
                }
            } else if !leading && serving.is_some() {
                let mut state = self.store.machine.state.lock();
                let mut meta = self.store.machine.meta.lock();
                meta.serving = None;
                match self.store.machine.rebuild(&self.store.log, &meta, Now::read()) {
                    Ok(rebuilt) => *state = rebuilt,
                    Err(e) => error!("rebuilding the committed state after losing the leadership: {e:#}"),
                }
                state.take_journal();
                info!("metadata node {} no longer leads; state rebuilt from the committed log", self.me);
            }
            // Metrics change at every heartbeat; the timeout retries an unconfirmed leadership.
            if let Ok(Err(_)) = tokio::time::timeout(Duration::from_millis(500), metrics.changed()).await {
                return;
            }
        }
    }
}

/// Whether `config` asks for replication.
pub fn replicated(config: &Config) -> bool {
    !config.peers.is_empty()
}

/// The Raft files' directory, for messages.
pub fn dir(config: &Config) -> std::path::PathBuf {
    Path::new(&config.dir).join("raft")
}
