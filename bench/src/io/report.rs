//! What `tern bench io` prints and writes: the table, with each Tern system's ratios to its raw
//! peer and to Redis, and the JSON Lines of `--json`.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;

use super::{CellResult, IoReport, Op, System};

/// "4KiB", "1MiB".
pub fn human_size(bytes: u64) -> String {
    tern_common::ByteSize(bytes).to_string()
}

/// The table: one block per (op, size, concurrency), a row per system with its median throughput
/// and range over the runs, and each Tern system's ratios to its raw peer (the transport's limit
/// on this machine) and to Redis.
pub fn print_table(report: &IoReport) {
    let mut groups: BTreeMap<(Op, u64, u32), Vec<&CellResult>> = BTreeMap::new();
    for r in &report.results {
        groups.entry((r.op, r.size_bytes, r.concurrency)).or_default().push(r);
    }
    let runs = report.results.iter().map(|r| r.runs).max().unwrap_or(0);
    println!(
        "{:<5} {:>6} {:>4}  {:<11} {:>21} {:>9} {:>9} {:>9}  {:>6} {:>9}  {:>7}",
        "OP", "SIZE", "CONC", "SYSTEM", "MiB/s [range]", "p50 us", "p99 us", "p999 us", "x raw", "p50 x raw", "x redis"
    );
    let us = |v: f64| if v.is_nan() { "n/a".to_string() } else { format!("{v:.1}") };
    for ((op, size, concurrency), rows) in groups {
        let find = |system: System| rows.iter().find(|r| r.system == system.name());
        let redis = find(System::Redis);
        for r in &rows {
            let system = r.system.parse::<System>().ok();
            let raw = match system.and_then(System::raw_peer).and_then(find) {
                Some(raw) => {
                    format!("{:>6.2} {:>9.2}", r.throughput_mib_s / raw.throughput_mib_s, r.p50_us / raw.p50_us)
                }
                None => format!("{:>6} {:>9}", "", ""),
            };
            let x_redis = match redis {
                Some(redis) if r.system != redis.system => {
                    format!("{:>7.2}", r.throughput_mib_s / redis.throughput_mib_s)
                }
                _ => String::new(),
            };
            let throughput =
                format!("{:.0} [{:.0}-{:.0}]", r.throughput_mib_s, r.throughput_min_mib_s, r.throughput_max_mib_s);
            println!(
                "{:<5} {:>6} {:>4}  {:<11} {:>21} {:>9} {:>9} {:>9}  {raw}  {x_redis}",
                op.name(),
                human_size(size),
                concurrency,
                r.system,
                throughput,
                us(r.p50_us),
                us(r.p99_us),
                us(r.p999_us)
            );
        }
    }
    println!(
        "medians of {runs} runs in rotating order, [min-max]; latencies: medians of the runs' percentiles (n/a: \
         too few samples); x raw: throughput over the raw peer of the same transport (tcp-raw, tls-raw, \
         quic-raw), p50 x raw: p50 latency over its (below 1 is better); x redis: throughput over Redis'"
    );
    for note in &report.notes {
        println!("{note}");
    }
}

/// Writes one JSON object per result, one per line.
pub fn write_json_lines(results: &[CellResult], path: &Path) -> anyhow::Result<()> {
    let mut out = String::new();
    for r in results {
        out.push_str(&serde_json::to_string(r)?);
        out.push('\n');
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}
