//! One cell's figures: the JSON Lines schema of `--json`, made from a run's samples and folded
//! over the runs into their median and range.

use serde::{Deserialize, Serialize};
use tern_common::Spread;

use super::{Cell, Op, System};
use crate::harness::Samples;

/// One (system, op, size, concurrency) over its runs: the JSON Lines schema of `--json`.
/// Throughput is the median run's, with the range; latencies are the medians of the runs'
/// percentiles, NaN (JSON null) where a run's samples are too few for the percentile.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CellResult {
    pub system: String,
    pub op: Op,
    pub size_bytes: u64,
    pub concurrency: u32,
    /// Measured ops and seconds, over every run.
    pub ops: u64,
    pub seconds: f64,
    pub runs: usize,
    pub throughput_mib_s: f64,
    pub throughput_min_mib_s: f64,
    pub throughput_max_mib_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
}

impl CellResult {
    /// The keys of each `--json` line, in the order the struct declares them (held to the struct by
    /// a test here, and to the binary's output by tests/integration/bench_io.rs).
    pub const JSON_FIELDS: [&'static str; 13] = [
        "system",
        "op",
        "size_bytes",
        "concurrency",
        "ops",
        "seconds",
        "runs",
        "throughput_mib_s",
        "throughput_min_mib_s",
        "throughput_max_mib_s",
        "p50_us",
        "p99_us",
        "p999_us",
    ];
}

impl CellResult {
    /// One run of `cell` on `system`, from its workers' merged samples.
    pub(super) fn of_samples(system: System, cell: Cell, samples: &Samples) -> CellResult {
        let ops = samples.ops();
        let seconds = samples.seconds();
        let throughput_mib_s =
            if seconds > 0.0 { (ops * cell.size) as f64 / seconds / f64::from(1 << 20) } else { 0.0 };
        CellResult {
            system: system.name().to_string(),
            op: cell.op,
            size_bytes: cell.size,
            concurrency: cell.concurrency,
            ops,
            seconds,
            runs: 1,
            throughput_mib_s,
            throughput_min_mib_s: throughput_mib_s,
            throughput_max_mib_s: throughput_mib_s,
            p50_us: samples.latency_us(0.5),
            p99_us: samples.latency_us(0.99),
            p999_us: samples.latency_us(0.999),
        }
    }

    /// The runs of one cell of one system folded into one row.
    pub(super) fn of_runs(runs: &[CellResult]) -> CellResult {
        let first = runs.first().expect("a cell ran at least once").clone();
        let spread = |f: fn(&CellResult) -> f64| Spread::of(runs.iter().map(f).collect());
        let throughput = spread(|r| r.throughput_mib_s);
        CellResult {
            ops: runs.iter().map(|r| r.ops).sum(),
            seconds: runs.iter().map(|r| r.seconds).sum(),
            runs: runs.len(),
            throughput_mib_s: throughput.median,
            throughput_min_mib_s: throughput.min,
            throughput_max_mib_s: throughput.max,
            p50_us: spread(|r| r.p50_us).median,
            p99_us: spread(|r| r.p99_us).median,
            p999_us: spread(|r| r.p999_us).median,
            ..first
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_have_exactly_the_schema_fields() {
        let r = CellResult {
            system: "redis".into(),
            op: Op::Read,
            size_bytes: 4096,
            concurrency: 1,
            ops: 10,
            seconds: 0.5,
            runs: 1,
            throughput_mib_s: 1.0,
            throughput_min_mib_s: 1.0,
            throughput_max_mib_s: 1.0,
            p50_us: 40.0,
            p99_us: 80.0,
            p999_us: 90.0,
        };
        let value: serde_json::Value = serde_json::to_value(&r).unwrap();
        let mut keys: Vec<&str> = value.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        keys.sort_unstable();
        let mut want = CellResult::JSON_FIELDS;
        want.sort_unstable();
        assert_eq!(keys, want);
        assert_eq!(value["op"], "read");
        // Runs fold into their median and range.
        let runs: Vec<CellResult> = [3.0, 1.0, 2.0]
            .into_iter()
            .map(|mib_s| CellResult { throughput_mib_s: mib_s, p50_us: 10.0 * mib_s, ..r.clone() })
            .collect();
        let folded = CellResult::of_runs(&runs);
        assert_eq!((folded.runs, folded.ops), (3, 30));
        assert_eq!(
            (folded.throughput_mib_s, folded.throughput_min_mib_s, folded.throughput_max_mib_s),
            (2.0, 1.0, 3.0)
        );
        assert_eq!(folded.p50_us, 20.0);
    }
}
