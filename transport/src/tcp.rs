//! Plain TCP: one socket per block connection, TCP_NODELAY on both ends.

use std::io;
use std::net::SocketAddr;

use futures::future::BoxFuture;
use futures::FutureExt;

use crate::{Connector, Listener, Stream};

/// Dials storage servers over TCP.
#[derive(Debug, Default, Clone, Copy)]
pub struct TcpConnector;

impl Connector for TcpConnector {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Stream>> {
        async move {
            let stream = tokio::net::TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            let peer = stream.peer_addr()?;
            let (reader, writer) = stream.into_split();
            Ok(Stream { reader: Box::new(reader), writer: Box::new(writer), peer, local: None, one_sided: None })
        }
        .boxed()
    }
}

/// Accepts block connections over TCP.
#[derive(Debug)]
pub struct TcpListener {
    inner: tokio::net::TcpListener,
    addr: SocketAddr,
}

impl TcpListener {
    pub async fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
        TcpListener::from_tokio(tokio::net::TcpListener::bind(addr).await?)
    }

    pub fn from_tokio(inner: tokio::net::TcpListener) -> io::Result<TcpListener> {
        let addr = inner.local_addr()?;
        Ok(TcpListener { inner, addr })
    }
}

impl Listener for TcpListener {
    fn accept(&mut self) -> BoxFuture<'_, io::Result<Stream>> {
        accept(&self.inner).boxed()
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn name(&self) -> &'static str {
        "tcp"
    }
}

/// The next connection on `listener`, with TCP_NODELAY set, as a [`Stream`].
async fn accept(listener: &tokio::net::TcpListener) -> io::Result<Stream> {
    let (stream, peer) = listener.accept().await?;
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!("TCP_NODELAY on {peer}: {e}");
    }
    let (reader, writer) = stream.into_split();
    Ok(Stream { reader: Box::new(reader), writer: Box::new(writer), peer, local: None, one_sided: None })
}

/// A bare tokio listener serves as is (TCP_NODELAY set on each accepted socket).
impl Listener for tokio::net::TcpListener {
    fn accept(&mut self) -> BoxFuture<'_, io::Result<Stream>> {
        accept(self).boxed()
    }

    fn local_addr(&self) -> SocketAddr {
        tokio::net::TcpListener::local_addr(self).unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    fn name(&self) -> &'static str {
        "tcp"
    }
}
