//! QUIC and TLS through real `tern` processes: block data over QUIC and TLS over TCP, the control plane over
//! mutual TLS, refusals of strangers, and the errors of missing, broken or expired material.

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{random_bytes, Cluster, Tls, TERN};
use tern_client::{Client, ClientOptions, ErrorKind, ShuffleOptions, TransportKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_and_shuffles_round_trip_over_quic_and_tls_with_tls_everywhere() {
    let cluster = Cluster::start_with(2, "64MiB", Tls::Full).await;
    let status = cluster.client_over(TransportKind::Quic).await.status().await.unwrap();
    for server in &status.servers {
        assert!(!server.quic_address.is_empty(), "storage server {} registered no QUIC address", server.server_id);
    }
    let tcp = cluster.client_over(TransportKind::Tcp).await;
    for transport in [TransportKind::Quic, TransportKind::Tls] {
        let client = cluster.client_over(transport).await;
        // Files of several blocks (1 MiB blocks), written and read over the transport.
        let path = format!("/data/{transport}-file");
        let data = random_bytes((5 << 20) + 12345);
        client.put(&path, data.clone().into()).await.unwrap();
        let (_, blocks) = client.stat_with_blocks(&path, true).await.unwrap();
        assert_eq!(blocks.len(), 6);
        assert!(blocks.iter().all(|(b, _)| !b.quic_address.is_empty()), "blocks carry their server's QUIC address");
        assert_eq!(client.open(&path).await.unwrap().read_to_end().await.unwrap(), data, "{transport}");
        // The same bytes read back over plain TCP: one block protocol, three transports.
        assert_eq!(tcp.open(&path).await.unwrap().read_to_end().await.unwrap(), data);

        // A shuffle pushed and fetched over the transport.
        let job = client.start_job(Some(&format!("{transport}-shuffle")), Duration::from_secs(30)).await.unwrap();
        let shuffle =
            client.register_shuffle(job.id(), 3, ShuffleOptions { maps: 2, ..Default::default() }).await.unwrap();
        for map in 0..2u32 {
            let mut writer = shuffle.writer(map, 0);
            for n in 0..2000u32 {
                writer.write(n % 3, format!("m{map}n{n:05};").as_bytes()).await.unwrap();
            }
            assert!(writer.commit().await.unwrap().committed);
        }
        let batches = shuffle.reader(0..3, 0..2).await.unwrap().read_to_end().await.unwrap();
        let total: usize = batches.iter().map(|b| b.data.len()).sum();
        assert_eq!(total, 2 * 2000 * "m0n00000;".len(), "{transport}");
        job.end().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_moves_files_over_quic() {
    let cluster = Cluster::start_with(1, "64MiB", Tls::Quic).await;
    let local = cluster.dir.path().join("in.bin");
    let data = random_bytes(3 << 20);
    std::fs::write(&local, &data).unwrap();
    let copy = cluster.dir.path().join("out.bin");
    cluster.tern_ok(&["fs", "--transport", "quic", "put", &local.to_string_lossy(), "/q/file"]);
    cluster.tern_ok(&["fs", "--transport", "quic", "get", "/q/file", &copy.to_string_lossy()]);
    assert_eq!(std::fs::read(&copy).unwrap(), data);
    cluster.tern_ok(&["fs", "--transport", "tls", "get", "/q/file", &copy.to_string_lossy()]);
    assert_eq!(std::fs::read(&copy).unwrap(), data);
    let status = cluster.tern_ok(&["status", "--json"]);
    assert!(status.contains("\"quic_address\":\"127.0.0.1:"), "{status}");
    // Plain clients of `tern up`-style clusters keep working over TCP without TLS material.
    let out = Command::new(TERN)
        .args(["fs", "cat", "/q/file"])
        .env("TERN_METADATA", &cluster.metadata_addr)
        .env_remove("TERN_TLS_DIR")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.stdout, data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_without_a_quic_endpoint_says_how_to_get_one() {
    let cluster = Cluster::start(1, "64MiB").await;
    let tls = tempfile::tempdir().unwrap();
    tern_transport::tls::init(tls.path(), &Default::default()).unwrap();
    let options = ClientOptions {
        transport: TransportKind::Quic,
        tls_dir: Some(tls.path().to_path_buf()),
        ..ClientOptions::default()
    };
    let client = Client::connect_with(&format!("http://{}", cluster.metadata_addr), options).await.unwrap();
    let err = client.put("/x", vec![1u8; 10].into()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
    assert!(err.message().contains("has no QUIC endpoint: start it with --tls-dir"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_is_refused_on_grpc_quic_and_tls() {
    let cluster = Cluster::start_with(1, "64MiB", Tls::Full).await;
    let other = tempfile::tempdir().unwrap();
    tern_transport::tls::init(other.path(), &Default::default()).unwrap();
    let stranger = |transport| ClientOptions {
        transport,
        tls_dir: Some(other.path().to_path_buf()),
        connect_timeout: Duration::from_secs(3),
        ..ClientOptions::default()
    };
    // gRPC: the handshake fails both ways (neither trusts the other's CA).
    let err = Client::connect_with(&cluster.metadata_addr, stranger(TransportKind::Tcp)).await.err().unwrap();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    // A plain client cannot talk to the TLS control plane either.
    let plain = ClientOptions { connect_timeout: Duration::from_secs(3), ..ClientOptions::default() };
    let plain = Client::connect_with(&format!("http://{}", cluster.metadata_addr), plain).await;
    assert!(plain.is_err() || plain.unwrap().status().await.is_err(), "plain gRPC was served by a TLS server");

    // QUIC: a cluster whose gRPC is plain, so the stranger reaches the metadata server, but not
    // the storage server's QUIC endpoint.
    let open = Cluster::start_with(1, "64MiB", Tls::Quic).await;
    let quic_stranger =
        Client::connect_with(&format!("http://{}", open.metadata_addr), stranger(TransportKind::Quic)).await.unwrap();
    let err = quic_stranger.put("/x", vec![1u8; 10].into()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.message().contains("cannot connect"), "{err}");
    // TLS over TCP: the same refusal in the handshake.
    let tls_stranger =
        Client::connect_with(&format!("http://{}", open.metadata_addr), stranger(TransportKind::Tls)).await.unwrap();
    let err = tls_stranger.put("/x", vec![1u8; 10].into()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.message().contains("TLS handshake"), "{err}");
}

/// Runs `tern` with `args` and expects it to exit non-zero within 20 s; returns its stderr.
fn fails(args: &[&str]) -> String {
    let out = Command::new(TERN).args(args).output().unwrap();
    assert!(!out.status.success(), "tern {args:?} should have failed");
    String::from_utf8_lossy(&out.stderr).to_string()
}

#[test]
fn missing_broken_or_expired_material_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("metadata").to_string_lossy().to_string();
    let missing = dir.path().join("no-such-dir").to_string_lossy().to_string();
    let base = ["metadata-server", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--dir", &state];
    let err = fails(&[&base[..], &["--tls-dir", &missing]].concat());
    assert!(err.contains("no TLS material in") && err.contains("tern cert init --dir"), "{err}");

    let tls = dir.path().join("tls");
    tern_transport::tls::init(&tls, &Default::default()).unwrap();
    std::fs::remove_file(tls.join("node.pem")).unwrap();
    let tls_arg = tls.to_string_lossy().to_string();
    let err = fails(&[&base[..], &["--tls-dir", &tls_arg]].concat());
    assert!(err.contains("node.pem is missing"), "{err}");

    let now = time::OffsetDateTime::now_utc();
    let expired = dir.path().join("expired");
    let options = tern_transport::tls::InitOptions::default();
    tern_transport::tls::init_with_validity(
        &expired,
        &options,
        now - time::Duration::days(400),
        now - time::Duration::days(35),
    )
    .unwrap();
    let expired_arg = expired.to_string_lossy().to_string();
    let err = fails(&[&base[..], &["--tls-dir", &expired_arg]].concat());
    assert!(err.contains("expired on"), "{err}");
    let storage = [
        "storage-server",
        "--metadata",
        "127.0.0.1:9",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--dram",
        "8MiB",
        "--tls-dir",
        &expired_arg,
    ];
    let err = fails(&storage);
    assert!(err.contains("expired on"), "{err}");

    // `tern cert init` refuses to replace a CA.
    let again = fails(&["cert", "init", "--dir", &tls_arg]);
    assert!(again.contains("--force"), "{again}");
}

#[test]
fn daemons_refuse_plain_tcp_beyond_loopback_unless_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("metadata").to_string_lossy().to_string();
    let base = ["metadata-server", "--listen", "0.0.0.0:0", "--admin", "127.0.0.1:0", "--dir", &state];
    let err = fails(&base);
    assert!(err.contains("tern cert init --dir DIR") && err.contains("--tls-dir DIR"), "{err}");
    let storage = ["storage-server", "--listen", "0.0.0.0:0", "--admin", "127.0.0.1:0", "--dram", "8MiB"];
    let err = fails(&storage);
    assert!(err.contains("tern cert init --dir DIR") && err.contains("--trusted-network"), "{err}");

    // With --trusted-network the metadata server starts and keeps running.
    let mut child = common::spawn_logged(dir.path(), "trusted", &[&base[..], &["--trusted-network"]].concat());
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            let log = std::fs::read_to_string(dir.path().join("trusted.log")).unwrap_or_default();
            panic!("the trusted metadata server exited ({status}):\n{log}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let log = std::fs::read_to_string(dir.path().join("trusted.log")).unwrap();
    assert!(log.contains("listening on 0.0.0.0:"), "{log}");
}
