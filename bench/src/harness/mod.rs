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

/// A daemon's `/metrics` text, from its admin endpoint at `admin`, within 2 s.
pub(crate) async fn scrape(admin: std::net::SocketAddr) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let read = async {
        let mut stream = tokio::net::TcpStream::connect(admin).await?;
        stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").await?;
        let mut text = String::new();
        stream.read_to_string(&mut text).await?;
        anyhow::Ok(text)
    };
    tokio::time::timeout(std::time::Duration::from_secs(2), read)
        .await
        .with_context(|| format!("{admin}/metrics not answered within 2 s"))?
        .with_context(|| format!("reading {admin}/metrics"))
}

/// The value of the unlabelled metric `name` in a `/metrics` text.
pub(crate) fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}
