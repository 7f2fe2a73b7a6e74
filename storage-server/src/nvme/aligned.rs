//! Owned, aligned buffers: the only memory the NVMe tier hands to the kernel. O_DIRECT needs the
//! buffer address, length and file offset aligned to the device's direct-I/O alignment; a buffer
//! that is allocated aligned and whose length is a whole number of units makes misaligned I/O
//! impossible to write. Owned (not borrowed), so an io_uring engine can keep it alive until the
//! kernel is done with it, whatever happens to the future that asked.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// A zeroed heap buffer of `len` bytes at an address aligned to `align`, `len` a positive multiple
/// of `align`.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
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
        AlignedBuf { ptr, layout }
    }

    pub fn len(&self) -> usize {
        self.layout.size()
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
        // SAFETY: `ptr` points at `len` initialised (zeroed, then written) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
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
}
