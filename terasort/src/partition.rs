//! Range partitioning of keys for TeraSort's shuffle.
//!
//! gensort keys are uniformly random, so a uniform split of the key space balances reduces without
//! sampling (Hadoop's TeraSort samples split points into a trie; that matters only for skewed keys).
//! The split uses the first 8 key bytes as a big-endian integer `x` and sends it to
//! `floor(x * reduces / 2^64)`: one multiply, no branches, and monotone in the key.

use super::gensort::KEY_LEN;

/// Maps keys to `0..reduces` so that partition `p`'s keys all sort below partition `p + 1`'s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RangePartitioner {
    reduces: u32,
}

impl RangePartitioner {
    /// A partitioner over `reduces` partitions.
    ///
    /// # Panics
    /// If `reduces` is 0.
    pub fn new(reduces: u32) -> Self {
        assert!(reduces > 0, "a range partitioner needs at least one partition");
        Self { reduces }
    }

    /// The number of partitions.
    pub fn partitions(&self) -> u32 {
        self.reduces
    }

    /// The number of partitions (the reduce count), as [`Self::partitions`].
    pub fn reduces(&self) -> u32 {
        self.reduces
    }

    /// The partition of `key` (normally a record's 10-byte key, or the whole record: only the
    /// first 8 bytes count). A key shorter than 8 bytes compares as if padded with zeros, as it
    /// does under `memcmp` order against longer keys, so monotonicity holds for it too.
    #[inline]
    pub fn partition(&self, key: &[u8]) -> u32 {
        let x = prefix(key);
        // floor(x * reduces / 2^64) < reduces because x < 2^64.
        ((u128::from(x) * u128::from(self.reduces)) >> 64) as u32
    }

    /// The smallest key of partition `p` (inclusive lower bound): `ceil(p * 2^64 / reduces)` as
    /// the first 8 bytes, then zeros. Partition `p` holds the keys from `bounds(p)` up to, not
    /// including, `bounds(p + 1)` (the last partition: to the largest key).
    ///
    /// # Panics
    /// If `p >= reduces`.
    pub fn bounds(&self, p: u32) -> [u8; KEY_LEN] {
        assert!(p < self.reduces, "partition {p} out of range 0..{}", self.reduces);
        let lower = (u128::from(p) << 64).div_ceil(u128::from(self.reduces));
        // p < reduces, so lower < 2^64.
        let mut key = [0u8; KEY_LEN];
        key[..8].copy_from_slice(&(lower as u64).to_be_bytes());
        key
    }
}

/// The first 8 bytes of `key` as a big-endian integer, zero-padded if shorter.
#[inline(always)]
fn prefix(key: &[u8]) -> u64 {
    match key.get(..8) {
        Some(head) => {
            let mut b = [0u8; 8];
            b.copy_from_slice(head);
            u64::from_be_bytes(b)
        }
        None => {
            let mut b = [0u8; 8];
            b[..key.len()].copy_from_slice(key);
            u64::from_be_bytes(b)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gensort::{generate, RECORD_LEN};

    fn splitmix(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn random_key(rng: &mut u64) -> [u8; KEY_LEN] {
        let mut k = [0u8; KEY_LEN];
        k[..8].copy_from_slice(&splitmix(rng).to_be_bytes());
        k[8..].copy_from_slice(&(splitmix(rng) as u16).to_be_bytes());
        k
    }

    #[test]
    fn monotone_on_random_keys() {
        let mut rng = 1u64;
        for reduces in [1u32, 2, 3, 7, 64, 1000, 65_537, u32::MAX] {
            let p = RangePartitioner::new(reduces);
            let mut keys: Vec<[u8; KEY_LEN]> = (0..20_000).map(|_| random_key(&mut rng)).collect();
            keys.sort_unstable();
            let parts: Vec<u32> = keys.iter().map(|k| p.partition(k)).collect();
            assert!(parts.windows(2).all(|w| w[0] <= w[1]), "reduces {reduces}");
            assert!(parts.iter().all(|&x| x < reduces));
        }
    }

    #[test]
    fn bounds_are_the_partition_edges() {
        for reduces in [1u32, 2, 3, 10, 97, 256, 1 << 20, u32::MAX] {
            let p = RangePartitioner::new(reduces);
            let probe = [0, 1, reduces / 2, reduces - 1];
            for &i in probe.iter().filter(|&&i| i < reduces) {
                let lower = p.bounds(i);
                assert_eq!(p.partition(&lower), i, "reduces {reduces} p {i}");
                // The key just below the bound belongs to the previous partition.
                let x = u64::from_be_bytes(lower[..8].try_into().unwrap());
                if x > 0 {
                    let below = (x - 1).to_be_bytes();
                    assert_eq!(p.partition(&below), i - 1, "reduces {reduces} p {i}");
                } else {
                    assert_eq!(i, 0);
                }
            }
        }
        assert_eq!(RangePartitioner::new(4).bounds(2), [0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn every_partition_reachable_and_extremes() {
        let p = RangePartitioner::new(1000);
        let mut seen = vec![false; 1000];
        for i in 0..1000 {
            seen[p.partition(&p.bounds(i)) as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(p.partition(&[0u8; KEY_LEN]), 0);
        assert_eq!(p.partition(&[0xFF; KEY_LEN]), 999);
        // Short keys are zero-padded, not a panic.
        assert_eq!(p.partition(&[]), 0);
        assert_eq!(p.partition(&[0xFF]), p.partition(&[0xFF, 0, 0, 0, 0, 0, 0, 0]));
    }

    #[test]
    fn uniform_on_gensort_keys() {
        let reduces = 16u32;
        let count = 160_000u64;
        let mut data = vec![0u8; count as usize * RECORD_LEN];
        generate(0, count, &mut data);
        let p = RangePartitioner::new(reduces);
        let mut counts = vec![0u64; reduces as usize];
        for rec in data.chunks(RECORD_LEN) {
            counts[p.partition(&rec[..KEY_LEN]) as usize] += 1;
        }
        let expected = count / u64::from(reduces);
        for (i, &c) in counts.iter().enumerate() {
            let dev = (c as f64 - expected as f64).abs() / expected as f64;
            assert!(dev < 0.03, "partition {i}: {c} vs {expected}");
        }
    }

    #[test]
    #[should_panic(expected = "at least one partition")]
    fn zero_reduces_panics() {
        RangePartitioner::new(0);
    }
}
