//! The raw peers of `tern bench io`: a plain request/response server and client over the same
//! transports Tern uses (`tcp-raw`, `tls-raw`, `quic-raw`), the same sizes and concurrency, and
//! nothing else: no block table, no checksums, no metadata. What they reach is the machine's
//! limit for Tern's data path over that transport, the figure Tern's is judged against.
//!
//! The protocol: a request is 16 bytes (`op` in byte 0: 0 write, 1 read; the length in bytes
//! 8..16, little-endian); a write's payload follows it and is answered by 8 bytes; a read is
//! answered by `length` bytes of a buffer made once. Both ends reuse their buffers (no allocation
//! or zeroing per op). The server runs on a runtime of its own with two worker threads, as a
//! separate process would, so that it does not share the clients' threads.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Context};
use tern_transport::tls_tcp::{PlainFrom, TcpOrTlsListener};
use tern_transport::{Connector, Listener, Stream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{Cell, Op};
use crate::harness::{go, join_all, payload, Budget, Recorder, Samples};

/// Largest op the server takes (the largest size the bench measures).
const MAX_OP_BYTES: u64 = 4 << 20;
const REQUEST_LEN: usize = 16;
const WRITE_ACK: [u8; 8] = *b"written\n";

/// Which transport a raw peer runs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RawTransport {
    Tcp,
    Tls,
    Quic,
}

/// A raw server on loopback and a way to dial it; the server stops when this drops.
pub(super) struct RawTarget {
    addr: SocketAddr,
    connector: Arc<dyn Connector>,
    /// Its runtime, shut down (without waiting, as a drop inside async code must) on drop.
    server: Option<tokio::runtime::Runtime>,
    /// The TLS material's directory (TLS and QUIC).
    _tls: Option<tempfile::TempDir>,
}

impl RawTarget {
    pub(super) async fn start(transport: RawTransport) -> anyhow::Result<RawTarget> {
        let server = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("raw-peer")
            .enable_all()
            .build()
            .context("starting the raw peer's runtime")?;
        let loopback: SocketAddr = "127.0.0.1:0".parse().expect("a valid address");
        let (tls, material) = match transport {
            RawTransport::Tcp => (None, None),
            RawTransport::Tls | RawTransport::Quic => {
                let dir = tempfile::tempdir()?;
                tern_transport::tls::init(dir.path(), &Default::default())?;
                let material = tern_transport::tls::TlsMaterial::load(dir.path())?;
                (Some(dir), Some(material))
            }
        };
        let (listener, connector): (Box<dyn Listener>, Arc<dyn Connector>) = match (transport, &material) {
            (RawTransport::Tcp, _) => {
                let listener = server.spawn(tern_transport::tcp::TcpListener::bind(loopback)).await??;
                (Box::new(listener), Arc::new(tern_transport::tcp::TcpConnector))
            }
            (RawTransport::Tls, Some(material)) => {
                let server_material = material.clone();
                let listener = server
                    .spawn(async move {
                        TcpOrTlsListener::bind(loopback, &server_material, PlainFrom::Loopback, 1024).await
                    })
                    .await??;
                (Box::new(listener), Arc::new(tern_transport::tls_tcp::TlsTcpConnector::new(material)?))
            }
            (RawTransport::Quic, Some(material)) => {
                let tuning = tern_transport::quic::QuicTuning::default();
                let listener = {
                    let _entered = server.enter();
                    tern_transport::quic::QuicListener::bind(loopback, material, &tuning, 1024)?
                };
                (Box::new(listener), Arc::new(tern_transport::quic::QuicConnector::new(material, &tuning)?))
            }
            _ => unreachable!("TLS material is made for TLS and QUIC"),
        };
        let addr = listener.local_addr();
        server.spawn(serve(listener));
        Ok(RawTarget { addr, connector, server: Some(server), _tls: tls })
    }

    pub(super) async fn measure(&self, cell: Cell, budget: Budget) -> anyhow::Result<Samples> {
        let addr = self.addr.to_string();
        let mut streams = Vec::with_capacity(cell.concurrency as usize);
        for _ in 0..cell.concurrency {
            streams
                .push(self.connector.connect(&addr).await.with_context(|| format!("dialing the raw peer at {addr}"))?);
        }
        let budget = budget.start();
        let tasks =
            streams.into_iter().map(|stream| tokio::spawn(client(stream, cell.op, cell.size, budget))).collect();
        Samples::merge(join_all(tasks).await?)
    }
}

impl Drop for RawTarget {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.shutdown_background();
        }
    }
}

/// One worker: requests one at a time until the budget ends.
async fn client(mut stream: Stream, op: Op, size: u64, budget: Budget) -> anyhow::Result<Recorder> {
    let mut request = [0u8; REQUEST_LEN];
    request[0] = u8::from(op == Op::Read);
    request[8..].copy_from_slice(&size.to_le_bytes());
    let data = payload(size, 7);
    let mut reply = vec![0u8; if op == Op::Read { size as usize } else { WRITE_ACK.len() }];
    let mut recorder = Recorder::new(budget);
    while go(&recorder).await {
        let started = Instant::now();
        stream.writer.write_all(&request).await?;
        if op == Op::Write {
            stream.writer.write_all(&data).await?;
        }
        stream.writer.flush().await?;
        stream.reader.read_exact(&mut reply).await?;
        recorder.record(started);
    }
    Ok(recorder)
}

async fn serve(mut listener: Box<dyn Listener>) {
    let data = payload(MAX_OP_BYTES, 11);
    while let Ok(stream) = listener.accept().await {
        let data = data.clone();
        tokio::spawn(async move {
            // A client that stops mid-request ends its own stream; the bench reports its errors.
            let _ = serve_stream(stream, &data).await;
        });
    }
}

async fn serve_stream(mut stream: Stream, data: &[u8]) -> anyhow::Result<()> {
    let mut request = [0u8; REQUEST_LEN];
    let mut sink = vec![0u8; MAX_OP_BYTES as usize];
    loop {
        match stream.reader.read_exact(&mut request).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let len = u64::from_le_bytes(request[8..].try_into().expect("8 bytes"));
        ensure!(len <= MAX_OP_BYTES, "an op of {len} bytes is past the raw peer's {MAX_OP_BYTES}");
        if request[0] == 0 {
            stream.reader.read_exact(&mut sink[..len as usize]).await?;
            stream.writer.write_all(&WRITE_ACK).await?;
        } else {
            stream.writer.write_all(&data[..len as usize]).await?;
        }
        stream.writer.flush().await?;
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::io::{CellResult, IoOptions, System};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn raw_peers_move_every_byte() {
        let options = IoOptions {
            tern: PathBuf::new(),
            systems: vec![],
            cells: vec![],
            seconds: 0.05,
            warmup_seconds: 0.0,
            runs: 1,
            max_bytes: 8 << 20,
            dir: std::env::temp_dir(),
            dram_bytes: 0,
            progress: false,
        };
        for transport in [RawTransport::Tcp, RawTransport::Tls, RawTransport::Quic] {
            let raw = RawTarget::start(transport).await.unwrap();
            for op in [Op::Write, Op::Read] {
                let cell = Cell { op, size: 1 << 20, concurrency: 2 };
                let samples = raw.measure(cell, cell.budget(&options)).await.unwrap();
                let result = CellResult::of_samples(System::TcpRaw, cell, &samples);
                assert!(result.ops >= 2 && result.throughput_mib_s > 0.0, "{transport:?} {op:?}: {result:?}");
            }
        }
    }
}
