//! The storage server's Prometheus metrics. Every request is recorded through [`Metrics::record`].

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tern_proto::frame::Op;
use tern_proto::{ErrorKind, Tier};

use crate::store::BlockStore;
use crate::Usage;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    op: &'static str,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabels {
    tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransportLabels {
    transport: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LendLabels {
    what: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EngineLabels {
    engine: &'static str,
}

/// Per-op handles, resolved once so the request path does no label hashing.
struct OpMetrics {
    requests: Counter,
    bytes: Counter,
    duration: Histogram,
}

/// Handles on every storage-server metric.
pub struct Metrics {
    ops: [OpMetrics; OPS.len()],
    errors: Family<ErrorLabels, Counter>,
    dram_capacity_bytes: Gauge,
    dram_used_bytes: Gauge,
    dram_blocks: Gauge,
    nvme_capacity_bytes: Gauge,
    nvme_used_bytes: Gauge,
    nvme_blocks: Gauge,
    io_engine: Family<EngineLabels, Gauge>,
    shuffle_segments: Gauge,
    dram_shuffle_bytes: Gauge,
    nvme_shuffle_bytes: Gauge,
    connections: Gauge,
    connections_accepted: Family<TransportLabels, Counter>,
    lends: Family<LendLabels, Counter>,
}

const OPS: [Op; 11] = [
    Op::Ping,
    Op::Write,
    Op::WriteStaged,
    Op::Read,
    Op::Free,
    Op::Push,
    Op::Fetch,
    Op::Auth,
    Op::Lease,
    Op::Release,
    Op::Malformed,
];

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Ping => "ping",
        Op::Write => "write",
        Op::WriteStaged => "write_staged",
        Op::Read => "read",
        Op::Free => "free",
        Op::Push => "push",
        Op::Fetch => "fetch",
        Op::Auth => "auth",
        Op::Lease => "lease",
        Op::Release => "release",
        Op::Malformed => "malformed",
    }
}

fn op_index(op: Op) -> usize {
    OPS.iter().position(|o| *o == op).expect("OPS lists every op")
}

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Arc<Metrics> {
        let requests = Family::<OpLabels, Counter>::default();
        let bytes = Family::<OpLabels, Counter>::default();
        let duration = Family::<OpLabels, Histogram, fn() -> Histogram>::new_with_constructor(|| {
            Histogram::new(tern_common::admin::latency_buckets())
        });
        let errors = Family::<ErrorLabels, Counter>::default();
        let capacity = Family::<TierLabels, Gauge>::default();
        let used = Family::<TierLabels, Gauge>::default();
        let blocks = Family::<TierLabels, Gauge>::default();
        let shuffle_segments = Gauge::default();
        let shuffle_bytes = Family::<TierLabels, Gauge>::default();
        let connections = Gauge::default();
        let connections_accepted = Family::<TransportLabels, Counter>::default();
        let io_engine = Family::<EngineLabels, Gauge>::default();
        let lends = Family::<LendLabels, Counter>::default();
        registry.register(
            "tern_storage_io_engine_info",
            "The NVMe tier's io engine (uring or psync): 1 for the one in use",
            io_engine.clone(),
        );
        registry.register("tern_storage_requests", "Block-service requests handled, by op", requests.clone());
        registry.register(
            "tern_storage_errors",
            "Block-service requests refused, by op and error kind",
            errors.clone(),
        );
        registry.register(
            "tern_storage_bytes",
            "Payload bytes stored (write, push: batch bytes) and sent (read, fetch), by op",
            bytes.clone(),
        );
        registry.register(
            "tern_storage_request_duration_seconds",
            "Time to handle a block-service request, from its header (write payloads included) to its reply",
            duration.clone(),
        );
        registry.register("tern_storage_tier_capacity_bytes", "Bytes a tier can hold", capacity.clone());
        registry.register("tern_storage_tier_used_bytes", "Bytes stored in a tier", used.clone());
        registry.register(
            "tern_storage_blocks",
            "Blocks in use in a tier (file blocks and shuffle data)",
            blocks.clone(),
        );
        registry.register("tern_storage_shuffle_segments", "Shuffle segments held", shuffle_segments.clone());
        registry.register(
            "tern_storage_shuffle_bytes",
            "Shuffle bytes held in a tier (batches with their headers)",
            shuffle_bytes.clone(),
        );
        registry.register("tern_storage_connections", "Open block-service connections", connections.clone());
        registry.register(
            "tern_storage_connections_accepted",
            "Block-service connections accepted, by listener (tcp+tls serves plain TCP and TLS)",
            connections_accepted.clone(),
        );
        registry.register(
            "tern_storage_lends",
            "Fetch pages and Leased blocks, by what and outcome: lent (READ one-sided or copied from the \
             shared arena), or why not (transport, gathered, nvme, limit, refused, timed_out, empty)",
            lends.clone(),
        );
        let ops = OPS.map(|op| {
            let labels = OpLabels { op: op_name(op) };
            OpMetrics {
                requests: requests.get_or_create_owned(&labels),
                bytes: bytes.get_or_create_owned(&labels),
                duration: duration.get_or_create_owned(&labels),
            }
        });
        let dram = TierLabels { tier: Tier::Dram.name() };
        let nvme = TierLabels { tier: Tier::Nvme.name() };
        Arc::new(Metrics {
            ops,
            errors,
            dram_capacity_bytes: capacity.get_or_create_owned(&dram),
            dram_used_bytes: used.get_or_create_owned(&dram),
            dram_blocks: blocks.get_or_create_owned(&dram),
            nvme_capacity_bytes: capacity.get_or_create_owned(&nvme),
            nvme_used_bytes: used.get_or_create_owned(&nvme),
            nvme_blocks: blocks.get_or_create_owned(&nvme),
            io_engine,
            shuffle_segments,
            dram_shuffle_bytes: shuffle_bytes.get_or_create_owned(&dram),
            nvme_shuffle_bytes: shuffle_bytes.get_or_create_owned(&nvme),
            connections,
            connections_accepted,
            lends,
        })
    }

    /// Counts one decision to lend `what` ("page" or "block") or not, by its outcome's name.
    pub(crate) fn lend(&self, what: &'static str, outcome: &'static str) {
        self.lends.get_or_create(&LendLabels { what, outcome }).inc();
    }

    /// Records one handled request: its op, time taken, payload bytes moved, and error if any.
    pub fn record(&self, op: Op, elapsed: Duration, bytes: u64, error: Option<ErrorKind>) {
        let m = &self.ops[op_index(op)];
        m.requests.inc();
        m.bytes.inc_by(bytes);
        m.duration.observe(elapsed.as_secs_f64());
        if let Some(kind) = error {
            self.errors.get_or_create(&ErrorLabels { op: op_name(op), kind: kind.name() }).inc();
        }
    }

    /// Updates the tier gauges.
    pub fn observe_usage(&self, usage: &Usage) {
        self.dram_capacity_bytes.set(gauge_value(usage.capacity_bytes));
        self.dram_used_bytes.set(gauge_value(usage.used_bytes));
        self.dram_blocks.set(gauge_value(usage.used_blocks));
    }

    /// Updates the NVMe tier gauges and names its io engine.
    pub fn observe_nvme(&self, usage: &Usage, engine: &'static str) {
        self.nvme_capacity_bytes.set(gauge_value(usage.capacity_bytes));
        self.nvme_used_bytes.set(gauge_value(usage.used_bytes));
        self.nvme_blocks.set(gauge_value(usage.used_blocks));
        self.io_engine.get_or_create(&EngineLabels { engine }).set(1);
    }

    /// Updates every gauge that describes `store`.
    pub fn observe_store(&self, store: &BlockStore) {
        self.observe_usage(&store.dram().usage());
        if let Some(nvme) = store.nvme() {
            self.observe_nvme(&nvme.usage(), nvme.engine());
        }
        self.shuffle_segments.set(gauge_value(store.shuffle_segments() as u64));
        let shuffles = store.shuffle_bytes();
        self.dram_shuffle_bytes.set(gauge_value(shuffles.dram));
        self.nvme_shuffle_bytes.set(gauge_value(shuffles.nvme));
    }

    /// A connection accepted on the listener of `transport` (`Listener::name`).
    pub(crate) fn connection_opened(&self, transport: &'static str) {
        self.connections.inc();
        self.connections_accepted.get_or_create(&TransportLabels { transport }).inc();
    }

    pub(crate) fn connection_closed(&self) {
        self.connections.dec();
    }
}

fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_requests_errors_and_usage() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        metrics.record(Op::Write, Duration::from_micros(30), 4096, None);
        metrics.record(Op::Write, Duration::from_micros(30), 0, Some(ErrorKind::OutOfSpace));
        metrics.record(Op::Read, Duration::from_millis(2), 100, None);
        metrics.observe_usage(&Usage { capacity_bytes: 1 << 20, used_bytes: 4096, capacity_blocks: 1, used_blocks: 1 });
        metrics.connection_opened("quic");
        metrics.observe_nvme(
            &Usage { capacity_bytes: 8 << 20, used_bytes: 10, capacity_blocks: 8, used_blocks: 1 },
            "uring",
        );
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "tern_storage_requests_total{op=\"write\"} 2",
            "tern_storage_requests_total{op=\"read\"} 1",
            "tern_storage_bytes_total{op=\"write\"} 4096",
            "tern_storage_errors_total{op=\"write\",kind=\"out-of-space\"} 1",
            "tern_storage_request_duration_seconds_count{op=\"write\"} 2",
            "tern_storage_tier_capacity_bytes{tier=\"dram\"} 1048576",
            "tern_storage_tier_used_bytes{tier=\"dram\"} 4096",
            "tern_storage_blocks{tier=\"dram\"} 1",
            "tern_storage_connections 1",
            "tern_storage_connections_accepted_total{transport=\"quic\"} 1",
            "tern_storage_tier_capacity_bytes{tier=\"nvme\"} 8388608",
            "tern_storage_blocks{tier=\"nvme\"} 1",
            "tern_storage_io_engine_info{engine=\"uring\"} 1",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }
}
