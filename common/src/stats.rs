//! Percentiles of measured samples, one definition for every benchmark and report.

/// The `p`th percentile (0..=100) of `sorted` samples by the nearest-rank method: the smallest
/// sample with at least `p`% of the samples at or below it (so the median of 1..=100 is 50, the
/// 99th percentile 99, and `p` = 0 is the minimum). NaN when there are no samples: no figure
/// rather than a made-up one.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The median (nearest rank) of samples in any order.
pub fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    percentile(&samples, 50.0)
}

#[cfg(test)]
mod tests {
    use super::{median, percentile};

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        // tern-bench's percentile (the rounded linear rank) gave 51 here; there is one
        // definition now, the nearest rank the scheduler benchmark used, and it gives 50.
        assert_eq!(percentile(&values, 50.0), 50.0);
        assert_eq!(percentile(&values, 99.0), 99.0);
        assert_eq!(percentile(&values, 0.0), 1.0);
        assert_eq!(percentile(&values, 100.0), 100.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0], 50.0), 2.0);
        // The scheduler benchmark's gave 0 for no samples; bench's NaN is kept: no figure.
        assert!(percentile(&[], 50.0).is_nan());
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    }
}
