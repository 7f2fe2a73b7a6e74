//! Page serving: which batches make the page a Fetch (or a copy) asks for, where their bytes
//! are ([`PageLayout`]: one view of the arena, gathered, or read from NVMe), and the check of
//! every batch against the crc taken when it was stored.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use tern_proto::shuffle::{BatchHeader, FetchRequest, BATCH_HEADER_LEN, FETCH_DONE};
use tern_proto::{MapAttempt, MapIndex, ServerId};

use super::segment::{Extent, Segment, SegmentState};
use super::{FetchPage, PageLayout, SegmentId, ShuffleError, Shuffles};
use crate::nvme::NvmeExtent;

/// Most bytes one Fetch reply carries, whatever the request asks for (a single batch may make it
/// up to [`BATCH_HEADER_LEN`] bytes more than the block size, which clients must accept).
pub const MAX_FETCH_PAGE_BYTES: u32 = 16 << 20;

/// Where a batch of a page is read from.
enum Stored {
    /// A view of the arena: the bytes themselves, `[offset, offset + len)` of DRAM extent
    /// `extent` of the segment.
    View { bytes: Bytes, extent: u32, offset: u32 },
    /// `[offset, offset + len)` of an NVMe extent, read outside the segment's lock.
    Disk(Arc<NvmeExtent>, u32, u32),
}

impl Shuffles {
    /// The page of `request`'s batches that starts at its cursor.
    pub(crate) async fn fetch(
        &self,
        server: ServerId,
        id: SegmentId,
        request: &FetchRequest,
    ) -> Result<FetchPage, ShuffleError> {
        let want = |map, attempt| request.attempt_of(map) == Some(attempt);
        self.page_of(server, id, request.cursor, request.max_bytes, &want).await
    }

    /// The page of the batches `want` names that starts at `cursor`.
    pub(super) async fn page_of(
        &self,
        server: ServerId,
        id: SegmentId,
        cursor: u32,
        max_bytes: u32,
        want: &(dyn Fn(MapIndex, MapAttempt) -> bool + Sync),
    ) -> Result<FetchPage, ShuffleError> {
        let segment = self.map.lock().get(id).ok_or(ShuffleError::NotHeld { segment: id, server })?;
        let limit = max_bytes.min(MAX_FETCH_PAGE_BYTES) as usize;
        let (page, span, layout, more, next) = {
            let state = segment.state.lock();
            let (page, more) = state.page(id, want, cursor, limit)?;
            let span = state.span_of(&page);
            let on_disk = page.iter().any(|(_, stored)| matches!(stored, Stored::Disk(..)));
            let layout = match (&span, on_disk) {
                (Some(_), _) => PageLayout::Arena,
                (None, true) => PageLayout::Disk,
                (None, false) => PageLayout::Gathered,
            };
            // A reader of NVMe: the page it asks for next, as NVMe spans to read ahead. (Readers
            // of DRAM alone pay nothing for it.)
            let next = match more && on_disk {
                true => state.page(id, want, cursor + page.len() as u32, limit)?.0,
                false => Vec::new(),
            };
            (page, span, layout, more, disk_spans(&next))
        };
        self.read_ahead(&segment, next);
        // Read outside the segment's lock, so pushes to it do not wait; the views and extents
        // keep their slots intact meanwhile, even if the shuffle is freed.
        let page = read_extents(id, &segment, page).await?;
        drop(segment);
        let batches = u32::try_from(page.len()).expect("a page holds fewer batches than its segment");
        let next_cursor = if more { cursor + batches } else { FETCH_DONE };
        // Each view is a stored `[header | bytes]`, exactly as the reply carries it. Batches that
        // lie back to back in one DRAM extent (one batch, the usual page for large batches, or a
        // run of small ones) go out as one view of the arena, without a copy; others are gathered
        // into one buffer. Either way every batch is checked against the crc taken when it was
        // stored (the check at rest, which names the map to recompute), and that checked crc
        // extends the payload's crc with no second pass.
        let check = |header: &BatchHeader, bytes: &[u8]| {
            let actual = crc32c::crc32c(bytes);
            if actual != header.crc {
                return Err(ShuffleError::Corrupt {
                    segment: id,
                    map: header.map,
                    attempt: header.attempt,
                    expected: header.crc,
                    actual,
                });
            }
            Ok(actual)
        };
        if let Some(span) = span {
            let mut crc = 0;
            for (header, stored) in &page {
                let (encoded, bytes) = stored.split_at(BATCH_HEADER_LEN);
                crc = tern_proto::crc::combine(crc32c::crc32c_append(crc, encoded), check(header, bytes)?, bytes.len());
            }
            return Ok(FetchPage { payload: span, next_cursor, batches, crc, layout });
        }
        let size = page.iter().map(|(_, stored)| stored.len()).sum();
        let mut payload = BytesMut::with_capacity(size);
        let mut crc = 0;
        for (header, stored) in &page {
            let (encoded, bytes) = stored.split_at(BATCH_HEADER_LEN);
            crc = crc32c::crc32c_append(crc, encoded);
            payload.extend_from_slice(encoded);
            let start = payload.len();
            payload.extend_from_slice(bytes);
            // Checked over the copy, so what is sent is what was pushed.
            crc = tern_proto::crc::combine(crc, check(header, &payload[start..])?, bytes.len());
        }
        Ok(FetchPage { payload: payload.freeze(), next_cursor, batches, crc, layout })
    }
}

/// Per NVMe extent (by address) a page touches, the span its batches cover.
fn disk_spans(page: &[(BatchHeader, Stored)]) -> Vec<(Arc<NvmeExtent>, u32, u32)> {
    let mut spans: Vec<(Arc<NvmeExtent>, u32, u32)> = Vec::new();
    for (_, stored) in page {
        if let Stored::Disk(extent, offset, len) = stored {
            match spans.iter_mut().find(|(e, _, _)| Arc::ptr_eq(e, extent)) {
                Some((_, start, end)) => {
                    *start = (*start).min(*offset);
                    *end = (*end).max(offset + len);
                }
                None => spans.push((extent.clone(), *offset, offset + len)),
            }
        }
    }
    spans
}

/// The page's batches as bytes: views as they are, and each NVMe extent the page covers read
/// once (the span its batches cover), all at once, or taken from what was read ahead.
async fn read_extents(
    id: SegmentId,
    segment: &Segment,
    page: Vec<(BatchHeader, Stored)>,
) -> Result<Vec<(BatchHeader, Bytes)>, ShuffleError> {
    let spans = disk_spans(&page);
    let reads = spans.iter().map(|(extent, start, end)| {
        let ahead = segment.take_read_ahead(extent, *start, *end);
        async move {
            match ahead {
                // The span read ahead starts at or before this one.
                Some((from, read)) => read.await.map(|bytes| bytes.slice((start - from) as usize..)),
                None => extent.read(*start, end - start).await.map_err(|e| e.to_string()),
            }
        }
    });
    let read = futures::future::try_join_all(reads).await.map_err(|error| ShuffleError::Io {
        segment: id,
        op: "fetch",
        error,
    })?;
    Ok(page
        .into_iter()
        .map(|(header, stored)| match stored {
            Stored::View { bytes, .. } => (header, bytes),
            Stored::Disk(extent, offset, len) => {
                let at = spans.iter().position(|(e, _, _)| Arc::ptr_eq(e, &extent)).expect("every extent was read");
                let from = (offset - spans[at].1) as usize;
                (header, read[at].slice(from..from + len as usize))
            }
        })
        .collect())
}

impl SegmentState {
    /// The page's batches as one view of the arena, when they lie back to back in one DRAM
    /// extent: what a same-host or RDMA connection can lend whole.
    fn span_of(&self, page: &[(BatchHeader, Stored)]) -> Option<Bytes> {
        let Some((_, Stored::View { extent, offset: start, .. })) = page.first() else { return None };
        let mut end = *start;
        for (_, stored) in page {
            match stored {
                Stored::View { bytes, extent: e, offset } if e == extent && *offset == end => end += bytes.len() as u32,
                _ => return None,
            }
        }
        let Extent::Dram(slot) = &self.slots[*extent as usize] else { return None };
        Some(slot.view(*start, end - start))
    }

    /// The batches of the page `want` names from `cursor` (at most about `limit` bytes with their
    /// headers, and at least one), and whether more remain after them.
    fn page(
        &self,
        id: SegmentId,
        want: &(dyn Fn(MapIndex, MapAttempt) -> bool + Sync),
        cursor: u32,
        limit: usize,
    ) -> Result<(Vec<(BatchHeader, Stored)>, bool), ShuffleError> {
        let mut skip = u64::from(cursor);
        let mut page = Vec::new();
        let mut size = 0;
        for (&(map, attempt), batches) in &self.index {
            if !want(map, attempt) {
                continue;
            }
            let held = batches.len() as u64;
            if skip >= held {
                skip -= held;
                continue;
            }
            // `skip < held`, so it fits a usize.
            let rest = &batches[skip as usize..];
            skip = 0;
            for batch in rest {
                let bytes = BATCH_HEADER_LEN + batch.len as usize;
                if !page.is_empty() && size + bytes > limit {
                    return Ok((page, true));
                }
                size += bytes;
                let header = BatchHeader { map, attempt, len: batch.len, crc: batch.crc };
                let (offset, len) = (batch.offset - BATCH_HEADER_LEN as u32, batch.len + BATCH_HEADER_LEN as u32);
                let stored = match &self.slots[batch.slot as usize] {
                    Extent::Dram(slot) => Stored::View { bytes: slot.view(offset, len), extent: batch.slot, offset },
                    Extent::Nvme(extent) => Stored::Disk(extent.clone(), offset, len),
                };
                page.push((header, stored));
            }
        }
        if skip > 0 {
            let held = u64::from(cursor) - skip;
            return Err(ShuffleError::CursorPastEnd { segment: id, cursor, held });
        }
        Ok((page, false))
    }
}
