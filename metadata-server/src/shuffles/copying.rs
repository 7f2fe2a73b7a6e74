//! Closed segments with a copy to make (a 2-copy shuffle's segment with one copy gone, or a
//! segment on a draining server nothing else backs), and a copy moved once made. The copies
//! themselves are `crate::copies`'s; this says which segments need one.

use tern_proto::v1::LogMoveSegment;
use tern_proto::{ServerId, ShuffleId, StorageClass};

use super::shuffle::Shuffle;
use super::{no_partition, unknown, SegmentCopy, Shuffles};
use crate::error::{invalid, Refusal};

/// A closed segment with a copy to make (see [`Shuffles::segments_to_copy`]): one of a 2-copy
/// shuffle with one copy gone and one readable (re-replication), or one on a draining server
/// that no copy elsewhere backs (a drain).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentToCopy {
    pub segment: SegmentCopy,
    /// The server of the copy replaced: gone (dead, or restarted without it), or draining.
    pub lost: ServerId,
    /// The server of the readable copy, which copies it (the draining server itself for a drain).
    pub live: ServerId,
    pub class: StorageClass,
    /// Committed bytes there as far as the commits tell (a map spanning several segments counts
    /// evenly in each): what the rate limit is charged until the source reports the bytes.
    pub bytes: u64,
    /// Copied off a draining server (else re-replicated).
    pub drain: bool,
}

impl Shuffles {
    /// Closed segments (not their partition's last: no writer pushes there any more) with a copy
    /// to make, by shuffle, partition and index, at most `limit`, those `skip` says are taken left
    /// out: a 2-copy shuffle's with exactly one readable copy, and any shuffle's with a copy on a
    /// server `draining` names that no readable copy on a server not draining backs. A copy is
    /// readable when `alive` says its server is and it is not marked lost. The last segment of a
    /// partition is left alone: writers may still push to it (with a copy lost they move on, and
    /// it is closed then; a draining server's are waited out).
    pub fn segments_to_copy(
        &self,
        alive: impl Fn(ServerId) -> bool,
        draining: impl Fn(ServerId) -> bool,
        skip: impl Fn(SegmentCopy) -> bool,
        limit: usize,
    ) -> Vec<SegmentToCopy> {
        let mut out = Vec::new();
        for (&shuffle_id, shuffle) in &self.shuffles {
            let first = out.len();
            for (p, partition) in (0..).zip(&shuffle.partitions) {
                let last = partition.len() - 1;
                for (index, copies) in (0..last).zip(partition.servers()) {
                    let readable = |server: ServerId| alive(server) && !shuffle.lost.contains(&(p, index, server));
                    let (lost, live, drain) = match copies.second {
                        Some(second) if readable(copies.first) != readable(second) => match readable(second) {
                            true => (copies.first, second, false),
                            false => (second, copies.first, false),
                        },
                        _ => {
                            let backed = copies.servers().any(|s| readable(s) && !draining(s));
                            match copies.servers().find(|&s| readable(s) && draining(s)) {
                                Some(off) if !backed => (off, off, true),
                                _ => continue,
                            }
                        }
                    };
                    let segment = SegmentCopy { shuffle_id, partition: p, index };
                    if skip(segment) {
                        continue;
                    }
                    let class = shuffle.storage_class;
                    out.push(SegmentToCopy { segment, lost, live, class, bytes: 0, drain });
                    if out.len() == limit {
                        break;
                    }
                }
                if out.len() == limit {
                    break;
                }
            }
            estimate_bytes(shuffle, &mut out[first..]);
            if out.len() == limit {
                break;
            }
        }
        out
    }

    /// Whether the chain names `server` as holding a copy of `segment` (of a registered shuffle).
    pub fn holds(&self, segment: SegmentCopy, server: ServerId) -> bool {
        self.shuffles
            .get(&segment.shuffle_id)
            .and_then(|shuffle| shuffle.partitions.get(segment.partition as usize))
            .and_then(|partition| partition.servers().nth(segment.index as usize))
            .is_some_and(|copies| copies.on(server))
    }

    /// Replaces a segment's copy on `log.old_server_id` by the one stored on `log.new_server_id`
    /// (as logged); the servers' counts are the caller's.
    pub fn move_segment(&mut self, log: &LogMoveSegment) -> Result<(), Refusal> {
        let shuffle_id = ShuffleId::from_wire(log.shuffle_id);
        let (old, new) = (ServerId::from_wire(log.old_server_id), ServerId::from_wire(log.new_server_id));
        let shuffle = self.shuffles.get_mut(&shuffle_id).ok_or_else(|| unknown(shuffle_id))?;
        let partitions = shuffle.partitions.len();
        let partition = shuffle
            .partitions
            .get_mut(log.partition as usize)
            .ok_or_else(|| no_partition(log.partition, partitions))?;
        let what = format!("segment {} of partition {} of shuffle {shuffle_id}", log.index, log.partition);
        let copies = partition.copies_mut(log.index).ok_or_else(|| invalid(format!("{what} does not exist")))?;
        if !copies.on(old) || copies.on(new) {
            return Err(invalid(format!(
                "{what} is on servers {:?}: a copy cannot move from server {old} to server {new}",
                copies.servers().collect::<Vec<_>>()
            )));
        }
        if copies.first == old {
            copies.first = new;
        } else {
            copies.second = Some(new);
        }
        shuffle.lost.remove(&(log.partition, log.index, old));
        if let Some(held) = shuffle.holders.get_mut(&old) {
            *held -= 1;
            if *held == 0 {
                shuffle.holders.remove(&old);
            }
        }
        *shuffle.holders.entry(new).or_default() += 1;
        Ok(())
    }
}

/// Fills in the committed bytes of `needs` (segments of `shuffle`): each commit's bytes of a
/// partition count evenly in each segment of its range there. One pass over the commits.
fn estimate_bytes(shuffle: &Shuffle, needs: &mut [SegmentToCopy]) {
    if needs.is_empty() {
        return;
    }
    for commit in shuffle.commits.values() {
        for need in needs.iter_mut() {
            let p = need.segment.partition as usize;
            let first = commit.first_segment.get(p).copied().unwrap_or(0);
            let last = commit.last_segment.get(p).copied().unwrap_or(0);
            if (first..=last).contains(&need.segment.index) {
                need.bytes += commit.partition_bytes[p] / u64::from(last - first + 1);
            }
        }
    }
}
