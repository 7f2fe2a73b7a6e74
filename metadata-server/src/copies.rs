//! Block and shuffle-segment copies the metadata server directs: re-replication (a 2-copy file's
//! block, or a 2-copy shuffle's closed segment, whose other copy's server died gets a second copy
//! again) and drains (a draining server's blocks that no other copy backs are copied off before
//! it exits). One table, one rate limit and one set of counters serve both kinds.
//!
//! Why server-to-server, directed by heartbeats: the metadata server never touches data, and the
//! storage server holding the surviving copy can read it locally and write it once over the
//! network, where a copy through the metadata server would cross the network twice and put data
//! on the control plane. The task travels in the source's heartbeat reply (as frees do), with
//! the target block's grant and its owner's token, so the target admits the write as it would a
//! client's; the source reports the outcome in its next heartbeat (which it sends early when its
//! batch is done, so copying is not paced by the heartbeat interval).
//!
//! A segment copy is the same path with the segment's content: the source closes the segment to
//! pushes and pushes every batch it holds, with its map and attempt, to the target (see
//! `storage-server/src/copier.rs`); the partition's chain names the new copy once it is stored
//! (`LogMoveSegment`).
//!
//! Only a stored copy is logged (`LogMoveBlock`, `LogMoveSegment`), so a metadata server that restarts mid-copy
//! knows only the old placement: the dead server is declared dead again after the server timeout
//! and its blocks are chosen for copying anew; a copy stored but never logged is an unreferenced
//! block (or segment) on its server, freed when that server reconciles. Ids of chosen targets are raised in the
//! log first (`LogCounters`), so no id of an unlogged copy is ever handed out again.
//!
//! Tasks live here, keyed by id, and are bounded ([`MAX_PENDING`]); this module decides what is
//! sent when (the rate limit) and keeps the counts `tern status` and the metrics show. Which
//! blocks need a copy, and where it goes, the state decides (`State::plan_copies`), since that
//! spans the namespace and the registry.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use tern_proto::v1::{CopyBlock, CopySegment, CopyStatus};
use tern_proto::{FileId, ServerId, StorageClass};

use crate::namespace::BlockRef;
use crate::shuffles::SegmentCopy;

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
    /// The block's (or segment's) other copy is on a dead server.
    Rereplicate,
    /// The copy is on a draining server and nothing else backs it.
    Drain,
}

/// What one copy makes.
#[derive(Debug, Clone)]
pub enum What {
    /// The file's copy at `copy` (index in `FileMeta::blocks`), now `old`, is replaced by `target`
    /// once `source` (another copy, or `old` itself when draining) was copied there.
    Block { file_id: FileId, copy: u32, old: BlockRef, source: BlockRef, target: BlockRef },
    /// The segment's copy on `old` (a dead server) is replaced by one on `target`, copied from
    /// its copy on `source`.
    Segment { segment: SegmentCopy, old: ServerId, source: ServerId, target: ServerId, class: StorageClass },
}

/// What a task is keyed by, so no copy has two tasks at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    Block(FileId, u32),
    Segment(SegmentCopy),
}

/// A task as a heartbeat reply carries it.
#[derive(Debug, Clone, PartialEq)]
pub enum Wire {
    Block(CopyBlock),
    Segment(CopySegment),
}

/// One copy to make.
#[derive(Debug, Clone)]
pub struct Task {
    pub what: What,
    /// Bytes it copies: a block's length; for a segment, the committed bytes the metadata server
    /// counts there (an estimate: the source reports what it copied).
    pub bytes: u64,
    pub why: Why,
    sent: Option<Instant>,
}

impl Task {
    pub fn new(what: What, bytes: u64, why: Why) -> Task {
        Task { what, bytes, why, sent: None }
    }

    /// The server that copies (holds the source copy).
    pub fn source(&self) -> ServerId {
        match &self.what {
            What::Block { source, .. } => source.server_id,
            What::Segment { source, .. } => *source,
        }
    }

    /// The server the copy goes to.
    pub fn target(&self) -> ServerId {
        match &self.what {
            What::Block { target, .. } => target.server_id,
            What::Segment { target, .. } => *target,
        }
    }

    /// The server of the copy replaced.
    pub fn old_server(&self) -> ServerId {
        match &self.what {
            What::Block { old, .. } => old.server_id,
            What::Segment { old, .. } => *old,
        }
    }

    pub fn is_segment(&self) -> bool {
        matches!(self.what, What::Segment { .. })
    }

    fn key(&self) -> Key {
        match &self.what {
            What::Block { file_id, copy, .. } => Key::Block(*file_id, *copy),
            What::Segment { segment, .. } => Key::Segment(*segment),
        }
    }
}

/// Counts of one kind of copy since start.
#[derive(Debug, Default, Clone, Copy)]
struct Done {
    copied: u64,
    failed: u64,
}

/// The copy table, the rate limit and the counters.
#[derive(Debug)]
pub struct Copies {
    /// Bytes per second all copies together may take (0 = no limit).
    rate: u64,
    tasks: BTreeMap<u64, Task>,
    next_id: u64,
    /// Copies with a task: never two for the same copy.
    busy: HashSet<Key>,
    /// Token bucket: bytes that may be handed out now, refilled at `rate`, at most one second's.
    /// A segment bigger than a second's worth is handed out from a full bucket and leaves it in
    /// debt (negative), so the rate holds over time.
    budget: f64,
    refilled: Instant,
    blocks: Done,
    segments: Done,
    copied_bytes: u64,
    recent: VecDeque<(Instant, u64)>,
    /// Something changed that may need copies (a death, a drain, a copy done or failed): the next
    /// reap looks over the files and shuffles.
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
            blocks: Done::default(),
            segments: Done::default(),
            copied_bytes: 0,
            recent: VecDeque::new(),
            dirty: false,
            unplaceable: 0,
            retry_at: None,
        }
    }

    /// Asks for a look over the files and shuffles at the next reap.
    pub fn wake(&mut self) {
        self.dirty = true;
    }

    /// Whether a look is due (asked for, or the retry for copies without room came), clearing it.
    pub fn take_wake(&mut self, now: Instant) -> bool {
        let retry = self.retry_at.is_some_and(|at| now >= at);
        if retry {
            self.retry_at = None;
        }
        std::mem::take(&mut self.dirty) || retry
    }

    /// Copies are needed and no server has room: look again in [`RETRY_UNPLACEABLE`].
    pub fn retry_later(&mut self, now: Instant) {
        self.retry_at = Some(now + RETRY_UNPLACEABLE);
    }

    pub fn is_busy(&self, file_id: FileId, copy: u32) -> bool {
        self.busy.contains(&Key::Block(file_id, copy))
    }

    pub fn is_segment_busy(&self, segment: SegmentCopy) -> bool {
        self.busy.contains(&Key::Segment(segment))
    }

    /// Room for this many more tasks.
    pub fn room(&self) -> usize {
        MAX_PENDING.saturating_sub(self.tasks.len())
    }

    pub fn add(&mut self, task: Task) {
        let id = self.next_id;
        self.next_id += 1;
        self.busy.insert(task.key());
        self.tasks.insert(id, task);
    }

    /// Tasks to hand to `source` in its heartbeat reply, within the rate limit; `wire` builds each
    /// one's message (the state adds address, grant and token).
    pub fn hand_out(&mut self, source: ServerId, now: Instant, mut wire: impl FnMut(u64, &Task) -> Wire) -> Vec<Wire> {
        if self.rate > 0 {
            let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
            self.budget = (self.budget + elapsed * self.rate as f64).min(self.rate as f64);
        }
        self.refilled = now;
        let mut out = Vec::new();
        for (&id, task) in self.tasks.iter_mut() {
            if task.source() != source {
                continue;
            }
            if task.sent.is_some_and(|sent| now.saturating_duration_since(sent) < RESEND_AFTER) {
                continue;
            }
            // A task bigger than the bucket waits for a full one.
            let cost = task.bytes.min(self.rate) as f64;
            if self.rate > 0 && task.sent.is_none() && self.budget < cost {
                break;
            }
            if self.rate > 0 && task.sent.is_none() {
                self.budget -= task.bytes as f64;
            }
            task.sent = Some(now);
            out.push(wire(id, task));
        }
        out
    }

    /// Takes a task reported done by `source` (`None` for an id it was not given: stale). A
    /// segment copy reports the bytes it copied, which the counts and the rate take instead of the
    /// estimate.
    pub fn finish(&mut self, id: u64, source: ServerId, ok: bool, reported: u64, now: Instant) -> Option<Task> {
        if self.tasks.get(&id).is_none_or(|task| task.source() != source) {
            return None;
        }
        let task = self.tasks.remove(&id).expect("checked above");
        self.busy.remove(&task.key());
        self.dirty = true;
        let bytes = if task.is_segment() { reported } else { task.bytes };
        if self.rate > 0 && task.is_segment() && ok {
            // Charged the estimate when handed out: the difference now.
            self.budget -= bytes as f64 - task.bytes as f64;
        }
        let done = if task.is_segment() { &mut self.segments } else { &mut self.blocks };
        if ok {
            done.copied += 1;
            self.copied_bytes += bytes;
            self.recent.push_back((now, bytes));
        } else {
            done.failed += 1;
        }
        Some(task)
    }

    /// Drops the tasks for which `keep` is false (their source died, their target died), and
    /// returns them so what their targets hold can be freed.
    pub fn drop_where(&mut self, mut keep: impl FnMut(&Task) -> bool) -> Vec<Task> {
        let gone: Vec<u64> = self.tasks.iter().filter(|(_, task)| !keep(task)).map(|(&id, _)| id).collect();
        let mut dropped = Vec::with_capacity(gone.len());
        for id in gone {
            let task = self.tasks.remove(&id).expect("listed above");
            self.busy.remove(&task.key());
            if task.is_segment() {
                self.segments.failed += 1;
            } else {
                self.blocks.failed += 1;
            }
            dropped.push(task);
        }
        if !dropped.is_empty() {
            self.dirty = true;
        }
        dropped
    }

    /// The segments copies under way write to `target`.
    pub fn segments_to(&self, target: ServerId) -> impl Iterator<Item = SegmentCopy> + '_ {
        self.tasks.values().filter_map(move |task| match task.what {
            What::Segment { segment, target: to, .. } if to == target => Some(segment),
            _ => None,
        })
    }

    /// Tasks with this source, for a server's status.
    pub fn pending_from(&self, source: ServerId) -> u64 {
        self.tasks.values().filter(|task| task.source() == source).count() as u64
    }

    /// Draining segment tasks pending off `server`.
    pub fn segments_draining_from(&self, server: ServerId) -> u64 {
        let off = |task: &&Task| task.why == Why::Drain && task.old_server() == server && task.is_segment();
        self.tasks.values().filter(off).count() as u64
    }

    /// Draining tasks pending off `server` (blocks and segments).
    pub fn draining_from(&self, server: ServerId) -> u64 {
        self.tasks.values().filter(|task| task.why == Why::Drain && task.old_server() == server).count() as u64
    }

    /// (pending blocks, pending segments, pending bytes).
    fn pending(&self) -> (u64, u64, u64) {
        let segments = self.tasks.values().filter(|task| task.is_segment()).count() as u64;
        let bytes = self.tasks.values().map(|task| task.bytes).sum();
        (self.tasks.len() as u64 - segments, segments, bytes)
    }

    /// Counts for the metrics: (pending blocks, pending bytes, copied blocks, copied bytes,
    /// failed blocks, pending segments, copied segments, failed segments).
    pub fn totals(&self) -> [u64; 8] {
        let (blocks, segments, bytes) = self.pending();
        [
            blocks,
            bytes,
            self.blocks.copied,
            self.copied_bytes,
            self.blocks.failed,
            segments,
            self.segments.copied,
            self.segments.failed,
        ]
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
        let (pending_blocks, pending_segments, pending_bytes) = self.pending();
        CopyStatus {
            pending_blocks,
            pending_bytes,
            copied_blocks: self.blocks.copied,
            copied_bytes: self.copied_bytes,
            failed_blocks: self.blocks.failed,
            recent_bytes_per_sec: (bytes as f64 / span.as_secs_f64()) as u64,
            limit_bytes_per_sec: self.rate,
            pending_segments,
            copied_segments: self.segments.copied,
            failed_segments: self.segments.failed,
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods, reason = "tests may read the clock")]
mod tests {
    use super::*;
    use tern_proto::BlockId;

    fn block(server: u64, id: u64) -> BlockRef {
        BlockRef { block_id: BlockId::from_wire(id), server_id: ServerId::from_wire(server) }
    }

    fn task(file: u64, length: u32) -> Task {
        let what = What::Block {
            file_id: FileId::from_wire(file),
            copy: 1,
            old: block(2, file),
            source: block(1, file),
            target: block(3, 1000 + file),
        };
        Task::new(what, u64::from(length), Why::Rereplicate)
    }

    fn id_of(wire: &Wire) -> u64 {
        match wire {
            Wire::Block(block) => block.copy_id,
            Wire::Segment(segment) => segment.copy_id,
        }
    }

    fn segment_task(partition: u32, bytes: u64) -> Task {
        let segment = SegmentCopy { shuffle_id: tern_proto::ShuffleId::from_wire(9), partition, index: 0 };
        let what = What::Segment {
            segment,
            old: ServerId::from_wire(2),
            source: ServerId::from_wire(1),
            target: ServerId::from_wire(3),
            class: StorageClass::Any,
        };
        Task::new(what, bytes, Why::Rereplicate)
    }

    #[test]
    fn hands_out_within_the_rate_and_resends_only_after_a_while() {
        let now = Instant::now();
        let mut copies = Copies::new(3 << 20, now);
        for file in 0..8 {
            copies.add(task(file, 1 << 20));
        }
        let first = copies.hand_out(ServerId::from_wire(1), now, |id, _| {
            Wire::Block(CopyBlock { copy_id: id, ..Default::default() })
        });
        assert_eq!(first.len(), 3, "one second's budget of 3 MiB");
        assert!(
            copies.hand_out(ServerId::from_wire(2), now, |_, _| Wire::Block(CopyBlock::default())).is_empty(),
            "not its source"
        );
        let later = now + Duration::from_millis(500);
        let second = copies.hand_out(ServerId::from_wire(1), later, |id, _| {
            Wire::Block(CopyBlock { copy_id: id, ..Default::default() })
        });
        assert_eq!(second.len(), 1, "half a second refills 1.5 MiB");
        assert!(copies.finish(id_of(&first[0]), ServerId::from_wire(1), true, 0, later).is_some());
        assert!(copies.finish(id_of(&first[0]), ServerId::from_wire(1), true, 0, later).is_none(), "reported twice");
        assert!(copies.finish(id_of(&first[1]), ServerId::from_wire(2), true, 0, later).is_none(), "not its source");
        let resent = copies.hand_out(ServerId::from_wire(1), now + RESEND_AFTER + Duration::from_secs(1), |id, _| {
            Wire::Block(CopyBlock { copy_id: id, ..Default::default() })
        });
        let ids: Vec<u64> = resent.iter().map(id_of).collect();
        assert!(ids.contains(&id_of(&first[1])) && !ids.contains(&id_of(&first[0])), "{ids:?}");
        let status = copies.status(later);
        assert_eq!((status.copied_blocks, status.copied_bytes, status.pending_blocks), (1, 1 << 20, 7));
        assert!(copies.is_busy(FileId::from_wire(1), 1) && !copies.is_busy(FileId::from_wire(0), 1));
    }

    #[test]
    fn dropped_tasks_count_as_failed_and_free_their_copy_index() {
        let now = Instant::now();
        let mut copies = Copies::new(0, now);
        copies.add(task(1, 10));
        copies.add(task(2, 10));
        let dropped = copies.drop_where(|task| !matches!(task.what, What::Block { file_id, .. } if file_id.get() == 1));
        assert_eq!(dropped.len(), 1);
        assert!(!copies.is_busy(FileId::from_wire(1), 1) && copies.is_busy(FileId::from_wire(2), 1));
        assert_eq!(copies.status(now).failed_blocks, 1);
        assert!(copies.take_wake(now) && !copies.take_wake(now));
        copies.retry_later(now);
        assert!(!copies.take_wake(now) && copies.take_wake(now + RETRY_UNPLACEABLE));
    }

    #[test]
    fn a_segment_larger_than_the_bucket_waits_for_a_full_one_and_its_reported_bytes_count() {
        let now = Instant::now();
        let mut copies = Copies::new(4 << 20, now);
        copies.add(segment_task(0, 10 << 20));
        copies.add(segment_task(1, 1 << 20));
        let wire = |id, _: &Task| Wire::Segment(CopySegment { copy_id: id, ..Default::default() });
        let first = copies.hand_out(ServerId::from_wire(1), now, wire);
        assert_eq!(first.len(), 1, "a full bucket hands out the 10 MiB segment, and is then in debt");
        assert!(copies.is_segment_busy(SegmentCopy {
            shuffle_id: tern_proto::ShuffleId::from_wire(9),
            partition: 0,
            index: 0
        }));
        // 10 MiB charged against 4 MiB: 1.5 s later the bucket is still below the next 1 MiB.
        assert!(copies.hand_out(ServerId::from_wire(1), now + Duration::from_millis(1500), wire).is_empty());
        // Reported 2 MiB copied: the debt shrinks by the 8 MiB not copied.
        copies
            .finish(id_of(&first[0]), ServerId::from_wire(1), true, 2 << 20, now + Duration::from_millis(1500))
            .unwrap();
        assert_eq!(copies.hand_out(ServerId::from_wire(1), now + Duration::from_millis(1500), wire).len(), 1);
        let status = copies.status(now + Duration::from_millis(1500));
        assert_eq!(
            (status.copied_segments, status.copied_bytes, status.pending_segments, status.pending_blocks),
            (1, 2 << 20, 1, 0)
        );
    }
}
