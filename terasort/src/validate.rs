//! valsort-compatible validation of sort output (gensort 1.5's `valsort`).
//!
//! valsort reads 100-byte records and reports their count, the 128-bit sum of the zlib CRC-32 of
//! each whole record (order-independent, so a sort's input and output must have the same sum), the
//! number of records whose key equals the previous one's (duplicates) and the number whose key is
//! below the previous one's (unordered), comparing keys by `memcmp` of their 10 bytes. Parts of an
//! output validate separately and join in order, as `valsort -o` / `valsort -s` do.

use std::fmt;

use rayon::prelude::*;

use super::gensort::{KEY_LEN, RECORD_LEN};

/// What validating a sequence of records found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Whole records seen.
    pub records: u64,
    /// Sum of the zlib CRC-32 of each whole record, wrapping at 2^128.
    pub checksum: u128,
    /// Records whose key equals the previous record's key.
    pub duplicates: u64,
    /// Records whose key is below the previous record's key.
    pub unsorted: u64,
    /// Index (from 0) of the first record whose key is below its predecessor's, as valsort's
    /// "First unordered record is record N".
    pub first_unsorted: Option<u64>,
    /// Key of the first record, if any.
    pub first_key: Option<[u8; KEY_LEN]>,
    /// Key of the last record, if any.
    pub last_key: Option<[u8; KEY_LEN]>,
}

impl Summary {
    /// Whether every record's key is at least its predecessor's.
    pub fn sorted(&self) -> bool {
        self.unsorted == 0
    }

    /// The summary of `self`'s records followed by `next`'s. Checks the order across the boundary
    /// the way `valsort -s` does: `next`'s first key below `self`'s last is one more unordered
    /// record, equal is one more duplicate. Associative, and an empty summary is its identity.
    pub fn merge(&self, next: &Summary) -> Summary {
        let mut joined = Summary {
            records: self.records.saturating_add(next.records),
            checksum: self.checksum.wrapping_add(next.checksum),
            duplicates: self.duplicates.saturating_add(next.duplicates),
            unsorted: self.unsorted.saturating_add(next.unsorted),
            first_unsorted: self.first_unsorted,
            first_key: self.first_key.or(next.first_key),
            last_key: next.last_key.or(self.last_key),
        };
        if let (Some(last), Some(first)) = (self.last_key, next.first_key) {
            if first == last {
                joined.duplicates = joined.duplicates.saturating_add(1);
            } else if first < last {
                joined.unsorted = joined.unsorted.saturating_add(1);
                joined.first_unsorted = joined.first_unsorted.or(Some(self.records));
            }
        }
        joined.first_unsorted = joined.first_unsorted.or(next.first_unsorted.map(|i| i.saturating_add(self.records)));
        joined
    }

    /// Joins summaries of record sets whose relative order does not matter (parts of a sort's
    /// input): counts and checksums add, nothing is compared across them. The order fields keep
    /// `self`'s first key and `next`'s last key, and sum the per-part order counts.
    pub fn add_unordered(&self, next: &Summary) -> Summary {
        Summary {
            records: self.records.saturating_add(next.records),
            checksum: self.checksum.wrapping_add(next.checksum),
            duplicates: self.duplicates.saturating_add(next.duplicates),
            unsorted: self.unsorted.saturating_add(next.unsorted),
            first_unsorted: self.first_unsorted.or(next.first_unsorted.map(|i| i.saturating_add(self.records))),
            first_key: self.first_key.or(next.first_key),
            last_key: next.last_key.or(self.last_key),
        }
    }

    /// The checksum as valsort prints it: lowercase hex without leading zeros.
    pub fn checksum_hex(&self) -> String {
        format!("{:x}", self.checksum)
    }
}

/// valsort's report, line for line.
impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(i) = self.first_unsorted {
            writeln!(f, "First unordered record is record {i}")?;
        }
        writeln!(f, "Records: {}", self.records)?;
        writeln!(f, "Checksum: {}", self.checksum_hex())?;
        if self.sorted() {
            writeln!(f, "Duplicate keys: {}", self.duplicates)?;
            write!(f, "SUCCESS - all records are in order")
        } else {
            write!(f, "ERROR - there are {} unordered records", self.unsorted)
        }
    }
}

/// The key as an 80-bit integer: integer order is `memcmp` order.
#[inline(always)]
fn key_value(rec: &[u8]) -> u128 {
    let mut k = [0u8; 16];
    k[6..].copy_from_slice(&rec[..KEY_LEN]);
    u128::from_be_bytes(k)
}

/// The first 10 bytes of a record as a key.
#[inline(always)]
fn key_of(rec: &[u8]) -> [u8; KEY_LEN] {
    let mut key = [0u8; KEY_LEN];
    key.copy_from_slice(&rec[..KEY_LEN]);
    key
}

/// Streaming validator: feed bytes in pieces of any size, records may straddle pieces.
#[derive(Clone, Debug, Default)]
pub struct Validator {
    summary: Summary,
    /// The previous record's key as an 80-bit integer, once there is one.
    prev: Option<u128>,
    /// Bytes of a record split across `feed` calls.
    partial: Vec<u8>,
}

impl Validator {
    /// A validator that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Validates the next bytes of the sequence.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        if !self.partial.is_empty() {
            let take = (RECORD_LEN - self.partial.len()).min(bytes.len());
            self.partial.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.partial.len() < RECORD_LEN {
                return;
            }
            let rec = std::mem::take(&mut self.partial);
            self.record(&rec);
            self.partial = rec;
            self.partial.clear();
        }
        let mut records = bytes.chunks_exact(RECORD_LEN);
        for rec in &mut records {
            self.record(rec);
        }
        self.partial.extend_from_slice(records.remainder());
    }

    #[inline]
    fn record(&mut self, rec: &[u8]) {
        let s = &mut self.summary;
        s.checksum = s.checksum.wrapping_add(u128::from(crc32fast::hash(&rec[..RECORD_LEN])));
        let key = key_value(rec);
        match self.prev {
            None => s.first_key = Some(key_of(rec)),
            Some(prev) if key == prev => s.duplicates += 1,
            Some(prev) if key < prev => {
                s.unsorted += 1;
                s.first_unsorted = s.first_unsorted.or(Some(s.records));
            }
            Some(_) => {}
        }
        self.prev = Some(key);
        s.records += 1;
    }

    /// Records validated so far (whole records only).
    pub fn records(&self) -> u64 {
        self.summary.records
    }

    /// The summary, or an error if the bytes ended inside a record.
    pub fn finish(mut self) -> Result<Summary, String> {
        if !self.partial.is_empty() {
            return Err(format!(
                "partial record found at end: {} bytes after {} whole records",
                self.partial.len(),
                self.summary.records
            ));
        }
        if let Some(prev) = self.prev {
            let bytes = prev.to_be_bytes();
            let mut key = [0u8; KEY_LEN];
            key.copy_from_slice(&bytes[6..]);
            self.summary.last_key = Some(key);
        }
        Ok(self.summary)
    }
}

/// Records per parallel validation or checksum task (6.4 MB).
const PARALLEL_RECORDS: usize = 64 * 1024;

/// Validates a whole buffer on all rayon threads: the same result as one [`Validator`].
pub fn validate_parallel(bytes: &[u8]) -> Result<Summary, String> {
    if !bytes.len().is_multiple_of(RECORD_LEN) {
        return Err(format!(
            "partial record found at end: {} bytes after {} whole records",
            bytes.len() % RECORD_LEN,
            bytes.len() / RECORD_LEN
        ));
    }
    let parts: Vec<Summary> = bytes
        .par_chunks(PARALLEL_RECORDS * RECORD_LEN)
        .map(|chunk| {
            let mut v = Validator::new();
            v.feed(chunk);
            v.finish()
        })
        .collect::<Result<_, _>>()?;
    Ok(parts.iter().fold(Summary::default(), |acc, part| acc.merge(part)))
}

/// Record count and checksum of the whole records in `bytes`, on all rayon threads, for inputs
/// whose order does not matter. A trailing partial record is not counted: callers that need to
/// reject one use [`checksum_exact`] (or compare `records * 100` with the length).
pub fn checksum(bytes: &[u8]) -> (u64, u128) {
    let whole = bytes.len() - bytes.len() % RECORD_LEN;
    bytes[..whole]
        .par_chunks(PARALLEL_RECORDS * RECORD_LEN)
        .map(|chunk| {
            let sum = chunk.chunks_exact(RECORD_LEN).fold(0u128, |acc, rec| acc + u128::from(crc32fast::hash(rec)));
            ((chunk.len() / RECORD_LEN) as u64, sum)
        })
        .reduce(|| (0, 0), |(r1, s1), (r2, s2)| (r1 + r2, s1.wrapping_add(s2)))
}

/// [`checksum`], or an error if `bytes` ends inside a record.
pub fn checksum_exact(bytes: &[u8]) -> Result<(u64, u128), String> {
    if !bytes.len().is_multiple_of(RECORD_LEN) {
        return Err(format!(
            "partial record found at end: {} bytes after {} whole records",
            bytes.len() % RECORD_LEN,
            bytes.len() / RECORD_LEN
        ));
    }
    Ok(checksum(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gensort::gen;

    fn validate(bytes: &[u8]) -> Result<Summary, String> {
        let mut v = Validator::new();
        v.feed(bytes);
        v.finish()
    }

    /// Records with the given keys (first byte = value, rest zero) and distinct payloads.
    fn records_with_keys(keys: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let mut rec = [0u8; RECORD_LEN];
            rec[0] = *k;
            rec[50] = i as u8;
            out.extend_from_slice(&rec);
        }
        out
    }

    /// Tiny deterministic PRNG for split points (splitmix64).
    fn splitmix(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    #[test]
    fn checksum_is_sum_of_zlib_crc32() {
        let data = gen(0, 1000);
        let expected: u128 = data.chunks(RECORD_LEN).map(|r| u128::from(crc32fast::hash(r))).sum();
        let s = validate(&data).unwrap();
        assert_eq!(s.records, 1000);
        assert_eq!(s.checksum, expected);
        assert_eq!(checksum(&data), (1000, expected));
        // zlib's crc32 check value: crc32("123456789") = 0xCBF43926.
        assert_eq!(crc32fast::hash(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn counts_duplicates_and_unsorted() {
        let data = records_with_keys(&[1, 2, 2, 5, 3, 3, 9, 0]);
        let s = validate(&data).unwrap();
        assert_eq!(s.records, 8);
        assert_eq!(s.duplicates, 2);
        assert_eq!(s.unsorted, 2);
        assert_eq!(s.first_unsorted, Some(4));
        assert!(!s.sorted());
        assert_eq!(s.first_key.unwrap()[0], 1);
        assert_eq!(s.last_key.unwrap()[0], 0);

        let sorted = validate(&records_with_keys(&[0, 0, 1, 7, 7, 7, 255])).unwrap();
        assert!(sorted.sorted());
        assert_eq!(sorted.duplicates, 3);
        assert_eq!(sorted.first_unsorted, None);
    }

    #[test]
    fn keys_compare_by_all_ten_bytes() {
        let mut a = [0u8; RECORD_LEN];
        let mut b = [0u8; RECORD_LEN];
        a[9] = 2;
        b[9] = 1;
        b[10] = 200; // payload differs, not part of the key
        let s = validate(&[a, b].concat()).unwrap();
        assert_eq!(s.unsorted, 1);
        b[9] = 2;
        let s = validate(&[a, b].concat()).unwrap();
        assert_eq!((s.unsorted, s.duplicates), (0, 1));
    }

    #[test]
    fn split_feeding_equals_whole() {
        let data = records_with_keys(&[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]);
        let whole = validate(&data).unwrap();
        let mut rng = 7u64;
        for _ in 0..200 {
            let mut v = Validator::new();
            let mut at = 0;
            while at < data.len() {
                let n = (splitmix(&mut rng) % 250) as usize;
                let end = (at + n).min(data.len());
                v.feed(&data[at..end]);
                at = end;
            }
            assert_eq!(v.finish().unwrap(), whole);
        }
    }

    #[test]
    fn merge_of_parts_equals_whole() {
        let keys = [3u8, 1, 4, 4, 5, 9, 2, 6, 6, 6, 5, 8, 9, 9, 7, 10];
        let data = records_with_keys(&keys);
        let whole = validate(&data).unwrap();
        let n = keys.len();
        for i in 0..=n {
            for j in i..=n {
                let a = validate(&data[..i * RECORD_LEN]).unwrap();
                let b = validate(&data[i * RECORD_LEN..j * RECORD_LEN]).unwrap();
                let c = validate(&data[j * RECORD_LEN..]).unwrap();
                assert_eq!(a.merge(&b).merge(&c), whole, "split {i} {j}");
                assert_eq!(a.merge(&b.merge(&c)), whole, "split {i} {j}, right first");
            }
        }
        assert_eq!(Summary::default().merge(&whole), whole);
        // Unordered joining: the same count and checksum whatever the order.
        let a = validate(&data[..5 * RECORD_LEN]).unwrap();
        let b = validate(&data[5 * RECORD_LEN..]).unwrap();
        let ba = b.add_unordered(&a);
        assert_eq!((ba.records, ba.checksum), (whole.records, whole.checksum));
        assert_eq!(whole.merge(&Summary::default()), whole);
    }

    #[test]
    fn merge_checks_the_boundary() {
        let a = validate(&records_with_keys(&[1, 5])).unwrap();
        let dup = validate(&records_with_keys(&[5, 6])).unwrap();
        let below = validate(&records_with_keys(&[4, 6])).unwrap();
        assert_eq!(a.merge(&dup).duplicates, 1);
        assert!(a.merge(&dup).sorted());
        let m = a.merge(&below);
        assert_eq!((m.unsorted, m.first_unsorted), (1, Some(2)));
    }

    #[test]
    fn partial_record_is_an_error() {
        let data = gen(0, 3);
        let mut v = Validator::new();
        v.feed(&data[..250]);
        let err = v.finish().unwrap_err();
        assert!(err.contains("50 bytes"), "{err}");
        assert!(validate_parallel(&data[..299]).is_err());
        assert!(checksum_exact(&data[..299]).is_err());
        assert_eq!(checksum(&data[..299]).0, 2);
        // Empty input is an empty summary, not an error (parts may be empty).
        assert_eq!(validate(&[]).unwrap(), Summary::default());
    }

    #[test]
    fn parallel_equals_serial() {
        let mut data = gen(0, PARALLEL_RECORDS as u64 * 3 + 11);
        // Unsorted as generated; make a duplicate across a parallel boundary too.
        let b = PARALLEL_RECORDS * RECORD_LEN;
        let prev = data[b - RECORD_LEN..b - RECORD_LEN + KEY_LEN].to_vec();
        data[b..b + KEY_LEN].copy_from_slice(&prev);
        let serial = validate(&data).unwrap();
        assert_eq!(validate_parallel(&data).unwrap(), serial);
        assert!(serial.unsorted > 0 && serial.duplicates >= 1);
        assert_eq!(checksum(&data), (serial.records, serial.checksum));
    }

    #[test]
    fn display_matches_valsort() {
        let ok = validate(&records_with_keys(&[1, 1, 2])).unwrap();
        let text = ok.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "Records: 3");
        assert_eq!(lines[1], format!("Checksum: {:x}", ok.checksum));
        assert_eq!(lines[2], "Duplicate keys: 1");
        assert_eq!(lines[3], "SUCCESS - all records are in order");
        let bad = validate(&records_with_keys(&[2, 1, 0])).unwrap().to_string();
        assert_eq!(
            bad.lines().collect::<Vec<_>>(),
            [
                "First unordered record is record 1",
                "Records: 3",
                &format!("Checksum: {:x}", validate(&records_with_keys(&[2, 1, 0])).unwrap().checksum),
                "ERROR - there are 2 unordered records",
            ]
        );
        let s = Summary { checksum: 0x1_0000_0000_0000_00ab, ..Summary::default() };
        assert_eq!(s.checksum_hex(), "100000000000000ab");
    }
}
