//! Loopback throughput of the block transports with 1 MiB writes: the server sends `--mib` MiB
//! on each of `--streams` streams in 1 MiB writes (what a storage server does answering 1 MiB
//! block reads), the client reads it all. Prints MiB/s for TCP and for QUIC with the tuning given.
//!
//! ```sh
//! cargo run --release -p tern-transport --example throughput -- --streams 4 --mib 512
//! cargo run --release -p tern-transport --example throughput -- --window-mib 2 --mtu 1452 --endpoints 1
//! ```

use std::time::Instant;

use tern_transport::quic::{QuicConnector, QuicListener, QuicTuning};
use tern_transport::tcp::{TcpConnector, TcpListener};
use tern_transport::tls::{self, TlsMaterial};
use tern_transport::{Connector, Listener};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MIB: usize = 1 << 20;

struct Args {
    streams: usize,
    mib: usize,
    tuning: QuicTuning,
}

fn parse() -> Args {
    let mut args = Args { streams: 4, mib: 256, tuning: QuicTuning::default() };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value: u64 = it.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{flag} needs a number"));
        match flag.as_str() {
            "--streams" => args.streams = value as usize,
            "--mib" => args.mib = value as usize,
            "--window-mib" => args.tuning.stream_receive_window = (value as u32) << 20,
            "--conn-window-mib" => args.tuning.receive_window = (value as u32) << 20,
            "--send-window-mib" => args.tuning.send_window = value << 20,
            "--mtu" => args.tuning.max_mtu = value as u16,
            "--endpoints" => args.tuning.endpoints = value as usize,
            other => panic!("unknown flag {other}"),
        }
    }
    args
}

/// Sends `mib` MiB in 1 MiB writes on every accepted stream, after its first byte arrives.
async fn serve(mut listener: impl Listener, mib: usize) {
    let chunk = bytes::Bytes::from(vec![7u8; MIB]);
    loop {
        let Ok(mut stream) = listener.accept().await else { return };
        let chunk = chunk.clone();
        tokio::spawn(async move {
            let mut hello = [0u8; 1];
            if stream.reader.read_exact(&mut hello).await.is_err() {
                return;
            }
            for _ in 0..mib {
                if stream.writer.write_all(&chunk).await.is_err() {
                    return;
                }
            }
            let _ = stream.writer.shutdown().await;
        });
    }
}

async fn measure(connector: &dyn Connector, addr: &str, streams: usize, mib: usize) -> anyhow::Result<f64> {
    let mut opened = Vec::new();
    for _ in 0..streams {
        opened.push(connector.connect(addr).await.expect("connect"));
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for mut stream in opened {
        tasks.push(tokio::spawn(async move {
            stream.writer.write_all(b"!").await?;
            stream.writer.flush().await?;
            let mut buf = vec![0u8; MIB];
            let mut total = 0usize;
            loop {
                match stream.reader.read(&mut buf).await? {
                    0 => break std::io::Result::Ok(total),
                    n => total += n,
                }
            }
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await??;
    }
    assert_eq!(total, streams * mib * MIB);
    Ok(total as f64 / MIB as f64 / started.elapsed().as_secs_f64())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse();
    let dir = tempfile::tempdir()?;
    tls::init(dir.path(), &tls::InitOptions::default())?;
    let material = TlsMaterial::load(dir.path())?;
    println!("GSO segments per send: {}", tern_transport::quic::max_gso_segments());
    println!("{:?}", args.tuning);

    let tcp = TcpListener::bind("127.0.0.1:0".parse()?).await?;
    let tcp_addr = tcp.local_addr().to_string();
    tokio::spawn(serve(tcp, args.mib));
    let tcp_rate = measure(&TcpConnector, &tcp_addr, args.streams, args.mib).await?;
    println!("tcp : {:>8.0} MiB/s ({} streams x {} MiB, 1 MiB writes)", tcp_rate, args.streams, args.mib);

    let quic = QuicListener::bind("127.0.0.1:0".parse()?, &material, &args.tuning, 1024)?;
    let quic_addr = quic.local_addr().to_string();
    tokio::spawn(serve(quic, args.mib));
    let connector = QuicConnector::new(&material, &args.tuning)?;
    let quic_rate = measure(&connector, &quic_addr, args.streams, args.mib).await?;
    println!("quic: {:>8.0} MiB/s ({:.0}% of tcp)", quic_rate, 100.0 * quic_rate / tcp_rate);
    Ok(())
}
