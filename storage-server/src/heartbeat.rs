//! Registration with the metadata server, and the heartbeat loop that reports tier use and carries
//! out the frees the metadata server orders.
//!
//! Frees are acknowledged by sequence number: a heartbeat reply lists block ids and shuffle ids to
//! free and the sequence number of the last free; once they are freed the next heartbeat echoes it
//! as `freed_through_seq`, and the metadata server stops resending them. A reply that says
//! `reregister` means the metadata server does not know this server right now (it restarted, or
//! declared this server dead): the server registers again from the same address, keeps its id,
//! and reports its inventory (every block, shuffle and shuffle segment it holds, in pages). The
//! metadata server frees what nothing references and marks referenced blocks and segments that
//! are missing as lost, so stale data is never served and nothing is dropped that is still needed.
//!
//! Every registration carries this process's random instance id: a new one tells the metadata
//! server that the DRAM tier of the previous process is gone (what came back from NVMe is in the
//! inventory).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tern_common::admin::Readiness;
use tern_common::Backoff;
use tern_proto::v1::admin_client::AdminClient;
use tern_proto::v1::registry_client::RegistryClient;
use tern_proto::v1::{
    HeartbeatRequest, HeartbeatResponse, HeldSegment, RegisterServerRequest, RegisterServerResponse,
    ReportInventoryRequest, TierUsage,
};
use tern_proto::{BlockId, ServerId, ShuffleId, Tier};
use tern_proto::{ErrorKind, PartitionIndex};
use tern_transport::failover::{self, Failover};
use tokio::time::{Instant, MissedTickBehavior};
/// The control-plane channel, this server's credential on every call, to whichever metadata
/// server leads.
pub(crate) type Channel = tern_proto::identity::Presenting<Failover>;

use crate::copier::Copier;
use crate::metrics::Metrics;
use crate::shuffle::SegmentId;
use crate::store::{BlockStore, Inventory};
use crate::Usage;

/// How long start-up waits for the metadata server to accept the registration.
const REGISTER_DEADLINE: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
pub(crate) const RPC_TIMEOUT: Duration = Duration::from_secs(5);
/// Shortest deadline of a heartbeat (see [`heartbeat_deadline`]).
const MIN_HEARTBEAT_DEADLINE: Duration = Duration::from_secs(1);
/// Backoff between registration attempts, doubling from the first to the last (with jitter).
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);
/// Used when the metadata server names no heartbeat interval; its choice is clamped to the bounds.
const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
const MIN_HEARTBEAT_INTERVAL: Duration = Duration::from_millis(10);
const MAX_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(60);
/// At most one warning this often while the metadata server cannot be reached.
const UNREACHABLE_LOG_EVERY: Duration = Duration::from_secs(30);

/// A gRPC client of the metadata server's Registry service (of the leader, given several
/// addresses). The channel connects lazily and reconnects by itself, so one client serves the
/// server's whole life. Every call carries `credential`: this server's, bound to its address.
pub(crate) fn connect(
    metadata: &str,
    tls: Option<&tern_transport::tls::TlsMaterial>,
    credential: &str,
) -> anyhow::Result<(RegistryClient<Channel>, AdminClient<Channel>)> {
    let addresses = failover::metadata_addresses(metadata).map_err(anyhow::Error::msg)?;
    let leader = failover::lazy_failover(&addresses, tls, |endpoint| {
        endpoint.connect_timeout(CONNECT_TIMEOUT).timeout(RPC_TIMEOUT)
    })
    .with_context(|| format!("metadata server address {metadata:?}"))?;
    let channel = tonic::service::interceptor::InterceptedService::new(
        leader,
        tern_proto::identity::Presents::credential(credential)?,
    );
    let registry = RegistryClient::new(channel.clone())
        .max_decoding_message_size(tern_proto::MAX_GRPC_MESSAGE_BYTES)
        .max_encoding_message_size(tern_proto::MAX_GRPC_MESSAGE_BYTES);
    // The drain a SIGTERM starts is asked for as an operator's would be.
    Ok((registry, AdminClient::new(channel)))
}

/// This process's instance id: random, fixed for its life.
pub(crate) fn instance_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static ID: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ID.get_or_init(|| {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        hasher.write_u64(tern_common::unix_ms());
        hasher.finish().max(1)
    })
}

/// Reports everything `store` holds to the metadata server, in pages of at most
/// [`tern_proto::MAX_INVENTORY_PAGE`] entries, each within `deadline`; the last page settles it.
pub(crate) async fn report_inventory(
    client: &mut RegistryClient<Channel>,
    server_id: u64,
    store: &BlockStore,
    deadline: Duration,
) -> Result<(u64, u64), tonic::Status> {
    for page in inventory_pages(server_id, store.inventory()) {
        let last = page.last;
        let mut request = tonic::Request::new(page);
        request.set_timeout(deadline);
        let reply = client.report_inventory(request).await?.into_inner();
        if last {
            return Ok((reply.blocks_unreferenced, reply.blocks_lost));
        }
    }
    unreachable!("the pages end with a last one")
}

/// The inventory as ReportInventory pages: blocks first, then shuffles, then segments, each page
/// within the bound; the last one says so (an empty inventory is one empty last page).
fn inventory_pages(server_id: u64, inventory: Inventory) -> Vec<ReportInventoryRequest> {
    let page = tern_proto::MAX_INVENTORY_PAGE;
    let mut blocks = inventory.blocks.into_iter().map(BlockId::get).peekable();
    let mut shuffles = inventory.shuffles.into_iter().map(ShuffleId::get).peekable();
    let mut segments = (inventory.segments.into_iter())
        .map(|s| HeldSegment { shuffle_id: s.shuffle.get(), partition: s.partition.get(), index: s.index })
        .peekable();
    let mut pages = Vec::new();
    loop {
        let block_ids: Vec<u64> = blocks.by_ref().take(page).collect();
        let shuffle_ids: Vec<u64> = shuffles.by_ref().take(page - block_ids.len()).collect();
        let held: Vec<HeldSegment> = segments.by_ref().take(page - block_ids.len() - shuffle_ids.len()).collect();
        let last = blocks.peek().is_none() && shuffles.peek().is_none() && segments.peek().is_none();
        pages.push(ReportInventoryRequest { server_id, block_ids, shuffle_ids, last, segments: held });
        if last {
            return pages;
        }
    }
}

fn tier_usage(tier: &str, usage: &Usage, engine: &str, shuffle_bytes: u64) -> TierUsage {
    TierUsage {
        tier: tier.to_string(),
        capacity_bytes: usage.capacity_bytes,
        used_bytes: usage.used_bytes,
        capacity_blocks: usage.capacity_blocks,
        used_blocks: usage.used_blocks,
        engine: engine.to_string(),
        shuffle_bytes,
    }
}

/// Every tier's use: DRAM, and NVMe (with its io engine) when the server has it.
pub(crate) fn tiers(store: &BlockStore) -> Vec<TierUsage> {
    let shuffles = store.shuffle_bytes();
    let mut tiers = vec![tier_usage(Tier::Dram.name(), &store.dram().usage(), "", shuffles.dram)];
    if let Some(nvme) = store.nvme() {
        tiers.push(tier_usage(Tier::Nvme.name(), &nvme.usage(), nvme.engine(), shuffles.nvme));
    }
    tiers
}

/// Registers at start-up, retrying while the metadata server is unreachable for up to
/// [`REGISTER_DEADLINE`]. The block count is unknown until the cluster's block size is: the first
/// heartbeat, sent before start-up completes, reports it.
pub(crate) async fn register_at_start(
    client: &mut RegistryClient<Channel>,
    metadata: &str,
    address: &str,
    quic_address: &str,
    dram_bytes: u64,
    nvme: Option<(u64, &str)>,
) -> anyhow::Result<RegisterServerResponse> {
    let capacity = |tier: &str, capacity_bytes: u64, engine: &str| TierUsage {
        tier: tier.to_string(),
        capacity_bytes,
        engine: engine.to_string(),
        ..TierUsage::default()
    };
    let mut tiers = vec![capacity(Tier::Dram.name(), dram_bytes, "")];
    if let Some((nvme_bytes, engine)) = nvme {
        tiers.push(capacity(Tier::Nvme.name(), nvme_bytes, engine));
    }
    let request = RegisterServerRequest {
        address: address.to_string(),
        tiers,
        quic_address: quic_address.to_string(),
        instance_id: instance_id(),
    };
    let mut backoff = Backoff::new(RETRY_FIRST, RETRY_MAX).deadline(Instant::now() + REGISTER_DEADLINE);
    loop {
        match client.register_server(request.clone()).await {
            Ok(reply) => return Ok(reply.into_inner()),
            Err(status) if ErrorKind::of_status(&status) != ErrorKind::Unavailable => {
                bail!("metadata server at {metadata} refused to register {address}: {}", status.message())
            }
            Err(status) => {
                let Some(delay) = backoff.next() else {
                    bail!(
                        "cannot reach the metadata server at {metadata} to register (gave up after {}s): {}; \
                         is it running, and is `metadata` right?",
                        REGISTER_DEADLINE.as_secs(),
                        status.message()
                    );
                };
                tracing::debug!("registering with {metadata}: {}; retrying", status.message());
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Each heartbeat's deadline (its grpc-timeout): the interval, within [`MIN_HEARTBEAT_DEADLINE`]
/// and [`RPC_TIMEOUT`]. Given several metadata addresses, a leader whose packets vanish then holds
/// a heartbeat that long before the failover channel asks the next address, not the whole
/// RPC_TIMEOUT, which is the default server timeout: the heartbeat reaches the new leader well
/// within the server timeout the new leader counts from its election, so the server is never
/// declared dead for its leader's failure.
pub(crate) fn heartbeat_deadline(interval: Duration) -> Duration {
    interval.clamp(MIN_HEARTBEAT_DEADLINE, RPC_TIMEOUT)
}

/// The heartbeat interval the metadata server asked for, within sane bounds.
pub(crate) fn heartbeat_interval(ms: u64) -> Duration {
    if ms == 0 {
        return DEFAULT_HEARTBEAT_INTERVAL;
    }
    Duration::from_millis(ms).clamp(MIN_HEARTBEAT_INTERVAL, MAX_HEARTBEAT_INTERVAL)
}

/// What a heartbeat reply led to.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// This many of the listed blocks, and segments of the listed shuffles, were held and are now
    /// freed.
    Freed { blocks: usize, segments: usize },
    /// The metadata server does not know this server right now: register again.
    Reregister,
    /// The server was drained: it exits.
    Drained,
}

/// The free-acknowledgement state of one registration.
#[derive(Debug, PartialEq, Eq)]
struct Session {
    server_id: u64,
    /// Every free ordered up to and including this sequence number has been carried out.
    freed_through_seq: u64,
}

impl Session {
    fn new(server_id: u64) -> Session {
        Session { server_id, freed_through_seq: 0 }
    }

    fn request(&self, store: &BlockStore, copies_done: Vec<tern_proto::v1::CopyDone>) -> HeartbeatRequest {
        HeartbeatRequest {
            server_id: self.server_id,
            tiers: tiers(store),
            freed_through_seq: self.freed_through_seq,
            shuffles: store.shuffle_usage(),
            copies_done,
        }
    }

    /// Carries out a heartbeat reply: frees first, and only then records them as done.
    fn apply(&mut self, reply: &HeartbeatResponse, store: &BlockStore) -> Outcome {
        if reply.drained {
            return Outcome::Drained;
        }
        if reply.reregister {
            return Outcome::Reregister;
        }
        let blocks = store.free(reply.free_block_ids.iter().map(|&id| BlockId::from_wire(id)));
        let segments = store.free_shuffles(reply.free_shuffle_ids.iter().map(|&id| ShuffleId::from_wire(id)));
        let single = reply.free_segments.iter().map(|s| SegmentId {
            shuffle: ShuffleId::from_wire(s.shuffle_id),
            partition: PartitionIndex::from_wire(s.partition),
            index: s.index,
        });
        let segments = segments + store.free_segments(single);
        store.set_quota_stops(&reply.quota_stops);
        // Never move the acknowledgement backwards: a reply with nothing to free may carry an
        // older (or zero) sequence number.
        self.freed_through_seq = self.freed_through_seq.max(reply.free_seq);
        Outcome::Freed { blocks, segments }
    }
}

/// Lets a repeating warning through at most once per period, counting what it held back.
struct Throttle {
    period: Duration,
    last: Option<Instant>,
    held_back: u64,
}

impl Throttle {
    fn new(period: Duration) -> Throttle {
        Throttle { period, last: None, held_back: 0 }
    }

    /// `Some(held back since the last one)` when this occurrence should be logged.
    fn allow(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(last) if now.duration_since(last) < self.period => {
                self.held_back += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.held_back))
            }
        }
    }

    /// Forgets past occurrences; returns whether there were any.
    fn reset(&mut self) -> bool {
        let had = self.last.is_some();
        *self = Throttle::new(self.period);
        had
    }
}

/// Sends heartbeats and acts on their replies.
pub(crate) struct Heartbeater {
    client: RegistryClient<Channel>,
    metadata: String,
    address: String,
    /// The QUIC address registered with `address` ("" for none).
    quic_address: String,
    store: Arc<BlockStore>,
    metrics: Arc<Metrics>,
    session: Session,
    interval: Duration,
    unreachable: Throttle,
    /// Set once a heartbeat reply says the server was drained.
    drained: tokio::sync::watch::Sender<bool>,
    /// Ready while registered with the metadata server.
    readiness: Readiness,
    /// Makes the block copies heartbeat replies ask for.
    copier: Arc<Copier>,
}

/// Installs the token key the registration reply carries.
pub(crate) fn take_key(store: &BlockStore, registered: &RegisterServerResponse) -> anyhow::Result<()> {
    let key = tern_proto::token::TokenKey::from_bytes(&registered.token_key)
        .map_err(|e| anyhow::anyhow!("the metadata server's registration reply carries no usable token key: {e}"))?;
    store.authority().set_key(key);
    Ok(())
}

impl Heartbeater {
    // Each is a distinct part the loop needs, all given once at start-up.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        client: RegistryClient<Channel>,
        metadata: String,
        address: String,
        store: Arc<BlockStore>,
        metrics: Arc<Metrics>,
        registered: &RegisterServerResponse,
        readiness: Readiness,
        copier: Arc<Copier>,
    ) -> Heartbeater {
        store.set_server_id(ServerId::from_wire(registered.server_id));
        Heartbeater {
            client,
            metadata,
            address,
            quic_address: String::new(),
            store,
            metrics,
            session: Session::new(registered.server_id),
            interval: heartbeat_interval(registered.heartbeat_interval_ms),
            unreachable: Throttle::new(UNREACHABLE_LOG_EVERY),
            drained: tokio::sync::watch::Sender::new(false),
            readiness,
            copier,
        }
    }

    /// Becomes true once the metadata server says this server was drained.
    pub(crate) fn drained(&self) -> tokio::sync::watch::Receiver<bool> {
        self.drained.subscribe()
    }

    /// Registers `quic_address` too when registering again.
    pub(crate) fn with_quic_address(mut self, quic_address: String) -> Heartbeater {
        self.quic_address = quic_address;
        self
    }

    /// Heartbeats every interval until an error that needs an operator (then logged).
    pub(crate) async fn run(mut self) {
        loop {
            let period = self.interval;
            let mut ticker = tokio::time::interval_at(Instant::now() + period, period);
            ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
            // A re-registration may bring a new interval: start a new ticker then.
            while self.interval == period {
                // Copies done report at once: the metadata server then hands out the next ones.
                tokio::select! {
                    _ = ticker.tick() => {}
                    () = self.copier.settled() => {}
                }
                if let Err(e) = self.beat().await {
                    tracing::error!("storage server stops heartbeating: {e:#}");
                    self.readiness.not_ready(format!("stopped heartbeating: {e:#}"));
                    return;
                }
            }
        }
    }

    /// One heartbeat, and the frees or re-registration its reply asks for. Errors only when this
    /// server cannot go on being part of the cluster; an unreachable metadata server is logged
    /// and retried at the next beat.
    pub(crate) async fn beat(&mut self) -> anyhow::Result<()> {
        self.metrics.observe_store(&self.store);
        let copies_done = self.copier.take_done();
        let mut request = tonic::Request::new(self.session.request(&self.store, copies_done.clone()));
        request.set_timeout(heartbeat_deadline(self.interval));
        let reply = match self.client.heartbeat(request).await {
            Ok(reply) => reply.into_inner(),
            Err(status) => {
                self.copier.give_back(copies_done);
                if let Some(held_back) = self.unreachable.allow(Instant::now()) {
                    tracing::warn!(
                        "heartbeat to the metadata server at {} failed: {} ({held_back} more failures since the last \
                         warning); still serving reads",
                        self.metadata,
                        status.message()
                    );
                }
                return Ok(());
            }
        };
        if self.unreachable.reset() {
            tracing::info!("metadata server at {} reachable again", self.metadata);
        }
        match self.session.apply(&reply, &self.store) {
            Outcome::Freed { blocks: 0, segments: 0 } => self.copier.start(&reply.copy_blocks, &reply.copy_segments),
            Outcome::Freed { blocks, segments } => {
                tracing::debug!(
                    "freed {blocks} blocks and {segments} shuffle segments (through free sequence {})",
                    reply.free_seq
                );
                self.copier.start(&reply.copy_blocks, &reply.copy_segments);
            }
            Outcome::Drained => {
                self.readiness.not_ready("drained");
                if !self.drained.send_replace(true) {
                    tracing::info!("the metadata server says storage server {} is drained", self.session.server_id);
                }
            }
            Outcome::Reregister => {
                tracing::warn!(
                    "metadata server at {} does not know storage server {} (it restarted, or declared this server \
                     dead): registering again and reporting the inventory",
                    self.metadata,
                    self.session.server_id
                );
                self.readiness.not_ready("unknown to the metadata server: registering again");
                self.reregister().await?;
                self.readiness.ready();
            }
        }
        self.metrics.observe_store(&self.store);
        Ok(())
    }

    /// Registers again and reports the inventory, retrying until the metadata server takes both.
    async fn reregister(&mut self) -> anyhow::Result<()> {
        // Unbounded: a storage server the metadata server does not know can do nothing else.
        let mut backoff = Backoff::new(RETRY_FIRST, RETRY_MAX);
        let mut failures = Throttle::new(UNREACHABLE_LOG_EVERY);
        let registered = loop {
            // Each call within a heartbeat's deadline, as heartbeats are: after a failover a call
            // sent to the old leader, whose packets may vanish, must give up in time to try the
            // next address. Without one it waited out the 5 s RPC timeout, longer than an
            // election takes, and multihost::replicated once found this server still
            // registering with the new leader 4 s after the election.
            let deadline = heartbeat_deadline(self.interval);
            let mut request = tonic::Request::new(RegisterServerRequest {
                address: self.address.clone(),
                tiers: tiers(&self.store),
                quic_address: self.quic_address.clone(),
                instance_id: instance_id(),
            });
            request.set_timeout(deadline);
            let attempt = match self.client.register_server(request).await {
                Ok(reply) => {
                    let registered = reply.into_inner();
                    let reported = report_inventory(&mut self.client, registered.server_id, &self.store, deadline);
                    reported.await.map(|_| registered)
                }
                Err(status) => Err(status),
            };
            match attempt {
                Ok(reply) => break reply,
                Err(status) => {
                    if let Some(held_back) = failures.allow(Instant::now()) {
                        tracing::warn!(
                            "registering again with {} failed: {} ({held_back} more failures since the last warning)",
                            self.metadata,
                            status.message()
                        );
                    }
                    tokio::time::sleep(backoff.next().expect("an unbounded backoff never ends")).await;
                }
            }
        };
        if registered.block_size != self.store.block_size() {
            bail!(
                "the metadata server at {} now uses {}-byte blocks but this server's DRAM tier is cut into {}-byte \
                 blocks; restart the storage server",
                self.metadata,
                registered.block_size,
                self.store.block_size()
            );
        }
        self.store.set_server_id(ServerId::from_wire(registered.server_id));
        // A metadata server that lost its directory signs with a new key.
        if let Err(e) = take_key(&self.store, &registered) {
            tracing::error!("{e:#}");
        }
        self.session = Session::new(registered.server_id);
        self.interval = heartbeat_interval(registered.heartbeat_interval_ms);
        tracing::info!("registered again as storage server {}", registered.server_id);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shuffle::test_wire::{pushed_by, wanted};
    use crate::shuffle::SegmentId;
    use tern_proto::shuffle::FetchRequest;
    use tern_proto::StorageClass;

    fn store_with(ids: &[u64]) -> BlockStore {
        let store = BlockStore::new(4096, 16 * 4096).unwrap();
        for id in ids {
            let mut pending = store.dram().begin_write(BlockId::from_wire(*id), 0, 1).unwrap();
            pending.buf()[0] = 1;
            pending.commit(crc32c::crc32c(&[1])).unwrap();
        }
        store
    }

    fn reply(ids: &[u64], free_seq: u64) -> HeartbeatResponse {
        HeartbeatResponse { free_block_ids: ids.to_vec(), free_seq, free_shuffle_ids: vec![], ..Default::default() }
    }

    fn freed(blocks: usize, segments: usize) -> Outcome {
        Outcome::Freed { blocks, segments }
    }

    /// The first byte of a DRAM block.
    fn read(store: &BlockStore, block: u64) -> Result<crate::BlockRead, crate::StoreError> {
        store.dram().read(BlockId::from_wire(block), 0, 1, ServerId::from_wire(0))
    }

    fn push(store: &BlockStore, shuffle: u64, partition: u32) {
        let segment = SegmentId {
            shuffle: ShuffleId::from_wire(shuffle),
            partition: PartitionIndex::from_wire(partition),
            index: 0,
        };
        futures::executor::block_on(store.push(segment, pushed_by(0, 0, StorageClass::Any), b"batch")).unwrap();
    }

    #[test]
    fn frees_are_acknowledged_after_they_are_done() {
        let store = store_with(&[1, 2, 3, 4]);
        let mut session = Session::new(7);
        let first = session.request(&store, Vec::new());
        assert_eq!((first.server_id, first.freed_through_seq), (7, 0));
        assert_eq!(first.tiers[0].tier, "dram");
        assert_eq!(first.tiers[0].used_blocks, 4);
        assert_eq!(first.tiers[0].capacity_blocks, 16);

        // Ids this server does not hold (already freed, or lost) are skipped but still acknowledged.
        assert_eq!(session.apply(&reply(&[1, 2, 99], 12), &store), freed(2, 0));
        assert_eq!(session.request(&store, Vec::new()).freed_through_seq, 12);
        assert_eq!(store.dram().usage().used_blocks, 2);
        assert!(read(&store, 1).is_err() && read(&store, 3).is_ok());

        // A resent list (the ack was lost) is idempotent.
        assert_eq!(session.apply(&reply(&[1, 2], 12), &store), freed(0, 0));
        // An empty reply does not move the acknowledgement backwards.
        assert_eq!(session.apply(&reply(&[], 0), &store), freed(0, 0));
        assert_eq!(session.freed_through_seq, 12);
        assert_eq!(session.apply(&reply(&[3], 13), &store), freed(1, 0));
        assert_eq!(session.request(&store, Vec::new()).freed_through_seq, 13);
    }

    #[test]
    fn shuffle_frees_share_the_acknowledgement() {
        let store = store_with(&[1]);
        for (shuffle, partition) in [(10, 0), (10, 1), (11, 0)] {
            push(&store, shuffle, partition);
        }
        let mut session = Session::new(7);
        assert_eq!(session.request(&store, Vec::new()).tiers[0].used_blocks, 4);
        // Each batch is stored behind its 16-byte header.
        assert_eq!(session.request(&store, Vec::new()).tiers[0].used_bytes, 1 + 3 * (5 + 16));
        let both = HeartbeatResponse { free_shuffle_ids: vec![10, 12], ..reply(&[1], 20) };
        assert_eq!(session.apply(&both, &store), freed(1, 2));
        let request = session.request(&store, Vec::new());
        assert_eq!(
            (request.freed_through_seq, request.tiers[0].used_blocks, request.tiers[0].used_bytes),
            (20, 1, 5 + 16)
        );
        assert_eq!(store.shuffle_segments(), 1);
        // Resent (the ack was lost): nothing more to do, nothing comes back.
        assert_eq!(session.apply(&both, &store), freed(0, 0));
        let fetch = FetchRequest { cursor: 0, max_bytes: 1 << 20, maps: wanted(&[(0, 0)]) };
        let fetch_of = |shuffle| {
            futures::executor::block_on(store.fetch(
                SegmentId { shuffle: ShuffleId::from_wire(shuffle), partition: PartitionIndex::from_wire(0), index: 0 },
                &fetch,
            ))
        };
        assert!(fetch_of(10).is_err());
        assert!(fetch_of(11).is_ok());
    }

    #[test]
    fn reregister_keeps_the_data_and_reports_it_as_the_inventory() {
        let store = store_with(&[1, 2, 3]);
        push(&store, 4, 0);
        let mut session = Session::new(7);
        session.apply(&reply(&[1], 5), &store);
        let outcome = session.apply(&HeartbeatResponse { reregister: true, ..reply(&[], 0) }, &store);
        assert_eq!(outcome, Outcome::Reregister);
        // The metadata server decides what goes, from the inventory.
        let mut inventory = store.inventory();
        inventory.blocks.sort_unstable();
        let segment = SegmentId { shuffle: ShuffleId::from_wire(4), partition: PartitionIndex::from_wire(0), index: 0 };
        let want = Inventory {
            blocks: vec![BlockId::from_wire(2), BlockId::from_wire(3)],
            shuffles: vec![ShuffleId::from_wire(4)],
            segments: vec![segment],
        };
        assert_eq!(inventory, want);
        assert!(read(&store, 2).is_ok());
    }

    #[test]
    fn inventory_pages_stay_within_the_bound_and_end_with_the_last() {
        let page = tern_proto::MAX_INVENTORY_PAGE;
        assert_eq!(
            inventory_pages(3, Inventory::default()),
            vec![ReportInventoryRequest { server_id: 3, last: true, ..Default::default() }]
        );
        let inventory = Inventory {
            blocks: (1..=page as u64 + 1).map(BlockId::from_wire).collect(),
            shuffles: vec![ShuffleId::from_wire(9)],
            segments: (0..page as u32)
                .map(|p| SegmentId {
                    shuffle: ShuffleId::from_wire(9),
                    partition: PartitionIndex::from_wire(p),
                    index: 2,
                })
                .collect(),
        };
        let pages = inventory_pages(3, inventory);
        let sizes: Vec<usize> =
            pages.iter().map(|p| p.block_ids.len() + p.shuffle_ids.len() + p.segments.len()).collect();
        assert_eq!(sizes, vec![page, page, 2]);
        assert_eq!(pages.iter().map(|p| p.last).collect::<Vec<_>>(), vec![false, false, true]);
        assert_eq!(pages[1].block_ids.len(), 1);
        assert_eq!(pages[1].shuffle_ids, vec![9]);
        assert_eq!(pages[2].segments[1], HeldSegment { shuffle_id: 9, partition: page as u32 - 1, index: 2 });
    }

    #[test]
    fn intervals_are_bounded() {
        assert_eq!(heartbeat_interval(0), DEFAULT_HEARTBEAT_INTERVAL);
        assert_eq!(heartbeat_interval(1), MIN_HEARTBEAT_INTERVAL);
        assert_eq!(heartbeat_interval(500), Duration::from_millis(500));
        assert_eq!(heartbeat_interval(u64::MAX), MAX_HEARTBEAT_INTERVAL);
        assert_eq!(heartbeat_deadline(Duration::from_millis(10)), MIN_HEARTBEAT_DEADLINE);
        assert_eq!(heartbeat_deadline(Duration::from_secs(2)), Duration::from_secs(2));
        assert_eq!(heartbeat_deadline(MAX_HEARTBEAT_INTERVAL), RPC_TIMEOUT);
    }

    #[test]
    fn warnings_are_rate_limited() {
        let start = Instant::now();
        let mut throttle = Throttle::new(Duration::from_secs(30));
        assert_eq!(throttle.allow(start), Some(0));
        assert_eq!(throttle.allow(start + Duration::from_secs(1)), None);
        assert_eq!(throttle.allow(start + Duration::from_secs(29)), None);
        assert_eq!(throttle.allow(start + Duration::from_secs(31)), Some(2));
        assert_eq!(throttle.allow(start + Duration::from_secs(32)), None);
        assert!(throttle.reset());
        assert!(!throttle.reset());
        assert_eq!(throttle.allow(start + Duration::from_secs(33)), Some(0));
    }

    #[tokio::test]
    async fn registration_gives_up_with_a_clear_error() {
        // Nothing listens on this port (it was just freed); use a short-lived paused clock so the
        // 10 s deadline passes instantly.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let metadata = format!("127.0.0.1:{port}");
        let (mut client, _) = connect(&metadata, None, "tern1 server - 127.0.0.1:1 00").unwrap();
        tokio::time::pause();
        let err =
            register_at_start(&mut client, &metadata, "127.0.0.1:1", "", 1 << 20, None).await.unwrap_err().to_string();
        assert!(err.contains("cannot reach the metadata server") && err.contains(&metadata), "{err}");
    }
}
