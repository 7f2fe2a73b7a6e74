//! The chart of `--plot`: throughput against size, a line per system, a panel per (op,
//! concurrency), SVG or PNG.

use std::path::Path;

use super::{human_size, CellResult, Op};
use crate::harness::chart::{self, Panel};

/// Draws throughput against size, a line per system, a panel per (op, concurrency); SVG or PNG
/// by the file's extension.
pub fn plot(results: &[CellResult], path: &Path) -> anyhow::Result<()> {
    let mut concurrencies: Vec<u32> = results.iter().map(|r| r.concurrency).collect();
    concurrencies.sort_unstable();
    concurrencies.dedup();
    let mut sizes: Vec<u64> = results.iter().map(|r| r.size_bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut systems: Vec<&str> = Vec::new();
    for r in results {
        if !systems.contains(&r.system.as_str()) {
            systems.push(&r.system);
        }
    }
    let mut panels = Vec::new();
    for op in [Op::Write, Op::Read] {
        for &concurrency in &concurrencies {
            let cells: Vec<&CellResult> =
                results.iter().filter(|r| r.op == op && r.concurrency == concurrency).collect();
            let series = systems
                .iter()
                .map(|system| {
                    let at = |size: &u64| {
                        cells.iter().find(|r| r.system == *system && r.size_bytes == *size).map(|r| r.throughput_mib_s)
                    };
                    (system.to_string(), sizes.iter().map(at).collect())
                })
                .collect();
            panels.push(Panel {
                title: format!("{} x{concurrency}", op.name()),
                unit: "MiB/s".into(),
                labels: sizes.iter().map(|s| human_size(*s)).collect(),
                series,
            });
        }
    }
    let columns = concurrencies.len().max(1);
    chart::save(path, (420 * columns as u32, 720), (2, columns), &panels)
}
