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
pub mod elect;
mod net;
#[cfg(test)]
mod power_loss;
mod store;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use openraft::{BasicNode, ChangeMembers, Raft, ServerState};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tern_common::durable::Fs;
use tern_common::Now;
use tern_proto::identity::ClusterSecret;
use tern_proto::v1::{LogRecord, MetadataMember, MetadataMembersResponse};
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
/// Longest wait for each step of a membership change (a new member's catching up, the change's
/// commit): within a client's default 30 s request timeout, so the caller hears why.
pub const MEMBERSHIP_DEADLINE: Duration = Duration::from_secs(12);
/// openraft's election timeouts: its maximum is also its leader lease (`elect::LEADER_LEASE`).
const ELECTION_TIMEOUT_MIN_MS: u64 = 600;
const ELECTION_TIMEOUT_MAX_MS: u64 = 1200;
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
    /// When this replica last heard a leader (`elect`), touched by the `Raft` service.
    pub heard: Arc<elect::Heard>,
    /// When each voter last answered this replica as its leader (`elect::Answers`).
    answers: Arc<elect::Answers>,
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
/// openraft's own election timer made a follower that had seen a leader wait out that leader's
/// lease (openraft 0.9: the maximum election timeout) and then its own election timeout before
/// it stood, and one refused a vote by a replica with a longer log another 2x the maximum; it is
/// off now (`elect`: 1.2 s and a random 0-0.6 s, then a pre-vote). Timeouts of 1.5-3 s made that 4.5-6 s, and `tern bench failover` timed
/// a write 5.7-13.7 s after the leader's SIGKILL (6 kills, 2026-12-03), against a target of
/// p50 <= 3 s and max <= 6 s. etcd's defaults (100 ms, 1 s) are the model: a heartbeat is one
/// small message per follower, so 100 ms costs nothing, and 1.2 s leaves twelve heartbeats of
/// room for a busy machine before a follower stands.
fn raft_config(snapshot_entries: u64) -> anyhow::Result<Arc<openraft::Config>> {
    let config = openraft::Config {
        cluster_name: "tern-metadata".into(),
        heartbeat_interval: 100,
        election_timeout_min: ELECTION_TIMEOUT_MIN_MS,
        election_timeout_max: ELECTION_TIMEOUT_MAX_MS,
        // `elect::stand` stands for election, after a pre-vote.
        enable_elect: false,
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
        let started = Now::read();
        let store = store::Store::open(fs, &config.dir, config, started)?;
        let heard = Arc::new(elect::Heard::new(started.instant));
        tracing::debug!("Raft files in {}", dir(config).display());
        let state = store.machine.state.clone();
        let (log, sm) = openraft::storage::Adaptor::new(store.clone());
        let tls = config.serve.tls_dir.as_deref().map(tern_transport::tls::TlsMaterial::load).transpose()?;
        let network = net::Network::new(secret, me, config.max_message_size.bytes() as usize, tls)?;
        let raft = Raft::new(me, raft_config(config.raft_snapshot_entries)?, network.clone(), log, sm).await?;
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
            heard: heard.clone(),
            answers: network.answers.clone(),
        });
        tokio::spawn(elect::stand(replica.raft.clone(), me, network, heard));
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
            return self.cut_off().map_or(Ok(()), Err);
        }
        let metrics = self.raft.metrics().borrow().clone();
        Err(match metrics.current_leader {
            Some(leader) if leader != self.me => {
                // The membership names every member, those added since start too.
                let address = metrics
                    .membership_config
                    .membership()
                    .get_node(&leader)
                    .map(|node| node.addr.clone())
                    .or_else(|| self.peers.get(&leader).cloned())
                    .unwrap_or_else(|| format!("node {leader}"));
                ErrorKind::Unavailable.status(format!("not the leader; the leader is {address}"))
            }
            _ => ErrorKind::Unavailable
                .status("not the leader; no leader is known yet (an election is under way): retry shortly"),
        })
    }

    /// The refusal of a leader that has not heard a majority of the voters within the leader
    /// lease (`elect::Answers`): it says "not the leader", so that the failover channel asks the
    /// others, among which the majority elects a new leader once the lease has passed.
    fn cut_off(&self) -> Option<Status> {
        #[expect(clippy::disallowed_methods, reason = "the edge: a lease is judged by the clock")]
        let now = Now::read().instant;
        // On every call's path: the voters are read in place, not collected.
        let metrics = self.raft.metrics();
        let majority = self.answers.majority(self.me, metrics.borrow().membership_config.membership().voter_ids(), now);
        (!majority).then(|| {
            ErrorKind::Unavailable.status(format!(
                "not the leader; no majority of the metadata replicas has answered this one within {:?} (is it cut \
                 off from them?)",
                elect::LEADER_LEASE
            ))
        })
    }

    /// `waited`, unless this leader is cut off from its majority first ([`Replica::cut_off`],
    /// looked at four times a lease): a call need not wait out its commit deadline on a leader
    /// the others have replaced.
    async fn unless_cut_off<T>(&self, waited: impl std::future::Future<Output = T>) -> Result<T, Status> {
        let cut_off = async {
            loop {
                tokio::time::sleep(elect::LEADER_LEASE / 4).await;
                if let Some(refusal) = self.cut_off() {
                    return refusal;
                }
            }
        };
        tokio::select! {
            done = waited => Ok(done),
            refusal = cut_off => Err(refusal),
        }
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
        let waited = tokio::time::timeout(
            COMMIT_DEADLINE,
            self.unless_cut_off(async {
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
            }),
        )
        .await
        .map_err(|_| unavailable(format!("not committed within {COMMIT_DEADLINE:?} (no majority reachable?)")))?;
        waited??;
        if read {
            let confirmed = self.unless_cut_off(self.raft.ensure_linearizable());
            match tokio::time::timeout(COMMIT_DEADLINE, confirmed).await {
                Ok(Err(refusal)) => return Err(refusal),
                Ok(Ok(Ok(_))) => {}
                Ok(Ok(Err(e))) if e.forward_to_leader().is_some() => {
                    return Err(unavailable(format!(
                        "not the leader any more: the leadership could not be confirmed ({e})"
                    )))
                }
                // No quorum answered the read index's heartbeats (those to a cut-off host fail at
                // once): "not the leader", so that the failover channel asks the others.
                Ok(Ok(Err(e))) => {
                    return Err(unavailable(format!("not the leader; the leadership could not be confirmed: {e}")))
                }
                Err(_) => {
                    return Err(unavailable(format!("the leadership was not confirmed within {COMMIT_DEADLINE:?}")))
                }
            }
        }
        Ok(())
    }

    /// The members as this leader sees them (only the leader knows how far each one is).
    pub fn members(&self) -> Result<MetadataMembersResponse, Status> {
        self.check_serving()?;
        let metrics = self.raft.metrics().borrow().clone();
        let membership = metrics.membership_config.membership();
        let voters: BTreeSet<u64> = membership.voter_ids().collect();
        let matched = |id: u64| match &metrics.replication {
            _ if id == self.me => metrics.last_log_index,
            Some(progress) => progress.get(&id).copied().flatten().map(|log_id| log_id.index),
            None => None,
        };
        let members = membership
            .nodes()
            .map(|(&id, node)| MetadataMember {
                id,
                addr: node.addr.clone(),
                voter: voters.contains(&id),
                leader: id == self.me,
                matched_index: matched(id),
            })
            .collect();
        Ok(MetadataMembersResponse {
            replicated: true,
            term: metrics.current_term,
            last_log_index: metrics.last_log_index.unwrap_or(0),
            members,
        })
    }

    /// Adds member `id` at `addr`: a learner until it has caught up, then a voter. Adding a
    /// voter already there at the same address answers the members (a retried add).
    pub async fn add_member(&self, id: u64, addr: &str) -> Result<MetadataMembersResponse, Status> {
        let invalid = |why: String| ErrorKind::Invalid.status(why);
        if id == 0 {
            return Err(invalid("a member's id is at least 1".into()));
        }
        let port = addr.rsplit_once(':').filter(|(host, _)| !host.is_empty()).map(|(_, port)| port.parse::<u16>());
        if !matches!(port, Some(Ok(port)) if port > 0) {
            return Err(invalid(format!("member {id}'s address {addr:?} is not host:port")));
        }
        let now = self.members()?;
        if now.members.len() >= crate::config::MAX_PEERS && !now.members.iter().any(|m| m.id == id) {
            return Err(invalid(format!(
                "the service has {} members already; at most {}",
                now.members.len(),
                crate::config::MAX_PEERS
            )));
        }
        if let Some(same) = now.members.iter().find(|m| m.id == id) {
            if same.addr != addr {
                return Err(invalid(format!("member {id} is already at {}: remove it first", same.addr)));
            }
            if same.voter {
                return Ok(now);
            }
        }
        // A server with an empty directory whose id is the smallest in its `peers` founds a new
        // cluster (`start`): a newcomer below every member would found one of its own.
        let smallest = now.members.iter().map(|m| m.id).min().unwrap_or(id);
        if id < smallest {
            return Err(invalid(format!(
                "a new member's id must be above the smallest member's ({smallest}): a server whose id is the smallest \
                 in its peers founds a cluster of its own on an empty directory"
            )));
        }
        if let Some(other) = now.members.iter().find(|m| m.addr == addr && m.id != id) {
            return Err(invalid(format!("{addr} is already member {}'s address", other.id)));
        }
        let deadline = MEMBERSHIP_DEADLINE;
        let caught_up = tokio::time::timeout(deadline, self.raft.add_learner(id, BasicNode::new(addr), true)).await;
        match caught_up {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(membership_refusal(&format!("adding member {id} as a learner"), &e)),
            Err(_) => {
                return Err(ErrorKind::Unavailable.status(format!(
                    "member {id} at {addr} did not catch up within {deadline:?}: is it running, with node_id = \
                     {id} and peers naming it? It stays a learner (no vote) until added again or removed"
                )))
            }
        }
        let mut voters: BTreeSet<u64> = now.members.iter().filter(|m| m.voter).map(|m| m.id).collect();
        voters.insert(id);
        self.change_voters(ChangeMembers::ReplaceAllVoters(voters), &format!("making member {id} a voter")).await
    }

    /// Removes member `id` (voter or learner). The last voter cannot be removed.
    pub async fn remove_member(&self, id: u64) -> Result<MetadataMembersResponse, Status> {
        let now = self.members()?;
        let Some(member) = now.members.iter().find(|m| m.id == id) else {
            let ids: Vec<String> = now.members.iter().map(|m| m.id.to_string()).collect();
            return Err(ErrorKind::NotFound.status(format!("{id} is not a member (members: {})", ids.join(", "))));
        };
        let change = if member.voter {
            let voters: BTreeSet<u64> = now.members.iter().filter(|m| m.voter && m.id != id).map(|m| m.id).collect();
            if voters.is_empty() {
                return Err(ErrorKind::Invalid.status(format!("member {id} is the last voter: it cannot be removed")));
            }
            ChangeMembers::ReplaceAllVoters(voters)
        } else {
            ChangeMembers::RemoveNodes(BTreeSet::from([id]))
        };
        self.change_voters(change, &format!("removing member {id}")).await
    }

    /// Commits a membership change (`retain: false`: a removed voter leaves the nodes too).
    async fn change_voters(
        &self,
        change: ChangeMembers<u64, BasicNode>,
        what: &str,
    ) -> Result<MetadataMembersResponse, Status> {
        match tokio::time::timeout(MEMBERSHIP_DEADLINE, self.raft.change_membership(change, false)).await {
            Ok(Ok(_)) => self.members(),
            Ok(Err(e)) => Err(membership_refusal(what, &e)),
            Err(_) => Err(ErrorKind::Unavailable
                .status(format!("{what}: not committed within {MEMBERSHIP_DEADLINE:?} (no majority reachable?)"))),
        }
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

/// A refused membership change: `unavailable` when this node no longer leads (the failover
/// channel asks the leader), `invalid` for what openraft refuses (a change under way).
fn membership_refusal(
    what: &str,
    e: &openraft::error::RaftError<u64, openraft::error::ClientWriteError<u64, BasicNode>>,
) -> Status {
    match e.forward_to_leader() {
        Some(_) => ErrorKind::Unavailable.status(format!("{what}: not the leader any more")),
        None => ErrorKind::Invalid.status(format!("{what}: {e}")),
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
