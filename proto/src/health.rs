//! The standard gRPC health service (`grpc.health.v1.Health`) on a daemon's gRPC port, following
//! the daemon's readiness: SERVING while it is ready, NOT_SERVING otherwise, for the whole server
//! ("") and for each service named.

use tokio::sync::watch;
pub use tonic_health::pb;
pub use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::ServingStatus;

/// The health service for a server whose readiness `ready` follows (`Ok` when ready), reporting
/// for the whole server and for each of `services` (their full gRPC names). It follows `ready`
/// until that channel closes.
pub fn service(mut ready: watch::Receiver<Result<(), String>>, services: &[&str]) -> HealthServer<impl Health> {
    let (reporter, server) = tonic_health::server::health_reporter();
    let names: Vec<String> = std::iter::once("").chain(services.iter().copied()).map(str::to_string).collect();
    tokio::spawn(async move {
        loop {
            let status =
                if ready.borrow_and_update().is_ok() { ServingStatus::Serving } else { ServingStatus::NotServing };
            for name in &names {
                reporter.set_service_status(name, status).await;
            }
            if ready.changed().await.is_err() {
                return;
            }
        }
    });
    server
}
