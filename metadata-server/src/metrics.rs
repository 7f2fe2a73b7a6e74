//! Prometheus metrics: per-RPC counters and latencies, and gauges read from the state at scrape.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use tern_proto::ErrorKind;

use crate::state::State;

type MethodLabel = [(&'static str, &'static str); 1];
type ErrorLabels = [(&'static str, &'static str); 2];

/// The per-RPC metrics, recorded once per call by the service.
#[derive(Debug)]
pub struct Metrics {
    requests: Family<MethodLabel, Counter>,
    errors: Family<ErrorLabels, Counter>,
    durations: Family<MethodLabel, Histogram, fn() -> Histogram>,
}

/// Sizes of the state, exported as gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gauges {
    pub files: u64,
    pub directories: u64,
    pub jobs: u64,
    pub live_servers: u64,
    pub dead_servers: u64,
    pub allocated_blocks: u64,
    pub shuffles: u64,
    /// Re-replication and drain copies: see `Copies::totals`.
    pub copies: [u64; 8],
}

impl Metrics {
    /// Registers the RPC metrics, and gauges that read `state` on each scrape.
    pub fn register(registry: &mut Registry, state: Arc<Mutex<State>>) -> Metrics {
        let metrics = Metrics {
            requests: Family::default(),
            errors: Family::default(),
            durations: Family::new_with_constructor(|| Histogram::new(tern_common::admin::latency_buckets())),
        };
        registry.register("tern_metadata_requests", "Metadata RPCs received", metrics.requests.clone());
        registry.register("tern_metadata_errors", "Metadata RPCs refused, by error kind", metrics.errors.clone());
        registry.register_with_unit(
            "tern_metadata_request_duration",
            "Time to serve a metadata RPC",
            Unit::Seconds,
            metrics.durations.clone(),
        );
        registry.register_collector(Box::new(StateGauges(state)));
        metrics
    }

    /// Records one RPC: its method, how long it took, and the error it ended with, if any.
    pub fn record(&self, method: &'static str, elapsed: Duration, error: Option<&tonic::Status>) {
        let label = [("method", method)];
        self.requests.get_or_create(&label).inc();
        self.durations.get_or_create(&label).observe(elapsed.as_secs_f64());
        if let Some(status) = error {
            self.errors.get_or_create(&[("method", method), ("kind", ErrorKind::of_status(status).name())]).inc();
        }
    }
}

/// Reads the gauges from the state when scraped, so they are exact and cost nothing between scrapes.
#[derive(Debug)]
struct StateGauges(Arc<Mutex<State>>);

impl Collector for StateGauges {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let gauges = self.0.lock().gauges();
        for (name, help, value) in [
            ("tern_metadata_files", "Files in the namespace", gauges.files),
            ("tern_metadata_directories", "Directories in the namespace", gauges.directories),
            ("tern_metadata_jobs", "Registered jobs", gauges.jobs),
            ("tern_metadata_live_servers", "Live storage servers", gauges.live_servers),
            ("tern_metadata_dead_servers", "Storage servers declared dead (and still remembered)", gauges.dead_servers),
            (
                "tern_metadata_allocated_blocks",
                "Blocks placed on live storage servers and not yet freed",
                gauges.allocated_blocks,
            ),
            ("tern_metadata_shuffles", "Registered shuffles", gauges.shuffles),
            (
                "tern_metadata_copies_pending_blocks",
                "Block copies (re-replication, drain) chosen, not yet stored",
                gauges.copies[0],
            ),
            (
                "tern_metadata_copies_pending_bytes",
                "Bytes of block and segment copies chosen, not yet stored (segments: committed bytes, an estimate)",
                gauges.copies[1],
            ),
            (
                "tern_metadata_copied_blocks",
                "Block copies stored since start (re-replication, drain)",
                gauges.copies[2],
            ),
            ("tern_metadata_copied_bytes", "Bytes of block and segment copies stored since start", gauges.copies[3]),
            (
                "tern_metadata_copy_failed_blocks",
                "Block copies that failed or were given up since start",
                gauges.copies[4],
            ),
            (
                "tern_metadata_copies_pending_segments",
                "Shuffle segment copies (re-replication) chosen, not yet stored",
                gauges.copies[5],
            ),
            ("tern_metadata_copied_segments", "Shuffle segment copies stored since start", gauges.copies[6]),
            (
                "tern_metadata_copy_failed_segments",
                "Shuffle segment copies that failed or were given up since start",
                gauges.copies[7],
            ),
        ] {
            let gauge = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

/// A replica's place in Raft, read from its Raft node when scraped: whether it leads and
/// serves, its term, and how far its log and state machine reach (a follower whose applied
/// index trails the leader's is catching up).
#[derive(Debug)]
pub struct RaftGauges(pub Arc<crate::raft::Replica>);

impl Collector for RaftGauges {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let place = self.0.place();
        for (name, help, value) in [
            ("tern_metadata_raft_serving", "1 while this replica leads and serves, else 0", u64::from(place.serving)),
            ("tern_metadata_raft_term", "This replica's current Raft term", place.term),
            (
                "tern_metadata_raft_last_log_index",
                "Index of the last entry in this replica's Raft log",
                place.last_log_index,
            ),
            (
                "tern_metadata_raft_applied_index",
                "Index of the last Raft entry this replica applied",
                place.applied_index,
            ),
        ] {
            let gauge = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}
