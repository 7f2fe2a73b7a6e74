//! What every Tern daemon and command shares, and nothing else: the default ports, the Spark
//! plugin's class names, sizes with units, durations, the layered config loader and the
//! listen/admin/TLS block of every daemon's config, the Prometheus admin endpoint, retry backoff,
//! the lock on a state directory (`dirlock`), the record of authorization's refusals (`refusals`), logging and shutdown signals, percentiles, the
//! contract between task code and the executor (`task_error`), the file layer of durable state
//! (`durable`, with a power-cut simulation for tests), and the time passed into state machines
//! (`now`).

pub mod admin;
pub mod backoff;
pub mod config;
pub mod dirlock;
pub mod durable;
pub mod duration;
pub mod now;
pub mod ports;
mod process_metrics;
pub mod refusals;
pub mod rng;
pub mod size;
pub mod spark;
pub mod stats;
pub mod systemd;
pub mod task_error;
pub mod text;

pub use backoff::Backoff;
pub use duration::parse_duration;
pub use now::Now;
pub use rng::SplitMix64;
pub use size::ByteSize;
pub use stats::{median, percentile, percentile_if_supported, rotation, Spread};
pub use task_error::{InputLost, OutOfMemory};

/// How a process writes its log lines: `text` for people, `json` (one object per line) for log
/// collectors. Chosen with `--log-format` or `TERN_LOG_FORMAT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(text: &str) -> Result<LogFormat, String> {
        match text {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("{other:?} is no log format (expected text or json)")),
        }
    }
}

impl std::fmt::Display for LogFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

/// Logs to stderr in `format`; `RUST_LOG` overrides `default` (e.g. "info"). Colour only when
/// stderr is a terminal, so log files and collectors get plain text.
pub fn init_logging(default: &str, format: LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).try_init(),
        LogFormat::Json => builder.json().with_ansi(false).try_init(),
    };
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

/// Milliseconds since the Unix epoch, for timestamps shown to users. State machines take the
/// time from their caller instead ([`Now`]).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
