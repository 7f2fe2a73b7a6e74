//! Streaming file writer: cuts the byte stream into blocks and pipelines them to the storage
//! servers, at most `writes_in_flight` at once, asking the metadata server for block locations in
//! growing batches so a large file costs few RPCs.
//!
//! With 2 replicas each block goes to both of its servers at once and counts as written only when
//! both acknowledged it. A copy that fails fails the write (and the writer, dropped, deletes the
//! file): the caller learns at once that the file does not have the copies it asked for, rather
//! than a file that silently holds one. Re-placing the failed copy elsewhere is left to a retry
//! of the whole write.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use tern_common::Backoff;
use tern_proto::v1::{self as pb, FileInfo};
use tern_proto::FileId;
use tokio::task::JoinHandle;

use crate::error::{Error, ErrorKind, Result};
use crate::location::BlockCopy;
use crate::Client;

/// Blocks asked for by a writer's first allocation; later batches double up to the client's
/// `max_allocate_batch`. Small, because seal frees what a short file did not use.
const FIRST_ALLOCATE_BATCH: u32 = 2;

/// Allocation attempts while the cluster answers `Unavailable`, and the backoff between them
/// (about 6 s in all before jitter, at least half that after: longer than a few heartbeats, so
/// freed space has time to come back).
const ALLOCATE_ATTEMPTS: u32 = 8;
const ALLOCATE_BACKOFF_START: std::time::Duration = std::time::Duration::from_millis(50);
const ALLOCATE_BACKOFF_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// Writes one new file. Call [`FileWriter::close`] to seal it, or [`FileWriter::abort`] to give it
/// up after a failure; a writer dropped unclosed gives its file up in the background.
pub struct FileWriter {
    client: Client,
    path: String,
    /// The job owning the file ("" outside `/jobs`): whose token its block frames carry.
    job: String,
    file_id: FileId,
    block_size: usize,
    buffer: BytesMut,
    /// Copies of each block (1 or 2).
    replicas: usize,
    /// Allocated locations not yet written, grouped by block (`replicas` entries each).
    spare: VecDeque<BlockCopy>,
    next_batch: u32,
    /// Blocks allocated so far (not counting copies).
    allocated: u64,
    /// Blocks the whole file needs, when the caller said (see [`FileWriter::expect_len`]).
    expected_blocks: Option<u64>,
    in_flight: FuturesUnordered<JoinHandle<Result<()>>>,
    written: u64,
    closed: bool,
    /// Renews the writer lease while the writer lives (see `renew_lease`); stopped on close and
    /// on drop. A writer whose process dies stops renewing, and the metadata server deletes
    /// the file when the lease lapses.
    lease: Option<tokio::task::AbortHandle>,
}

impl FileWriter {
    pub(crate) fn new(
        client: Client,
        path: String,
        job: String,
        file_id: FileId,
        block_size: u32,
        replicas: u32,
        writer_lease: std::time::Duration,
    ) -> FileWriter {
        let lease = (!writer_lease.is_zero())
            .then(|| tokio::spawn(renew_lease(client.clone(), file_id, writer_lease)).abort_handle());
        FileWriter {
            client,
            path,
            job,
            file_id,
            block_size: block_size as usize,
            replicas: replicas.max(1) as usize,
            buffer: BytesMut::new(),
            spare: VecDeque::new(),
            next_batch: FIRST_ALLOCATE_BATCH,
            allocated: 0,
            expected_blocks: None,
            in_flight: FuturesUnordered::new(),
            written: 0,
            closed: false,
            lease,
        }
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// Bytes accepted so far.
    pub fn len(&self) -> u64 {
        self.written
    }

    pub fn is_empty(&self) -> bool {
        self.written == 0
    }

    /// Says how long the whole file will be, so allocation never asks for blocks beyond it: the
    /// doubling batches otherwise hold up to twice a large file's blocks until the seal frees
    /// them, which matters when the cluster is nearly full (and doubly with 2 replicas). A file
    /// that turns out longer simply allocates more.
    pub fn expect_len(&mut self, bytes: u64) {
        self.expected_blocks = Some(bytes.div_ceil(self.block_size as u64));
    }

    /// Appends `data` (copied into the current block buffer).
    pub async fn write(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            if self.buffer.capacity() == 0 {
                self.buffer.reserve(self.block_size);
            }
            let take = (self.block_size - self.buffer.len()).min(data.len());
            self.buffer.extend_from_slice(&data[..take]);
            self.written += take as u64;
            data = &data[take..];
            if self.buffer.len() == self.block_size {
                let block = self.buffer.split().freeze();
                self.send_block(block).await?;
            }
        }
        Ok(())
    }

    /// Appends `data` without copying whole blocks of it.
    pub async fn write_bytes(&mut self, mut data: Bytes) -> Result<()> {
        if !self.buffer.is_empty() {
            let fill = (self.block_size - self.buffer.len()).min(data.len());
            self.write(&data.split_to(fill)).await?;
        }
        while data.len() >= self.block_size {
            let block = data.split_to(self.block_size);
            self.written += block.len() as u64;
            self.send_block(block).await?;
        }
        self.write(&data).await
    }

    async fn send_block(&mut self, data: Bytes) -> Result<()> {
        // Bound memory: wait for a slot before taking another block's worth in flight.
        while self.in_flight.len() >= self.client.options().writes_in_flight.max(1) {
            self.finish_one().await?;
        }
        let client = self.client.clone();
        let mut copies = Vec::with_capacity(self.replicas);
        for location in self.next_copies().await? {
            let access = client.access(&self.job, &location.grant).await?;
            copies.push((location, access));
        }
        let path = self.path.clone();
        self.in_flight.push(tokio::spawn(async move {
            // Every copy at once; the payload is shared, not copied.
            let writes = copies.into_iter().map(|(location, access)| {
                let (client, path, data) = (client.clone(), path.clone(), data.clone());
                async move {
                    let written = match client.block_connection(&location.holder).await {
                        Ok(conn) => conn.write(&access, location.block.get(), 0, data).await,
                        Err(e) => Err(e),
                    };
                    // The file's writer fails (a retry writes it anew), but its new blocks must
                    // not be placed where this client cannot reach.
                    if let Err(e) = &written {
                        client.report_if_unreachable(&location.holder.address, e).await;
                    }
                    written.map(|_| ()).map_err(|e| {
                        e.context(format_args!(
                            "write {path}: block {} on storage server {} ({})",
                            location.block, location.holder.id, location.holder.address
                        ))
                    })
                }
            });
            futures::future::try_join_all(writes).await.map(|_| ())
        }));
        Ok(())
    }

    async fn finish_one(&mut self) -> Result<()> {
        match self.in_flight.next().await {
            Some(joined) => joined.map_err(|e| Error::new(ErrorKind::Internal, format!("write {}: {e}", self.path)))?,
            None => Ok(()),
        }
    }

    /// Where the next block's copies go.
    async fn next_copies(&mut self) -> Result<Vec<BlockCopy>> {
        if self.spare.is_empty() {
            let reply = self.allocate().await?;
            if !reply.blocks.len().is_multiple_of(self.replicas) {
                return Err(Error::new(
                    ErrorKind::Internal,
                    format!(
                        "write {}: {} block locations allocated, not a whole number of {}-copy blocks",
                        self.path,
                        reply.blocks.len(),
                        self.replicas
                    ),
                ));
            }
            self.allocated += (reply.blocks.len() / self.replicas) as u64;
            self.spare.extend(reply.blocks.into_iter().map(BlockCopy::from));
            let max = self.client.options().max_allocate_batch.clamp(1, tern_proto::MAX_ALLOCATE_BLOCKS);
            self.next_batch = (self.next_batch * 2).min(max);
        }
        if self.spare.is_empty() {
            return Err(Error::new(ErrorKind::Internal, format!("write {}: no block allocated", self.path)));
        }
        Ok(self.spare.drain(..self.replicas).collect())
    }

    /// Asks for the next batch of block locations, retrying (a bounded number of times, with
    /// backoff) while the cluster is `Unavailable`, e.g. while freed space is on its way back.
    /// A batch refused by the tenant's quota is asked again as the one block needed now: the
    /// batch asks ahead, and the quota may still hold that one.
    async fn allocate(&self) -> Result<pb::AllocateBlocksResponse> {
        let mut backoff = Backoff::new(ALLOCATE_BACKOFF_START, ALLOCATE_BACKOFF_MAX).attempts(ALLOCATE_ATTEMPTS);
        let mut count = match self.expected_blocks {
            Some(expected) => u64::from(self.next_batch).min(expected.saturating_sub(self.allocated).max(1)) as u32,
            None => self.next_batch,
        };
        loop {
            let request = pb::AllocateBlocksRequest {
                file_id: self.file_id.get(),
                count,
                client_host: self.client.inner.host.clone(),
            };
            match self.client.metadata().allocate_blocks(request).await {
                Ok(reply) => return Ok(reply.into_inner()),
                Err(status) if count > 1 && ErrorKind::of_status(&status) == ErrorKind::QuotaExceeded => {
                    count = 1;
                    continue;
                }
                Err(status) => {
                    let e = Error::from(status).context(format_args!("write {}", self.path));
                    if e.kind() != ErrorKind::Unavailable {
                        return Err(e);
                    }
                    let Some(delay) = backoff.next() else { return Err(e) };
                    tracing::debug!("allocation attempt {} failed, retrying in {delay:?}: {e}", backoff.failures());
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// Writes what is buffered, waits for every block, and seals the file. Blocks allocated but
    /// unused are freed by the seal. A close that fails gives the file up before it returns (see
    /// [`FileWriter::abort`]), so nothing is left behind.
    pub async fn close(mut self) -> Result<FileInfo> {
        let result = self.seal().await;
        if let Some(lease) = self.lease.take() {
            lease.abort();
        }
        if result.is_err() && !self.closed {
            self.closed = true;
            if let Err(e) = abort_file(&self.client, self.file_id, std::mem::take(&mut self.in_flight)).await {
                tracing::warn!("could not give up unfinished file {}: {e}", self.path);
            }
        }
        result
    }

    /// Gives the file up (after a failed write, or when the caller changes its mind): once the
    /// block writes in flight have ended (each within its deadline), the metadata server deletes
    /// the unsealed file and frees its blocks at once, so the path can be written again. Returns
    /// whether there was a file to give up (one deleted meanwhile is not an error).
    pub async fn abort(mut self) -> Result<bool> {
        if let Some(lease) = self.lease.take() {
            lease.abort();
        }
        self.closed = true;
        abort_file(&self.client, self.file_id, std::mem::take(&mut self.in_flight))
            .await
            .map_err(|e| e.context(format_args!("abort the write of {}", self.path)))
    }

    async fn seal(&mut self) -> Result<FileInfo> {
        if !self.buffer.is_empty() {
            // Only this block remains: allocate no more than it needs.
            self.next_batch = 1;
            let last = self.buffer.split().freeze();
            self.send_block(last).await?;
        }
        while !self.in_flight.is_empty() {
            self.finish_one().await?;
        }
        let reply = self
            .client
            .metadata()
            .seal(pb::SealRequest { file_id: self.file_id.get(), length: self.written })
            .await
            .map_err(|s| Error::from(s).context(format_args!("close {}", self.path)))?
            .into_inner();
        self.closed = true;
        reply.info.ok_or_else(|| Error::new(ErrorKind::Internal, format!("close {}: reply without info", self.path)))
    }
}

impl Drop for FileWriter {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.abort();
        }
        if self.closed {
            return;
        }
        // An abandoned write leaves no debris: its file is given up (its blocks are freed). In
        // the background, so only while the runtime lives: a process that exits at once leaves
        // it to the writer lease, which is why a failed write should call `abort` instead.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (client, file_id, path) = (self.client.clone(), self.file_id, std::mem::take(&mut self.path));
            let in_flight = std::mem::take(&mut self.in_flight);
            runtime.spawn(async move {
                if let Err(e) = abort_file(&client, file_id, in_flight).await {
                    tracing::warn!("could not give up unfinished file {path}: {e}");
                }
            });
        }
    }
}

/// Waits for a writer's block writes in flight to end (whatever their outcome), then asks the
/// metadata server to delete the unsealed file; whether there was one.
async fn abort_file(
    client: &Client,
    file_id: FileId,
    mut in_flight: FuturesUnordered<JoinHandle<Result<()>>>,
) -> Result<bool> {
    while in_flight.next().await.is_some() {}
    let reply = client.metadata().abort(pb::AbortRequest { file_id: file_id.get() }).await?.into_inner();
    Ok(reply.aborted)
}

/// Renews a writer's lease every third of it until aborted. A renewal that fails is retried at
/// the next tick: the lease has two more in it.
async fn renew_lease(client: Client, file_id: FileId, lease: std::time::Duration) {
    let period = lease / 3;
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let mut request = tonic::Request::new(pb::RenewWriterRequest { file_id: file_id.get() });
        request.set_timeout(crate::renewal_deadline(lease));
        match client.metadata().renew_writer(request).await {
            Ok(_) => {}
            // Sealed or deleted: nothing left to keep.
            Err(status) if matches!(ErrorKind::of_status(&status), ErrorKind::NotFound | ErrorKind::Invalid) => return,
            Err(status) => tracing::warn!("renewing the writer lease of file {file_id}: {}", status.message()),
        }
    }
}
