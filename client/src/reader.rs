//! File reader: streams a sealed file's blocks in order with bounded read-ahead, or reads any
//! range. A block with several copies is read from the first (the metadata server lists copies on
//! live servers first) and from the next when a copy fails (its server unreachable or restarted,
//! a crc mismatch). A block none of whose copies can be read is checked with the metadata server,
//! so a lost server shows as `DataLost` naming the file rather than as a network error.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use tern_proto::v1::FileInfo;
use tern_proto::BlockId;
use tokio::task::JoinHandle;

use crate::error::{Error, ErrorKind, Result};
use crate::location::BlockCopy;
use crate::Client;

/// Reads one sealed file.
pub struct FileReader {
    client: Client,
    info: FileInfo,
    /// Each block's copies, in the order to try them.
    blocks: Vec<Vec<BlockCopy>>,
    block_size: u64,
    /// Index of the next block to hand out by [`FileReader::next_chunk`].
    next: usize,
    ahead: VecDeque<JoinHandle<Result<Bytes>>>,
}

impl FileReader {
    pub(crate) fn new(client: Client, info: FileInfo, blocks: Vec<BlockCopy>, block_size: u32) -> Result<FileReader> {
        let replicas = info.replicas.max(1) as usize;
        if !blocks.len().is_multiple_of(replicas) {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("open {}: {} block locations for {replicas} copies of each block", info.path, blocks.len()),
            ));
        }
        let blocks: Vec<Vec<BlockCopy>> = blocks.chunks(replicas).map(<[BlockCopy]>::to_vec).collect();
        let listed: u64 = blocks.iter().map(|copies| copies[0].length as u64).sum();
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
        if let Some(block) = self.blocks.get(first).filter(|b| len > 0 && within + len as u64 <= b[0].length as u64) {
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
            let take = (block[0].length as u64 - within).min(end - at);
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

/// Reads `len` bytes (default: the rest of the block) of one block from `offset`, from its first
/// copy that answers with good data.
async fn fetch(client: Client, path: String, copies: Vec<BlockCopy>, offset: u32, len: Option<u32>) -> Result<Bytes> {
    let mut failures: Vec<(BlockCopy, Error)> = Vec::with_capacity(copies.len());
    for block in copies {
        match fetch_copy(&client, &path, &block, offset, len).await {
            Ok(bytes) => return Ok(bytes),
            Err(e) => {
                tracing::debug!("read {path}: block {} on {} failed: {e}", block.block, block.holder.address);
                failures.push((block, e));
            }
        }
    }
    // Unreachable or missing everywhere: ask whether the data is lost. Any other failure (a crc
    // mismatch, a bad reply) is reported as it is, for the last copy tried.
    if failures.iter().all(|(_, e)| matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::NotFound)) {
        return Err(diagnose(&client, &path, failures).await);
    }
    let (block, e) = failures
        .into_iter()
        .rev()
        .find(|(_, e)| !matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::NotFound))
        .expect("a failure that is not Unavailable or NotFound");
    Err(e.context(format_args!("read {path}: block {}", block.block)))
}

/// One copy's read.
async fn fetch_copy(client: &Client, path: &str, block: &BlockCopy, offset: u32, len: Option<u32>) -> Result<Bytes> {
    let len = len.unwrap_or(block.length - offset);
    let access = client.access(crate::auth::job_of(path), &block.grant).await?;
    let conn = client.block_connection(&block.holder).await?;
    let data = conn.read(&access, block.block.get(), offset, len).await?;
    if data.len() != len as usize {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("read {path}: block {} returned {} bytes, expected {len}", block.block, data.len()),
        ));
    }
    Ok(data)
}

/// Asks the metadata server whether the servers of a block's copies are dead: when every copy is
/// gone the data is lost, and the error says so and names the file. Otherwise the last error
/// stands.
async fn diagnose(client: &Client, path: &str, failures: Vec<(BlockCopy, Error)>) -> Error {
    let dead: Option<Vec<BlockId>> = match client.stat_with_blocks(path, true).await {
        Ok((_, blocks)) => {
            Some(blocks.iter().filter(|(_, alive)| !alive).map(|(b, _)| BlockId::from_wire(b.block_id)).collect())
        }
        // Every copy of some block is gone.
        Err(e) if e.kind() == ErrorKind::DataLost => None,
        Err(_) => Some(Vec::new()),
    };
    // A server that restarted lost its DRAM blocks: the block is gone even though a server answers.
    let lost = |copy: &BlockCopy, error: &Error| {
        error.kind() == ErrorKind::NotFound || dead.as_ref().is_none_or(|dead| dead.contains(&copy.block))
    };
    if failures.iter().all(|(block, error)| lost(block, error)) {
        let each: Vec<String> = failures
            .iter()
            .map(|(block, error)| {
                format!(
                    "block {} on storage server {} ({}) is lost: {}",
                    block.block,
                    block.holder.id,
                    block.holder.address,
                    error.message()
                )
            })
            .collect();
        let what = if each.len() == 1 { each.concat() } else { format!("every copy is lost: {}", each.join("; ")) };
        return Error::new(ErrorKind::DataLost, format!("read {path}: {what}"));
    }
    let (block, error) = failures.into_iter().next_back().expect("at least one copy was tried");
    error.context(format_args!("read {path}: block {}", block.block))
}
