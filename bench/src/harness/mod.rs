//! What the benches share and none of the systems they measure: the timing of one cell (when
//! its workers warm up, measure and stop; what each records; the figures of all of them merged)
//! and the bytes they move. It knows no target and no report: a bench says how to reach its
//! systems and how to show their figures, and this times the ops it is given.
//!
//! - `budget.rs`: [`Budget`] (a cell's warm-up and measured window and its op limits),
//!   [`Recorder`] (one worker's latencies) and [`go`] / [`go_blocking`] (whether a worker's next op
//!   may start).
//! - `samples.rs`: [`Samples`], every worker's recorders of one cell merged: ops, seconds and
//!   latency percentiles.
//! - `histogram.rs`: [`Histogram`], the log-linear latency histogram behind them.
//! - `chart.rs`: the `--plot` charts (panels of labelled points, SVG or PNG).
//! - `data.rs`: [`payload`] (the same incompressible bytes for every system) and [`AlignedVec`]
//!   (a 4 KiB-aligned buffer for O_DIRECT).

mod budget;
pub(crate) mod chart;
mod data;
mod histogram;
mod samples;

use anyhow::Context;

pub(crate) use budget::{go, go_blocking, Budget, Recorder};
pub(crate) use data::{payload, AlignedVec};
pub use histogram::Histogram;
pub(crate) use samples::Samples;

/// Awaits every worker of a cell, in order; the first error (or panic) is the cell's.
pub(crate) async fn join_all<T: Send + 'static>(
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<T>>>,
) -> anyhow::Result<Vec<T>> {
    let mut out = Vec::with_capacity(tasks.len());
    for task in tasks {
        out.push(task.await.context("a bench worker panicked")??);
    }
    Ok(out)
}
