//! What a daemon keeps of the calls its authorization refused: a counter per call and reason,
//! and a log line at most once a minute per caller and reason, so a hostile caller cannot flood
//! the log. The metadata server and the scheduler each decide their own calls; this is the part
//! they share.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// A refusal of one caller for one reason is logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(60);
/// Callers whose last refusal log is remembered; past this the memory starts afresh.
const MAX_LOGGED_CALLERS: usize = 4096;

/// The refusals of one service.
#[derive(Debug)]
pub struct Refusals {
    counted: Family<[(&'static str, &'static str); 2], Counter>,
    logged: Mutex<HashMap<(String, &'static str), Instant>>,
}

impl Refusals {
    /// Registers `<name>_total{method,reason}` (e.g. `tern_metadata_refused`).
    pub fn register(registry: &mut prometheus_client::registry::Registry, name: &str) -> Refusals {
        let counted = Family::default();
        registry.register(name, "Calls refused by authorization, by call and reason", counted.clone());
        Refusals { counted, logged: Mutex::new(HashMap::new()) }
    }

    /// Counts a refusal of `method` for `reason`, and logs `message` unless this caller was
    /// logged for this reason within the last minute.
    pub fn record(&self, method: &'static str, caller: &str, reason: &'static str, message: &str, now: Instant) {
        self.counted.get_or_create(&[("method", method), ("reason", reason)]).inc();
        let mut logged = self.logged.lock();
        if logged.len() >= MAX_LOGGED_CALLERS {
            logged.clear();
        }
        let key = (caller.to_string(), reason);
        if logged.get(&key).is_none_or(|at| now.duration_since(*at) >= LOG_EVERY) {
            logged.insert(key, now);
            tracing::warn!("{message} (logged once a minute per caller and reason)");
        }
    }
}
