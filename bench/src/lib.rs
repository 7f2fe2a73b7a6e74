//! Tern's benchmarks. Each measures Tern and a peer in the same run on the same machine, and
//! reports figures with their ratio to the peer, because these machines are shared and noisy and
//! only figures taken side by side compare.

// kill(2) on the cluster's `tern up` child.
#[allow(unsafe_code)]
pub mod cluster;
pub mod core;
pub mod io;
pub mod shuffle;
pub mod soak;
pub mod terasort;
pub mod terasort_run;

/// Percentile `p` (0..=100) of sorted samples.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// The median of samples in any order.
pub fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    percentile(&samples, 50.0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn percentiles() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(super::percentile(&samples, 50.0), 51.0);
        assert_eq!(super::percentile(&samples, 0.0), 1.0);
        assert_eq!(super::percentile(&samples, 100.0), 100.0);
        assert!(super::percentile(&[], 50.0).is_nan());
    }
}
