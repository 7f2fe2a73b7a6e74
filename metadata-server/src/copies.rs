//! Block copies the metadata server directs: re-replication (a 2-copy file's block whose other
//! copy's server died gets a second copy again) and drains (a draining server's blocks that no
//! other copy backs are copied off before it exits).
//!
//! Why server-to-server, directed by heartbeats: the metadata server never touches data, and the
//! storage server holding the surviving copy can read it locally and write it once over the
//! network, where a copy through the metadata server would cross the network twice and put data
//! on the control plane. The task travels in the source's heartbeat reply (as frees do), with
//! the target block's grant and its owner's token, so the target admits the write as it would a
//! client's; the source reports the outcome in its next heartbeat (which it sends early when its
//! batch is done, so copying is not paced by the heartbeat interval).
//!
//! Only a stored copy is logged (`LogMoveBlock`), so a metadata server that restarts mid-copy
//! knows only the old placement: the dead server is declared dead again after the server timeout
//! and its blocks are chosen for copying anew; a copy stored but never logged is an unreferenced
//! block on its server, freed when that server reconciles. Ids of chosen targets are raised in the
//! log first (`LogCounters`), so no id of an unlogged copy is ever handed out again.
//!
//! Tasks live here, keyed by id, and are bounded ([`MAX_PENDING`]); this module decides what is
//! sent when (the rate limit) and keeps the counts `tern status` and the metrics show. Which
//! blocks need a copy, and where it goes, the state decides (`State::plan_copies`), since that
//! spans the namespace and the registry.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use tern_proto::v1::{CopyBlock, CopyStatus};
use tern_proto::ServerId;

use crate::namespace::BlockRef;

/// Most copies chosen and not yet done at once: a pass chooses more only as these finish, so the
/// table stays small whatever a dead server held (1 GiB of 1 MiB blocks is 1024).
pub const MAX_PENDING: usize = 4096;
/// A task handed out and not reported within this long is handed out again (its source may have
/// restarted and forgotten it; a storage server ignores a copy id it is already running).
const RESEND_AFTER: Duration = Duration::from_secs(30);
/// While blocks need a copy and no server has room for it, the files are looked over again this
/// often (besides when a server registers), not at every reap.
pub const RETRY_UNPLACEABLE: Duration = Duration::from_secs(10);
/// The window of the recent copy rate shown in status.
const RATE_WINDOW: Duration = Duration::from_secs(10);

/// Why a copy is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The block's other copy is on a dead server.
    Rereplicate,
    /// The copy is on a draining server and nothing else backs it.
    Drain,
}

/// One copy to make: the file's copy at `copy` (index in `FileMeta::blocks`), now `old`, is
/// replaced by `target` once `source` (another copy, or `old` itself when draining) was copied
/// there.
#[derive(Debug, Clone)]
pub struct Task {
    pub file_id: u64,
    pub copy: u32,
    pub old: BlockRef,
    pub source: BlockRef,
    pub target: BlockRef,
    pub length: u32,
    pub why: Why,
    /// Filled in when the task is handed out.
    pub wire: CopyBlock,
    sent: Option<Instant>,
}

impl Task {
    pub fn new(
        file_id: u64,
        copy: u32,
        old: BlockRef,
        source: BlockRef,
        target: BlockRef,
        length: u32,
        why: Why,
    ) -> Task {
        Task { file_id, copy, old, source, target, length, why, wire: CopyBlock::default(), sent: None }
    }
}

/// The copy table, the rate limit and the counters.
#[derive(Debug)]
pub struct Copies {
    /// Bytes per second all copies together may take (0 = no limit).
    rate: u64,
    tasks: BTreeMap<u64, Task>,
    next_id: u64,
    /// (file, copy index) pairs with a task: never two for the same copy.
    busy: HashSet<(u64, u32)>,
    /// Token bucket: bytes that may be handed out now, refilled at `rate`, at most one second's.
    budget: f64,
    refilled: Instant,
    copied_blocks: u64,
    copied_bytes: u64,
    failed_blocks: u64,
    recent: VecDeque<(Instant, u64)>,
    /// Something changed that may need copies (a death, a drain, a copy done or failed): the next
    /// reap looks over the files.
    dirty: bool,
    /// Blocks the last look found no room for, so a repeat is not logged again.
    pub unplaceable: u64,
    /// When to look again for those blocks.
    retry_at: Option<Instant>,
}

impl Copies {
    pub fn new(rate: u64, now: Instant) -> Copies {
        Copies {
            rate,
            tasks: BTreeMap::new(),
            next_id: 1,
            busy: HashSet::new(),
            budget: rate as f64,
            refilled: now,
            copied_blocks: 0,
            copied_bytes: 0,
            failed_blocks: 0,
            recent: VecDeque::new(),
            dirty: false,
            unplaceable: 0,
            retry_at: None,
        }
    }

    /// Asks for a look over the files at the next reap.
    pub fn wake(&mut self) {
        self.dirty = true;
    }

    /// Whether a look is due (asked for, or the retry for blocks without room came), clearing it.
    pub fn take_wake(&mut self, now: Instant) -> bool {
        let retry = self.retry_at.is_some_and(|at| now >= at);
        if retry {
            self.retry_at = None;
        }
        std::mem::take(&mut self.dirty) || retry
    }

    /// Blocks need a copy and no server has room: look again in [`RETRY_UNPLACEABLE`].
    pub fn retry_later(&mut self, now: Instant) {
        self.retry_at = Some(now + RETRY_UNPLACEABLE);
    }

    pub fn is_busy(&self, file_id: u64, copy: u32) -> bool {
        self.busy.contains(&(file_id, copy))
    }

    /// Room for this many more tasks.
    pub fn room(&self) -> usize {
        MAX_PENDING.saturating_sub(self.tasks.len())
    }

    pub fn add(&mut self, task: Task) {
        let id = self.next_id;
        self.next_id += 1;
        self.busy.insert((task.file_id, task.copy));
        self.tasks.insert(id, task);
    }

    /// Tasks to hand to `source` in its heartbeat reply, within the rate limit; `wire` builds each
    /// one's message (the state adds address, grant and token).
    pub fn hand_out(
        &mut self,
        source: ServerId,
        now: Instant,
        mut wire: impl FnMut(u64, &Task) -> CopyBlock,
    ) -> Vec<CopyBlock> {
        if self.rate > 0 {
            let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
            self.budget = (self.budget + elapsed * self.rate as f64).min(self.rate as f64);
        }
        self.refilled = now;
        let mut out = Vec::new();
        for (&id, task) in self.tasks.iter_mut() {
            if task.source.server_id != source {
                continue;
            }
            if task.sent.is_some_and(|sent| now.saturating_duration_since(sent) < RESEND_AFTER) {
                continue;
            }
            if self.rate > 0 && self.budget < f64::from(task.length) {
                break;
            }
            if self.rate > 0 && task.sent.is_none() {
                self.budget -= f64::from(task.length);
            }
            task.sent = Some(now);
            task.wire = wire(id, task);
            out.push(task.wire.clone());
        }
        out
    }

    /// Takes a task reported done by `source` (`None` for an id it was not given: stale).
    pub fn finish(&mut self, id: u64, source: ServerId, ok: bool, now: Instant) -> Option<Task> {
        if self.tasks.get(&id).is_none_or(|task| task.source.server_id != source) {
            return None;
        }
        let task = self.tasks.remove(&id).expect("checked above");
        self.busy.remove(&(task.file_id, task.copy));
        self.dirty = true;
        if ok {
            self.copied_blocks += 1;
            self.copied_bytes += u64::from(task.length);
            self.recent.push_back((now, u64::from(task.length)));
        } else {
            self.failed_blocks += 1;
        }
        Some(task)
    }

    /// Drops the tasks for which `keep` is false (their source died, their target died), and
    /// returns them so their targets' blocks can be freed.
    pub fn drop_where(&mut self, mut keep: impl FnMut(&Task) -> bool) -> Vec<Task> {
        let gone: Vec<u64> = self.tasks.iter().filter(|(_, task)| !keep(task)).map(|(&id, _)| id).collect();
        let mut dropped = Vec::with_capacity(gone.len());
        for id in gone {
            let task = self.tasks.remove(&id).expect("listed above");
            self.busy.remove(&(task.file_id, task.copy));
            self.failed_blocks += 1;
            dropped.push(task);
        }
        if !dropped.is_empty() {
            self.dirty = true;
        }
        dropped
    }

    /// Tasks with this source, for a server's status.
    pub fn pending_from(&self, source: ServerId) -> u64 {
        self.tasks.values().filter(|task| task.source.server_id == source).count() as u64
    }

    /// Draining tasks pending off `server`.
    pub fn draining_from(&self, server: ServerId) -> u64 {
        self.tasks.values().filter(|task| task.why == Why::Drain && task.old.server_id == server).count() as u64
    }

    /// Counts for the metrics: (pending blocks, pending bytes, copied blocks, copied bytes,
    /// failed blocks).
    pub fn totals(&self) -> [u64; 5] {
        let pending_bytes = self.tasks.values().map(|task| u64::from(task.length)).sum();
        [self.tasks.len() as u64, pending_bytes, self.copied_blocks, self.copied_bytes, self.failed_blocks]
    }

    pub fn status(&mut self, now: Instant) -> CopyStatus {
        while self.recent.front().is_some_and(|(at, _)| now.saturating_duration_since(*at) > RATE_WINDOW) {
            self.recent.pop_front();
        }
        // Over the window, or since the first copy in it when it began less than a window ago.
        let bytes: u64 = self.recent.iter().map(|(_, bytes)| bytes).sum();
        let span = match self.recent.front() {
            Some((first, _)) => now.saturating_duration_since(*first).max(Duration::from_millis(100)),
            None => RATE_WINDOW,
        }
        .min(RATE_WINDOW);
        CopyStatus {
            pending_blocks: self.tasks.len() as u64,
            pending_bytes: self.tasks.values().map(|task| u64::from(task.length)).sum(),
            copied_blocks: self.copied_blocks,
            copied_bytes: self.copied_bytes,
            failed_blocks: self.failed_blocks,
            recent_bytes_per_sec: (bytes as f64 / span.as_secs_f64()) as u64,
            limit_bytes_per_sec: self.rate,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tern_proto::BlockId;

    fn block(server: u64, id: u64) -> BlockRef {
        BlockRef { block_id: BlockId::from(id), server_id: ServerId(server) }
    }

    fn task(file: u64, length: u32) -> Task {
        Task::new(file, 1, block(2, file), block(1, file), block(3, 1000 + file), length, Why::Rereplicate)
    }

    #[test]
    fn hands_out_within_the_rate_and_resends_only_after_a_while() {
        let now = Instant::now();
        let mut copies = Copies::new(3 << 20, now);
        for file in 0..8 {
            copies.add(task(file, 1 << 20));
        }
        let first = copies.hand_out(ServerId(1), now, |id, _| CopyBlock { copy_id: id, ..Default::default() });
        assert_eq!(first.len(), 3, "one second's budget of 3 MiB");
        assert!(copies.hand_out(ServerId(2), now, |_, _| CopyBlock::default()).is_empty(), "not its source");
        let later = now + Duration::from_millis(500);
        let second = copies.hand_out(ServerId(1), later, |id, _| CopyBlock { copy_id: id, ..Default::default() });
        assert_eq!(second.len(), 1, "half a second refills 1.5 MiB");
        assert!(copies.finish(first[0].copy_id, ServerId(1), true, later).is_some());
        assert!(copies.finish(first[0].copy_id, ServerId(1), true, later).is_none(), "reported twice");
        assert!(copies.finish(first[1].copy_id, ServerId(2), true, later).is_none(), "not its source");
        let resent = copies.hand_out(ServerId(1), now + RESEND_AFTER + Duration::from_secs(1), |id, _| CopyBlock {
            copy_id: id,
            ..Default::default()
        });
        let ids: Vec<u64> = resent.iter().map(|c| c.copy_id).collect();
        assert!(ids.contains(&first[1].copy_id) && !ids.contains(&first[0].copy_id), "{ids:?}");
        let status = copies.status(later);
        assert_eq!((status.copied_blocks, status.copied_bytes, status.pending_blocks), (1, 1 << 20, 7));
        assert!(copies.is_busy(1, 1) && !copies.is_busy(0, 1));
    }

    #[test]
    fn dropped_tasks_count_as_failed_and_free_their_copy_index() {
        let now = Instant::now();
        let mut copies = Copies::new(0, now);
        copies.add(task(1, 10));
        copies.add(task(2, 10));
        let dropped = copies.drop_where(|task| task.file_id != 1);
        assert_eq!(dropped.len(), 1);
        assert!(!copies.is_busy(1, 1) && copies.is_busy(2, 1));
        assert_eq!(copies.status(now).failed_blocks, 1);
        assert!(copies.take_wake(now) && !copies.take_wake(now));
        copies.retry_later(now);
        assert!(!copies.take_wake(now) && copies.take_wake(now + RETRY_UNPLACEABLE));
    }
}
