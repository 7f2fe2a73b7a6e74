//! The storage server's store: a thin router over its tiers. It holds the DRAM tier
//! ([`crate::dram`]), the NVMe tier if the server has one ([`crate::nvme`]) and the shuffle
//! segments ([`crate::shuffle`]), routes an op to the tier its block id names, and keeps what is
//! the server's rather than a tier's: its id and how data frames are checked. The tiers do not
//! know it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tern_proto::shuffle::{FetchRequest, PushHeader};
use tern_proto::{BlockId, ServerId, ShuffleId, Tier};

use crate::arena::Arena;
use crate::block_table::StoreError;
use crate::dram::{DramTier, DramWrite};
use crate::nvme::NvmeTier;
use crate::shuffle::{FetchPage, SegmentId, ShuffleBytes, ShuffleError, Shuffles};

/// Most shuffle slots one DRAM block write moves to NVMe to find room (each frees a slot once the
/// Fetches reading it let go, so one nearly always does).
const DRAM_ROOM_MOVES: usize = 4;

/// The tier an op on a block goes to.
pub enum TierRef<'a> {
    Dram(&'a DramTier),
    Nvme(&'a Arc<NvmeTier>),
}

/// What a storage server holds, as it reports it when it registers.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Inventory {
    /// Blocks of both tiers.
    pub blocks: Vec<BlockId>,
    /// Shuffles it holds segments of.
    pub shuffles: Vec<ShuffleId>,
    pub segments: Vec<SegmentId>,
}

/// Every tier of one storage server, and the server's id and authority.
pub struct BlockStore {
    dram: DramTier,
    nvme: Option<Arc<NvmeTier>>,
    shuffles: Shuffles,
    /// The id the metadata server gave this server, named in not-held errors, as the wire
    /// carries it: 0 (the wire's "no server") until the first registration.
    server_id: AtomicU64,
    /// Job tokens and grants: how data frames are checked.
    authority: crate::auth::Authority,
}

impl BlockStore {
    /// A store of `floor(dram / block_size)` DRAM blocks in a fresh arena (not prefaulted, small
    /// pages): for tests and tools. Servers map their arena at start-up and cut it once
    /// registered.
    pub fn new(block_size: u32, dram: u64) -> anyhow::Result<BlockStore> {
        Ok(BlockStore::with_dram(DramTier::new(block_size, dram)?))
    }

    /// Cuts `arena` into blocks of `block_size`.
    pub(crate) fn with_arena(arena: Arena, block_size: u32) -> anyhow::Result<BlockStore> {
        Ok(BlockStore::with_dram(DramTier::with_arena(arena, block_size)?))
    }

    fn with_dram(dram: DramTier) -> BlockStore {
        BlockStore {
            shuffles: Shuffles::new(dram.slots()),
            dram,
            nvme: None,
            server_id: AtomicU64::new(0),
            authority: crate::auth::Authority::default(),
        }
    }

    /// Adds an NVMe tier (cut into this store's block size).
    pub fn with_nvme(mut self, nvme: NvmeTier) -> BlockStore {
        self.nvme = Some(Arc::new(nvme));
        self
    }

    pub fn block_size(&self) -> u32 {
        self.dram.block_size()
    }

    pub fn dram(&self) -> &DramTier {
        &self.dram
    }

    /// The NVMe tier, if any.
    pub fn nvme(&self) -> Option<&Arc<NvmeTier>> {
        self.nvme.as_ref()
    }

    /// The tier an op on `block` goes to, or why there is none.
    pub fn tier(&self, block: BlockId) -> Result<TierRef<'_>, StoreError> {
        match block.tier() {
            Tier::Dram => Ok(TierRef::Dram(&self.dram)),
            Tier::Nvme => match &self.nvme {
                Some(nvme) => Ok(TierRef::Nvme(nvme)),
                None => Err(StoreError::NoNvmeTier { block, server: self.server_id() }),
            },
        }
    }

    pub fn server_id(&self) -> ServerId {
        ServerId::from_wire(self.server_id.load(Ordering::Relaxed))
    }

    pub fn set_server_id(&self, id: ServerId) {
        self.server_id.store(id.get(), Ordering::Relaxed);
    }

    /// How data frames are checked: nothing for a store served on its own (tests, tools); a
    /// daemon requires tokens from the start and gets the key when it registers.
    pub fn authority(&self) -> &crate::auth::Authority {
        &self.authority
    }

    /// Drops the listed blocks of either tier (ids not held are skipped); returns how many were
    /// held.
    pub fn free(&self, ids: impl IntoIterator<Item = BlockId>) -> usize {
        let (nvme, dram): (Vec<BlockId>, Vec<BlockId>) = ids.into_iter().partition(|id| id.tier() == Tier::Nvme);
        let nvme_freed = self.nvme.as_ref().map_or(0, |tier| tier.free(&nvme));
        nvme_freed + self.dram.free(&dram)
    }

    /// What this server holds, for its inventory.
    pub fn inventory(&self) -> Inventory {
        let mut blocks = self.dram.ids();
        if let Some(nvme) = &self.nvme {
            blocks.extend(nvme.ids());
        }
        Inventory { blocks, shuffles: self.shuffles.ids(), segments: self.shuffles.held() }
    }

    /// Takes back the shuffle segments sealed in the NVMe shuffle index at `path` (see
    /// [`crate::shuffle::durable`]), and keeps sealing idle ones there; returns how many came back.
    /// Called once, before the server serves anyone; nothing without an NVMe tier.
    pub async fn restore_shuffles(&self, path: &std::path::Path) -> anyhow::Result<usize> {
        self.restore_shuffles_in(tern_common::durable::RealFs::shared(), path).await
    }

    /// [`BlockStore::restore_shuffles`] with the index on the filesystem `fs`.
    pub async fn restore_shuffles_in(
        &self,
        fs: Arc<dyn tern_common::durable::Fs>,
        path: &std::path::Path,
    ) -> anyhow::Result<usize> {
        match &self.nvme {
            Some(nvme) => self.shuffles.restore(nvme, fs, path).await,
            None => Ok(0),
        }
    }

    /// The mover's durability pass (see [`crate::shuffle`]): segments idle since the last pass
    /// are made durable; returns how many were sealed.
    pub async fn make_idle_shuffles_durable(&self) -> usize {
        match &self.nvme {
            Some(nvme) => self.shuffles.make_idle_durable(self.dram.slots(), nvme).await,
            None => 0,
        }
    }

    /// Drops every block and shuffle segment: the cluster no longer counts them, so they must
    /// never be served again. Returns how many blocks and how many segments were held.
    pub fn clear(&self) -> (usize, usize) {
        let nvme = self.nvme.as_ref().map_or(0, |tier| tier.clear());
        (self.dram.clear() + nvme, self.shuffles.clear())
    }

    /// Begins a write to DRAM block `block` as [`DramTier::begin_write`] does. A new block that
    /// finds every DRAM slot taken while shuffle data that may live on NVMe holds some gets room
    /// first: such slots move down to NVMe now (at most [`DRAM_ROOM_MOVES`] of them) rather than
    /// the write be refused with NVMe free. Refused `Full` only when nothing can move.
    pub async fn begin_dram_write(&self, block: BlockId, offset: u32, len: u32) -> Result<DramWrite<'_>, StoreError> {
        let mut moves = 0;
        loop {
            match self.dram.begin_write(block, offset, len) {
                Err(full @ StoreError::Full { .. }) => {
                    let nvme = self.nvme.as_deref().filter(|_| moves < DRAM_ROOM_MOVES);
                    let moved = match nvme {
                        Some(nvme) => self.shuffles.make_dram_room(self.dram.slots(), nvme).await,
                        None => false,
                    };
                    if !moved {
                        let shuffle = self.shuffles.bytes();
                        tracing::info!(
                            "write of dram block {} refused: {full}; {} file blocks and {} of shuffle data in \
                             DRAM, no shuffle slot there could move to NVMe ({moves} moved for it)",
                            block.get(),
                            self.dram.ids().len(),
                            tern_common::ByteSize(shuffle.dram),
                        );
                        return Err(full);
                    }
                    moves += 1;
                    tracing::info!(
                        "dram tier full: moved a shuffle slot to NVMe to make room for dram block {}",
                        block.get()
                    );
                }
                Ok(write) => {
                    // A block's first write takes its slot.
                    if offset == 0 {
                        self.shuffles.dram_block_taken(self.dram.slots());
                    }
                    return Ok(write);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Appends a pushed batch to a shuffle segment, creating the segment on its first push;
    /// returns the segment's size in bytes afterwards. See [`crate::shuffle`].
    pub async fn push(&self, segment: SegmentId, from: PushHeader, batch: &[u8]) -> Result<u64, ShuffleError> {
        let nvme = self.nvme.as_deref();
        self.shuffles.push(self.dram.slots(), nvme, self.server_id(), segment, from, batch).await
    }

    /// A page of a segment's batches from the committed attempts `request` lists.
    pub async fn fetch(&self, segment: SegmentId, request: &FetchRequest) -> Result<FetchPage, ShuffleError> {
        self.shuffles.fetch(self.server_id(), segment, request).await
    }

    /// Closes a segment to pushes before it is copied to another server (see
    /// [`crate::copier`]); returns whether it is held (one no push reached is empty).
    pub async fn close_segment_for_copy(&self, segment: SegmentId) -> Result<bool, ShuffleError> {
        self.shuffles.close_for_copy(self.server_id(), segment).await
    }

    /// A page of every batch a segment holds, from `cursor`, for its copy.
    pub async fn copy_page(&self, segment: SegmentId, cursor: u32, max_bytes: u32) -> Result<FetchPage, ShuffleError> {
        self.shuffles.copy_page(self.server_id(), segment, cursor, max_bytes).await
    }

    /// Drops single segments; returns how many were held.
    pub fn free_segments(&self, segments: impl IntoIterator<Item = SegmentId>) -> usize {
        self.shuffles.free_segments(segments)
    }

    /// Moves shuffle data from DRAM to NVMe as [`crate::shuffle`] says (nothing without an NVMe
    /// tier); returns how many slots moved.
    pub async fn move_shuffles_down(&self) -> usize {
        match &self.nvme {
            Some(nvme) => self.shuffles.move_down(self.dram.slots(), nvme).await,
            None => 0,
        }
    }

    /// The shuffle mover of a server with an NVMe tier: runs until the task is aborted.
    pub async fn run_shuffle_mover(self: Arc<BlockStore>) {
        // Past the high watermark, pushes wake it; the tick catches what they did not.
        const TICK: std::time::Duration = std::time::Duration::from_millis(200);
        let mut last_pass = tokio::time::Instant::now();
        loop {
            self.shuffles.mover_woken(TICK).await;
            self.move_shuffles_down().await;
            // Once a tick, however often pushes wake it: "idle" means no batch for a tick.
            if last_pass.elapsed() >= TICK {
                last_pass = tokio::time::Instant::now();
                self.make_idle_shuffles_durable().await;
            }
        }
    }

    /// Shuffle bytes held in each tier.
    pub fn shuffle_bytes(&self) -> ShuffleBytes {
        self.shuffles.bytes()
    }

    /// Each shuffle's bytes per tier (for the tenants' quotas).
    pub fn shuffle_usage(&self) -> Vec<tern_proto::v1::ShuffleUsage> {
        self.shuffles.usage()
    }

    /// Keeps new batches of the listed shuffles off the tiers their tenants' quotas close.
    pub fn set_quota_stops(&self, stops: &[tern_proto::v1::QuotaStop]) {
        self.shuffles.set_quota_stops(stops);
    }

    /// Drops every segment of the listed shuffles (ids not held are skipped), and refuses later
    /// pushes to them; returns how many segments were held.
    pub fn free_shuffles(&self, ids: impl IntoIterator<Item = ShuffleId>) -> usize {
        self.shuffles.free(ids)
    }

    /// Shuffle segments held.
    pub fn shuffle_segments(&self) -> usize {
        self.shuffles.segments()
    }

    #[cfg(test)]
    pub(crate) fn shuffles(&self) -> &Shuffles {
        &self.shuffles
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_table::Usage;

    const BS: u32 = 4096;

    fn write(store: &BlockStore, block: BlockId, data: &[u8]) -> u32 {
        let mut pending = store.dram().begin_write(block, 0, data.len() as u32).unwrap();
        pending.buf().copy_from_slice(data);
        pending.commit(crc32c::crc32c(data)).unwrap()
    }

    #[test]
    fn clear_drops_every_block() {
        let store = BlockStore::new(BS, 4 * BS as u64).unwrap();
        for id in 0..4 {
            write(&store, BlockId::from_wire(id), b"x");
        }
        assert_eq!(store.clear(), (4, 0));
        assert_eq!(store.dram().usage().used_blocks, 0);
        assert_eq!(store.dram().usage().used_bytes, 0);
        assert!(matches!(
            store.dram().read(BlockId::from_wire(0), 0, 1, ServerId::from_wire(0)),
            Err(StoreError::NotHeld { .. })
        ));
    }

    #[test]
    fn ops_go_to_the_tier_their_block_names() {
        let store = BlockStore::new(BS, 4 * BS as u64).unwrap();
        store.set_server_id(ServerId::from_wire(7));
        let dram = BlockId::new(Tier::Dram, 3);
        let nvme = BlockId::new(Tier::Nvme, 3);
        assert!(matches!(store.tier(dram), Ok(TierRef::Dram(_))));
        let err = store.tier(nvme).err().unwrap();
        assert_eq!(err, StoreError::NoNvmeTier { block: nvme, server: ServerId::from_wire(7) });
        assert!(err.to_string().contains(&format!("block {} is an NVMe block", nvme.get())), "{err}");
        write(&store, dram, b"x");
        // A free names blocks of either tier; those of a tier the server lacks are not held.
        assert_eq!(store.free([nvme, dram]), 1);
        let usage = store.dram().usage();
        assert_eq!(usage, Usage { capacity_bytes: 4 * BS as u64, used_bytes: 0, capacity_blocks: 4, used_blocks: 0 });
    }
}
