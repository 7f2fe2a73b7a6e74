//! Copy (re-replication): a segment is closed to pushes, then paged through whole, every map and
//! attempt, in the order a Fetch serves them, for [`crate::copier`] to push to another server.

use tern_proto::ServerId;

use super::{FetchPage, SegmentId, ShuffleError, Shuffles};

impl Shuffles {
    /// Closes a segment to pushes, for a copy of it to another server: from now on it holds
    /// exactly what the copy will. Its partition has moved on, so only a writer that has not
    /// seen that yet pushes here, and it is refused as by a full segment (OutOfSpace), which
    /// moves it on too. Returns whether the segment is held: one that no push ever reached (its
    /// partition moved on before a map wrote there) is empty, which readers take a copy without
    /// it to mean too, so it is closed all the same and its copy has nothing to carry.
    pub(crate) async fn close_for_copy(&self, server: ServerId, id: SegmentId) -> Result<bool, ShuffleError> {
        let segment = {
            let mut map = self.map.lock();
            if map.freed.contains(&id.shuffle) {
                return Err(ShuffleError::NotHeld { segment: id, server });
            }
            match map.get(id) {
                Some(segment) => segment,
                None => {
                    map.closed_unheld.insert(id);
                    return Ok(false);
                }
            }
        };
        // After any append straight to NVMe under way (it indexes its batch when its write is
        // done): a closed segment's extents hold no batch its index lacks.
        let _turn = segment.nvme_appends.lock().await;
        segment.state.lock().closed = true;
        Ok(true)
    }

    /// A page of every batch the segment holds, of every map and attempt, in the order a Fetch
    /// serves them (by map and attempt, each in push order), from `cursor`: what a copy of the
    /// segment pushes to its target, so the target's index is the same.
    pub(crate) async fn copy_page(
        &self,
        server: ServerId,
        id: SegmentId,
        cursor: u32,
        max_bytes: u32,
    ) -> Result<FetchPage, ShuffleError> {
        self.page_of(server, id, cursor, max_bytes, &|_, _| true).await
    }
}
