//! The bytes benches move: the same incompressible payload for every system, and buffers
//! aligned for O_DIRECT.

use bytes::{Bytes, BytesMut};

/// A payload of `size` pseudo-random bytes (incompressible, the same for every system).
pub(crate) fn payload(size: u64, seed: u64) -> Bytes {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ seed.wrapping_mul(0xff51_afd7_ed55_8ccd);
    let mut out = BytesMut::with_capacity(size as usize + 8);
    while (out.len() as u64) < size {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(size as usize);
    out.freeze()
}

/// A zeroed byte buffer aligned to 4 KiB, as O_DIRECT needs.
pub(crate) struct AlignedVec {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedVec {
    const ALIGN: usize = 4096;

    pub(crate) fn new(len: usize) -> AlignedVec {
        let raw = vec![0u8; len + AlignedVec::ALIGN];
        let start = raw.as_ptr().align_offset(AlignedVec::ALIGN);
        AlignedVec { raw, start, len }
    }

    pub(crate) fn as_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
}

impl AsRef<[u8]> for AlignedVec {
    fn as_ref(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }
}
