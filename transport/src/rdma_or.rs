//! RDMA where both ends have it, another transport where not: the client's choice, per server.
//!
//! A client asked for RDMA (`--transport rdma`, or `auto` on a trusted network with a device)
//! dials each storage server over rdma_cm first. A server that does not answer over RDMA (built
//! without it, no device, not serving it on that address) is dialled with the fallback connector
//! instead, said once in the log, and not tried over RDMA again for [`RETRY_RDMA_AFTER`].

use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::FutureExt;
use parking_lot::Mutex;

use crate::{Connector, Stream};

/// How long a server that refused RDMA is dialled with the fallback before RDMA is tried again
/// (it may have been restarted with a device).
pub const RETRY_RDMA_AFTER: Duration = Duration::from_secs(60);
/// How long one RDMA connect may take, by default, before the fallback is used: well inside the
/// client's connect deadline (`connect_timeout`, 5 s by default), which covers the fallback too.
/// A server with no RDMA listener is not always refused at once (soft-RoCE answered nothing to a
/// connection request for a port with no listener, in the test guest), and an RDMA connect that
/// works takes milliseconds on hardware. On an emulated CPU it can take seconds (queue pairs and
/// their buffers registered under TCG, beside three servers): such hosts set a longer deadline
/// (`ClientOptions::rdma_connect_timeout`), so that a slow connect is not taken for a missing device.
pub const DEFAULT_RDMA_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Servers remembered as not serving RDMA, at most (older entries are dropped first).
const MAX_REMEMBERED: usize = 4096;

/// Dials over RDMA, falling back per server (see the module doc).
pub struct RdmaOr {
    fallback: Arc<dyn Connector>,
    /// Servers that refused RDMA, and when.
    refused: Mutex<HashMap<String, Instant>>,
    /// RDMA was asked for by name: a fallback is a warning, not news.
    required: bool,
    /// How long one RDMA connect may take before the fallback is used.
    timeout: Duration,
}

impl RdmaOr {
    /// RDMA with `fallback` (named `fallback_name` in logs) when this host has an RDMA device and
    /// this build has RDMA; else `fallback` alone, with one log line saying why (at warn when
    /// RDMA was `required`, i.e. asked for by name; at debug for `auto`). An RDMA connect taking
    /// longer than `timeout` falls back.
    pub fn connector(
        fallback: Arc<dyn Connector>,
        fallback_name: &str,
        required: bool,
        timeout: Duration,
    ) -> Arc<dyn Connector> {
        match crate::rdma_devices() {
            Ok(devices) => {
                tracing::debug!("RDMA transport on {devices:?}, {fallback_name} where a server has none");
                Arc::new(RdmaOr { fallback, refused: Mutex::default(), required, timeout })
            }
            Err(why) if required => {
                tracing::warn!("RDMA transport asked for, but {why}: using {fallback_name}");
                fallback
            }
            Err(why) => {
                tracing::debug!("no RDMA for block traffic ({why}): using {fallback_name}");
                fallback
            }
        }
    }

    fn refused_lately(&self, addr: &str) -> bool {
        let mut refused = self.refused.lock();
        match refused.get(addr) {
            Some(at) if at.elapsed() < RETRY_RDMA_AFTER => true,
            Some(_) => {
                refused.remove(addr);
                false
            }
            None => false,
        }
    }

    fn remember_refusal(&self, addr: &str) {
        let mut refused = self.refused.lock();
        if refused.len() >= MAX_REMEMBERED {
            if let Some(oldest) = refused.iter().min_by_key(|(_, at)| **at).map(|(a, _)| a.clone()) {
                refused.remove(&oldest);
            }
        }
        refused.insert(addr.to_string(), Instant::now());
    }
}

impl Connector for RdmaOr {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Stream>> {
        async move {
            if !self.refused_lately(addr) {
                let why = match tokio::time::timeout(self.timeout, rdma_connect(addr)).await {
                    Ok(Ok(stream)) => return Ok(stream),
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => format!("connect timed out after {:?}", self.timeout),
                };
                if self.required {
                    tracing::warn!("storage server {addr}: no RDMA ({why}); falling back to TCP");
                } else {
                    tracing::info!("storage server {addr}: no RDMA ({why}); falling back to TCP");
                }
                self.remember_refusal(addr);
            }
            self.fallback.connect(addr).await
        }
        .boxed()
    }
}

/// A connection over RDMA alone, no fallback (for checks that must know RDMA answers); an error
/// saying so in a build without RDMA.
pub async fn rdma_connect(addr: &str) -> io::Result<Stream> {
    match crate::rdma_provider::provider() {
        Some(rdma) => rdma.connect(addr).await,
        None => Err(io::Error::new(io::ErrorKind::Unsupported, crate::rdma_provider::NOT_BUILT)),
    }
}
