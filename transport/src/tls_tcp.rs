//! TLS 1.3 over TCP: one socket per block connection, mutual TLS with the cluster CA (rustls on
//! aws-lc-rs), TCP_NODELAY on both ends; served on the block service's own TCP port beside plain
//! frames ([`TcpOrTlsListener`]), and chosen per server by [`AutoConnector`].
//!
//! Why beside QUIC: QUIC does its per-packet work (pacing, acks, encryption of every ~1.4 KB
//! datagram) in user space, which costs on few cores; TLS records (16 KiB each) over kernel TCP
//! leave segmentation, acks and retransmission to the kernel (and to the NIC's offloads), so the
//! only work added to plain TCP is AES-GCM, at several GB/s per core. BENCHMARKS.md measures the
//! three side by side; this is the default encrypted path between hosts.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use rustls_pki_types::ServerName;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;

use crate::tls::{server_name_of, TlsMaterial};
use crate::{Connector, Listener, Stream};

/// ALPN of the block protocol over TLS (the same protocol as over QUIC).
pub const ALPN: &[u8] = crate::quic::ALPN;
/// A client that has not finished its handshake by then is dropped (it holds a connection slot).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshaken streams waiting for the block service's accept loop.
const ACCEPT_QUEUE: usize = 64;

/// Dials storage servers over TLS 1.3 on TCP, presenting the node certificate.
#[derive(Clone)]
pub struct TlsTcpConnector {
    tls: tokio_rustls::TlsConnector,
}

impl TlsTcpConnector {
    pub fn new(material: &TlsMaterial) -> anyhow::Result<TlsTcpConnector> {
        let config = material.client_config(&[ALPN])?;
        Ok(TlsTcpConnector { tls: tokio_rustls::TlsConnector::from(Arc::new(config)) })
    }
}

impl Connector for TlsTcpConnector {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Stream>> {
        async move {
            let name = ServerName::try_from(server_name_of(addr))
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("server name of {addr}: {e}")))?;
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            let peer = tcp.peer_addr()?;
            let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, self.tls.connect(name, tcp))
                .await
                .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("TLS handshake with {addr} timed out")))?
                .map_err(|e| {
                    io::Error::new(io::ErrorKind::ConnectionRefused, format!("TLS handshake with {addr}: {e}"))
                })?;
            let (reader, writer) = tokio::io::split(stream);
            Ok(Stream { reader: Box::new(reader), writer: Box::new(writer), peer, local: None, one_sided: None })
        }
        .boxed()
    }
}

/// Who may speak plain (unencrypted) frames on the block service's TCP port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlainFrom {
    /// Only peers on loopback: this host's clients.
    Loopback,
    /// Anyone: the operator declared the network trusted.
    Anyone,
}

/// The block service's TCP port when the server has TLS material: TLS from anyone, plain frames
/// as [`PlainFrom`] allows. The first byte tells them apart: a TLS record of a ClientHello starts
/// with 0x16, a block frame with its magic `T`. One port and one registered address serve both,
/// so a client across hosts and one beside the server need nothing different from the cluster.
///
/// The first byte is awaited and handshakes run off the accept loop (a slow or silent client
/// delays no one), at most `max_pending` at once, each within [`HANDSHAKE_TIMEOUT`].
pub struct TcpOrTlsListener {
    addr: SocketAddr,
    streams: mpsc::Receiver<Stream>,
    task: tokio::task::JoinHandle<()>,
}

/// A TLS record's first byte when it carries a handshake message (ClientHello).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

impl TcpOrTlsListener {
    pub async fn bind(
        addr: SocketAddr,
        material: &TlsMaterial,
        plain: PlainFrom,
        max_pending: usize,
    ) -> anyhow::Result<TcpOrTlsListener> {
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(material.server_config(&[ALPN])?));
        let listener = tokio::net::TcpListener::bind(addr).await?;
        TcpOrTlsListener::from_tokio(listener, acceptor, plain, max_pending)
    }

    fn from_tokio(
        listener: tokio::net::TcpListener,
        acceptor: tokio_rustls::TlsAcceptor,
        plain: PlainFrom,
        max_pending: usize,
    ) -> anyhow::Result<TcpOrTlsListener> {
        let addr = listener.local_addr()?;
        let (tx, streams) = mpsc::channel(ACCEPT_QUEUE);
        let permits = Arc::new(Semaphore::new(max_pending.max(1)));
        let task = tokio::spawn(accept_loop(listener, acceptor, plain, tx, permits));
        Ok(TcpOrTlsListener { addr, streams, task })
    }
}

impl Drop for TcpOrTlsListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    plain: PlainFrom,
    tx: mpsc::Sender<Stream>,
    permits: Arc<Semaphore>,
) {
    let mut pending = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (tcp, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // EMFILE and the like: back off rather than spin.
                        tracing::warn!("block service: TCP accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                // Held until the stream is handed over; then the block service's own connection
                // limit applies.
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    tracing::debug!("block service: refusing {peer}: too many connections not yet identified");
                    continue;
                };
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!("TCP_NODELAY on {peer}: {e}");
                }
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                pending.spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, identify(tcp, peer, &acceptor, plain)).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send(stream).await;
                        }
                        Ok(Err(why)) => tracing::info!("block service: connection from {peer} refused: {why}"),
                        Err(_) => tracing::info!(
                            "block service: {peer} sent nothing or no TLS handshake within {HANDSHAKE_TIMEOUT:?}"
                        ),
                    }
                });
            }
            Some(joined) = pending.join_next(), if !pending.is_empty() => {
                if let Err(e) = joined {
                    if e.is_panic() {
                        tracing::error!("block service: a connection task panicked: {e}");
                    }
                }
            }
        }
    }
}

/// Reads the first byte without taking it, then hands back the plain stream or the one the TLS
/// handshake made.
async fn identify(
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
    acceptor: &tokio_rustls::TlsAcceptor,
    plain: PlainFrom,
) -> Result<Stream, String> {
    let mut first = [0u8; 1];
    if tcp.peek(&mut first).await.map_err(|e| e.to_string())? == 0 {
        return Err("closed before sending anything".into());
    }
    if first[0] == TLS_HANDSHAKE_RECORD {
        let stream = acceptor.accept(tcp).await.map_err(|e| format!("TLS handshake failed: {e}"))?;
        let (reader, writer) = tokio::io::split(stream);
        return Ok(Stream { reader: Box::new(reader), writer: Box::new(writer), peer, local: None, one_sided: None });
    }
    if plain == PlainFrom::Loopback && !peer.ip().is_loopback() {
        return Err("plain TCP is served to this host's clients only (the network is not declared trusted); \
                    clients on other hosts use TLS (--transport tls or auto, with --tls-dir)"
            .into());
    }
    let (reader, writer) = tcp.into_split();
    Ok(Stream { reader: Box::new(reader), writer: Box::new(writer), peer, local: None, one_sided: None })
}

impl Listener for TcpOrTlsListener {
    fn accept(&mut self) -> BoxFuture<'_, io::Result<Stream>> {
        crate::next_handed_over(&mut self.streams).boxed()
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn name(&self) -> &'static str {
        "tcp+tls"
    }
}

/// The client side when the choice is automatic: plain TCP to a server on loopback (this host),
/// TLS to any other when the client has TLS material, plain TCP otherwise (a trusted network).
pub struct AutoConnector {
    tls: Option<TlsTcpConnector>,
}

impl AutoConnector {
    pub fn new(material: Option<&TlsMaterial>) -> anyhow::Result<AutoConnector> {
        Ok(AutoConnector { tls: material.map(TlsTcpConnector::new).transpose()? })
    }

    /// Whether a connection to `addr` goes over TLS.
    pub fn encrypts(&self, addr: &str) -> bool {
        self.tls.is_some() && !is_loopback_host(&server_name_of(addr))
    }
}

fn is_loopback_host(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl Connector for AutoConnector {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Stream>> {
        match &self.tls {
            Some(tls) if self.encrypts(addr) => tls.connect(addr),
            _ => crate::tcp::TcpConnector.connect(addr),
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::tls::{init, InitOptions};

    /// Echoes 1 MiB on each stream accepted, forever.
    fn echo(mut listener: TcpOrTlsListener) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            while let Ok(mut stream) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0; 1 << 20];
                    stream.reader.read_exact(&mut buf).await.unwrap();
                    stream.writer.write_all(&buf).await.unwrap();
                    stream.writer.flush().await.unwrap();
                });
            }
        })
    }

    async fn round_trip(connector: &dyn Connector, addr: &str) -> io::Result<()> {
        let mut stream = connector.connect(addr).await?;
        let sent: Vec<u8> = (0..1u32 << 20).map(|i| (i * 7) as u8).collect();
        stream.writer.write_all(&sent).await?;
        stream.writer.flush().await?;
        let mut got = vec![0; sent.len()];
        stream.reader.read_exact(&mut got).await?;
        assert_eq!(got, sent);
        Ok(())
    }

    #[tokio::test]
    async fn one_port_serves_tls_and_plain_frames_and_refuses_a_stranger() {
        let (ours, theirs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        init(ours.path(), &InitOptions::default()).unwrap();
        init(theirs.path(), &InitOptions::default()).unwrap();
        let material = TlsMaterial::load(ours.path()).unwrap();
        let listener =
            TcpOrTlsListener::bind("127.0.0.1:0".parse().unwrap(), &material, PlainFrom::Loopback, 4).await.unwrap();
        let addr = listener.local_addr().to_string();
        let _server = echo(listener);
        round_trip(&TlsTcpConnector::new(&material).unwrap(), &addr).await.unwrap();
        // Plain frames start with the magic "TB"; a loopback peer may send them.
        round_trip(&crate::tcp::TcpConnector, &addr).await.unwrap();
        // Auto: loopback is this host, so plain; another host's address gets TLS.
        let auto = AutoConnector::new(Some(&material)).unwrap();
        assert!(!auto.encrypts(&addr) && !auto.encrypts("localhost:1"));
        assert!(auto.encrypts("10.0.0.2:9070") && auto.encrypts("store-1:9070"));
        assert!(!AutoConnector::new(None).unwrap().encrypts("10.0.0.2:9070"));
        round_trip(&auto, &addr).await.unwrap();
        // A client of another cluster's CA is refused in the handshake.
        let stranger = TlsTcpConnector::new(&TlsMaterial::load(theirs.path()).unwrap()).unwrap();
        let err = round_trip(&stranger, &addr).await.unwrap_err();
        assert!(err.to_string().contains("TLS handshake"), "{err}");
    }

    #[tokio::test]
    async fn plain_frames_from_another_host_are_refused_unless_the_network_is_trusted() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path(), &InitOptions::default()).unwrap();
        let material = TlsMaterial::load(dir.path()).unwrap();
        // Every peer in a test is on loopback: the rule is checked on `identify`, as if the
        // connection came from another host.
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(material.server_config(&[ALPN]).unwrap()));
        for (plain, admitted) in [(PlainFrom::Loopback, false), (PlainFrom::Anyone, true)] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let client = tokio::spawn(async move {
                let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
                tcp.write_all(b"TB").await.unwrap();
                tcp
            });
            let (tcp, _) = listener.accept().await.unwrap();
            let remote: SocketAddr = "10.1.2.3:40000".parse().unwrap();
            let result = identify(tcp, remote, &acceptor, plain).await;
            assert_eq!(result.is_ok(), admitted, "{plain:?}");
            if let Err(why) = result {
                assert!(why.contains("--transport tls"), "{why}");
            }
            drop(client.await.unwrap());
        }
    }
}
