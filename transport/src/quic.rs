//! QUIC (quinn) with mutual TLS: each block connection is one bidirectional stream.
//!
//! A quinn endpoint drives all of its UDP traffic from one task, so one endpoint keeps one core
//! busy at most. The client therefore spreads its streams over several endpoints (each its own
//! UDP socket and connection to the server), and the server binds several UDP sockets to its one
//! port with SO_REUSEPORT, one endpoint each: the kernel hashes each client socket to one of
//! them, so the connections, and their packet work, land on different tasks.
//!
//! Frames are carried exactly as over TCP; a stream's FIN is the connection's end. Both sides
//! present the node certificate and accept only peers whose certificate the cluster CA signed.

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures::future::BoxFuture;
use futures::FutureExt;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Endpoint, EndpointConfig, IdleTimeout, MtuDiscoveryConfig, TransportConfig, VarInt};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;

use crate::tls::{self, TlsMaterial};
use crate::{Connector, Listener, Stream};

/// ALPN of the block protocol over QUIC.
pub const ALPN: &[u8] = b"tern-block/1";

/// How long a QUIC handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections idle this long are closed; keep-alives (below) keep pooled ones open.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
const KEEP_ALIVE: Duration = Duration::from_secs(10);
/// Accepted streams waiting for the block service to take them.
const ACCEPT_QUEUE: usize = 64;
/// UDP socket buffers asked for (the kernel may cap them at net.core.[rw]mem_max).
const SOCKET_BUFFER_BYTES: usize = 8 << 20;

/// Window and packet sizes, and how many endpoints carry the traffic. The defaults were chosen by
/// measurement on loopback with 1 MiB frames (see ARCHITECTURE.md and `examples/throughput.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuicTuning {
    /// Per-stream receive window: bytes a sender may have unacknowledged on one stream. A stream
    /// runs at most window / RTT; the default (quinn's is 1.25 MB) holds two 1 MiB frames.
    pub stream_receive_window: u32,
    /// Per-connection receive window, over all its streams.
    pub receive_window: u32,
    /// Per-connection send buffer: bytes written but not yet acknowledged.
    pub send_window: u64,
    /// Upper bound of path-MTU discovery (UDP payload bytes); discovery starts at 1200 and
    /// climbs to the largest size the path carries, up to this.
    pub max_mtu: u16,
    /// Endpoints (UDP sockets, driver tasks) a client spreads its streams over, and UDP sockets
    /// (SO_REUSEPORT) a server binds to its port.
    pub endpoints: usize,
    /// Most bidirectional streams a peer may open at once on one connection.
    pub max_streams_per_connection: u32,
}

impl Default for QuicTuning {
    fn default() -> QuicTuning {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        QuicTuning {
            // Measured on loopback (2 shared cores, 4 streams of 1 MiB writes): 2 MiB stream /
            // 8 MiB connection windows gave 435-530 MiB/s; 8 / 32 MiB only 250-290 MiB/s (more
            // in flight than the UDP socket buffers hold: drops, then congestion backoff).
            stream_receive_window: 2 << 20,
            receive_window: 8 << 20,
            send_window: 8 << 20,
            // Jumbo packets measured slower on loopback (4 streams: 755-759 MiB/s at 8952 against
            // 950-968 at 1452, with the endpoint's max UDP payload raised to match): fewer packets
            // but larger losses when a socket buffer overflows.
            max_mtu: 1452,
            endpoints: cores.clamp(2, 4),
            max_streams_per_connection: 256,
        }
    }
}

impl QuicTuning {
    /// The endpoint's largest UDP payload, advertised to peers: without raising it with
    /// `max_mtu`, peers never send packets larger than quinn's default of 1472 bytes, whatever
    /// MTU discovery finds.
    fn endpoint_config(&self) -> EndpointConfig {
        let mut config = EndpointConfig::default();
        config.max_udp_payload_size(self.max_mtu.max(1200)).expect("1200..=65527 is a valid UDP payload size");
        config
    }

    fn transport_config(&self) -> TransportConfig {
        let mut config = TransportConfig::default();
        let mut mtu = MtuDiscoveryConfig::default();
        mtu.upper_bound(self.max_mtu.max(1200));
        config
            .stream_receive_window(VarInt::from_u32(self.stream_receive_window))
            .receive_window(VarInt::from_u32(self.receive_window))
            .send_window(self.send_window)
            .max_concurrent_bidi_streams(VarInt::from_u32(self.max_streams_per_connection))
            .max_concurrent_uni_streams(VarInt::from_u32(0))
            .mtu_discovery_config(Some(mtu))
            .keep_alive_interval(Some(KEEP_ALIVE))
            .max_idle_timeout(Some(IdleTimeout::try_from(IDLE_TIMEOUT).expect("30 s is a valid idle timeout")));
        // GSO is on by default where the kernel has it (one sendmsg for up to 64 packets);
        // said here so nobody turns it off unknowingly.
        config.enable_segmentation_offload(true);
        config
    }
}

/// A UDP socket with large buffers; with `reuse_port`, other sockets may bind the same port.
fn udp_socket(addr: SocketAddr, reuse_port: bool) -> io::Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if addr.is_ipv6() {
        socket.set_only_v6(false).ok();
    }
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    // Best effort: the kernel caps these, and small buffers only cost throughput.
    socket.set_recv_buffer_size(SOCKET_BUFFER_BYTES).ok();
    socket.set_send_buffer_size(SOCKET_BUFFER_BYTES).ok();
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

fn to_io(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// Whether GSO (UDP segmentation offload) is available on this machine: how many packets one
/// send may carry (1 means none).
pub fn max_gso_segments() -> usize {
    match UdpSocket::bind("127.0.0.1:0") {
        Ok(socket) => quinn::udp::UdpSocketState::new((&socket).into()).map(|s| s.max_gso_segments()).unwrap_or(1),
        Err(_) => 1,
    }
}

/// The server side: several endpoints on one UDP port, their streams merged into one queue.
pub struct QuicListener {
    addr: SocketAddr,
    endpoints: Vec<Endpoint>,
    streams: mpsc::Receiver<Stream>,
    tasks: JoinSet<()>,
}

impl QuicListener {
    /// Binds `tuning.endpoints` UDP sockets to `addr` (port 0 picks one for all of them) and
    /// accepts at most `max_connections` QUIC connections at once, each authenticated by a client
    /// certificate signed by the cluster CA.
    pub fn bind(
        addr: SocketAddr,
        material: &TlsMaterial,
        tuning: &QuicTuning,
        max_connections: usize,
    ) -> anyhow::Result<QuicListener> {
        let tls = material.server_config(&[ALPN])?;
        let crypto = QuicServerConfig::try_from(tls).context("TLS config for QUIC")?;
        let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        server_config.transport_config(Arc::new(tuning.transport_config()));
        let count = tuning.endpoints.max(1);
        let mut endpoints = Vec::with_capacity(count);
        let mut bound = addr;
        for i in 0..count {
            let socket = udp_socket(bound, count > 1).with_context(|| format!("binding QUIC (UDP) to {bound}"))?;
            if i == 0 {
                bound = socket.local_addr()?;
            }
            let endpoint = Endpoint::new(
                tuning.endpoint_config(),
                Some(server_config.clone()),
                socket,
                Arc::new(quinn::TokioRuntime),
            )
            .with_context(|| format!("starting a QUIC endpoint on {bound}"))?;
            endpoints.push(endpoint);
        }
        let (tx, streams) = mpsc::channel(ACCEPT_QUEUE);
        let permits = Arc::new(Semaphore::new(max_connections.max(1)));
        let mut tasks = JoinSet::new();
        for endpoint in &endpoints {
            tasks.spawn(accept_connections(endpoint.clone(), tx.clone(), permits.clone()));
        }
        Ok(QuicListener { addr: bound, endpoints, streams, tasks })
    }
}

impl Drop for QuicListener {
    fn drop(&mut self) {
        for endpoint in &self.endpoints {
            endpoint.close(VarInt::from_u32(0), b"storage server shutting down");
        }
        self.tasks.abort_all();
    }
}

/// Accepts connections on one endpoint until it closes; each connection's streams go to `tx`.
async fn accept_connections(endpoint: Endpoint, tx: mpsc::Sender<Stream>, permits: Arc<Semaphore>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            incoming = endpoint.accept() => {
                let Some(incoming) = incoming else { return };
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    tracing::debug!("QUIC: refusing {}: at the connection limit", incoming.remote_address());
                    incoming.refuse();
                    continue;
                };
                let tx = tx.clone();
                connections.spawn(async move {
                    let _permit = permit;
                    serve_connection(incoming, tx).await;
                });
            }
            Some(joined) = connections.join_next(), if !connections.is_empty() => {
                if let Err(e) = joined {
                    if e.is_panic() {
                        tracing::error!("QUIC: a connection task panicked: {e}");
                    }
                }
            }
        }
    }
}

async fn serve_connection(incoming: quinn::Incoming, tx: mpsc::Sender<Stream>) {
    let remote = incoming.remote_address();
    let connection = match tokio::time::timeout(HANDSHAKE_TIMEOUT, async { incoming.accept()?.await }).await {
        Ok(Ok(connection)) => connection,
        Ok(Err(e)) => {
            tracing::info!("QUIC: handshake with {remote} failed: {e}");
            return;
        }
        Err(_) => {
            tracing::info!("QUIC: handshake with {remote} timed out after {HANDSHAKE_TIMEOUT:?}");
            return;
        }
    };
    loop {
        match connection.accept_bi().await {
            Ok((send, recv)) => {
                let stream = Stream {
                    reader: Box::new(recv),
                    writer: Box::new(send),
                    peer: remote,
                    local: None,
                    one_sided: None,
                };
                if tx.send(stream).await.is_err() {
                    return;
                }
            }
            Err(quinn::ConnectionError::ApplicationClosed(_) | quinn::ConnectionError::LocallyClosed) => return,
            Err(e) => {
                tracing::debug!("QUIC: connection from {remote} ended: {e}");
                return;
            }
        }
    }
}

impl Listener for QuicListener {
    fn accept(&mut self) -> BoxFuture<'_, io::Result<Stream>> {
        crate::next_handed_over(&mut self.streams).boxed()
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn name(&self) -> &'static str {
        "quic"
    }
}

/// The client side: streams spread round-robin over `tuning.endpoints` endpoints, each with one
/// connection per server, made on first use and replaced when closed.
pub struct QuicConnector {
    config: quinn::ClientConfig,
    endpoint_config: EndpointConfig,
    endpoint_count: usize,
    /// Endpoints per address family (IPv4 first, IPv6 second), made on first use.
    endpoints: parking_lot::Mutex<[Vec<Endpoint>; 2]>,
    connections: tokio::sync::Mutex<HashMap<(SocketAddr, usize), quinn::Connection>>,
    next: AtomicUsize,
}

impl QuicConnector {
    pub fn new(material: &TlsMaterial, tuning: &QuicTuning) -> anyhow::Result<QuicConnector> {
        QuicConnector::from_rustls(material.client_config(&[ALPN])?, tuning)
    }

    /// A connector with a rustls config of the caller's (which must offer [`ALPN`]).
    pub fn from_rustls(tls: rustls::ClientConfig, tuning: &QuicTuning) -> anyhow::Result<QuicConnector> {
        let crypto = QuicClientConfig::try_from(tls).context("TLS config for QUIC")?;
        let mut config = quinn::ClientConfig::new(Arc::new(crypto));
        config.transport_config(Arc::new(tuning.transport_config()));
        Ok(QuicConnector {
            config,
            endpoint_config: tuning.endpoint_config(),
            endpoint_count: tuning.endpoints.max(1),
            endpoints: parking_lot::Mutex::default(),
            connections: tokio::sync::Mutex::default(),
            next: AtomicUsize::new(0),
        })
    }

    fn endpoint(&self, ipv4: bool, index: usize) -> io::Result<Endpoint> {
        let mut endpoints = self.endpoints.lock();
        let family = &mut endpoints[usize::from(!ipv4)];
        while family.len() <= index {
            let any: SocketAddr = if ipv4 { "0.0.0.0:0" } else { "[::]:0" }.parse().expect("a valid address");
            let socket = udp_socket(any, false)?;
            family.push(Endpoint::new(self.endpoint_config.clone(), None, socket, Arc::new(quinn::TokioRuntime))?);
        }
        Ok(family[index].clone())
    }

    async fn connection(&self, peer: SocketAddr, name: &str, index: usize) -> io::Result<quinn::Connection> {
        let mut connections = self.connections.lock().await;
        if let Some(connection) = connections.get(&(peer, index)) {
            if connection.close_reason().is_none() {
                return Ok(connection.clone());
            }
        }
        let endpoint = self.endpoint(peer.is_ipv4(), index)?;
        let connecting = endpoint.connect_with(self.config.clone(), peer, name).map_err(to_io)?;
        let connection = match tokio::time::timeout(HANDSHAKE_TIMEOUT, connecting).await {
            Ok(Ok(connection)) => connection,
            Ok(Err(e)) => return Err(io::Error::new(io::ErrorKind::ConnectionRefused, format!("QUIC handshake: {e}"))),
            Err(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("QUIC handshake timed out after {HANDSHAKE_TIMEOUT:?}"),
                ))
            }
        };
        connections.insert((peer, index), connection.clone());
        Ok(connection)
    }
}

impl Drop for QuicConnector {
    fn drop(&mut self) {
        for family in self.endpoints.lock().iter() {
            for endpoint in family {
                endpoint.close(VarInt::from_u32(0), b"client closed");
            }
        }
    }
}

impl Connector for QuicConnector {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Stream>> {
        async move {
            let peer = tokio::net::lookup_host(addr)
                .await?
                .next()
                .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to no address")))?;
            let name = tls::server_name_of(addr);
            let index = self.next.fetch_add(1, Ordering::Relaxed) % self.endpoint_count;
            let connection = self.connection(peer, &name, index).await?;
            let (send, recv) = connection.open_bi().await.map_err(to_io)?;
            Ok(Stream { reader: Box::new(recv), writer: Box::new(send), peer, local: None, one_sided: None })
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::tls::InitOptions;

    fn material(dir: &std::path::Path) -> TlsMaterial {
        tls::init(dir, &InitOptions::default()).unwrap();
        TlsMaterial::load(dir).unwrap()
    }

    async fn echo_server(mut listener: QuicListener) {
        loop {
            let mut stream = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut stream.reader, &mut stream.writer).await;
                let _ = stream.writer.shutdown().await;
            });
        }
    }

    #[tokio::test]
    async fn streams_round_trip_over_several_endpoints() {
        let dir = tempfile::tempdir().unwrap();
        let material = material(dir.path());
        let tuning = QuicTuning { endpoints: 3, ..QuicTuning::default() };
        let listener = QuicListener::bind("127.0.0.1:0".parse().unwrap(), &material, &tuning, 16).unwrap();
        let addr = listener.local_addr().to_string();
        let server = tokio::spawn(echo_server(listener));
        let connector = QuicConnector::new(&material, &tuning).unwrap();
        let mut tasks = JoinSet::new();
        for i in 0..6u8 {
            let stream = connector.connect(&addr).await.unwrap();
            tasks.spawn(async move {
                let data = vec![i; 3 << 20];
                let (mut reader, mut writer) = (stream.reader, stream.writer);
                let sent = data.clone();
                let send = tokio::spawn(async move {
                    writer.write_all(&sent).await.unwrap();
                    writer.shutdown().await.unwrap();
                });
                let mut back = Vec::new();
                reader.read_to_end(&mut back).await.unwrap();
                send.await.unwrap();
                assert_eq!(back, data);
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.unwrap();
        }
        // Six streams over three endpoints: three connections.
        assert_eq!(connector.connections.lock().await.len(), 3);
        server.abort();
    }

    #[tokio::test]
    async fn a_client_of_another_ca_is_refused() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (ours, theirs) = (material(a.path()), material(b.path()));
        let tuning = QuicTuning { endpoints: 1, ..QuicTuning::default() };
        let listener = QuicListener::bind("127.0.0.1:0".parse().unwrap(), &ours, &tuning, 16).unwrap();
        let addr = listener.local_addr().to_string();
        let server = tokio::spawn(echo_server(listener));
        // A client that trusts our CA (say, a stolen ca.pem) but presents another CA's certificate.
        let mut intruder = rustls::ClientConfig::builder_with_provider(tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(ours.roots())
            .with_client_auth_cert(theirs.chain.clone(), theirs.key.clone_key())
            .unwrap();
        intruder.alpn_protocols = vec![ALPN.to_vec()];
        let connector = QuicConnector::from_rustls(intruder, &tuning).unwrap();
        let refused = async {
            let mut stream = connector.connect(&addr).await?;
            stream.writer.write_all(b"hello").await?;
            stream.writer.shutdown().await?;
            let mut back = Vec::new();
            stream.reader.read_to_end(&mut back).await?;
            Ok::<_, io::Error>(back)
        };
        let result = tokio::time::timeout(Duration::from_secs(10), refused).await.expect("no answer in 10 s");
        assert!(result.is_err(), "a client of another CA was served: {result:?}");
        server.abort();
    }

    #[test]
    fn gso_is_reported() {
        // Not an assertion on the kernel: just that the probe works and says something sane.
        assert!(max_gso_segments() >= 1);
    }
}
