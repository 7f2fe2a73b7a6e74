//! In-memory sort of 100-byte records by the `memcmp` order of their 10-byte keys.
//!
//! Moving 100-byte records while sorting costs far more than moving 16-byte entries, so the sort
//! works on entries: each is one `u128` holding the 80-bit key above a 48-bit record index, so
//! comparing entries is one integer comparison, and ties on the key fall back to input order (the
//! sort is stable). Entries are first scattered into 2^k buckets by their top key bits (one
//! counting pass and one scatter pass, both parallel), then each bucket, small enough for the
//! cache, is sorted on its own in parallel; keys are uniformly random in TeraSort, so buckets are
//! even, and skewed keys only make some buckets larger, never wrong. Last, records are gathered
//! into the output in parallel.

use rayon::prelude::*;

use super::gensort::{KEY_LEN, RECORD_LEN};

/// Bits of an entry below the key: the record index.
const INDEX_BITS: u32 = 48;
const INDEX_MASK: u128 = (1 << INDEX_BITS) - 1;
/// Below this many records one parallel comparison sort beats bucketing.
const SMALL: usize = 1 << 15;
/// Target entries per bucket: 32 KiB of entries, sorted within L1/L2.
const BUCKET_TARGET: usize = 2048;
/// At most 2^12 buckets: more scatter streams than that thrash the TLB.
const MAX_BUCKET_BITS: u32 = 12;
/// Records per parallel gather task.
const GATHER_CHUNK: usize = 16 * 1024;

/// Writes the records of `input` into `out` (replacing its contents) in ascending `memcmp` order
/// of their keys; records with equal keys keep their input order.
///
/// # Panics
/// If `input` is not a whole number of records (or has 2^48 records or more); callers that take
/// input they have not checked use [`try_sort_records`].
pub fn sort_records(input: &[u8], out: &mut Vec<u8>) {
    if let Err(e) = try_sort_records(input, out) {
        panic!("sort_records: {e}");
    }
}

/// [`sort_records`], or an error if `input` is not a whole number of records or has 2^48 records
/// or more.
pub fn try_sort_records(input: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
    if !input.len().is_multiple_of(RECORD_LEN) {
        return Err(format!(
            "input is not whole records: {} bytes after {} records",
            input.len() % RECORD_LEN,
            input.len() / RECORD_LEN
        ));
    }
    let n = input.len() / RECORD_LEN;
    if n as u128 > INDEX_MASK {
        return Err(format!("{n} records is more than one sort can index"));
    }
    let mut entries: Vec<u128> = input.par_chunks_exact(RECORD_LEN).enumerate().map(|(i, rec)| entry(rec, i)).collect();
    sort_entries(&mut entries);
    gather(input, &entries, out);
    Ok(())
}

/// The sort entry of record `index`: its key above its index.
#[inline(always)]
fn entry(rec: &[u8], index: usize) -> u128 {
    let mut k = [0u8; 16];
    k[..KEY_LEN].copy_from_slice(&rec[..KEY_LEN]);
    u128::from_be_bytes(k) | index as u128
}

/// Sorts entries ascending.
fn sort_entries(entries: &mut Vec<u128>) {
    let n = entries.len();
    if n < SMALL {
        entries.par_sort_unstable();
        return;
    }
    let bits = (n / BUCKET_TARGET).ilog2().clamp(1, MAX_BUCKET_BITS);
    let buckets = 1usize << bits;
    let shift = 128 - bits;
    let bucket = |e: u128| (e >> shift) as usize;

    // One part per thread for counting and scattering.
    let parts = rayon::current_num_threads().max(1);
    let part_len = n.div_ceil(parts);
    let counts: Vec<Vec<usize>> = entries
        .par_chunks(part_len)
        .map(|part| {
            let mut c = vec![0usize; buckets];
            for &e in part {
                c[bucket(e)] += 1;
            }
            c
        })
        .collect();

    // Carve the destination into disjoint slices, bucket-major then part, so each part scatters
    // into its own slice of every bucket without synchronization.
    let mut dest = vec![0u128; n];
    let mut slices: Vec<Vec<&mut [u128]>> = (0..counts.len()).map(|_| Vec::with_capacity(buckets)).collect();
    let mut rest: &mut [u128] = &mut dest;
    for b in 0..buckets {
        for (p, c) in counts.iter().enumerate() {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(c[b]);
            slices[p].push(head);
            rest = tail;
        }
    }
    entries.par_chunks(part_len).zip(slices.par_iter_mut()).for_each(|(part, out)| {
        let mut cursor = vec![0usize; buckets];
        for &e in part {
            let b = bucket(e);
            out[b][cursor[b]] = e;
            cursor[b] += 1;
        }
    });
    drop(slices);

    // Sort each bucket; a bucket holding a large share (skewed keys) sorts in parallel itself.
    let mut bucket_slices: Vec<&mut [u128]> = Vec::with_capacity(buckets);
    let mut rest: &mut [u128] = &mut dest;
    for b in 0..buckets {
        let len: usize = counts.iter().map(|c| c[b]).sum();
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
        bucket_slices.push(head);
        rest = tail;
    }
    let large = (n / parts).max(SMALL);
    bucket_slices.into_par_iter().for_each(|s| {
        if s.len() > large {
            s.par_sort_unstable();
        } else {
            s.sort_unstable();
        }
    });
    *entries = dest;
}

/// Copies the records named by sorted `entries` from `input` into `out`, in parallel.
fn gather(input: &[u8], entries: &[u128], out: &mut Vec<u8>) {
    let len = entries.len() * RECORD_LEN;
    out.clear();
    // Size the output with a parallel fill: on fresh memory this is where the pages fault in, and
    // faulting a GB in on one thread (`resize`) costs several times the whole gather.
    out.par_extend(rayon::iter::repeat_n(0u8, len));
    out.par_chunks_mut(GATHER_CHUNK * RECORD_LEN).zip(entries.par_chunks(GATHER_CHUNK)).for_each(|(dst, es)| {
        for (d, &e) in dst.chunks_exact_mut(RECORD_LEN).zip(es) {
            let at = (e & INDEX_MASK) as usize * RECORD_LEN;
            d.copy_from_slice(&input[at..at + RECORD_LEN]);
        }
    });
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::gensort::{gen, generate, generate_parallel};
    use crate::validate::{checksum, validate_parallel};

    fn check_sorted_permutation(input: &[u8], out: &[u8]) {
        let s = validate_parallel(out).unwrap();
        assert!(s.sorted(), "{s}");
        assert_eq!(checksum(input), (s.records, s.checksum));
        // Against a plain reference sort (stable: equal keys keep input order).
        let mut reference: Vec<&[u8]> = input.chunks(RECORD_LEN).collect();
        reference.sort_by(|a, b| a[..KEY_LEN].cmp(&b[..KEY_LEN]));
        assert!(reference.concat() == out, "differs from the reference sort");
    }

    #[test]
    fn sorts_small_and_large_inputs() {
        for count in [0u64, 1, 2, 3, 100, SMALL as u64 - 1, SMALL as u64, 200_003] {
            let input = gen(count * 7, count);
            let mut out = Vec::new();
            sort_records(&input, &mut out);
            check_sorted_permutation(&input, &out);
        }
    }

    #[test]
    fn duplicates_and_skew() {
        // Many equal keys, all in one bucket, with distinct payloads: stable order is checked.
        let mut input = gen(0, 100_000);
        for (i, rec) in input.chunks_mut(RECORD_LEN).enumerate() {
            let k = (i % 7) as u8;
            rec[..KEY_LEN].copy_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, k]);
        }
        let mut out = Vec::new();
        sort_records(&input, &mut out);
        check_sorted_permutation(&input, &out);
        assert_eq!(validate_parallel(&out).unwrap().duplicates, 100_000 - 7);

        // Keys differing only in the last two bytes.
        let mut input = gen(5, 50_000);
        for rec in input.chunks_mut(RECORD_LEN) {
            rec[..8].fill(0xAB);
        }
        sort_records(&input, &mut out);
        check_sorted_permutation(&input, &out);
    }

    #[test]
    fn reuses_output_buffer_and_rejects_partial_records() {
        let input = gen(0, 1000);
        let mut out = vec![7u8; 500_000];
        sort_records(&input, &mut out);
        assert_eq!(out.len(), input.len());
        check_sorted_permutation(&input, &out);
        let err = try_sort_records(&input[..150], &mut out).unwrap_err();
        assert!(err.contains("50 bytes"), "{err}");
        let panicked = std::panic::catch_unwind(|| sort_records(&input[..150], &mut Vec::new()));
        assert!(panicked.is_err());
    }

    /// Throughput of generate, sort and validate; prints, never asserts timing. Size in MB from
    /// `TERASORT_BENCH_MB` (default 100); each figure is the best of `TERASORT_BENCH_REPS` runs
    /// (default 3), since the build machines are shared and a run that lost its cores is noise.
    #[test]
    fn throughput() {
        let env = |name: &str, default: u64| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
        let mb = env("TERASORT_BENCH_MB", 100);
        let reps = env("TERASORT_BENCH_REPS", 3).max(1);
        let count = mb * 1_000_000 / RECORD_LEN as u64;
        let bytes = count as f64 * RECORD_LEN as f64;
        let best = |f: &mut dyn FnMut()| {
            let mut best = f64::MAX;
            for _ in 0..reps {
                let t = Instant::now();
                f();
                best = best.min(t.elapsed().as_secs_f64());
            }
            bytes / best / 1e6
        };

        // Touch every page first so that page faults do not count as generation time.
        let mut input = vec![1u8; count as usize * RECORD_LEN];
        let gen1 = best(&mut || generate(0, count, &mut input));
        let gen_par = best(&mut || generate_parallel(0, count, &mut input));
        // A fresh output each time, as a reduce task has: its page faults are part of the cost.
        let sort_fresh = best(&mut || {
            let mut out = Vec::new();
            sort_records(&input, &mut out);
        });
        let mut out = Vec::new();
        sort_records(&input, &mut out);
        let sort_reused = best(&mut || sort_records(&input, &mut out));
        let val = best(&mut || assert!(validate_parallel(&out).unwrap().sorted()));
        let sum_rate = best(&mut || {
            std::hint::black_box(checksum(&input));
        });
        let s = validate_parallel(&out).unwrap();
        assert_eq!(checksum(&input), (s.records, s.checksum));
        println!(
            "terasort {mb} MB on {} threads, best of {reps}: generate {gen1:.0} MB/s (1 thread), \
             {gen_par:.0} MB/s (parallel); sort {sort_fresh:.0} MB/s (fresh output), \
             {sort_reused:.0} MB/s (reused output); validate {val:.0} MB/s; checksum {sum_rate:.0} MB/s",
            rayon::current_num_threads()
        );
    }
}
