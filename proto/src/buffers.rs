//! Receive buffers recycled from a bounded pool. A payload read into a fresh buffer of a megabyte
//! pays for fresh pages: the kernel zeroes each one and faults it in, which costs about as much
//! as the kernel copying the bytes off the socket (the profile of 1 MiB reads in BENCHMARKS.md).
//! Large payloads are read into a buffer of the pool instead, and the buffer goes back to the pool
//! when the last `Bytes` of it drops, so a reader that keeps nothing keeps reusing warm pages.
//!
//! Buffers come in power-of-two classes from [`POOLED_FROM`] up; smaller payloads are left to the
//! allocator, whose free lists already reuse their memory. The pool holds at most `max_idle`
//! bytes of idle buffers; buffers in use are bounded by whoever reads (requests in flight).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

/// The smallest payload read into a pooled buffer.
pub const POOLED_FROM: usize = 64 << 10;

/// Classes: `POOLED_FROM << i` bytes, up to a class holding the largest payload a frame carries.
const CLASSES: usize =
    (crate::frame::MAX_PAYLOAD_BYTES as usize / POOLED_FROM).next_power_of_two().trailing_zeros() as usize + 1;

/// Idle receive buffers, by size class, at most `max_idle` bytes of them.
pub struct BufferPool {
    classes: [Mutex<Vec<Vec<u8>>>; CLASSES],
    idle: AtomicUsize,
    max_idle: usize,
}

impl BufferPool {
    /// A pool keeping at most `max_idle` bytes of idle buffers (0: keeps none).
    pub fn new(max_idle: usize) -> Arc<BufferPool> {
        Arc::new(BufferPool { classes: std::array::from_fn(|_| Mutex::default()), idle: AtomicUsize::new(0), max_idle })
    }

    /// Bytes of idle buffers held now.
    pub fn idle_bytes(&self) -> usize {
        self.idle.load(Ordering::Relaxed)
    }

    /// The class of a `len`-byte payload and its buffers' capacity; `None` below [`POOLED_FROM`].
    fn class(len: usize) -> Option<(usize, usize)> {
        if len < POOLED_FROM {
            return None;
        }
        let capacity = len.next_power_of_two();
        let class = (capacity / POOLED_FROM).trailing_zeros() as usize;
        (class < CLASSES).then_some((class, capacity))
    }

    /// An empty buffer with room for `len` bytes: an idle one of its class if there is one.
    pub fn take(self: &Arc<BufferPool>, len: usize) -> Pooled {
        let Some((class, capacity)) = BufferPool::class(len) else {
            return Pooled::unpooled(len);
        };
        let idle = self.classes[class].lock().pop();
        let buf = match idle {
            Some(buf) => {
                self.idle.fetch_sub(buf.capacity(), Ordering::Relaxed);
                buf
            }
            None => Vec::with_capacity(capacity),
        };
        Pooled { buf, home: Some(self.clone()) }
    }

    /// Keeps `buf` (emptied) for reuse, unless that would hold more than `max_idle` idle bytes.
    fn give_back(&self, mut buf: Vec<u8>) {
        let Some((class, capacity)) = BufferPool::class(buf.capacity()) else { return };
        if capacity != buf.capacity() {
            return;
        }
        let mut idle = self.classes[class].lock();
        if self.idle.load(Ordering::Relaxed) + capacity > self.max_idle {
            return;
        }
        self.idle.fetch_add(capacity, Ordering::Relaxed);
        buf.clear();
        idle.push(buf);
    }
}

/// A buffer taken from a [`BufferPool`] (or not pooled, when small): filled through
/// [`Pooled::buf`], then frozen into `Bytes` that give it back when the last of them drops.
pub struct Pooled {
    buf: Vec<u8>,
    home: Option<Arc<BufferPool>>,
}

impl Pooled {
    /// A buffer of `len` bytes' room that no pool takes back.
    pub fn unpooled(len: usize) -> Pooled {
        Pooled { buf: Vec::with_capacity(len), home: None }
    }

    /// The buffer to fill (its capacity is at least the length it was taken for).
    pub fn buf(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }

    /// The filled bytes, handing the buffer back to its pool when the last clone drops.
    pub fn freeze(mut self) -> Bytes {
        match self.home {
            None => Bytes::from(std::mem::take(&mut self.buf)),
            Some(_) => Bytes::from_owner(self),
        }
    }
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(home) = self.home.take() {
            home.give_back(std::mem::take(&mut self.buf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_comes_back_when_its_last_bytes_drop_and_is_reused() {
        let pool = BufferPool::new(4 << 20);
        let mut taken = pool.take(1 << 20);
        taken.buf().extend_from_slice(&[7; 1 << 20]);
        let first = taken.buf().as_ptr();
        let bytes = taken.freeze();
        let part = bytes.slice(10..20);
        drop(bytes);
        assert_eq!(pool.idle_bytes(), 0, "a slice still holds it");
        assert_eq!(part[..], [7; 10]);
        drop(part);
        assert_eq!(pool.idle_bytes(), 1 << 20);
        // A payload of the same class gets the same (warm) buffer back, emptied.
        let mut again = pool.take((1 << 20) - 5);
        assert_eq!((again.buf().as_ptr(), again.buf().len()), (first, 0));
        assert_eq!(pool.idle_bytes(), 0);
        drop(again);
        assert_eq!(pool.idle_bytes(), 1 << 20, "an unfrozen buffer comes back too");
    }

    #[test]
    fn idle_buffers_are_bounded_and_small_ones_are_not_pooled() {
        let pool = BufferPool::new(3 << 20);
        let held: Vec<Bytes> = (0..5).map(|_| pool.take(1 << 20).freeze()).collect();
        drop(held);
        assert_eq!(pool.idle_bytes(), 3 << 20, "at most max_idle bytes idle");
        let small = pool.take(POOLED_FROM - 1);
        assert!(small.home.is_none());
        drop(small.freeze());
        assert_eq!(pool.idle_bytes(), 3 << 20);
        let none = BufferPool::new(0);
        drop(none.take(1 << 20).freeze());
        assert_eq!(none.idle_bytes(), 0);
    }

    #[test]
    fn classes_cover_every_payload_a_frame_carries() {
        assert_eq!(BufferPool::class(POOLED_FROM), Some((0, POOLED_FROM)));
        assert_eq!(BufferPool::class(POOLED_FROM + 1), Some((1, 2 * POOLED_FROM)));
        let largest = crate::frame::MAX_PAYLOAD_BYTES as usize;
        assert!(BufferPool::class(largest).is_some_and(|(_, capacity)| capacity >= largest));
    }
}
