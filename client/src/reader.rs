//! File reader: streams a sealed file's blocks in order with bounded read-ahead, or reads any
//! range. A block whose server cannot be reached is checked with the metadata server, so a lost
//! server shows as `DataLost` naming the file rather than as a network error.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use tern_proto::frame::Frame;
use tern_proto::v1::{BlockLocation, FileInfo};
use tokio::task::JoinHandle;

use crate::error::{Error, ErrorKind, Result};
use crate::Client;

/// Reads one sealed file.
pub struct FileReader {
    client: Client,
    info: FileInfo,
    blocks: Vec<BlockLocation>,
    block_size: u64,
    /// Index of the next block to hand out by [`FileReader::next_chunk`].
    next: usize,
    ahead: VecDeque<JoinHandle<Result<Bytes>>>,
}

impl FileReader {
    pub(crate) fn new(
        client: Client,
        info: FileInfo,
        blocks: Vec<BlockLocation>,
        block_size: u32,
    ) -> Result<FileReader> {
        let listed: u64 = blocks.iter().map(|b| b.length as u64).sum();
        if listed != info.length || block_size == 0 {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("open {}: blocks hold {listed} bytes but the file has {}", info.path, info.length),
            ));
        }
        Ok(FileReader { client, info, blocks, block_size: block_size as u64, next: 0, ahead: VecDeque::new() })
    }

    pub fn info(&self) -> &FileInfo {
        &self.info
    }

    pub fn len(&self) -> u64 {
        self.info.length
    }

    pub fn is_empty(&self) -> bool {
        self.info.length == 0
    }

    /// The next block's bytes in file order, `None` at the end. Keeps up to `read_ahead_blocks`
    /// blocks in flight.
    pub async fn next_chunk(&mut self) -> Result<Option<Bytes>> {
        let window = self.client.options().read_ahead_blocks.max(1);
        while self.ahead.len() < window && self.next + self.ahead.len() < self.blocks.len() {
            let block = self.blocks[self.next + self.ahead.len()].clone();
            self.ahead.push_back(tokio::spawn(fetch(self.client.clone(), self.info.path.clone(), block, 0, None)));
        }
        let Some(task) = self.ahead.pop_front() else {
            return Ok(None);
        };
        self.next += 1;
        let chunk =
            task.await.map_err(|e| Error::new(ErrorKind::Internal, format!("read {}: {e}", self.info.path)))??;
        Ok(Some(chunk))
    }

    /// The whole file (which must fit in memory; use `next_chunk` to stream).
    pub async fn read_to_end(mut self) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(self.info.length as usize);
        while let Some(chunk) = self.next_chunk().await? {
            out.extend_from_slice(&chunk);
        }
        Ok(out)
    }

    /// `len` bytes from `offset`, which must lie within the file.
    pub async fn read_at(&self, offset: u64, len: usize) -> Result<Bytes> {
        let end = offset.checked_add(len as u64).filter(|end| *end <= self.info.length).ok_or_else(|| {
            Error::invalid(format!(
                "read {}: range {offset}+{len} is beyond the end ({} bytes)",
                self.info.path, self.info.length
            ))
        })?;
        let first = (offset / self.block_size) as usize;
        let within = offset % self.block_size;
        // A range inside one block (the common small read) is fetched on the caller's task:
        // spawning it would add a task hop, a cross-core wakeup here, to every small read.
        if let Some(block) = self.blocks.get(first).filter(|b| len > 0 && within + len as u64 <= b.length as u64) {
            return fetch(self.client.clone(), self.info.path.clone(), block.clone(), within as u32, Some(len as u32))
                .await;
        }
        let mut parts = Vec::new();
        let mut at = offset;
        for block in &self.blocks[first..] {
            if at >= end {
                break;
            }
            let within = at % self.block_size;
            let take = (block.length as u64 - within).min(end - at);
            parts.push(tokio::spawn(fetch(
                self.client.clone(),
                self.info.path.clone(),
                block.clone(),
                within as u32,
                Some(take as u32),
            )));
            at += take;
        }
        if parts.len() == 1 {
            return join(parts.pop().expect("one part"), &self.info.path).await;
        }
        let mut out = BytesMut::with_capacity(len);
        for part in parts {
            out.extend_from_slice(&join(part, &self.info.path).await?);
        }
        Ok(out.freeze())
    }
}

async fn join(task: JoinHandle<Result<Bytes>>, path: &str) -> Result<Bytes> {
    task.await.map_err(|e| Error::new(ErrorKind::Internal, format!("read {path}: {e}")))?
}

/// Reads `len` bytes (default: the rest of the block) of one block from `offset`.
async fn fetch(client: Client, path: String, block: BlockLocation, offset: u32, len: Option<u32>) -> Result<Bytes> {
    let len = len.unwrap_or(block.length - offset);
    let result = async {
        let access = client.access(crate::auth::job_of(&path), &block.grant).await?;
        let conn = client.block_connection(block.server_id, &block.address, &block.quic_address).await?;
        conn.call_as(&access, |id| Frame::read(id, block.block_id, offset, len)).await
    }
    .await;
    match result {
        Ok(reply) if reply.payload.len() == len as usize => Ok(reply.payload),
        Ok(reply) => Err(Error::new(
            ErrorKind::Corrupt,
            format!("read {path}: block {} returned {} bytes, expected {len}", block.block_id, reply.payload.len()),
        )),
        Err(e) if matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::NotFound) => {
            Err(diagnose(&client, &path, &block, e).await)
        }
        Err(e) => Err(e.context(format_args!("read {path}: block {}", block.block_id))),
    }
}

/// Asks the metadata server whether the block's server is dead: then the data is lost, and the
/// error says so and names the file. Otherwise the original error stands.
async fn diagnose(client: &Client, path: &str, block: &BlockLocation, error: Error) -> Error {
    let lost = match client.stat_with_blocks(path, true).await {
        Ok((_, blocks)) => blocks.iter().any(|(b, alive)| b.block_id == block.block_id && !alive),
        Err(e) if e.kind() == ErrorKind::DataLost => true,
        Err(_) => false,
    };
    // A server that restarted lost its DRAM blocks: the block is gone even though a server answers.
    if lost || error.kind() == ErrorKind::NotFound {
        return Error::new(
            ErrorKind::DataLost,
            format!(
                "read {path}: block {} on storage server {} ({}) is lost: {}",
                block.block_id,
                block.server_id,
                block.address,
                error.message()
            ),
        );
    }
    error.context(format_args!("read {path}: block {}", block.block_id))
}
