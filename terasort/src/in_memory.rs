//! The limit a TeraSort through the shuffle is measured against: the same records, generated as
//! teragen generates them, sorted in this process's memory by the sort the reducers use
//! ([`crate::sort::try_sort_records`]), with no shuffle, store or network in the way.
//!
//! Memory is bounded: the sort holds the records, their sorted copy and 16-byte entries (about
//! 2.2 times the records), so above [`MAX_BYTES`] it sorts the first [`MAX_BYTES`] of the same
//! records (a sample: keys are uniformly random, so the rate per byte is comparable, if a little
//! flattering, as a smaller sort has fewer buckets to scatter into) and says so.

use std::time::Instant;

use serde::Serialize;

use crate::gensort::{self, RECORD_LEN};
use crate::sort::try_sort_records;

/// Most bytes of records sorted in memory: about 2.3 GiB held at the peak.
pub const MAX_BYTES: u64 = 1 << 30;

/// One in-memory sort.
#[derive(Debug, Clone, Serialize)]
pub struct InMemorySort {
    /// Records sorted (the first `records` of teragen's).
    pub records: u64,
    pub bytes: u64,
    /// Fewer records than were asked for (more than [`MAX_BYTES`]).
    pub sampled: bool,
    /// Seconds of the sort alone (generation excluded).
    pub seconds: f64,
    /// Bytes sorted per second, in GB (1e9 bytes).
    pub gb_per_s: f64,
}

impl InMemorySort {
    /// One line: its rate, and whether it sorted every one of `asked_records` or a bounded sample.
    pub fn describe(&self, asked_records: u64) -> String {
        let what = if self.sampled {
            format!(
                "the first {} of the {asked_records} records (bounded at {}: a sample)",
                self.records,
                tern_common::ByteSize(MAX_BYTES).human()
            )
        } else {
            format!("the same {} records", self.records)
        };
        format!(
            "in-memory sort of {what}, same process, the reducers' sort: {:.3} GB/s ({:.2} s); \
             the limit the shuffle is measured against",
            self.gb_per_s, self.seconds
        )
    }
}

/// Records the in-memory sort takes when asked for `records`: all of them up to [`MAX_BYTES`].
pub fn records_to_sort(records: u64) -> u64 {
    records.min(MAX_BYTES / RECORD_LEN as u64)
}

/// Generates the first [`records_to_sort`]`(records)` records as teragen does, sorts them in
/// memory on all cores, checks the result is in order, and times the sort.
pub fn sort(records: u64) -> anyhow::Result<InMemorySort> {
    let n = records_to_sort(records);
    anyhow::ensure!(n > 0, "no records to sort");
    let bytes = n * RECORD_LEN as u64;
    let mut input = vec![0u8; bytes as usize];
    gensort::generate_parallel(0, n, &mut input);
    let mut out = Vec::with_capacity(input.len());
    let started = Instant::now();
    try_sort_records(&input, &mut out).map_err(anyhow::Error::msg)?;
    let seconds = started.elapsed().as_secs_f64();
    drop(input);
    let summary = crate::validate::validate_parallel(&out).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(summary.sorted() && summary.records == n, "the in-memory sort's output is not in order");
    Ok(InMemorySort { records: n, bytes, sampled: n < records, seconds, gb_per_s: bytes as f64 / seconds / 1e9 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_at_most_the_bound() {
        assert_eq!(records_to_sort(10), 10);
        assert_eq!(records_to_sort(u64::MAX), MAX_BYTES / RECORD_LEN as u64);
        let sorted = sort(5000).unwrap();
        assert_eq!((sorted.records, sorted.bytes, sorted.sampled), (5000, 500_000, false));
        assert!(sorted.gb_per_s > 0.0);
        assert!(sorted.describe(5000).contains("the same 5000 records"));
        let sample = InMemorySort { records: 10, bytes: 1000, sampled: true, seconds: 1.0, gb_per_s: 1e-6 };
        assert!(sample.describe(20).contains("the first 10 of the 20 records"), "{}", sample.describe(20));
    }
}
