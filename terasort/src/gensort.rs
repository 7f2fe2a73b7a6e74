//! gensort-compatible record generation.
//!
//! The generator is the Sort Benchmark's 128-bit linear congruential generator (`rand16.c` in
//! gensort 1.2 through 1.5): `X[k+1] = (A * X[k] + C) mod 2^128`, `X[0] = 0`, with `A` from
//! L'Ecuyer's tables and `C` the odd constant `"JimGrayRIP" + spaces + 1` in ASCII. Record `n`
//! (counting from 0) is built from `X[n+1]`; gensort reaches `X[n]` directly by composing the
//! precomputed powers `f^(2^i)` of the generator for the set bits of `n` (`skip_ahead_rand`), which
//! is what lets `gensort -bN` start anywhere, and lets us generate parts in parallel.
//!
//! Two binary payload layouts exist (see the module docs of `terasort`): [`Format::Gensort12`],
//! the one the TeraSort notes describe and Hadoop's TeraGen writes, and [`Format::Gensort15`], what
//! gensort 1.3-1.5 write without `-a`; keys are the same in both. [`Format::Ascii`] is `gensort -a`.
//!
//! Verified against published values (tests): the skip-ahead table against rand16.c's `Gen` table,
//! keys of records `2^i - 1` against its `Gen[i].c` entries (`X[2^i]`), record 0's key
//! `"JimGrayRIP"`, and whole-output valsort checksums published beside gensort runs (1,000,000
//! gensort 1.5 binary records; 163,840 and 13,107,200 `-a` records). The 1.2 payload has no
//! published checksum we could find; it is checked field by field against gensort 1.2's `gen_rec`.

use rayon::prelude::*;

/// Bytes in one record.
pub const RECORD_LEN: usize = 100;
/// Bytes of the sort key at the start of each record.
pub const KEY_LEN: usize = 10;

/// The LCG multiplier (rand16.c: 47026247687942121848144207491837523525).
const LCG_A: u128 = 0x2360_ed05_1fc6_5da4_4385_df64_9fcc_f645;
/// The LCG increment (rand16.c: 98910279301475397889117759788405497857, "JimGrayRIP      \x01").
const LCG_C: u128 = 0x4a69_6d47_7261_7952_4950_2020_2020_2001;

/// `JUMPS[i] = (a, c)` such that `f^(2^i)(x) = a * x + c (mod 2^128)`: rand16.c's `Gen` table,
/// computed by repeated squaring instead of transcribed (`f∘f(x) = a(ax + c) + c`).
const JUMPS: [(u128, u128); 128] = jump_table();

const fn jump_table() -> [(u128, u128); 128] {
    let mut table = [(0u128, 0u128); 128];
    let (mut a, mut c) = (LCG_A, LCG_C);
    let mut i = 0;
    while i < 128 {
        table[i] = (a, c);
        c = a.wrapping_mul(c).wrapping_add(c);
        a = a.wrapping_mul(a);
        i += 1;
    }
    table
}

/// One step of the generator (rand16.c `next_rand`).
#[inline(always)]
fn next_rand(x: u128) -> u128 {
    x.wrapping_mul(LCG_A).wrapping_add(LCG_C)
}

/// `X[n]`: the generator advanced `n` steps from 0 (rand16.c `skip_ahead_rand`), at most 128
/// multiply-adds.
fn skip_ahead(n: u128) -> u128 {
    let mut x = 0u128;
    let mut bits = n;
    while bits != 0 {
        let i = bits.trailing_zeros() as usize;
        let (a, c) = JUMPS[i];
        x = x.wrapping_mul(a).wrapping_add(c);
        bits &= bits - 1;
    }
    x
}

/// The 10 bytes gensort's `ASSIGN_10_BYTES` takes from a 128-bit value: its top 80 bits, big-endian.
#[inline(always)]
fn top10(x: u128) -> [u8; 10] {
    let b = x.to_be_bytes();
    [b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9]]
}

/// The key of record `n`, without generating the rest of it.
pub fn record_key(n: u64) -> [u8; KEY_LEN] {
    top10(next_rand(skip_ahead(u128::from(n))))
}

/// A binary record layout of gensort.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Format {
    /// gensort 1.2's binary record, also Hadoop TeraGen's: key, `00 11`, the record number as 32
    /// uppercase hex digits, `88 99 AA BB`, 48 bytes of filler (12 hex digits of the low 48 bits of
    /// the record's random number, each repeated 4 times), `CC DD EE FF`.
    #[default]
    Gensort12,
    /// gensort 1.3-1.5's binary record: key, then nine 10-byte parts, each the top 80 bits of the
    /// next random number in sequence xor'ed with a constant for that part.
    Gensort15,
    /// `gensort -a` (the same in 1.2 and 1.5): printable key (base-95 digits of the random
    /// number), two spaces, the record number as 32 hex digits, two spaces, 52 bytes of hex
    /// filler, `\r\n`. Keys differ from the binary formats'.
    Ascii,
}

/// Uppercase hex pair of each byte value (gensort's `HEX_DIGIT`).
const HEX_PAIRS: [[u8; 2]; 256] = hex_pairs();

const fn hex_digit(v: u8) -> u8 {
    if v >= 10 {
        b'A' + v - 10
    } else {
        b'0' + v
    }
}

const fn hex_pairs() -> [[u8; 2]; 256] {
    let mut t = [[0u8; 2]; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = [hex_digit((i >> 4) as u8), hex_digit((i & 15) as u8)];
        i += 1;
    }
    t
}

/// gensort 1.3+ xors part `j` (bytes `10j..10j+10`) with the top 80 bits of `PART_XOR[j]`.
const PART_XOR: [u128; 10] = [
    0,
    0xF0E8_E4E2_E1D8_D4D2_D1CC_0000_0000_0000,
    0xCAC9_C6C5_C3B8_B4B2_B1AC_0000_0000_0000,
    0xAAA9_A6A5_A39C_9A99_9695_0000_0000_0000,
    0x938E_8D8B_8778_7472_716C_0000_0000_0000,
    0x6A69_6665_635C_5A59_5655_0000_0000_0000,
    0x534E_4D4B_473C_3A39_3635_0000_0000_0000,
    0x332E_2D2B_271E_1D1B_170F_0000_0000_0000,
    0xC8C4_C2C1_9894_9291_8CE0_0000_0000_0000,
    0x170F_332E_2D2B_271E_1D1B_0000_0000_0000,
];

/// Records generated per block: the block's random numbers stay in L1.
const BLOCK: usize = 256;

/// gensort 1.2 record `n` whose random number is `r` (gensort 1.2 `gen_rec`).
#[inline(always)]
fn write_gensort12(rec: &mut [u8], r: u128, n: u128) {
    let rec: &mut [u8; RECORD_LEN] = match rec.try_into() {
        Ok(rec) => rec,
        Err(_) => unreachable!("chunks_exact_mut yields RECORD_LEN slices"),
    };
    rec[..10].copy_from_slice(&top10(r));
    rec[10] = 0x00;
    rec[11] = 0x11;
    write_record_number(&mut rec[12..44], n);
    rec[44..48].copy_from_slice(&[0x88, 0x99, 0xAA, 0xBB]);
    // Filler: hex digits of bits 47..0 of the random number, most significant first, 4 bytes each.
    let low = r as u64;
    for i in 0..12 {
        let digit = hex_digit(((low >> (44 - 4 * i)) & 0xF) as u8);
        rec[48 + 4 * i..52 + 4 * i].copy_from_slice(&[digit; 4]);
    }
    rec[96..100].copy_from_slice(&[0xCC, 0xDD, 0xEE, 0xFF]);
}

/// Writes `n` as 32 uppercase hex digits (gensort's record-number field).
#[inline(always)]
fn write_record_number(field: &mut [u8], n: u128) {
    for (pair, b) in field.chunks_exact_mut(2).zip(n.to_be_bytes()) {
        pair.copy_from_slice(&HEX_PAIRS[usize::from(b)]);
    }
}

/// `gensort -a` record `n` whose random number is `r` (gensort 1.5 `gen_ascii_rec`).
#[inline(always)]
fn write_ascii(rec: &mut [u8], r: u128, n: u128) {
    // Key: base-95 digits, least significant first, of the high 64 bits (8 characters) and then of
    // the low 64 bits (2 characters), offset from ' '.
    let mut t = (r >> 64) as u64;
    for b in &mut rec[..8] {
        *b = b' ' + (t % 95) as u8;
        t /= 95;
    }
    let mut t = r as u64;
    for b in &mut rec[8..10] {
        *b = b' ' + (t % 95) as u8;
        t /= 95;
    }
    rec[10..12].copy_from_slice(b"  ");
    write_record_number(&mut rec[12..44], n);
    rec[44..46].copy_from_slice(b"  ");
    // Filler: hex digits of bits 51..0 of the random number, 4 bytes each.
    let low = r as u64;
    for i in 0..13 {
        let digit = hex_digit(((low >> (48 - 4 * i)) & 0xF) as u8);
        rec[46 + 4 * i..50 + 4 * i].copy_from_slice(&[digit; 4]);
    }
    rec[98..100].copy_from_slice(b"\r\n");
}

/// gensort 1.5 record whose ten random numbers are `window` (gensort 1.5 `gen_rec`).
#[inline(always)]
fn write_gensort15(rec: &mut [u8], window: &[u128]) {
    for (j, (part, r)) in rec.chunks_exact_mut(10).zip(window).enumerate() {
        part.copy_from_slice(&top10(r ^ PART_XOR[j]));
    }
}

/// Checked `count * RECORD_LEN`, panicking with a message on overflow.
fn byte_len(count: u64) -> usize {
    usize::try_from(count)
        .ok()
        .and_then(|c| c.checked_mul(RECORD_LEN))
        .unwrap_or_else(|| panic!("{count} records do not fit in memory"))
}

/// Fills `out` with records `first..first + count` in gensort 1.2 / TeraGen layout (see
/// [`Format::Gensort12`]): byte for byte what gensort 1.2 `-b<first> <count>` writes.
///
/// # Panics
/// If `out.len() != count * RECORD_LEN`.
pub fn generate(first: u64, count: u64, out: &mut [u8]) {
    generate_format(Format::Gensort12, first, count, out);
}

/// Fills `out` with records `first..first + count` in `format`. One skip-ahead, then one
/// generator step per record.
///
/// # Panics
/// If `out.len() != count * RECORD_LEN`.
pub fn generate_format(format: Format, first: u64, count: u64, out: &mut [u8]) {
    assert_eq!(out.len(), byte_len(count), "output buffer must hold exactly {count} records");
    generate_from(format, u128::from(first), out);
}

/// Fills `out` (a whole number of records) with records from `first` on. Record numbers are
/// 128-bit in gensort, so `first + count` may pass 2^64.
fn generate_from(format: Format, first: u128, out: &mut [u8]) {
    if out.is_empty() {
        return;
    }
    let mut n = first;
    // `state` is X[n]: the random number before record n's.
    let mut state = skip_ahead(n);
    let mut randoms = [0u128; BLOCK + 9];
    for block in out.chunks_mut(BLOCK * RECORD_LEN) {
        let records = block.len() / RECORD_LEN;
        let needed = match format {
            Format::Gensort12 | Format::Ascii => records,
            Format::Gensort15 => records + 9,
        };
        let mut x = state;
        for slot in &mut randoms[..needed] {
            x = next_rand(x);
            *slot = x;
        }
        state = randoms[records - 1];
        match format {
            Format::Gensort12 => {
                for (rec, r) in block.chunks_exact_mut(RECORD_LEN).zip(&randoms) {
                    write_gensort12(rec, *r, n);
                    n += 1;
                }
            }
            Format::Gensort15 => {
                for (i, rec) in block.chunks_exact_mut(RECORD_LEN).enumerate() {
                    write_gensort15(rec, &randoms[i..i + 10]);
                }
            }
            Format::Ascii => {
                for (rec, r) in block.chunks_exact_mut(RECORD_LEN).zip(&randoms) {
                    write_ascii(rec, *r, n);
                    n += 1;
                }
            }
        }
    }
}

/// Records per parallel task: 6.4 MB, large enough that the skip-ahead per task is noise.
const PARALLEL_CHUNK: usize = 64 * 1024;

/// [`generate`] on all rayon threads: the same bytes, produced in independent chunks.
///
/// # Panics
/// If `out.len() != count * RECORD_LEN`.
pub fn generate_parallel(first: u64, count: u64, out: &mut [u8]) {
    generate_parallel_format(Format::Gensort12, first, count, out);
}

/// [`generate_format`] on all rayon threads.
///
/// # Panics
/// If `out.len() != count * RECORD_LEN`.
pub fn generate_parallel_format(format: Format, first: u64, count: u64, out: &mut [u8]) {
    assert_eq!(out.len(), byte_len(count), "output buffer must hold exactly {count} records");
    out.par_chunks_mut(PARALLEL_CHUNK * RECORD_LEN).enumerate().for_each(|(i, chunk)| {
        let start = u128::from(first) + (i * PARALLEL_CHUNK) as u128;
        generate_from(format, start, chunk);
    });
}

/// Records `first..first + count`, for tests.
#[cfg(test)]
pub(crate) fn gen(first: u64, count: u64) -> Vec<u8> {
    let mut out = vec![0u8; count as usize * RECORD_LEN];
    generate(first, count, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Top 80 bits of published rand16.c `Gen[i].c` values. `Gen[i].c = f^(2^i)(0) = X[2^i]`, the
    /// random number of record `2^i - 1`, so these are published keys of records 0, 1, 3, 7, ...
    /// (hi8, lo8) pairs copied from gensort 1.5's rand16.c table.
    const PUBLISHED_C: [(u32, u64, u64); 8] = [
        (0, 0x4a696d4772617952, 0x4950202020202001),
        (1, 0x95e0e48262b3edfe, 0x04479485c755b646),
        (2, 0x882a02c315362b60, 0x765f100068b33a1c),
        (3, 0x5efc4abfaca23e8c, 0xa8edb1f2dfbf6478),
        (20, 0x1b25cb9cfe5a0c96, 0x3174f91a97f00000),
        (40, 0xe941a65d66b64bfd, 0x71a97f0000000000),
        (63, 0x7858ca25feb8d4bf, 0x8000000000000000),
        (64, 0xf0b1944bfd71a97f, 0x0000000000000000),
    ];
    /// Published `Gen[i].a` values: the multipliers of `f^(2^i)`.
    const PUBLISHED_A: [(u32, u64, u64); 4] = [
        (0, 0x2360ed051fc65da4, 0x4385df649fccf645),
        (1, 0x17bce35bdf69743c, 0x529ed9eb20e0ae99),
        (2, 0xf4dd417327db7a9b, 0xd194dfbe42d45771),
        (64, 0x5f0ba18c53cd8fbc, 0x0000000000000001),
    ];

    fn u128_of(hi: u64, lo: u64) -> u128 {
        (u128::from(hi) << 64) | u128::from(lo)
    }

    /// The gensort 1.2 record built field by field from the layout, given its random number.
    fn expected_gensort12(n: u128, r: u128) -> Vec<u8> {
        let mut rec = r.to_be_bytes()[..10].to_vec();
        rec.extend_from_slice(&[0x00, 0x11]);
        rec.extend_from_slice(format!("{n:032X}").as_bytes());
        rec.extend_from_slice(&[0x88, 0x99, 0xAA, 0xBB]);
        let filler = format!("{:012X}", r & 0xFFFF_FFFF_FFFF);
        for c in filler.bytes() {
            rec.extend_from_slice(&[c; 4]);
        }
        rec.extend_from_slice(&[0xCC, 0xDD, 0xEE, 0xFF]);
        rec
    }

    #[test]
    fn jump_table_matches_published_rand16_table() {
        for (i, hi, lo) in PUBLISHED_A {
            assert_eq!(JUMPS[i as usize].0, u128_of(hi, lo), "Gen[{i}].a");
        }
        for (i, hi, lo) in PUBLISHED_C {
            assert_eq!(JUMPS[i as usize].1, u128_of(hi, lo), "Gen[{i}].c");
        }
    }

    #[test]
    fn record_zero_key_is_jim_gray_rip() {
        // X[1] = C, whose top 10 bytes spell "JimGrayRIP".
        assert_eq!(&record_key(0), b"JimGrayRIP");
        assert_eq!(&gen(0, 1)[..10], b"JimGrayRIP");
    }

    #[test]
    fn keys_match_published_generator_values() {
        for (i, hi, lo) in PUBLISHED_C {
            let record = if i == 64 { u64::MAX } else { (1u64 << i) - 1 };
            let r = u128_of(hi, lo);
            assert_eq!(record_key(record), top10(r), "record 2^{i}-1");
            let rec = gen(record, 1);
            assert_eq!(rec, expected_gensort12(u128::from(record), r), "record 2^{i}-1");
        }
    }

    #[test]
    fn fixed_fields_follow_layout() {
        // Random numbers by plain stepping from 0, independent of the skip-ahead.
        let mut x = 0u128;
        let mut randoms = Vec::new();
        for _ in 0..3 {
            x = next_rand(x);
            randoms.push(x);
        }
        let out = gen(0, 3);
        for n in 0..3 {
            let rec = &out[n * RECORD_LEN..(n + 1) * RECORD_LEN];
            assert_eq!(rec, &expected_gensort12(n as u128, randoms[n])[..], "record {n}");
        }
        // Record 123456789: step there one at a time.
        let mut x = 0u128;
        for _ in 0..=123_456_789u64 {
            x = next_rand(x);
        }
        assert_eq!(gen(123_456_789, 1), expected_gensort12(123_456_789, x));
        assert_eq!(&gen(123_456_789, 1)[12..44], b"000000000000000000000000075BCD15");
    }

    #[test]
    fn skip_ahead_equals_sequential_generation() {
        let whole = gen(0, 5000);
        for (a, n) in [(0u64, 5000u64), (1, 10), (255, 2), (256, 300), (1000, 3999), (4999, 1)] {
            let part = gen(a, n);
            let (s, e) = (a as usize * RECORD_LEN, (a + n) as usize * RECORD_LEN);
            assert_eq!(part, whole[s..e], "generate({a}, {n})");
        }
        assert_eq!(gen(0, 5000), whole, "deterministic");
    }

    #[test]
    fn parallel_equals_sequential() {
        let count = PARALLEL_CHUNK as u64 * 2 + 777;
        for format in [Format::Gensort12, Format::Gensort15] {
            let mut seq = vec![0u8; count as usize * RECORD_LEN];
            let mut par = vec![0u8; count as usize * RECORD_LEN];
            generate_format(format, 12_345, count, &mut seq);
            generate_parallel_format(format, 12_345, count, &mut par);
            assert!(seq == par, "{format:?}");
        }
    }

    #[test]
    fn parallel_across_2_pow_64() {
        let (first, count) = (u64::MAX - 10, PARALLEL_CHUNK as u64 + 20);
        let mut seq = vec![0u8; count as usize * RECORD_LEN];
        let mut par = vec![0u8; count as usize * RECORD_LEN];
        generate(first, count, &mut seq);
        generate_parallel(first, count, &mut par);
        assert!(seq == par);
    }

    #[test]
    fn record_numbers_beyond_2_pow_64() {
        // The last u64 record and the next one (128-bit record number 2^64).
        let out = gen(u64::MAX, 2);
        assert_eq!(&out[12..44], b"0000000000000000FFFFFFFFFFFFFFFF");
        assert_eq!(&out[112..144], b"00000000000000010000000000000000");
        let r = next_rand(skip_ahead(1u128 << 64));
        assert_eq!(&out[100..110], &top10(r));
    }

    #[test]
    fn gensort15_record_zero_from_published_values() {
        let mut rec = [0u8; RECORD_LEN];
        generate_format(Format::Gensort15, 0, 1, &mut rec);
        // Record 0 uses X[1..=10]; X[1], X[2], X[4], X[8] are published (Gen[0..4].c).
        let x = |i: usize| u128_of(PUBLISHED_C[i].1, PUBLISHED_C[i].2);
        assert_eq!(&rec[..10], b"JimGrayRIP");
        assert_eq!(&rec[10..20], &top10(x(1) ^ PART_XOR[1]));
        assert_eq!(&rec[30..40], &top10(x(2) ^ PART_XOR[3]));
        assert_eq!(&rec[70..80], &top10(x(3) ^ PART_XOR[7]));
        // Keys are the same in both formats.
        let mut both = vec![0u8; 600 * RECORD_LEN];
        generate_format(Format::Gensort15, 77, 600, &mut both);
        let classic = gen(77, 600);
        for (a, b) in both.chunks(RECORD_LEN).zip(classic.chunks(RECORD_LEN)) {
            assert_eq!(a[..KEY_LEN], b[..KEY_LEN]);
        }
    }

    #[test]
    fn gensort15_skip_ahead_across_blocks() {
        let mut whole = vec![0u8; 1000 * RECORD_LEN];
        generate_format(Format::Gensort15, 0, 1000, &mut whole);
        for (a, n) in [(1u64, 999u64), (250, 10), (255, 300)] {
            let mut part = vec![0u8; n as usize * RECORD_LEN];
            generate_format(Format::Gensort15, a, n, &mut part);
            let s = a as usize * RECORD_LEN;
            assert_eq!(part, whole[s..s + part.len()], "({a}, {n})");
        }
    }

    /// The valsort checksum of records 0..count, generated a chunk at a time so memory stays
    /// at one chunk (100 MB) whatever the count.
    fn checksum_of(format: Format, count: u64) -> u128 {
        const CHUNK: u64 = 1_000_000;
        let mut out = vec![0u8; count.min(CHUNK) as usize * RECORD_LEN];
        let mut sum = 0u128;
        for first in (0..count).step_by(CHUNK as usize) {
            let n = CHUNK.min(count - first);
            let chunk = &mut out[..n as usize * RECORD_LEN];
            generate_parallel_format(format, first, n, chunk);
            sum = sum.wrapping_add(crate::validate::checksum(chunk).1);
        }
        sum
    }

    /// valsort checksums published beside gensort output (records from 0). Matching them checks
    /// every byte of every record at once, since the sum of CRC-32s moves with any byte.
    #[test]
    fn checksums_match_published_valsort_output() {
        // gensort 1.5 binary, 1,000,000 records: "Records: 1000000   Checksum: 7a0e0d4868cd4".
        assert_eq!(checksum_of(Format::Gensort15, 1_000_000), 0x7a0e0d4868cd4);
        // gensort -a, 163840 records (a 16 MB dataset): "Checksum: 1400fed7bb2c2".
        assert_eq!(checksum_of(Format::Ascii, 163_840), 0x1400fed7bb2c2);
    }

    /// The same for a larger published gensort -a dataset (1.3 GB, generated 100 MB at a time):
    /// skip-ahead is exercised across 14 chunks.
    #[test]
    fn checksum_matches_published_valsort_output_large() {
        // gensort -a, 13107200 records: "Checksum: 63f9af71da7682".
        assert_eq!(checksum_of(Format::Ascii, 13_107_200), 0x63f9af71da7682);
    }

    #[test]
    fn ascii_skip_ahead_and_layout() {
        let mut whole = vec![0u8; 700 * RECORD_LEN];
        generate_format(Format::Ascii, 0, 700, &mut whole);
        let mut part = vec![0u8; 400 * RECORD_LEN];
        generate_format(Format::Ascii, 300, 400, &mut part);
        assert!(part == whole[300 * RECORD_LEN..]);
        let rec = &whole[299 * RECORD_LEN..300 * RECORD_LEN];
        assert!(rec[..98].iter().all(|b| (b' '..=b'~').contains(b)));
        assert_eq!(&rec[10..12], b"  ");
        assert_eq!(&rec[12..44], format!("{:032X}", 299).as_bytes());
        assert_eq!(&rec[98..], b"\r\n");
    }

    #[test]
    fn empty_and_wrong_size() {
        generate(5, 0, &mut []);
        let r = std::panic::catch_unwind(|| generate(0, 2, &mut [0u8; 150]));
        assert!(r.is_err());
    }
}
