//! Tern's storage server: the DRAM and NVMe tiers and the block service.
//!
//! - [`config`]: the typed configuration;
//! - `block_table`: one tier's slots and blocks, and the rules every block follows (write-once,
//!   append-only, one writer, Acquire/Release publication), for every tier;
//! - `arena`: the DRAM tier's one memory mapping (a memfd, shared read-only with same-host clients);
//! - [`dram`]: the arena cut into blocks: writes straight into it, zero-copy reads;
//! - [`nvme`]: the NVMe tier: an O_DIRECT file or block device cut into blocks, behind an io
//!   engine (io_uring or pread/pwrite);
//! - [`shuffle`]: shuffle segments in the DRAM tier's slots: pushed batches appended
//!   (push-merge), fetched by committed attempt, a page at a time;
//! - [`store`]: the router that holds the tiers and sends each op to the one its block names;
//! - [`service`]: the block protocol over TCP and, with TLS material, TLS on the same port and
//!   QUIC (one code path over
//!   `tern_transport`'s listener trait; pipelined, bounded, never taken down by bad input);
//! - `heartbeat`: registration with the metadata server, heartbeats and the frees they carry;
//! - [`metrics`]: Prometheus metrics, served on the admin endpoint;
//! - `fuzzing`: the block service under arbitrary input, for fuzzing and tests.
//!
//! [`start`] brings a server up and hands back a [`StorageServer`]; [`run`] is the daemon's main
//! loop. Tests can serve a [`BlockStore`] without a metadata server through [`serve_blocks`].

// The DRAM tier hands out slices of one memory mapping and the NVMe tier drives O_DIRECT
// buffers, io_uring and raw syscalls: both need unsafe code, each block with its SAFETY argument.
#![allow(unsafe_code)]

mod arena;
pub mod auth;
mod block_table;
pub mod config;
pub mod copier;
pub mod dram;
#[doc(hidden)]
pub mod fuzzing;
mod heartbeat;
pub mod metrics;
pub mod nvme;
mod rdma;
pub mod service;
pub mod shuffle;
pub mod store;

use std::net::SocketAddr;
use std::sync::Arc;

use crate::heartbeat::Channel;
use anyhow::Context;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use tern_common::admin::Readiness;
use tern_proto::v1::admin_client::AdminClient;
use tern_proto::v1::{ServerMode, SetServerModeRequest};
use tern_transport::tls_tcp::{PlainFrom, TcpOrTlsListener};

pub use block_table::{BlockRead, StoreError, Usage};
pub use config::Config;
pub use metrics::Metrics;
pub use service::{serve_block_listeners, serve_blocks, Limits};
pub use shuffle::{FetchPage, SegmentId, ShuffleError};
pub use store::BlockStore;

/// Bytes of each same-host connection's staging area (see `tern_transport::local::Staging`): room
/// for four 4 MiB writes in flight. Pages are taken as a client first writes them and go when the
/// connection closes; a write that does not fit a client's share goes through the socket.
const STAGING_BYTES: usize = 16 << 20;

/// A running storage server. Dropping it stops its tasks; [`StorageServer::shutdown`] also waits
/// for them to end.
pub struct StorageServer {
    addr: SocketAddr,
    quic_addr: Option<SocketAddr>,
    /// Whether the block service is served over RDMA too (on `addr`).
    rdma: bool,
    admin_addr: SocketAddr,
    store: Arc<BlockStore>,
    tasks: Vec<JoinHandle<()>>,
    /// Asks the metadata server for this server's drain.
    admin: AdminClient<Channel>,
    drained: tokio::sync::watch::Receiver<bool>,
    readiness: Readiness,
}

impl StorageServer {
    /// The bound address of the block service.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bound address of the QUIC block service, if it serves one.
    pub fn quic_addr(&self) -> Option<SocketAddr> {
        self.quic_addr
    }

    /// The bound address of the admin endpoint (`/metrics`, `/health`).
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// The id the metadata server currently knows this server by (it changes on re-registration).
    pub fn server_id(&self) -> tern_proto::ServerId {
        self.store.server_id()
    }

    /// Waits until the metadata server says this server is drained (see [`StorageServer::drain`]
    /// and `tern admin drain`).
    pub async fn drained(&self) {
        let mut drained = self.drained.clone();
        let _ = drained.wait_for(|&drained| drained).await;
    }

    /// Drains this server: asks the metadata server to place nothing more here, then waits until
    /// nothing it holds is needed by a live job or file, at most `grace`. Returns whether the
    /// drain finished (false: the grace ran out, or the metadata server could not be asked).
    pub async fn drain(&self, grace: std::time::Duration) -> bool {
        self.readiness.not_ready("draining");
        let request = SetServerModeRequest {
            server: self.server_id().get().to_string(),
            mode: ServerMode::Draining as i32,
            drain_timeout_ms: (grace.as_millis() as u64).max(1),
        };
        let deadline = tokio::time::Instant::now() + grace;
        let asked = tokio::time::timeout_at(deadline, self.admin.clone().set_server_mode(request)).await;
        match asked {
            Ok(Ok(reply)) => {
                let waiting = reply.into_inner().server.map(|s| s.drain_waiting_for).unwrap_or_default();
                if !waiting.is_empty() {
                    tracing::info!("draining: waiting up to {grace:?} for {waiting}");
                }
            }
            Ok(Err(status)) => {
                tracing::warn!("the metadata server refused the drain: {}; exiting without it", status.message());
                return false;
            }
            Err(_) => {
                tracing::warn!("the metadata server did not answer the drain within {grace:?}; exiting without it");
                return false;
            }
        }
        tokio::time::timeout_at(deadline, self.drained()).await.is_ok()
    }

    /// Stops heartbeating, closes the block service and every connection, and waits for it.
    /// (The admin endpoint lives until the process ends: `tern_common::admin::serve` offers no way
    /// to stop it.)
    pub async fn shutdown(mut self) {
        for task in &self.tasks {
            task.abort();
        }
        for task in std::mem::take(&mut self.tasks) {
            if let Err(e) = task.await {
                if e.is_panic() {
                    tracing::error!("storage server task panicked: {e}");
                }
            }
        }
    }
}

impl Drop for StorageServer {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Maps the DRAM arena, binds the block service and admin endpoint, registers with the metadata
/// server (waiting up to 10 s for it), cuts the arena into the cluster's blocks, and starts serving
/// and heartbeating.
pub async fn start(config: Config) -> anyhow::Result<StorageServer> {
    config.validate()?;
    let dram = config.dram.bytes();
    let (prefault, huge_pages, shared) = (config.prefault, config.huge_pages, config.local_clients);
    // Prefaulting a large arena takes a while: keep it off the async workers.
    let arena = tokio::task::spawn_blocking(move || arena::Arena::map_with(dram, prefault, huge_pages, shared))
        .await
        .context("mapping the DRAM arena")??;

    let device = match &config.nvme {
        Some(path) => {
            let (path, size) = (path.clone(), config.nvme_size);
            // Creating and preallocating a large file takes a while: off the async workers.
            let device = tokio::task::spawn_blocking(move || nvme::device::open(&path, size))
                .await
                .context("opening the NVMe tier")??;
            let file = Arc::new(device.file);
            let engine = nvme::engine::choose(config.io_engine, file, device.align as usize).await?;
            Some((engine, device.size, device.align))
        }
        None => None,
    };

    let tls = config.serve.tls_dir.as_deref().map(tern_transport::tls::TlsMaterial::load).transpose()?;
    let listen = config.serve.listen;
    let binding = || format!("binding the block service to {listen}");
    let listener: Box<dyn tern_transport::Listener> = match &tls {
        // TLS to anyone, plain frames as the network allows, on one port.
        Some(tls) => {
            let plain = if config.serve.trusted_network { PlainFrom::Anyone } else { PlainFrom::Loopback };
            Box::new(TcpOrTlsListener::bind(listen, tls, plain, config.max_connections).await.with_context(binding)?)
        }
        None => Box::new(TcpListener::bind(listen).await.with_context(binding)?),
    };
    let addr = listener.local_addr();
    let address = config.advertised_address(addr)?;
    let mut listeners = vec![listener];
    // The arena lives as long as the process (the store holds it), so the listener's memory
    // registration of it never outlives it.
    let lendable = tern_transport::rdma_provider::Lendable { base: arena.base() as usize, len: arena.len() };
    let rdma = rdma::listener(config.rdma, config.serve.trusted_network, addr, Some(lendable))?;
    let serves_rdma = rdma.is_some();
    listeners.extend(rdma);
    let (mut quic_addr, mut quic_address) = (None, String::new());
    if let Some(tls) = &tls {
        let quic_listen = config.quic_listen_for(addr);
        let quic = tern_transport::quic::QuicListener::bind(
            quic_listen,
            tls,
            &tern_transport::quic::QuicTuning::default(),
            config.max_connections,
        )
        .with_context(|| format!("starting the QUIC block service on {quic_listen} (UDP)"))?;
        let bound = tern_transport::Listener::local_addr(&quic);
        quic_address = config.advertised_quic_address(bound)?;
        quic_addr = Some(bound);
        listeners.push(Box::new(quic));
    }
    if let Some(memfd) = arena.memfd() {
        let shared = tern_transport::local::SharedArena::lent(arena.base(), arena.len());
        let local = tern_transport::local::LocalListener::bind(addr, &address, memfd, shared, STAGING_BYTES)
            .with_context(|| {
                format!("binding the same-host socket @{}", tern_transport::local::socket_name(&address))
            })?;
        listeners.push(Box::new(local));
    }
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::register(&mut registry);
    let readiness = Readiness::starting(&format!("registering with the metadata server at {}", config.metadata));
    let admin_addr =
        tern_common::admin::serve(config.serve.admin_listen, "storage-server", registry, readiness.clone()).await?;

    // The server proves its role, bound to its address, with the cluster secret.
    let secret_path = config.serve.cluster_secret_path(config.cluster_secret_file.as_deref()).ok_or_else(|| {
        anyhow::anyhow!(
            "no cluster secret: storage servers prove their role to the metadata server with it; set \
             cluster_secret_file (`tern up` and `tern cert init` make one; with --tls-dir, cluster.secret there)"
        )
    })?;
    let secret = tern_proto::identity::ClusterSecret::load(&secret_path).map_err(|e| anyhow::anyhow!("{e}"))?;
    let credential =
        secret.credential(&tern_proto::identity::Identity::new(tern_proto::identity::Role::Server, "", &address));
    let (mut client, admin) = heartbeat::connect(&config.metadata, tls.as_ref(), &credential)?;
    let nvme_tier = device.as_ref().map(|(engine, size, _)| (*size, engine.name()));
    let registered =
        heartbeat::register_at_start(&mut client, &config.metadata, &address, &quic_address, dram, nvme_tier).await?;
    let mut store = BlockStore::with_arena(arena, registered.block_size)
        .with_context(|| format!("cutting the DRAM tier into the cluster's {}-byte blocks", registered.block_size))?;
    if let Some((engine, size, align)) = device {
        let nvme_path = config.nvme.as_deref().expect("a device was opened from the nvme path");
        let index = nvme::index::BlockIndex::path_for(nvme_path);
        let tier = nvme::NvmeTier::new(engine, size, align, registered.block_size)
            .context("cutting the NVMe tier into the cluster's blocks")?
            .with_index(&index)?;
        store = store.with_nvme(tier);
        store.restore_shuffles(&shuffle::durable::ShuffleIndex::path_for(nvme_path)).await?;
    }
    // Every data frame is checked against the metadata server's key from here on.
    store.authority().require_tokens();
    heartbeat::take_key(&store, &registered)?;
    let store = Arc::new(store);
    // Nothing is placed here until the inventory is in: report it before serving anyone.
    heartbeat::report_inventory(&mut client, registered.server_id, &store, heartbeat::RPC_TIMEOUT)
        .await
        .map_err(|status| anyhow::anyhow!("reporting the inventory to {}: {}", config.metadata, status.message()))?;
    metrics.observe_store(&store);
    let service = tokio::spawn(serve_block_listeners(listeners, store.clone(), Limits::from(&config), metrics.clone()));
    let connector = tern_transport::tls_tcp::AutoConnector::new(tls.as_ref()).context("the copier's connector")?;
    let copier = copier::Copier::new(store.clone(), Box::new(connector));
    let mut heartbeater = heartbeat::Heartbeater::new(
        client,
        config.metadata.clone(),
        address,
        store.clone(),
        metrics,
        &registered,
        readiness.clone(),
        copier,
    )
    .with_quic_address(quic_address);
    let drained = heartbeater.drained();
    // The registration could not say how many blocks fit; report them before anyone allocates.
    if let Err(e) = heartbeater.beat().await {
        service.abort();
        return Err(e);
    }
    let heartbeat = tokio::spawn(heartbeater.run());
    let mut tasks = vec![service, heartbeat];
    if store.nvme().is_some() {
        tasks.push(tokio::spawn(store.clone().run_shuffle_mover()));
    }
    // Registered, its inventory and tiers reported, serving blocks: placements may come.
    readiness.ready();
    Ok(StorageServer { addr, quic_addr, rdma: serves_rdma, admin_addr, store, tasks, admin, drained, readiness })
}

/// The `tern storage-server` daemon: starts, logs what it runs with, and serves until SIGINT or
/// SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let shutdown = tern_common::shutdown_signal();
    let server = start(config.clone()).await?;
    let nvme = match server.store.nvme() {
        Some(nvme) => {
            format!(", nvme {} on the {} io engine", tern_common::ByteSize(nvme.usage().capacity_bytes), nvme.engine())
        }
        None => String::new(),
    };
    let encrypted = match server.quic_addr() {
        Some(quic) => format!(" and TLS; QUIC on {quic} (UDP)"),
        None => String::new(),
    };
    let encrypted = if server.rdma { format!("{encrypted}; RDMA on the same address") } else { encrypted };
    tracing::info!(
        "storage server {} listening on {} (TCP{encrypted}; admin {}, dram {}{nvme})",
        server.server_id(),
        server.addr(),
        server.admin_addr(),
        config.dram
    );
    tern_common::config::log_effective("storage-server", &config);
    tokio::select! {
        () = shutdown => {
            // systemd hears it at once: a drain may take a while.
            tern_common::systemd::notify_stopping();
            let grace = std::time::Duration::from_millis(config.drain_grace_ms);
            if !grace.is_zero() {
                tracing::info!("storage server {} draining (at most {grace:?}; signal again to stop at once)", server.server_id());
                let again = tern_common::shutdown_signal();
                tokio::select! {
                    drained = server.drain(grace) => if drained {
                        tracing::info!("storage server {} drained", server.server_id());
                    } else {
                        tracing::warn!("storage server {} exits with its drain unfinished", server.server_id());
                    },
                    () = again => tracing::warn!("second signal: exiting without finishing the drain"),
                }
            }
        }
        () = server.drained() => {
            tern_common::systemd::notify_stopping();
            tracing::info!("storage server {} drained by the metadata server", server.server_id());
        }
    }
    tracing::info!("storage server {} shutting down", server.server_id());
    server.shutdown().await;
    Ok(())
}
