//! Every worker's recorders of one cell merged, and the figures read from them.

use std::time::Instant;

use anyhow::Context;

use super::{Histogram, Recorder};

/// Every worker's recorders of one cell, merged.
pub(crate) struct Samples {
    measure_from: Instant,
    histogram: Histogram,
    last_end: Option<Instant>,
}

impl Samples {
    pub(crate) fn merge(recorders: Vec<Recorder>) -> anyhow::Result<Samples> {
        let first = recorders.first().context("a cell ran no worker")?;
        let mut samples =
            Samples { measure_from: first.budget.measure_from, histogram: Histogram::default(), last_end: None };
        for r in recorders {
            samples.histogram.merge(&r.histogram);
            samples.last_end = samples.last_end.max(r.last_end);
        }
        Ok(samples)
    }

    /// Measured ops, over every worker.
    pub(crate) fn ops(&self) -> u64 {
        self.histogram.count()
    }

    /// From the start of the measured window to the end of the last measured op; 0 when none
    /// was measured.
    pub(crate) fn seconds(&self) -> f64 {
        self.last_end.map(|end| (end - self.measure_from).as_secs_f64()).unwrap_or(0.0)
    }

    /// The latency at quantile `q` in microseconds; NaN where the samples are too few for it: a
    /// percentile needs enough samples to be more than the maximum (p99: 100, p99.9: 1000).
    pub(crate) fn latency_us(&self, q: f64) -> f64 {
        let supported = q <= 0.5 || self.ops() as f64 >= (1.0 / (1.0 - q)).round();
        if supported {
            self.histogram.quantile_ns(q) as f64 / 1e3
        } else {
            f64::NAN
        }
    }
}
