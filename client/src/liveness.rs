//! Requests stalled on a storage server the metadata server has declared dead are given up at
//! once, not at their deadline.
//!
//! A server whose link is cut answers nothing and refuses nothing: the requests on its
//! connections would each wait out the full block deadline. The metadata server notices the
//! silence first (its heartbeat timeout is shorter than the deadline), so while any request has
//! waited past [`STALLED_AFTER`], one watcher task per client asks it (a status call, at most
//! every [`POLL_INTERVAL`]) whether the stalled servers are alive, and gives up the connections
//! of those it has declared dead: their requests fail as Unavailable, naming why, and the
//! callers act on the metadata server's answer (new placements, another copy, DataLost).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::error::Error;

/// A request that has waited this long for its reply counts as stalled.
pub(crate) const STALLED_AFTER: Duration = Duration::from_secs(2);
/// Least time between two liveness questions to the metadata server.
const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// Servers with stalled requests (address -> how many), shared by a client's connections and
/// its watcher.
#[derive(Default)]
pub(crate) struct Stalls {
    waiting: Mutex<HashMap<String, usize>>,
    changed: Notify,
    /// The client is gone: the watcher ends.
    closed: AtomicBool,
}

/// Counts one stalled request on a server while held.
pub(crate) struct Stalled<'a> {
    stalls: &'a Stalls,
    addr: String,
}

impl Stalls {
    /// Marks a request to `addr` stalled until the guard is dropped.
    pub(crate) fn stalled(&self, addr: &str) -> Stalled<'_> {
        *self.waiting.lock().entry(addr.to_string()).or_default() += 1;
        self.changed.notify_one();
        Stalled { stalls: self, addr: addr.to_string() }
    }

    fn addresses(&self) -> Vec<String> {
        self.waiting.lock().keys().cloned().collect()
    }

    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.changed.notify_one();
    }
}

impl Drop for Stalled<'_> {
    fn drop(&mut self) {
        let mut waiting = self.stalls.waiting.lock();
        if let Some(count) = waiting.get_mut(&self.addr) {
            *count -= 1;
            if *count == 0 {
                waiting.remove(&self.addr);
            }
        }
    }
}

/// The watcher: runs until the client is dropped. Holds the client weakly, so it does not keep
/// it alive.
pub(crate) async fn watch(client: Weak<crate::Inner>, stalls: Arc<Stalls>) {
    loop {
        stalls.changed.notified().await;
        loop {
            if stalls.closed.load(Ordering::Acquire) {
                return;
            }
            let stalled = stalls.addresses();
            if stalled.is_empty() {
                break;
            }
            let Some(inner) = client.upgrade() else { return };
            let client = crate::Client { inner };
            match client.status().await {
                Ok(status) => {
                    for addr in stalled {
                        // A server restarted at the same address is listed twice, the old one dead.
                        let alive = status.servers.iter().any(|s| {
                            s.alive && (s.address == addr || (!s.quic_address.is_empty() && s.quic_address == addr))
                        });
                        if !alive {
                            let why = Error::unavailable(format!(
                                "storage server {addr}: declared dead by the metadata server while a request waited"
                            ));
                            client.inner.blocks.give_up_server(&addr, &why);
                        }
                    }
                }
                // The metadata server cannot say: the requests' own deadlines still hold.
                Err(e) => tracing::debug!("asking the metadata server about stalled storage servers: {e}"),
            }
            drop(client);
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }
}
