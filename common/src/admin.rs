//! The admin HTTP endpoint: `GET /metrics` in the Prometheus text format, `GET /health`.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus_client::registry::Registry;

/// Latency histogram buckets in seconds: 10 us to ~5 s, doubling.
pub fn latency_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(10e-6, 2.0, 20)
}

/// Binds the admin endpoint and serves it in the background; returns the bound address.
pub async fn serve(addr: SocketAddr, registry: Registry) -> anyhow::Result<SocketAddr> {
    let listener =
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding admin endpoint {addr}"))?;
    let bound = listener.local_addr()?;
    let registry = Arc::new(registry);
    let app = Router::new().route("/health", get(|| async { "ok\n" })).route(
        "/metrics",
        get(move || {
            let registry = registry.clone();
            async move {
                let mut text = String::new();
                match prometheus_client::encoding::text::encode(&mut text, &registry) {
                    Ok(()) => ([(CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text)
                        .into_response(),
                    Err(e) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
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
