//! The admin HTTP endpoint every daemon serves: `GET /metrics` in the Prometheus text format,
//! `GET /health` (liveness: the process answers) and `GET /ready` (readiness: the daemon should
//! be sent work now, as its [`Readiness`] says).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

/// Latency histogram buckets in seconds: 10 us to ~5 s, doubling.
pub fn latency_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(10e-6, 2.0, 20)
}

/// Whether a daemon should be sent work now: what `/ready`, the gRPC health service and systemd
/// are told. A daemon starts not ready, says when it is ready, and says why whenever it stops
/// being so. Clones share one state.
#[derive(Clone, Debug)]
pub struct Readiness(Arc<watch::Sender<Result<(), String>>>);

impl Readiness {
    /// Not ready yet: `why` (e.g. "registering with the metadata server").
    pub fn starting(why: &str) -> Readiness {
        Readiness(Arc::new(watch::Sender::new(Err(why.to_string()))))
    }

    /// Ready for work. The first time, systemd hears READY=1 (when it started the process).
    pub fn ready(&self) {
        let was_ready = self.0.send_replace(Ok(())).is_ok();
        if !was_ready {
            crate::systemd::notify_ready();
        }
    }

    /// Not ready for work, because of `why`; logged when it changes.
    pub fn not_ready(&self, why: impl Into<String>) {
        let why = why.into();
        let changed = self.0.send_if_modified(|state| {
            let changed = state.as_ref().err() != Some(&why);
            *state = Err(why.clone());
            changed
        });
        if changed {
            tracing::warn!("not ready: {why}");
        }
    }

    /// `Ok` when ready, else why not.
    pub fn check(&self) -> Result<(), String> {
        self.0.borrow().clone()
    }

    /// Sees every change (the gRPC health service follows it).
    pub fn subscribe(&self) -> watch::Receiver<Result<(), String>> {
        self.0.subscribe()
    }
}

/// Binds the admin endpoint of the daemon `role` (e.g. "storage-server") and serves it in the
/// background; returns the bound address. Beside the daemon's own metrics in `registry` it
/// exports the process's (`process_*`) and `tern_build_info{version,role}`.
pub async fn serve(
    addr: SocketAddr,
    role: &'static str,
    mut registry: Registry,
    readiness: Readiness,
) -> anyhow::Result<SocketAddr> {
    registry.register(
        "tern_build",
        "The running build: its version and the daemon's role (always 1)",
        Info::new(vec![("version", env!("CARGO_PKG_VERSION")), ("role", role)]),
    );
    registry.register_collector(Box::new(crate::process_metrics::ProcessCollector::new()));
    let listener =
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding admin endpoint {addr}"))?;
    let bound = listener.local_addr()?;
    let registry = Arc::new(registry);
    let app = Router::new()
        .route("/health", get(|| async { "ok\n" }))
        .route(
            "/ready",
            get(move || {
                let state = readiness.check();
                async move {
                    match state {
                        Ok(()) => (StatusCode::OK, "ready\n".to_string()),
                        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}\n")),
                    }
                }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    let mut text = String::new();
                    match prometheus_client::encoding::text::encode(&mut text, &registry) {
                        Ok(()) => {
                            ([(CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text)
                                .into_response()
                        }
                        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
                    }
                }
            }),
        );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("admin endpoint {bound} stopped: {e}");
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes()).await.unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.unwrap();
        let status = reply.split(' ').nth(1).unwrap().parse().unwrap();
        (status, reply.split("\r\n\r\n").nth(1).unwrap_or_default().to_string())
    }

    #[tokio::test]
    async fn ready_follows_the_readiness_and_metrics_carry_the_process_and_build() {
        let readiness = Readiness::starting("registering");
        let addr =
            serve("127.0.0.1:0".parse().unwrap(), "test-role", Registry::default(), readiness.clone()).await.unwrap();
        assert_eq!(get(addr, "/health").await, (200, "ok\n".to_string()));
        assert_eq!(get(addr, "/ready").await, (503, "not ready: registering\n".to_string()));
        readiness.ready();
        assert_eq!(get(addr, "/ready").await, (200, "ready\n".to_string()));
        readiness.not_ready("the log failed");
        assert_eq!(get(addr, "/ready").await, (503, "not ready: the log failed\n".to_string()));

        let (status, metrics) = get(addr, "/metrics").await;
        assert_eq!(status, 200);
        let version = env!("CARGO_PKG_VERSION");
        assert!(
            metrics.contains(&format!("tern_build_info{{version=\"{version}\",role=\"test-role\"}} 1")),
            "{metrics}"
        );
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_virtual_memory_bytes",
            "process_open_fds",
            "process_max_fds",
            "process_start_time_seconds",
            "process_threads",
        ] {
            assert!(metrics.lines().any(|line| line.starts_with(&format!("{name} "))), "{name} missing:\n{metrics}");
        }
    }
}
