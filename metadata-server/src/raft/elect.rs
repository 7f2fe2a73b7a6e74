//! Elections behind a pre-vote round (the Raft thesis, §9.6), which openraft 0.9 lacks.
//!
//! On its own timer openraft 0.9 makes a follower that hears no leader stand for election,
//! raising its term each time. A follower whose packets vanish does so every second or two, and
//! when its link heals its higher term reaches the leader in an AppendEntries reply, which
//! deposes the leader: every client then waits out an election that nothing needed (`Engine`'s
//! `HigherVote`; openraft added a pre-vote only in its 0.10 line). So openraft's timer is off
//! (`enable_elect: false`) and [`stand`] stands for the replica instead: once it has heard no
//! leader for [`LEADER_LEASE`] and a random part of [`JITTER`], it asks the other voters whether
//! they would vote for it (`Raft.PreVote`), and only when a majority would does it call
//! openraft's election (`Trigger::elect`), which then runs as before. A voter would ([`would_vote`])
//! when it has heard no leader for the lease either and the candidate's log is at least as
//! long as its own: the checks a real vote makes (openraft refuses a vote inside the lease too),
//! without changing its term or its vote. A leader never would.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use openraft::{BasicNode, LogId, Raft, ServerState};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tern_common::{Now, SplitMix64};
use tracing::{debug, info};

use super::net::{Client, Network};
use super::TypeConfig;

/// How long a leader's silence must last before anyone stands: openraft's leader lease (its
/// maximum election timeout, `raft_config`), inside which it refuses a vote anyway.
pub const LEADER_LEASE: Duration = Duration::from_millis(super::ELECTION_TIMEOUT_MAX_MS);
/// The random part of a replica's wait beyond the lease, drawn afresh for each round, so two
/// replicas that lost the same leader rarely stand at once: openraft's minimum election timeout.
pub const JITTER: Duration = Duration::from_millis(super::ELECTION_TIMEOUT_MIN_MS);
/// How often a replica looks at whether it should stand.
const TICK: Duration = Duration::from_millis(50);
/// Deadline of one pre-vote request: a silent peer counts as a refusal.
pub const PRE_VOTE_DEADLINE: Duration = Duration::from_millis(500);

/// When this replica last heard a leader: an accepted AppendEntries or InstallSnapshot (the
/// `Raft` service touches it), or its own leadership.
#[derive(Debug)]
pub struct Heard(Mutex<Instant>);

impl Heard {
    pub fn new(now: Instant) -> Heard {
        Heard(Mutex::new(now))
    }

    pub fn touch(&self, now: Instant) {
        let mut last = self.0.lock();
        *last = (*last).max(now);
    }

    fn since(&self, now: Instant) -> Duration {
        now.saturating_duration_since(*self.0.lock())
    }
}

/// When each voter last answered this node's AppendEntries (heartbeats included) as one that
/// follows it: what a leader judges whether it still has a majority by ([`Answers::majority`]).
/// openraft 0.9's leader never steps down by itself: cut off from the other replicas but not from
/// its clients, it kept taking calls, each waiting out the 10 s commit deadline and then failing
/// with an error that sent no caller elsewhere, while the majority had long elected a new leader.
/// A leader that has not heard a majority within [`LEADER_LEASE`] now refuses calls as not the
/// leader (`Replica::check_serving`, `Replica::wait`), which moves its callers to the others.
/// This is for availability only: what it answers is still confirmed by a commit or a read index.
#[derive(Debug, Default)]
pub struct Answers(Mutex<BTreeMap<u64, Instant>>);

impl Answers {
    pub fn touch(&self, voter: u64, now: Instant) {
        let mut answered = self.0.lock();
        let at = answered.entry(voter).or_insert(now);
        *at = (*at).max(now);
    }

    /// Whether `me` and the voters that answered within [`LEADER_LEASE`] of `now` are a majority
    /// of `voters`.
    pub fn majority(&self, me: u64, voters: impl Iterator<Item = u64>, now: Instant) -> bool {
        let answered = self.0.lock();
        let (mut heard, mut all) = (0, 0);
        for voter in voters {
            all += 1;
            let recent = answered.get(&voter).is_some_and(|&at| now.saturating_duration_since(at) < LEADER_LEASE);
            if voter == me || recent {
                heard += 1;
            }
        }
        heard * 2 > all
    }
}

/// A would-be candidate's question: would you vote for `candidate`, whose log ends at `last_log`?
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PreVote {
    pub candidate: u64,
    pub last_log: Option<LogId<u64>>,
}

/// This replica's answer to `ask` at `now`.
pub fn would_vote(raft: &Raft<TypeConfig>, heard: &Heard, ask: &PreVote, now: Instant) -> bool {
    if raft.metrics().borrow().state == ServerState::Leader {
        return false;
    }
    heard.since(now) >= LEADER_LEASE && ask.last_log >= raft.data_metrics().borrow().last_log
}

/// How long a replica waits, from the last leader it heard or its last round, before its next
/// round: the lease and a fresh random part of the jitter.
fn silence_to_stand(rng: &mut SplitMix64) -> Duration {
    LEADER_LEASE + JITTER.mul_f64(rng.below(1000) as f64 / 1000.0)
}

/// Stands for election when the leader has been silent long enough and a majority of the
/// voters would vote; runs until openraft shuts down.
pub async fn stand(raft: Raft<TypeConfig>, me: u64, network: Network, heard: Arc<Heard>) {
    #[expect(clippy::disallowed_methods, reason = "the edge: an election timer reads the clock")]
    let started = Now::read();
    let mut rng = SplitMix64(me.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ started.unix_ms);
    let mut wait = silence_to_stand(&mut rng);
    let mut peers: BTreeMap<u64, (String, Client)> = BTreeMap::new();
    // Kept apart from `heard`: a replica that stood (or asked) recently must still answer
    // another's pre-vote as one that heard no leader.
    let mut last_round = started.instant;
    loop {
        tokio::time::sleep(TICK).await;
        #[expect(clippy::disallowed_methods, reason = "the edge: an election timer reads the clock")]
        let now = Now::read().instant;
        let (state, term, membership) = {
            let metrics = raft.metrics();
            let metrics = metrics.borrow();
            if metrics.running_state.is_err() {
                return;
            }
            (metrics.state, metrics.current_term, metrics.membership_config.clone())
        };
        if state == ServerState::Leader {
            heard.touch(now);
            continue;
        }
        // A learner, or a replica that has no membership yet (on a fresh cluster, until the
        // founder's first entries reach it), does not stand; it still answers pre-votes, as one
        // that has heard no leader (it would grant the founder's).
        let membership = membership.membership();
        if !membership.voter_ids().any(|id| id == me) {
            continue;
        }
        if heard.since(now) < wait || now.saturating_duration_since(last_round) < wait {
            continue;
        }
        let voters: Vec<(u64, &BasicNode)> =
            membership.voter_ids().filter_map(|id| membership.get_node(&id).map(|node| (id, node))).collect();
        let ask = PreVote { candidate: me, last_log: raft.data_metrics().borrow().last_log };
        let mut answers = Vec::new();
        for (id, node) in voters.iter().filter(|(id, _)| *id != me) {
            // One lazily connected client per peer, made again when its address changed.
            let client = match peers.get(id) {
                Some((addr, client)) if *addr == node.addr => client.clone(),
                _ => match network.client(&node.addr) {
                    Ok(client) => peers.entry(*id).insert_entry((node.addr.clone(), client)).get().1.clone(),
                    Err(e) => {
                        debug!("pre-vote to {id}: {e}");
                        continue;
                    }
                },
            };
            answers.push(Network::pre_vote(client, &ask));
        }
        let grants = 1 + futures::future::join_all(answers).await.into_iter().filter(|&granted| granted).count();
        #[expect(clippy::disallowed_methods, reason = "the edge: an election timer reads the clock")]
        let after = Now::read().instant;
        // The round waits up to PRE_VOTE_DEADLINE on a silent voter. Meanwhile another replica
        // may have won an election this one granted in the round, and standing now would depose
        // it: two replicas that lost the same leader did so to each other for seconds on end
        // (multihost::replicated, a Status past 12 s). Stand only if still nobody leads.
        let term_after = raft.metrics().borrow().current_term;
        let moved_on = term_after != term || heard.since(after) < after.saturating_duration_since(now);
        if moved_on {
            debug!(term, term_after, "a leader was heard, or the term moved, during the pre-vote round: not standing");
        } else if grants * 2 > voters.len() {
            info!(term, grants, voters = voters.len(), "no leader heard: standing for election");
            if raft.trigger().elect().await.is_err() {
                return;
            }
        } else {
            debug!(grants, voters = voters.len(), "no leader heard, but no majority would vote: not standing");
        }
        last_round = after;
        wait = silence_to_stand(&mut rng);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[expect(clippy::disallowed_methods, reason = "a test's clock")]
    fn a_leader_has_a_majority_while_enough_voters_answered_within_the_lease() {
        let start = Instant::now();
        let answers = Answers::default();
        let voters = || [1, 2, 3].into_iter();
        assert!(!answers.majority(1, voters(), start), "none answered: itself alone is not a majority of three");
        answers.touch(2, start);
        assert!(answers.majority(1, voters(), start + LEADER_LEASE / 2));
        assert!(!answers.majority(1, voters(), start + LEADER_LEASE), "the answer is a lease old");
        answers.touch(3, start + LEADER_LEASE);
        assert!(answers.majority(1, voters(), start + LEADER_LEASE));
        answers.touch(3, start);
        assert!(answers.majority(1, voters(), start + LEADER_LEASE), "an older answer does not move it back");
        assert!(answers.majority(1, [1].into_iter(), start + LEADER_LEASE * 10), "a lone voter is its own majority");
        assert!(!answers.majority(1, [1, 2, 3, 4, 5].into_iter(), start + LEADER_LEASE), "two of five");
    }
}
