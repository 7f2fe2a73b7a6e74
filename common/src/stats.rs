//! Percentiles of measured samples, the spread of repeated runs, and the order runs take: one
//! definition for every benchmark and report.

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

/// The `p`th percentile, or `None` when `samples` are too few for it to be more than the maximum
/// (the 99th needs 100 samples, the 99.9th 1000): reports print "n/a" rather than a maximum under
/// a percentile's name.
pub fn percentile_if_supported(sorted: &[f64], p: f64) -> Option<f64> {
    let needed = (100.0 / (100.0 - p).max(f64::EPSILON)).ceil();
    (p <= 50.0 || sorted.len() as f64 >= needed).then(|| percentile(sorted, p)).filter(|v| !v.is_nan())
}

/// The median and range of one figure over repeated runs.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub runs: usize,
}

impl Spread {
    /// The spread of `runs` (NaN figures when there are none).
    pub fn of(mut runs: Vec<f64>) -> Spread {
        runs.sort_by(f64::total_cmp);
        let (min, max) = (runs.first().copied().unwrap_or(f64::NAN), runs.last().copied().unwrap_or(f64::NAN));
        Spread { median: percentile(&runs, 50.0), min, max, runs: runs.len() }
    }
}

impl std::fmt::Display for Spread {
    /// `median [min-max]`, with the formatter's precision (default 2).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = f.precision().unwrap_or(2);
        write!(f, "{:.p$} [{:.p$}-{:.p$}]", self.median, self.min, self.max)
    }
}

/// The order the systems of run `run` take: the list rotated by `run`, so over as many runs as
/// systems each goes first once and none always follows the same one (warm caches, a neighbour's
/// leftover load).
pub fn rotation<T: Clone>(systems: &[T], run: usize) -> Vec<T> {
    let mut order = systems.to_vec();
    if !order.is_empty() {
        let len = order.len();
        order.rotate_left(run % len);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::{median, percentile, percentile_if_supported, rotation, Spread};

    #[test]
    fn spreads_rotations_and_supported_percentiles() {
        let s = Spread::of(vec![3.0, 1.0, 2.0]);
        assert_eq!((s.median, s.min, s.max, s.runs), (2.0, 1.0, 3.0, 3));
        assert_eq!(format!("{s:.1}"), "2.0 [1.0-3.0]");
        assert_eq!(rotation(&['a', 'b', 'c'], 0), ['a', 'b', 'c']);
        assert_eq!(rotation(&['a', 'b', 'c'], 4), ['b', 'c', 'a']);
        let twenty: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(percentile_if_supported(&twenty, 50.0), Some(10.0));
        assert_eq!(percentile_if_supported(&twenty, 90.0), Some(18.0));
        assert_eq!(percentile_if_supported(&twenty, 99.0), None, "20 samples have no 99th percentile");
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile_if_supported(&hundred, 99.0), Some(99.0));
        assert_eq!(percentile_if_supported(&hundred, 99.9), None);
        assert_eq!(percentile_if_supported(&[], 50.0), None);
    }

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
