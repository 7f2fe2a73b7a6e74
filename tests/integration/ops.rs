//! What operators run Tern by, against the real daemons: readiness that tells the truth (`/ready`,
//! the gRPC health service, systemd's notify protocol with its watchdog), logs as text without
//! colour codes or as JSON, and configuration from the environment with `--print-config`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::common::{free_port, TERN};
use tern_local::{Daemon, DaemonSpec, Deadline, Host};
use tern_proto::health::pb::health_check_response::ServingStatus;
use tern_proto::health::pb::health_client::HealthClient;
use tern_proto::health::pb::HealthCheckRequest;

const WAIT: Duration = Duration::from_secs(30);

/// `GET path` on an admin endpoint: the status code and body, or `None` while nothing answers.
fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: tern\r\n\r\n").as_bytes()).ok()?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).ok()?;
    let status = reply.split(' ').nth(1)?.parse().ok()?;
    Some((status, reply.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default()))
}

/// Polls `path` until it answers with `status`; returns the body.
async fn wait_for_status(addr: SocketAddr, path: &str, status: u16) -> String {
    let deadline = Deadline::after(WAIT);
    let got = tern_local::poll_until(&deadline, || async {
        match http_get(addr, path) {
            Some((code, body)) if code == status => Ok(body),
            other => Err(other),
        }
    })
    .await;
    got.unwrap_or_else(|last| panic!("{addr}{path} never answered {status}; last: {last:?}"))
}

/// The next datagram systemd would have received, within `timeout`.
fn next_notification(socket: &UnixDatagram, timeout: Duration) -> Option<String> {
    socket.set_read_timeout(Some(timeout)).unwrap();
    let mut buffer = [0u8; 4096];
    let n = socket.recv(&mut buffer).ok()?;
    Some(String::from_utf8_lossy(&buffer[..n]).into_owned())
}

/// Notifications until one equal to `wanted`, within `timeout`; all of them, in order.
fn notifications_until(socket: &UnixDatagram, wanted: &str, timeout: Duration) -> Vec<String> {
    let deadline = std::time::Instant::now() + timeout;
    let mut seen = Vec::new();
    while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
        match next_notification(socket, left.max(Duration::from_millis(1))) {
            Some(state) => {
                let done = state == wanted;
                seen.push(state);
                if done {
                    return seen;
                }
            }
            None => break,
        }
    }
    panic!("no {wanted:?} within {timeout:?}; got {seen:?}");
}

async fn health_client(addr: SocketAddr) -> HealthClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    HealthClient::new(channel)
}

async fn grpc_health(addr: SocketAddr, service: &str) -> ServingStatus {
    let mut client = health_client(addr).await;
    let reply = client.check(HealthCheckRequest { service: service.to_string() }).await.unwrap().into_inner();
    ServingStatus::try_from(reply.status).unwrap()
}

fn spawn(dir: &Path, name: &str, spec: impl FnOnce(DaemonSpec) -> DaemonSpec) -> Daemon {
    spec(DaemonSpec::new(name, TERN, dir.join(format!("{name}.log")))).spawn().unwrap_or_else(|e| panic!("{e:#}"))
}

#[tokio::test]
async fn readiness_waits_for_registration_and_systemd_hears_ready_watchdog_and_stopping() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let host = Host::local();
    let [metadata, metadata_admin, storage, storage_admin, scheduler, scheduler_admin] =
        [(); 6].map(|()| host.addr(free_port()));
    let notify_path = dir.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    let secret = crate::common::cluster_secret(dir.path());

    // The storage server starts first: alive at once, but not ready (nor READY=1) until the
    // metadata server it must register with is there.
    let mut storage_server = spawn(dir.path(), "storage", |spec| {
        spec.args(["storage-server", "--metadata", &metadata.to_string(), "--dram", "64MiB"])
            .args(["--listen", &storage.to_string(), "--admin", &storage_admin.to_string()])
            .args(["--set", "drain_grace_ms=5000", "--set", &secret])
            .env("NOTIFY_SOCKET", &notify_path)
            // A watchdog of 400 ms: a keep-alive every 200 ms.
            .env("WATCHDOG_USEC", "400000")
    });
    assert_eq!(wait_for_status(storage_admin, "/health", 200).await, "ok\n");
    let not_ready = wait_for_status(storage_admin, "/ready", 503).await;
    assert!(not_ready.contains("registering with the metadata server"), "{not_ready}");
    assert_eq!(next_notification(&notify, Duration::from_millis(300)), None, "READY=1 before registering");

    let _metadata_server = spawn(dir.path(), "metadata", |spec| {
        spec.args(["metadata-server", "--listen", &metadata.to_string(), "--admin", &metadata_admin.to_string()])
            .args(["--dir", &dir.path().join("metadata").to_string_lossy(), "--set", &secret])
    });
    assert_eq!(wait_for_status(storage_admin, "/ready", 200).await, "ready\n");
    assert_eq!(notifications_until(&notify, "READY=1", WAIT), ["READY=1"]);
    // The watchdog's keep-alives follow, about every 200 ms.
    for _ in 0..3 {
        assert_eq!(next_notification(&notify, Duration::from_secs(5)).as_deref(), Some("WATCHDOG=1"));
    }
    assert_eq!(wait_for_status(metadata_admin, "/ready", 200).await, "ready\n");
    for service in ["", "tern.v1.Metadata", "tern.v1.Registry", "tern.v1.Admin"] {
        assert_eq!(grpc_health(metadata, service).await, ServingStatus::Serving, "metadata {service:?}");
    }

    let _scheduler = spawn(dir.path(), "scheduler", |spec| {
        spec.args(["scheduler", "--metadata", &metadata.to_string()]).args([
            "--listen",
            &scheduler.to_string(),
            "--admin",
            &scheduler_admin.to_string(),
            "--set",
            &secret,
        ])
    });
    assert_eq!(wait_for_status(scheduler_admin, "/ready", 200).await, "ready\n");
    for service in ["", "tern.sched.v1.Scheduler"] {
        assert_eq!(grpc_health(scheduler, service).await, ServingStatus::Serving, "scheduler {service:?}");
    }
    // A service the daemon does not have is NotFound, as the protocol says.
    let mut client = health_client(scheduler).await;
    let unknown = client.check(HealthCheckRequest { service: "tern.v1.Metadata".into() }).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);

    // SIGTERM: the storage server drains (it holds nothing) and tells systemd it is stopping.
    storage_server.terminate().unwrap();
    let stopping = notifications_until(&notify, "STOPPING=1", WAIT);
    assert!(stopping.iter().all(|state| state == "WATCHDOG=1" || state == "STOPPING=1"), "{stopping:?}");
    let status = tokio::task::spawn_blocking(move || storage_server.wait()).await.unwrap().unwrap();
    assert!(status.success(), "the drained storage server exited with {status}");
}

#[test]
fn settings_come_from_the_file_then_the_environment_then_flags() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("storage.toml");
    std::fs::write(&file, "dram = \"1GiB\"\nmax_connections = 100\ndrain_grace_ms = 700\n").unwrap();
    let print = |env: &[(&str, &str)], flags: &[&str]| {
        let out = Command::new(TERN)
            .args(["storage-server", "--config", file.to_str().unwrap(), "--print-config"])
            .args(flags)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let env = [
        ("TERN_DRAM", "3GiB"),
        ("TERN_MAX_CONNECTIONS", "200"),
        ("TERN_METADATA", "10.1.2.3:9060"),
        // Not storage server keys: the log format is a flag's, the rest belong to nobody.
        ("TERN_LOG_FORMAT", "text"),
        ("TERN_SOMETHING_ELSE", "x"),
    ];
    let (ok, config, stderr) = print(&env, &["--dram", "5GiB"]);
    assert!(ok, "{stderr}");
    let table: toml::Table = toml::from_str(&config).unwrap_or_else(|e| panic!("{e}: {config}"));
    assert_eq!(table["dram"].as_str(), Some("5GiB"), "a flag beats the environment:\n{config}");
    assert_eq!(table["max_connections"].as_integer(), Some(200), "the environment beats the file:\n{config}");
    assert_eq!(table["metadata"].as_str(), Some("10.1.2.3:9060"), "{config}");
    assert_eq!(table["drain_grace_ms"].as_integer(), Some(700), "the file beats the defaults:\n{config}");

    let (ok, _, stderr) = print(&[("TERN_DRAM", "lots")], &[]);
    assert!(!ok && stderr.contains("environment TERN_DRAM=lots"), "{stderr}");
}

#[tokio::test]
async fn logs_are_json_when_asked_and_never_coloured_into_a_file() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let host = Host::local();
    for format in ["json", "text"] {
        let [listen, admin] = [(); 2].map(|()| host.addr(free_port()));
        let mut daemon = spawn(dir.path(), &format!("metadata-{format}"), |spec| {
            spec.args(["metadata-server", "--listen", &listen.to_string(), "--admin", &admin.to_string()])
                .args(["--dir", &dir.path().join(format!("metadata-{format}")).to_string_lossy()])
                .env("TERN_LOG_FORMAT", format)
        });
        wait_for_status(admin, "/ready", 200).await;
        let path = dir.path().join(format!("metadata-{format}.log"));
        let deadline = Deadline::after(WAIT);
        let log = tern_local::poll_until(&deadline, || {
            let log = std::fs::read_to_string(&path).unwrap_or_default();
            std::future::ready(if log.contains("listening on") { Ok(log) } else { Err(log) })
        })
        .await
        .unwrap_or_else(|log| panic!("no start-up line:\n{log}"));
        daemon.terminate().unwrap();
        assert!(!log.contains('\u{1b}'), "{format} log carries escape codes:\n{log}");
        if format == "json" {
            for line in log.lines() {
                let value: serde_json::Value =
                    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
                assert!(value["level"].is_string() && value["fields"]["message"].is_string(), "{line}");
            }
        } else {
            assert!(log.lines().any(|line| line.contains(" INFO ") && line.contains("listening on")), "{log}");
        }
    }
}
