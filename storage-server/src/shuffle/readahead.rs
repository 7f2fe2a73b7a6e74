//! Read-ahead: a reader of NVMe gets its next page's spans read while it takes this one, within
//! a bound per segment ([`READ_AHEAD_SPANS`]) and per server ([`READ_AHEAD_BYTES`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;

use super::segment::Segment;
use super::Shuffles;
use crate::nvme::NvmeExtent;

/// NVMe spans one segment keeps read ahead (oldest dropped first), and bytes a server keeps read
/// ahead in all: a reducer's next pages are on their way while it takes this one, within a bound.
const READ_AHEAD_SPANS: usize = 8;
const READ_AHEAD_BYTES: usize = 256 << 20;

/// An NVMe read under way (or done) that a fetch may take instead of reading itself.
type SharedRead = futures::future::Shared<futures::future::BoxFuture<'static, Result<Bytes, String>>>;

/// A span of an extent read ahead, its bytes counted against the server's bound until dropped.
pub(super) struct ReadAhead {
    extent: Arc<NvmeExtent>,
    start: u32,
    end: u32,
    read: SharedRead,
    _counted: Counted,
}

/// Bytes counted in a shared total while this lives.
struct Counted {
    total: Arc<AtomicUsize>,
    bytes: usize,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl Segment {
    /// Takes the read-ahead of `extent` covering `[start, end)`, if there is one: where its span
    /// starts, and the read.
    pub(super) fn take_read_ahead(&self, extent: &Arc<NvmeExtent>, start: u32, end: u32) -> Option<(u32, SharedRead)> {
        let mut ahead = self.read_ahead.lock();
        let at = ahead.iter().position(|r| Arc::ptr_eq(&r.extent, extent) && r.start <= start && end <= r.end)?;
        let taken = ahead.remove(at)?;
        Some((taken.start, taken.read.clone()))
    }
}

impl Shuffles {
    /// Starts reading `spans` of `segment` (the page a reader asks for next), unless already read
    /// ahead or past the server's bound; they go on in the background.
    pub(super) fn read_ahead(&self, segment: &Segment, spans: Vec<(Arc<NvmeExtent>, u32, u32)>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        for (extent, start, end) in spans {
            let mut ahead = segment.read_ahead.lock();
            if ahead.iter().any(|r| Arc::ptr_eq(&r.extent, &extent) && r.start <= start && end <= r.end) {
                continue;
            }
            let bytes = (end - start) as usize;
            if self.read_ahead_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes > READ_AHEAD_BYTES {
                self.read_ahead_bytes.fetch_sub(bytes, Ordering::Relaxed);
                return;
            }
            let counted = Counted { total: self.read_ahead_bytes.clone(), bytes };
            let reading = extent.clone();
            let read = futures::FutureExt::shared(futures::FutureExt::boxed(async move {
                reading.read(start, end - start).await.map_err(|e| e.to_string())
            }));
            runtime.spawn(read.clone());
            ahead.push_back(ReadAhead { extent, start, end, read, _counted: counted });
            if ahead.len() > READ_AHEAD_SPANS {
                ahead.pop_front();
            }
        }
    }
}
