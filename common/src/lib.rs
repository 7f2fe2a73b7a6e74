//! What every Tern daemon and command shares, and nothing else: sizes with units, durations, the
//! layered config loader and the listen/admin/TLS block of every daemon's config, the Prometheus
//! admin endpoint, retry backoff, logging and shutdown signals, percentiles, and the out-of-memory
//! contract between task code and the executor.

pub mod admin;
pub mod backoff;
pub mod config;
pub mod duration;
pub mod oom;
pub mod rng;
pub mod size;
pub mod stats;

pub use backoff::Backoff;
pub use duration::parse_duration;
pub use oom::OutOfMemory;
pub use rng::SplitMix64;
pub use size::ByteSize;
pub use stats::{median, percentile};

/// Logs to stderr; `RUST_LOG` overrides `default` (e.g. "info").
pub fn init_logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// A future that resolves on SIGINT (Ctrl-C) or SIGTERM. The handlers are installed when this
/// is called, not when the future is first polled, so a signal that arrives in between is not
/// lost (nor does it kill the process).
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut interrupt = signal(SignalKind::interrupt()).expect("install SIGINT handler");
    let mut terminate = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
    }
}

/// Milliseconds since the Unix epoch, for timestamps shown to users.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
