//! `noop`: does nothing, so dispatch can be measured alone; `sleep_ms` makes it hold its
//! resources for a while (autoscaler and executor-loss tests).

use std::time::Duration;

use tern_proto::sched as pb;

use super::{param, Report};

/// Longest `sleep_ms` a noop task takes.
const MAX_SLEEP_MS: u64 = 3_600_000;

pub async fn run(task: &pb::Assignment) -> anyhow::Result<Report> {
    let sleep_ms: u64 = param(task, "sleep_ms")?.unwrap_or(0);
    anyhow::ensure!(sleep_ms <= MAX_SLEEP_MS, "noop sleep_ms = {sleep_ms} is more than {MAX_SLEEP_MS}");
    if sleep_ms > 0 {
        tokio::time::sleep(Duration::from_millis(sleep_ms)).await;
    }
    Ok(Report::succeeded(""))
}
