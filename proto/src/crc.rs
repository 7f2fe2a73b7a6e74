//! crc32c arithmetic for checksums a store keeps instead of taking again: the crc of `A ++ B`
//! from the crcs of `A` and `B`. The `crc32c` crate's `crc32c_combine` builds and squares a
//! 32x32 bit matrix per bit of the length, some microseconds a call, which is as long as a pass
//! over 64 KiB; here the same is one multiplication modulo the polynomial per set bit of the
//! length, from a table of `x^(2^k)`, and one in all for a length known up front ([`Shift`]).
//!
//! The arithmetic is in the reflected form crc32c uses (bit 31 is the coefficient of `x^0`), and
//! `crc(A ++ B) = crc(A) * x^(8 * |B|) ⊕ crc(B)` (mod the Castagnoli polynomial): the initial and
//! final inversions of the register cancel out.

/// The Castagnoli polynomial, reflected.
const POLY: u32 = 0x82f6_3b78;

/// `x^0` in the reflected form.
const ONE: u32 = 1 << 31;

/// `a * b` modulo the polynomial.
const fn mul(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut bit = ONE;
    while bit != 0 {
        if a & bit != 0 {
            product ^= b;
        }
        bit >>= 1;
        // b * x: a shift towards the high powers, reduced.
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
    product
}

/// `x^(2^k)` for every k a length in bytes can need: `8 * bytes` has at most 3 + 64 bits.
const POWERS: [u32; 67] = {
    let mut powers = [0u32; 67];
    let mut p = ONE >> 1; // x^1
    let mut k = 0;
    while k < powers.len() {
        powers[k] = p;
        p = mul(p, p);
        k += 1;
    }
    powers
};

/// `x^(8 * bytes)` modulo the polynomial: what shifting a crc past `bytes` zero bytes multiplies
/// it by.
const fn shift_for(bytes: u64) -> u32 {
    let mut n = bytes;
    let mut k = 3; // 8 * bytes = bytes * 2^3
    let mut p = ONE;
    while n != 0 {
        if n & 1 != 0 {
            p = mul(POWERS[k], p);
        }
        n >>= 1;
        k += 1;
    }
    p
}

/// The crc32c of `A ++ B`, given `crc_a` of `A`, and `crc_b` of `B` which is `len_b` bytes long.
pub fn combine(crc_a: u32, crc_b: u32, len_b: usize) -> u32 {
    if len_b == 0 {
        return crc_a;
    }
    mul(shift_for(len_b as u64), crc_a) ^ crc_b
}

/// [`combine`] for parts of one length, known up front: one multiplication a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shift(u32);

impl Shift {
    /// For parts `len` bytes long.
    pub const fn new(len: u64) -> Shift {
        Shift(shift_for(len))
    }

    /// The crc32c of `A ++ B`, where `B` is as long as this shift was made for.
    pub fn combine(self, crc_a: u32, crc_b: u32) -> u32 {
        mul(self.0, crc_a) ^ crc_b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut rng = tern_common::rng::SplitMix64(seed);
        (0..len).map(|_| rng.next_u64() as u8).collect()
    }

    #[test]
    fn combining_two_parts_gives_the_crc_of_both() {
        for (len_a, len_b) in
            [(0, 0), (0, 5), (5, 0), (1, 1), (3, 4096), (65536, 65536), (100_000, 1 << 20), (7, 12345)]
        {
            let (a, b) = (bytes(len_a, len_a as u64), bytes(len_b, len_b as u64 + 1));
            let whole = crc32c::crc32c(&[a.as_slice(), b.as_slice()].concat());
            let (crc_a, crc_b) = (crc32c::crc32c(&a), crc32c::crc32c(&b));
            assert_eq!(combine(crc_a, crc_b, len_b), whole, "{len_a} + {len_b}");
            assert_eq!(Shift::new(len_b as u64).combine(crc_a, crc_b), whole, "{len_a} + {len_b}");
            assert_eq!(combine(crc_a, crc_b, len_b), crc32c::crc32c_combine(crc_a, crc_b, len_b));
        }
    }

    #[test]
    fn lengths_past_four_gibibytes_agree_with_the_matrix_method() {
        // No buffer that large here: the matrix method of the crc32c crate is the reference.
        for len in [1usize << 32, (1 << 32) + 1, (1 << 40) + 12345, usize::MAX] {
            assert_eq!(combine(0x1234_5678, 0x9abc_def0, len), crc32c::crc32c_combine(0x1234_5678, 0x9abc_def0, len));
        }
    }

    #[test]
    fn many_chunks_combine_to_the_whole() {
        let data = bytes(10 * 65536 + 1234, 9);
        let shift = Shift::new(65536);
        let mut crc = 0;
        for chunk in data.chunks(65536) {
            crc = if chunk.len() == 65536 {
                shift.combine(crc, crc32c::crc32c(chunk))
            } else {
                combine(crc, crc32c::crc32c(chunk), chunk.len())
            };
        }
        assert_eq!(crc, crc32c::crc32c(&data));
    }
}
