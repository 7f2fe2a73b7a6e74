//! Owned, aligned buffers: the only memory the NVMe tier hands to the kernel. O_DIRECT needs the
//! buffer address, length and file offset aligned to the device's direct-I/O alignment; a buffer
//! that is allocated aligned and whose length is a whole number of units makes misaligned I/O
//! impossible to write. Owned (not borrowed), so an io_uring engine can keep it alive until the
//! kernel is done with it, whatever happens to the future that asked.
//!
//! The tier's reads and writes take their buffers from an [`AlignedPool`] and give them back when
//! dropped: a fresh buffer of a megabyte costs fresh pages, zeroed and faulted in by the kernel,
//! on every request.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// A heap buffer of `len` bytes at an address aligned to `align`, `len` a positive multiple of
/// `align`: zeroed when made, or taken from an [`AlignedPool`] (then holding bytes of an earlier
/// I/O of the tier, see [`AlignedPool::take`]).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    /// The allocation: at least `len` bytes.
    layout: Layout,
    len: usize,
    /// The pool it goes back to when dropped.
    home: Option<Arc<AlignedPool>>,
}

// SAFETY: the buffer is uniquely owned heap memory, like a `Box<[u8]>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only ever forms `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Panics unless `align` is a power of two and `len` a positive multiple of it (callers
    /// round with [`round_up`]).
    pub fn zeroed(len: usize, align: usize) -> AlignedBuf {
        assert!(align.is_power_of_two(), "alignment {align} is not a power of two");
        assert!(len > 0 && len.is_multiple_of(align), "length {len} is not a positive multiple of {align}");
        let layout = Layout::from_size_align(len, align).expect("valid layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout);
        };
        AlignedBuf { ptr, layout, len, home: None }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn align(&self) -> usize {
        self.layout.align()
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points at `layout.size() >= len` initialised (zeroed when allocated, then
        // written) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(home) = self.home.take() {
            // The allocation moves to a buffer the pool keeps (or drops, freeing it): not freed here.
            home.give_back(AlignedBuf { ptr: self.ptr, layout: self.layout, len: self.layout.size(), home: None });
            return;
        }
        // SAFETY: allocated in `zeroed` with this layout, and owned by this buffer alone.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Aligned buffers of one alignment kept for reuse, by capacity (powers of two), at most
/// `max_idle` bytes of them.
pub struct AlignedPool {
    align: usize,
    idle: Mutex<HashMap<usize, Vec<AlignedBuf>>>,
    idle_bytes: AtomicUsize,
    max_idle: usize,
}

impl AlignedPool {
    pub fn new(align: usize, max_idle: usize) -> Arc<AlignedPool> {
        Arc::new(AlignedPool { align, idle: Mutex::default(), idle_bytes: AtomicUsize::new(0), max_idle })
    }

    /// A buffer of `len` bytes (a positive multiple of the alignment), back in the pool when
    /// dropped. It holds bytes of an earlier I/O of this tier: a read fills all of it, and a
    /// write must zero what it does not write (its padding), or stale bytes reach the disk.
    pub fn take(self: &Arc<AlignedPool>, len: usize) -> AlignedBuf {
        let capacity = len.next_power_of_two().max(self.align);
        let idle = self.idle.lock().get_mut(&capacity).and_then(Vec::pop);
        let mut buf = match idle {
            Some(buf) => {
                self.idle_bytes.fetch_sub(capacity, Ordering::Relaxed);
                buf
            }
            None => AlignedBuf::zeroed(capacity, self.align),
        };
        assert!(len > 0 && len.is_multiple_of(self.align), "length {len} is not a positive multiple of {}", self.align);
        buf.len = len;
        buf.home = Some(self.clone());
        buf
    }

    /// Bytes of idle buffers held now.
    pub fn idle_bytes(&self) -> usize {
        self.idle_bytes.load(Ordering::Relaxed)
    }

    fn give_back(&self, buf: AlignedBuf) {
        let capacity = buf.layout.size();
        let mut idle = self.idle.lock();
        if self.idle_bytes.load(Ordering::Relaxed) + capacity > self.max_idle {
            return;
        }
        self.idle_bytes.fetch_add(capacity, Ordering::Relaxed);
        idle.entry(capacity).or_default().push(buf);
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes, align {})", self.len(), self.align())
    }
}

/// A range of an aligned buffer as a `Bytes` owner: read replies point into the buffer the disk
/// filled, without a copy.
pub struct AlignedSlice {
    pub buf: AlignedBuf,
    pub start: usize,
    pub len: usize,
}

impl AsRef<[u8]> for AlignedSlice {
    fn as_ref(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }
}

/// `n` rounded down to a multiple of `align` (a power of two).
pub fn round_down(n: u64, align: u64) -> u64 {
    n & !(align - 1)
}

/// `n` rounded up to a multiple of `align` (a power of two).
pub fn round_up(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_zeroed() {
        for align in [512, 4096] {
            let mut buf = AlignedBuf::zeroed(3 * align, align);
            assert_eq!(buf.as_ptr() as usize % align, 0);
            assert!(buf.iter().all(|b| *b == 0));
            buf[5] = 7;
            assert_eq!(buf[5], 7);
        }
        assert_eq!((round_down(4097, 4096), round_up(4097, 4096), round_up(0, 512)), (4096, 8192, 0));
    }

    #[test]
    #[should_panic(expected = "not a positive multiple")]
    fn misaligned_lengths_are_refused() {
        AlignedBuf::zeroed(100, 512);
    }

    #[test]
    fn pooled_buffers_come_back_are_reused_and_are_bounded() {
        let pool = AlignedPool::new(4096, 3 << 20);
        let mut buf = pool.take(3 * 4096);
        assert_eq!((buf.len(), buf.as_ptr() as usize % 4096), (3 * 4096, 0));
        buf[3 * 4096 - 1] = 9;
        let first = buf.as_ptr();
        drop(buf);
        assert_eq!(pool.idle_bytes(), 4 * 4096, "kept at its capacity, a power of two");
        // A length of the same class gets the same allocation back, at the length asked for.
        let again = pool.take(4 * 4096);
        assert_eq!((again.as_ptr(), again.len()), (first, 4 * 4096));
        assert_eq!(pool.idle_bytes(), 0);
        drop(again);
        let held: Vec<AlignedBuf> = (0..4).map(|_| pool.take(1 << 20)).collect();
        drop(held);
        assert_eq!(pool.idle_bytes(), 4 * 4096 + (2 << 20), "at most max_idle bytes idle");
    }
}
