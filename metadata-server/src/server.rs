//! Starting and stopping the metadata server: bind, serve gRPC and the admin endpoint, reap.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use parking_lot::Mutex;
use tern_common::admin::Readiness;
use tern_common::durable::RealFs;
use tern_common::Now;
use tern_proto::v1::admin_server::{self, AdminServer as AdminService};
use tern_proto::v1::metadata_server::{self, MetadataServer as MetadataService};
use tern_proto::v1::registry_server::{self, RegistryServer as RegistryService};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;
use tracing::{error, info, warn};

use crate::config::Config;
use crate::dirlock::DirLock;
use crate::metrics::Metrics;
use crate::service::{Log, Service};
use crate::state::State;
use crate::wal::{self, Wal};

/// The reaper runs at least this often, so lapsed leases end promptly.
const MAX_REAP_PERIOD: Duration = Duration::from_millis(500);
/// How long shutdown waits for in-flight RPCs before cutting them off.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// A running metadata server. Dropping it stops it too, abruptly; prefer [`MetadataServer::shutdown`].
#[derive(Debug)]
pub struct MetadataServer {
    addr: SocketAddr,
    admin_addr: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    readiness: Readiness,
    /// A replicated server's Raft node, stopped at shutdown (or it would go on voting).
    replica: Option<Arc<crate::raft::Replica>>,
    _lock: DirLock,
}

/// Validates `config`, locks its directory, binds, and starts serving in the background.
pub async fn start(config: Config) -> anyhow::Result<MetadataServer> {
    config.validate().context("invalid metadata server configuration")?;
    let mut grpc = tonic::transport::Server::builder();
    if let Some(dir) = &config.serve.tls_dir {
        let tls = tern_transport::tls::TlsMaterial::load(dir)?;
        grpc = grpc.tls_config(tls.tonic_server()).with_context(|| format!("gRPC TLS from {}", dir.display()))?;
    }
    let lock = DirLock::acquire(&config.dir, "metadata server")?;
    let secret = crate::keyfile::cluster_secret(&config)?;
    let (state, log) = if crate::raft::replicated(&config) {
        let raft_dir = crate::raft::dir(&config);
        std::fs::create_dir_all(&raft_dir).with_context(|| format!("creating {}", raft_dir.display()))?;
        let (replica, state) = crate::raft::Replica::start(&config, RealFs::shared(), &secret)
            .await
            .with_context(|| format!("starting the Raft node in {}", crate::raft::dir(&config).display()))?;
        (state, Log::Raft(replica))
    } else {
        let (state, wal) = recover(&config)?;
        (Arc::new(Mutex::new(state)), Log::Wal(Arc::new(wal)))
    };
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::register(&mut registry, state.clone());
    if let Log::Raft(replica) = &log {
        registry.register_collector(Box::new(crate::metrics::RaftGauges(replica.clone())));
    }
    let authz = Arc::new(crate::authz::Authz::new(secret, &mut registry));
    let refused = prometheus_client::metrics::counter::Counter::default();
    registry.register(
        "tern_metadata_connections_refused",
        "gRPC connections closed on arrival because max_connections were open",
        refused.clone(),
    );
    let limits = GrpcLimits {
        max_connections: config.max_connections as usize,
        max_message_bytes: usize::try_from(config.max_message_size.bytes()).unwrap_or(usize::MAX),
        refused,
    };
    grpc = grpc.max_concurrent_streams(config.max_concurrent_streams);
    let listener = tokio::net::TcpListener::bind(config.serve.listen)
        .await
        .with_context(|| format!("binding metadata server to {}", config.serve.listen))?;
    let addr = listener.local_addr()?;
    let readiness = Readiness::starting("starting the gRPC service");
    let admin_addr =
        tern_common::admin::serve(config.serve.admin_listen, "metadata-server", registry, readiness.clone()).await?;
    let (stop, stopped) = watch::channel(false);
    let replica = log.replica().cloned();
    let raft = crate::raft::RaftService::new(replica.clone(), authz.clone());
    let service = Arc::new(Service::new(state.clone(), log.clone(), metrics, authz));
    let reap_period = config.heartbeat_interval().min(MAX_REAP_PERIOD);
    let snapshots = Snapshots {
        dir: config.dir.clone(),
        interval: config.snapshot_interval(),
        log_bytes: config.snapshot_log_size.bytes(),
    };
    let health = tern_proto::health::service(
        readiness.subscribe(),
        &[metadata_server::SERVICE_NAME, registry_server::SERVICE_NAME, admin_server::SERVICE_NAME],
    );
    let mut tasks = vec![
        tokio::spawn(serve(grpc, listener, service, raft, health, limits, stopped.clone())),
        tokio::spawn(reap(state.clone(), log.clone(), reap_period, stopped.clone())),
    ];
    if let Log::Wal(wal) = log {
        // A replicated server's snapshots are openraft's (`raft/store.rs`).
        tasks.push(tokio::spawn(watch_log(wal.clone(), readiness.clone(), stopped.clone())));
        tasks.push(tokio::spawn(snapshot_loop(state, wal, snapshots, stopped)));
    }
    // The log is open and writable and the service bound: clients may come.
    readiness.ready();
    Ok(MetadataServer { addr, admin_addr, stop, tasks, readiness, replica, _lock: lock })
}

/// Runs a metadata server until SIGINT or SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let shutdown = tern_common::shutdown_signal();
    let server = start(config.clone()).await?;
    // Once started: a configuration that is refused is said in one line, not after the dump.
    tern_common::config::log_effective("metadata server", &config);
    let tls = match &config.serve.tls_dir {
        Some(dir) => format!("mutual TLS from {}", dir.display()),
        None => "plain TCP".to_string(),
    };
    info!("metadata server listening on {} ({tls}; admin {})", server.addr(), server.admin_addr());
    shutdown.await;
    info!("metadata server shutting down");
    tern_common::systemd::notify_stopping();
    server.shutdown().await;
    Ok(())
}

impl MetadataServer {
    /// The bound gRPC address (the configured one, with the port chosen when it was 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bound admin (Prometheus) address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Stops accepting RPCs, lets in-flight ones finish (for a bounded time), stops the reaper,
    /// and releases the directory lock.
    #[expect(clippy::disallowed_methods, reason = "the edge: shutdown's grace period is timed here, not in the state")]
    pub async fn shutdown(self) {
        self.readiness.not_ready("shutting down");
        let _ = self.stop.send(true);
        if let Some(replica) = &self.replica {
            if let Err(e) = replica.raft.shutdown().await {
                warn!("stopping the Raft node: {e}");
            }
        }
        let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
        for mut task in self.tasks {
            match tokio::time::timeout_at(deadline, &mut task).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => error!("metadata server task failed: {e}"),
                Err(_) => {
                    warn!("metadata server task still busy after {SHUTDOWN_GRACE:?}; aborting it");
                    task.abort();
                }
            }
        }
    }
}

/// The gRPC edge's bounds, from the config.
struct GrpcLimits {
    max_connections: usize,
    max_message_bytes: usize,
    /// Counts connections closed for being over `max_connections`.
    refused: prometheus_client::metrics::counter::Counter,
}

async fn serve(
    mut grpc: tonic::transport::Server,
    listener: tokio::net::TcpListener,
    service: Arc<Service>,
    raft: crate::raft::RaftService,
    health: tern_proto::health::HealthServer<impl tern_proto::health::Health>,
    limits: GrpcLimits,
    mut stopped: watch::Receiver<bool>,
) {
    let limit = limits.max_message_bytes;
    let metadata =
        MetadataService::from_arc(service.clone()).max_decoding_message_size(limit).max_encoding_message_size(limit);
    let registry =
        RegistryService::from_arc(service.clone()).max_decoding_message_size(limit).max_encoding_message_size(limit);
    let admin = AdminService::from_arc(service).max_decoding_message_size(limit).max_encoding_message_size(limit);
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let incoming = crate::conn_limit::limit(incoming, limits.max_connections, limits.refused);
    let raft = tern_proto::v1::raft_server::RaftServer::new(raft)
        .max_decoding_message_size(limit)
        .max_encoding_message_size(limit);
    let result = grpc
        .add_service(metadata)
        .add_service(registry)
        .add_service(admin)
        .add_service(health)
        .add_service(raft)
        .serve_with_incoming_shutdown(incoming, async move {
            // Stop when told to, or when the MetadataServer handle is dropped.
            let _ = stopped.wait_for(|&stop| stop).await;
        })
        .await;
    if let Err(e) = result {
        error!("metadata gRPC service stopped: {e}");
    }
}

/// Marks the server not ready once its log fails: from then on nothing can be acknowledged.
async fn watch_log(wal: Arc<Wal>, readiness: Readiness, mut stopped: watch::Receiver<bool>) {
    tokio::select! {
        why = wal.failed() => readiness.not_ready(format!("the metadata log failed: {why}")),
        _ = stopped.wait_for(|&stop| stop) => {}
    }
}

/// Rebuilds the state from `config.dir` (snapshot, then log), writes a fresh snapshot of it (so
/// the log files read are no longer needed), and starts a new log file.
#[expect(clippy::disallowed_methods, reason = "the edge: recovery reads the clock once and passes it in")]
fn recover(config: &Config) -> anyhow::Result<(State, Wal)> {
    let now = Now::read();
    let fs = RealFs::shared();
    let recovered = wal::recover(&*fs, &config.dir)
        .with_context(|| format!("recovering the metadata state in {}", config.dir.display()))?;
    let mut state = State::new(config, now);
    // Every record replays at this one time: what each needs of the wall clock it carries.
    state.restore(&recovered.records, now)?;
    if !state.key_logged() {
        // A log from before the key was logged, or a fresh one: the key file's key (made now
        // if there is none) becomes the logged one; the snapshot below carries it.
        state.log_key(&crate::keyfile::load_or_create(&config.dir)?, now).map_err(|s| anyhow::anyhow!("{s}"))?;
        state.take_journal();
    }
    let snapshot = state.snapshot(now);
    let bytes = wal::write_snapshot(&*fs, &config.dir, recovered.next_seq, &snapshot)?;
    if !recovered.records.is_empty() {
        info!(
            "metadata state recovered from {}: {} snapshot records and {} log records from {} log files in {:.0?}; \
             new snapshot of {bytes} bytes",
            config.dir.display(),
            recovered.snapshot_records,
            recovered.records.len() - recovered.snapshot_records,
            recovered.wal_files,
            now.instant.elapsed()
        );
    }
    if !config.fsync {
        warn!("fsync = false: a machine crash may lose acknowledged metadata changes");
    }
    let wal = Wal::open(fs, &config.dir, recovered.next_seq, config.fsync)?;
    Ok((state, wal))
}

/// Ends lapsed jobs and declares silent servers dead, every `period`.
#[expect(clippy::disallowed_methods, reason = "the edge: each reap pass reads the clock once and passes it in")]
async fn reap(state: Arc<Mutex<State>>, log: Log, period: Duration, mut stopped: watch::Receiver<bool>) {
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {
                let mut state = state.lock();
                // Only the serving leader of a replicated service reaps: its changes are proposed.
                if let Log::Raft(replica) = &log {
                    if replica.check_serving().is_err() {
                        continue;
                    }
                }
                state.reap(Now::read());
                log.append(state.take_journal());
            }
            _ = stopped.wait_for(|&stop| stop) => return,
        }
    }
}

struct Snapshots {
    dir: std::path::PathBuf,
    interval: Duration,
    log_bytes: u64,
}

/// Snapshots the state when the log has grown past `log_bytes`, or every `interval` when it grew
/// at all. The state is copied out as records under the lock (and the log moves on to a new file
/// at that point); the file is written outside it.
#[expect(clippy::disallowed_methods, reason = "the edge: the loop times snapshots and passes the time into the state")]
async fn snapshot_loop(
    state: Arc<Mutex<State>>,
    wal: Arc<Wal>,
    snapshots: Snapshots,
    mut stopped: watch::Receiver<bool>,
) {
    let mut ticks = tokio::time::interval(snapshots.interval.min(Duration::from_secs(1)));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = Instant::now();
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stopped.wait_for(|&stop| stop) => return,
        }
        let grown = wal.file_bytes();
        if grown == 0 || (grown < snapshots.log_bytes && last.elapsed() < snapshots.interval) {
            continue;
        }
        let now = Now::read();
        last = now.instant;
        let (records, seq) = {
            let mut state = state.lock();
            wal.append(&state.take_journal());
            (state.snapshot(now), wal.rotate())
        };
        let dir = snapshots.dir.clone();
        let started = Instant::now();
        match tokio::task::spawn_blocking(move || wal::write_snapshot(&RealFs, &dir, seq, &records)).await {
            Ok(Ok(bytes)) => info!("metadata snapshot of {bytes} bytes written in {:.0?}; log cut", started.elapsed()),
            Ok(Err(e)) => error!("metadata snapshot failed (the log keeps growing until one succeeds): {e:#}"),
            Err(e) => error!("metadata snapshot task failed: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use tern_common::config::Serve;
    use tern_proto::v1::metadata_client::MetadataClient;
    use tern_proto::v1::registry_client::RegistryClient;
    use tern_proto::v1::*;
    use tern_proto::ErrorKind;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A Registry client acting as the storage server at `address`, its credential made from the
    /// cluster secret at `secret`.
    fn registry_as(
        channel: tonic::transport::Channel,
        secret: &std::path::Path,
        address: &str,
    ) -> RegistryClient<tern_proto::identity::Presenting<tonic::transport::Channel>> {
        use tern_proto::identity::{ClusterSecret, Identity as Caller, Presents, Role};
        let credential = ClusterSecret::load(secret).unwrap().credential(&Caller::new(Role::Server, "", address));
        RegistryClient::with_interceptor(channel, Presents::credential(&credential).unwrap())
    }

    async fn scrape(admin: SocketAddr) -> String {
        let mut stream = tokio::net::TcpStream::connect(admin).await.unwrap();
        stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut text = String::new();
        stream.read_to_string(&mut text).await.unwrap();
        text
    }

    #[tokio::test]
    async fn mutual_tls_admits_the_cluster_ca_only_and_passes_quic_addresses_on() {
        use tern_transport::tls;
        use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
        let temp = tempfile::tempdir().unwrap();
        let (ours, theirs) = (temp.path().join("ours"), temp.path().join("theirs"));
        tls::init(&ours, &tls::InitOptions::default()).unwrap();
        tls::init(&theirs, &tls::InitOptions::default()).unwrap();
        let config = Config {
            serve: Serve { tls_dir: Some(ours.clone()), ..Serve::on_loopback(0, 0) },
            dir: temp.path().join("meta"),
            ..Config::default()
        };
        let server = start(config).await.unwrap();
        let addr = server.addr().to_string();

        let material = tls::TlsMaterial::load(&ours).unwrap();
        let channel = tls::grpc_endpoint(&addr, Some(&material)).unwrap().connect().await.unwrap();
        let mut registry = registry_as(channel.clone(), &ours.join("cluster.secret"), "127.0.0.1:7000");
        let tiers = vec![TierUsage { tier: "dram".into(), capacity_blocks: 8, ..TierUsage::default() }];
        let request = RegisterServerRequest {
            address: "127.0.0.1:7000".into(),
            tiers,
            quic_address: "127.0.0.1:7001".into(),
            instance_id: 1,
        };
        registry.register_server(request).await.unwrap();
        let status = MetadataClient::new(channel).status(StatusRequest {}).await.unwrap().into_inner();
        assert_eq!(status.servers[0].quic_address, "127.0.0.1:7001");

        // A client that trusts our CA but presents a certificate of another CA is refused.
        let read = |path: std::path::PathBuf| std::fs::read(path).unwrap();
        let intruder = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read(ours.join(tls::CA_CERT))))
            .identity(Identity::from_pem(read(theirs.join(tls::NODE_CERT)), read(theirs.join(tls::NODE_KEY))))
            .domain_name("127.0.0.1");
        let endpoint = Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(intruder).unwrap();
        let refused = match endpoint.connect().await {
            Ok(channel) => MetadataClient::new(channel).status(StatusRequest {}).await.map(|_| ()),
            Err(e) => Err(tonic::Status::unavailable(e.to_string())),
        };
        assert!(refused.is_err(), "a client certificate of another CA was accepted");
        // So is a client with no certificate at all.
        let anonymous = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read(ours.join(tls::CA_CERT))))
            .domain_name("127.0.0.1");
        let endpoint = Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(anonymous).unwrap();
        let refused = match endpoint.connect().await {
            Ok(channel) => MetadataClient::new(channel).status(StatusRequest {}).await.map(|_| ()),
            Err(e) => Err(tonic::Status::unavailable(e.to_string())),
        };
        assert!(refused.is_err(), "a client without a certificate was accepted");
        server.shutdown().await;
    }

    #[tokio::test]
    async fn serves_clients_and_storage_servers_over_grpc() {
        let temp = tempfile::tempdir().unwrap();
        let config = Config { serve: Serve::on_loopback(0, 0), dir: temp.path().join("meta"), ..Config::default() };
        let server = start(config.clone()).await.unwrap();
        let err = format!("{:#}", start(config.clone()).await.unwrap_err());
        assert!(err.contains("in use by another metadata server"), "{err}");

        let endpoint = format!("http://{}", server.addr());
        let channel = tonic::transport::Endpoint::from_shared(endpoint.clone()).unwrap().connect().await.unwrap();
        // Registration needs the storage server's credential: a caller without one is refused.
        let mut stranger = RegistryClient::new(channel.clone());
        let tiers = vec![TierUsage { tier: "dram".into(), capacity_blocks: 64, ..TierUsage::default() }];
        let ask =
            RegisterServerRequest { address: "127.0.0.1:7000".into(), tiers: tiers.clone(), ..Default::default() };
        let refused = stranger.register_server(ask).await.unwrap_err();
        assert_eq!(ErrorKind::of_status(&refused), ErrorKind::PermissionDenied, "{refused:?}");
        let mut registry = registry_as(channel.clone(), &temp.path().join("meta/cluster.secret"), "127.0.0.1:7000");
        let registered = registry
            .register_server(RegisterServerRequest { address: "127.0.0.1:7000".into(), tiers, ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((registered.server_id, registered.block_size), (1, tern_proto::DEFAULT_BLOCK_SIZE));
        let inventory = ReportInventoryRequest { server_id: 1, last: true, ..Default::default() };
        registry.report_inventory(inventory).await.unwrap();
        assert_eq!(registered.heartbeat_interval_ms, 1000);

        let mut client = MetadataClient::new(channel.clone());
        let job = client
            .register_job(RegisterJobRequest { name: "j".into(), lease_ms: 0, ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        let path = format!("{}/out", job.root);
        // The job's files need its token.
        let refused = client.create(CreateRequest { path: path.clone(), ..Default::default() }).await.unwrap_err();
        assert_eq!(ErrorKind::of_status(&refused), ErrorKind::PermissionDenied, "{refused:?}");
        let token: tonic::metadata::AsciiMetadataValue = job.token.parse().unwrap();
        let mut client = MetadataClient::with_interceptor(channel, move |mut request: tonic::Request<()>| {
            request.metadata_mut().insert(tern_proto::identity::JOB_TOKEN_HEADER, token.clone());
            Ok(request)
        });
        let created = client
            .create(CreateRequest { path: path.clone(), parents: false, ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        let ask = AllocateBlocksRequest { file_id: created.file_id, count: 2, client_host: "127.0.0.1".into() };
        let blocks = client.allocate_blocks(ask).await.unwrap().into_inner().blocks;
        assert!(blocks.iter().all(|b| b.address == "127.0.0.1:7000"));
        client.seal(SealRequest { file_id: created.file_id, length: 10 }).await.unwrap();
        let opened = client.open(OpenRequest { path: path.clone() }).await.unwrap().into_inner();
        assert_eq!(opened.blocks.len(), 1);
        assert_eq!(opened.blocks[0].length, 10);
        let refused = client.create(CreateRequest { path, parents: false, ..Default::default() }).await.unwrap_err();
        assert_eq!(ErrorKind::of_status(&refused), ErrorKind::AlreadyExists);

        // A shuffle's life: register, advance, commit, locate, invalidate, unregister.
        let ask = RegisterShuffleRequest { job_id: job.job_id.clone(), partitions: 2, ..Default::default() };
        let shuffle = client.register_shuffle(ask).await.unwrap().into_inner();
        let shuffle_id = shuffle.shuffle_id;
        assert!(shuffle.segments.iter().all(|s| s.address == "127.0.0.1:7000" && s.index == 0));
        let ask = AdvanceSegmentRequest { shuffle_id, partition: 1, full_segment: 0 };
        let next = client.advance_segment(ask).await.unwrap().into_inner().segment.unwrap();
        assert_eq!((next.partition, next.index), (1, 1));
        let commit = |attempt| CommitMapRequest {
            shuffle_id,
            map_index: 0,
            attempt,
            partition_bytes: vec![5, 7],
            first_segment: vec![0, 0],
            last_segment: vec![0, 1],
        };
        let won = client.commit_map(commit(0)).await.unwrap().into_inner();
        let lost = client.commit_map(commit(1)).await.unwrap().into_inner();
        assert_eq!((won.committed, lost.committed, lost.winning_attempt), (true, false, 0));
        let ask = LocateShuffleRequest { shuffle_id, start_partition: 1, end_partition: 2, start_map: 0, end_map: 9 };
        let located = client.locate_shuffle(ask).await.unwrap().into_inner();
        assert_eq!((located.segments.len(), located.outputs[0].partition_bytes.clone()), (2, vec![7]));
        let ask = InvalidateMapsRequest { shuffle_id, map_indexes: vec![0] };
        assert_eq!(client.invalidate_maps(ask).await.unwrap().into_inner().invalidated, 1);
        client.unregister_shuffle(UnregisterShuffleRequest { shuffle_id }).await.unwrap();
        let refused = client.unregister_shuffle(UnregisterShuffleRequest { shuffle_id }).await.unwrap_err();
        assert_eq!(ErrorKind::of_status(&refused), ErrorKind::NotFound);

        // The unused block and the shuffle are freed through the next heartbeat.
        let beat = HeartbeatRequest { server_id: 1, ..Default::default() };
        let reply = registry.heartbeat(beat).await.unwrap().into_inner();
        assert_eq!(
            (reply.free_block_ids, reply.free_shuffle_ids, reply.free_seq),
            (vec![blocks[1].block_id], vec![shuffle_id], 2)
        );

        let metrics = scrape(server.admin_addr()).await;
        for expected in [
            "tern_metadata_requests_total{method=\"create\"} 3",
            "tern_metadata_refused_total{method=\"create\",reason=\"no_token\"} 1",
            "tern_metadata_refused_total{method=\"register_server\",reason=\"not_server\"} 1",
            "tern_metadata_errors_total{method=\"create\",kind=\"already-exists\"} 1",
            "tern_metadata_request_duration_seconds_count{method=\"open\"} 1",
            "tern_metadata_files 1",
            "tern_metadata_jobs 1",
            "tern_metadata_live_servers 1",
            "tern_metadata_requests_total{method=\"commit_map\"} 2",
            "tern_metadata_errors_total{method=\"unregister_shuffle\",kind=\"not-found\"} 1",
            "tern_metadata_shuffles 0",
        ] {
            assert!(metrics.contains(expected), "missing {expected:?} in\n{metrics}");
        }

        let addr = server.addr();
        server.shutdown().await;
        assert!(tokio::net::TcpStream::connect(addr).await.is_err());

        // Started again on the same directory, it has everything acknowledged before.
        let server = start(config.clone()).await.unwrap();
        let mut client = MetadataClient::connect(format!("http://{}", server.addr())).await.unwrap();
        // The job's token still verifies: the key outlives the restart.
        let mut stat = tonic::Request::new(StatRequest { path: format!("{}/out", job.root), with_blocks: true });
        stat.metadata_mut().insert(tern_proto::identity::JOB_TOKEN_HEADER, job.token.parse().unwrap());
        let info = client.stat(stat).await.unwrap();
        let stat = info.into_inner();
        assert_eq!((stat.info.unwrap().length, stat.blocks.len()), (10, 1));
        assert_eq!(stat.blocks[0].address, "127.0.0.1:7000");
        let status = client.status(StatusRequest {}).await.unwrap().into_inner();
        assert_eq!((status.jobs.len(), status.servers.len(), status.servers[0].alive), (1, 1, false));
        server.shutdown().await;
        let names: Vec<String> = std::fs::read_dir(&config.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with("wal-") || name == "snapshot")
            .collect();
        assert_eq!(names.len(), 2, "one snapshot and the log file started after it: {names:?}");
    }
}
