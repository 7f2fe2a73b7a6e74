//! The bound on open gRPC connections: accepted connections past `max_connections` are closed at
//! once (logged at warn, counted in `tern_metadata_connections_refused_total`), before any HTTP/2
//! is spoken, so a flood of connections costs the server a socket each only briefly. Clients see
//! `unavailable` and retry. RPCs per connection are bounded by HTTP/2's max concurrent streams.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::{Stream, StreamExt};
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::Connected;

/// A connection holding its place under the limit until it closes.
pub struct Limited<IO> {
    io: IO,
    _permit: OwnedSemaphorePermit,
}

/// `incoming` with connections over `max` closed as they arrive.
pub fn limit<IO, S>(incoming: S, max: usize, refused: Counter) -> impl Stream<Item = io::Result<Limited<IO>>>
where
    S: Stream<Item = io::Result<IO>>,
{
    let permits = Arc::new(Semaphore::new(max));
    incoming.filter_map(move |accepted| {
        let result = match accepted {
            Ok(io) => match permits.clone().try_acquire_owned() {
                Ok(permit) => Some(Ok(Limited { io, _permit: permit })),
                Err(_) => {
                    // Dropping `io` closes the socket.
                    refused.inc();
                    tracing::warn!("metadata server: at its limit of {max} gRPC connections (max_connections); closing a new one");
                    None
                }
            },
            Err(e) => Some(Err(e)),
        };
        std::future::ready(result)
    })
}

impl<IO: Connected> Connected for Limited<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Limited<IO> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Limited<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}
