//! The model's storage servers: each registers, reports an empty inventory and heartbeats as a
//! real one would, under its own credential (bound to its address, from the cluster secret).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tern_proto::identity::{ClusterSecret, Identity, Role, CREDENTIAL_HEADER};
use tern_proto::v1::registry_client::RegistryClient;
use tern_proto::v1::{HeartbeatRequest, RegisterServerRequest, ReportInventoryRequest, TierUsage};
use tokio::task::JoinSet;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::Channel;

use super::SERVER_CAPACITY_BLOCKS;

pub(super) fn tiers() -> Vec<TierUsage> {
    vec![TierUsage {
        tier: "dram".to_string(),
        capacity_bytes: SERVER_CAPACITY_BLOCKS * u64::from(tern_proto::DEFAULT_BLOCK_SIZE),
        capacity_blocks: SERVER_CAPACITY_BLOCKS,
        ..Default::default()
    }]
}

/// The simulated storage servers: their ids and the free sequence each last heard.
pub(super) struct Fleet {
    pub(super) ids: Vec<u64>,
    free_seqs: Vec<std::sync::atomic::AtomicU64>,
    /// Each server's credential, as a header.
    credentials: Arc<Vec<AsciiMetadataValue>>,
}

/// `message` with `credential` in its headers: each simulated server calls as itself.
fn as_server<T>(message: T, credential: &AsciiMetadataValue) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(CREDENTIAL_HEADER, credential.clone());
    request
}

/// Each simulated server's credential, bound to its address, as a storage server makes its own
/// (made before the memory baseline: they are the model's, not the server's).
pub(super) fn fleet_credentials(secret: &ClusterSecret, servers: u32) -> anyhow::Result<Arc<Vec<AsciiMetadataValue>>> {
    let credentials: Vec<AsciiMetadataValue> = (0..servers)
        .map(|i| secret.credential(&Identity::new(Role::Server, "", &fleet_address(i))).parse())
        .collect::<Result<_, _>>()
        .context("a credential is not a header")?;
    Ok(Arc::new(credentials))
}

pub(super) async fn register_fleet(
    registry: &RegistryClient<Channel>,
    credentials: Arc<Vec<AsciiMetadataValue>>,
    servers: u32,
    concurrency: usize,
) -> anyhow::Result<Fleet> {
    let mut ids = vec![0u64; servers as usize];
    let mut tasks = JoinSet::new();
    let workers = concurrency.max(1) as u32;
    for first in 0..workers.min(servers) {
        let (mut registry, credentials) = (registry.clone(), credentials.clone());
        tasks.spawn(async move {
            let mut got = Vec::new();
            for i in (first..servers).step_by(workers as usize) {
                let credential = &credentials[i as usize];
                let register = RegisterServerRequest {
                    address: fleet_address(i),
                    tiers: tiers(),
                    instance_id: 1 + u64::from(i),
                    ..Default::default()
                };
                let reply = registry.register_server(as_server(register, credential)).await?.into_inner();
                let inventory = ReportInventoryRequest { server_id: reply.server_id, last: true, ..Default::default() };
                registry.report_inventory(as_server(inventory, credential)).await?;
                got.push((i, reply.server_id));
            }
            Ok::<_, tonic::Status>(got)
        });
    }
    while let Some(done) = tasks.join_next().await {
        for (i, id) in done.context("a registering task failed")?? {
            ids[i as usize] = id;
        }
    }
    let free_seqs = ids.iter().map(|_| std::sync::atomic::AtomicU64::new(0)).collect();
    Ok(Fleet { ids, free_seqs, credentials })
}

/// Simulated server `i`'s block-service address.
fn fleet_address(i: u32) -> String {
    format!("10.{}.{}.{}:9070", (i >> 16) & 255, (i >> 8) & 255, i & 255)
}

/// Most heartbeats in flight at once: the rate is offered open loop (a slow reply does not delay
/// the next beat) up to this bound, past which the driver waits and the achieved rate falls.
const HEARTBEATS_IN_FLIGHT: usize = 32;

/// Heartbeats round robin over the fleet at `rate` per second until `stop`; returns each
/// heartbeat's latency (microseconds) taken while `measure` was set.
pub(super) async fn heartbeats(
    registry: RegistryClient<Channel>,
    fleet: Arc<Fleet>,
    rate: f64,
    stop: Arc<AtomicBool>,
    measure: Arc<AtomicBool>,
) -> anyhow::Result<Vec<f64>> {
    let period = Duration::from_secs_f64(1.0 / rate.max(0.001));
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut measured = Vec::new();
    let mut in_flight = JoinSet::new();
    let mut next = 0usize;
    let mut take = |done: Result<anyhow::Result<Option<f64>>, tokio::task::JoinError>| -> anyhow::Result<()> {
        measured.extend(done.context("a heartbeat task failed")??);
        Ok(())
    };
    while !stop.load(Ordering::Relaxed) {
        ticks.tick().await;
        while in_flight.len() >= HEARTBEATS_IN_FLIGHT {
            if let Some(done) = in_flight.join_next().await {
                take(done)?;
            }
        }
        while let Some(done) = in_flight.try_join_next() {
            take(done)?;
        }
        let i = next % fleet.ids.len().max(1);
        next += 1;
        let Some(&server_id) = fleet.ids.get(i) else { break };
        let (mut registry, fleet, measure) = (registry.clone(), fleet.clone(), measure.clone());
        in_flight.spawn(async move {
            let freed = fleet.free_seqs[i].load(Ordering::Relaxed);
            let started = Instant::now();
            let request =
                HeartbeatRequest { server_id, tiers: tiers(), freed_through_seq: freed, ..Default::default() };
            let reply = registry.heartbeat(as_server(request, &fleet.credentials[i])).await?.into_inner();
            let us = measure.load(Ordering::Relaxed).then(|| started.elapsed().as_secs_f64() * 1e6);
            anyhow::ensure!(
                !reply.reregister,
                "the metadata server asked simulated server {server_id} to register again"
            );
            fleet.free_seqs[i].fetch_max(reply.free_seq, Ordering::Relaxed);
            Ok(us)
        });
    }
    while let Some(done) = in_flight.join_next().await {
        take(done)?;
    }
    Ok(measured)
}
