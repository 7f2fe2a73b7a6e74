//! Shuffle segments across a restart: those sealed wholly on NVMe come back byte for byte, those
//! with a part in DRAM do not, and a power cut at any file operation (on a [`SimFs`], as the
//! block index's tests do) never brings back a segment without a batch that was acknowledged,
//! nor one whose shuffle was freed.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use tern_common::durable::sim::{Keep, SimFs};
use tern_common::durable::{Fs, Open};
use tern_common::ByteSize;
use tern_proto::shuffle::{batches, FetchRequest, FETCH_DONE};
use tern_proto::{PartitionIndex, ShuffleId, StorageClass};

use super::durable::ShuffleIndex;
use super::test_wire::{pushed_by, wanted, written_by};
use super::{SegmentId, ShuffleError};
use crate::nvme::engine::{self, IoEngineChoice};
use crate::nvme::index::power_loss::SimEngine;
use crate::nvme::index::BlockIndex;
use crate::nvme::{device, NvmeTier};
use crate::store::BlockStore;

const BS: u32 = 4096;
/// Four batches (each behind its 16-byte header) fill a slot but for 32 bytes.
const BATCH: usize = 1000;

fn seg(shuffle: u64, partition: u32) -> SegmentId {
    SegmentId { shuffle: ShuffleId::from_wire(shuffle), partition: PartitionIndex::from_wire(partition), index: 0 }
}

fn data(id: SegmentId, n: u32) -> Vec<u8> {
    (0..BATCH)
        .map(|i| (i as u64 * 7 + id.shuffle.get() * 131 + u64::from(id.partition.get()) * 31 + u64::from(n)) as u8)
        .collect()
}

/// Pushes batch `n` of `id` (map `n % 3`).
async fn push(store: &BlockStore, id: SegmentId, class: StorageClass, n: u32) -> Result<u64, ShuffleError> {
    store.push(id, pushed_by(n % 3, 0, class), &data(id, n)).await
}

/// Every batch of maps 0..3 in `id`, as (map, bytes), each checked against its crc; `None` if
/// the server does not hold it.
async fn fetch_all(store: &BlockStore, id: SegmentId) -> Option<Vec<(u32, Vec<u8>)>> {
    let (mut cursor, mut all) = (0, Vec::new());
    while cursor != FETCH_DONE {
        let request = FetchRequest { cursor, max_bytes: 3000, maps: wanted(&[(0, 0), (1, 0), (2, 0)]) };
        let page = match store.fetch(id, &request).await {
            Err(ShuffleError::NotHeld { .. }) => return None,
            page => page.unwrap(),
        };
        for batch in batches(page.payload.clone()) {
            let (header, bytes) = batch.unwrap();
            assert_eq!(header.crc, crc32c::crc32c(&bytes));
            all.push((written_by(&header).0, bytes.to_vec()));
        }
        cursor = page.next_cursor;
    }
    Some(all)
}

/// What a segment holds after pushes `0..n`, in the order a fetch returns them.
fn expected(id: SegmentId, n: u32) -> Vec<(u32, Vec<u8>)> {
    let mut want: Vec<(u32, Vec<u8>)> = (0..n).map(|k| (k % 3, data(id, k))).collect();
    want.sort_by_key(|(map, _)| *map);
    want
}

/// A store on the real O_DIRECT file under `dir`, its block and shuffle indexes beside it.
async fn open_real(dir: &Path, dram_blocks: u64, nvme_blocks: u64) -> BlockStore {
    let path = dir.join("tier.nvme");
    let device = device::open(&path, Some(ByteSize(nvme_blocks * u64::from(BS)))).unwrap();
    let engine = engine::choose(IoEngineChoice::Psync, Arc::new(device.file), device.align as usize).await.unwrap();
    let nvme =
        NvmeTier::new(engine, device.size, device.align, BS).unwrap().with_index(&BlockIndex::path_for(&path)).unwrap();
    let store = BlockStore::new(BS, dram_blocks * u64::from(BS)).unwrap().with_nvme(nvme);
    store.restore_shuffles(&ShuffleIndex::path_for(&path)).await.unwrap();
    store
}

/// Two passes of the mover's durability upkeep: the first sees what is there, the second finds
/// it idle. Returns how many segments the second sealed.
async fn settle(store: &BlockStore) -> usize {
    store.make_idle_shuffles_durable().await;
    store.make_idle_shuffles_durable().await
}

#[tokio::test]
async fn segments_wholly_on_nvme_come_back_after_a_restart_and_the_rest_do_not() {
    let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let (whole, dram, any, half) = (seg(1, 0), seg(2, 0), seg(3, 0), seg(1, 1));
    {
        let store = open_real(dir.path(), 16, 16).await;
        // 10 batches: two full slots and one open, all moved down once idle.
        for n in 0..10 {
            push(&store, whole, StorageClass::Nvme, n).await.unwrap();
        }
        for n in 0..3 {
            push(&store, dram, StorageClass::Dram, n).await.unwrap();
            push(&store, any, StorageClass::Any, n).await.unwrap();
            push(&store, half, StorageClass::Nvme, n).await.unwrap();
        }
        assert_eq!(settle(&store).await, 2, "the two nvme segments, once idle; dram and any stay in DRAM");
        assert_eq!(store.shuffle_bytes().nvme, 13 * (BATCH as u64 + 16));
        assert_eq!(settle(&store).await, 0, "nothing changed");
        // One more batch: `half` is unsealed before it goes in, and it stays in DRAM.
        push(&store, half, StorageClass::Nvme, 3).await.unwrap();
        assert_eq!(store.dram().usage().used_blocks, 3);
        assert_eq!(fetch_all(&store, whole).await.unwrap(), expected(whole, 10));
        // The process ends (what was not synced would be lost in a power cut; see below).
    }
    let store = open_real(dir.path(), 16, 16).await;
    assert_eq!(store.inventory().segments, vec![whole]);
    assert_eq!(store.inventory().shuffles, vec![ShuffleId::from_wire(1)]);
    assert_eq!(fetch_all(&store, whole).await.unwrap(), expected(whole, 10), "byte for byte, in the same order");
    for lost in [dram, any, half] {
        assert_eq!(fetch_all(&store, lost).await, None, "{lost} had a part in DRAM");
    }
    assert_eq!(store.nvme().unwrap().usage().used_blocks, 3, "the extents of `half` were freed");
    assert_eq!(store.shuffle_bytes().nvme, 10 * (BATCH as u64 + 16));
    // It goes on: a push to the restored segment unseals it, and the next seal covers it.
    push(&store, whole, StorageClass::Nvme, 10).await.unwrap();
    assert_eq!(settle(&store).await, 1);
    drop(store);
    let store = open_real(dir.path(), 16, 16).await;
    assert_eq!(fetch_all(&store, whole).await.unwrap(), expected(whole, 11));
    // Freed, it is gone for good, and so are its slots.
    assert_eq!(store.free_shuffles([ShuffleId::from_wire(1)]), 1);
    drop(store);
    let store = open_real(dir.path(), 16, 16).await;
    assert_eq!(store.inventory().segments, vec![]);
    assert_eq!(store.nvme().unwrap().usage().used_blocks, 0);
}

#[tokio::test]
async fn a_damaged_extent_or_entry_drops_its_segment() {
    let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let (a, b) = (seg(5, 0), seg(5, 1));
    {
        let store = open_real(dir.path(), 16, 16).await;
        for n in 0..6 {
            push(&store, a, StorageClass::Nvme, n).await.unwrap();
            push(&store, b, StorageClass::Nvme, n).await.unwrap();
        }
        assert_eq!(settle(&store).await, 2);
        // Damage: a byte of one of b's entries (its crc no longer matches).
        let index = store.shuffles().index.get().unwrap().clone();
        let slot = store.shuffles().map.lock().get(b).unwrap().state.lock().nvme_slots().last().unwrap();
        index.damage(&[0xff], 64 * (slot as u64 + 1) + 26);
    }
    let store = open_real(dir.path(), 16, 16).await;
    assert_eq!(store.inventory().segments, vec![a]);
    assert_eq!(fetch_all(&store, a).await.unwrap(), expected(a, 6));
}

#[tokio::test]
async fn a_segment_whose_dram_and_nvme_appends_interleaved_is_not_sealed() {
    let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let id = seg(7, 0);
    let big = vec![9u8; 3500];
    {
        let store = open_real(dir.path(), 4, 16).await;
        push(&store, id, StorageClass::Nvme, 0).await.unwrap();
        // DRAM fills with a dram shuffle: past the high watermark, a batch that needs a new slot
        // goes to a new NVMe extent, and the next one still fits the open DRAM slot.
        for partition in 0..3 {
            push(&store, seg(8, partition), StorageClass::Dram, 0).await.unwrap();
        }
        store.push(id, pushed_by(0, 0, StorageClass::Nvme), &big).await.unwrap();
        push(&store, id, StorageClass::Nvme, 3).await.unwrap();
        assert_eq!(store.nvme().unwrap().usage().used_blocks, 1, "the big batch went straight to NVMe");
        let order: Vec<Vec<u8>> = fetch_all(&store, id).await.unwrap().into_iter().map(|(_, b)| b).collect();
        assert_eq!(order, [data(id, 0), big.clone(), data(id, 3)], "arrival order");
        // Idle, it moves down whole, but its extents' order is not its arrival order.
        assert_eq!(settle(&store).await, 0);
        assert_eq!(store.shuffle_bytes().dram, 3 * (BATCH as u64 + 16), "only the dram shuffle is in DRAM");
    }
    let store = open_real(dir.path(), 4, 16).await;
    assert_eq!(fetch_all(&store, id).await, None);
}

/// A store on the simulated disk `fs`: the tier's data file and both indexes.
async fn open_sim(fs: &SimFs) -> anyhow::Result<BlockStore> {
    const SLOTS: u64 = 12;
    let data = fs.open(Path::new("/nvme/tier"), Open::Create)?;
    if data.size()? == 0 {
        data.set_len(SLOTS * u64::from(BS))?;
        data.sync_all()?;
        fs.sync_dir(Path::new("/nvme"))?;
    }
    let nvme = NvmeTier::new(Arc::new(SimEngine(data)), SLOTS * u64::from(BS), 512, BS)?
        .with_index_in(fs.shared(), Path::new("/nvme/tier.index"))?;
    let store = BlockStore::new(BS, 8 * u64::from(BS))?.with_nvme(nvme);
    store.restore_shuffles_in(fs.shared(), Path::new("/nvme/tier.shuffles")).await?;
    Ok(store)
}

/// What the test was told, by the file operations done by then.
#[derive(Default)]
struct Answers {
    /// Per segment: (ops, batches pushed) after each push was acknowledged.
    pushed: BTreeMap<(u64, u32), Vec<(u64, u32)>>,
    /// Per segment: ops before each push began.
    pushing: BTreeMap<(u64, u32), Vec<u64>>,
    /// Per segment: ops after each pass that left it sealed.
    sealed: BTreeMap<(u64, u32), Vec<u64>>,
    /// (ops before the free began, ops after it was answered, shuffle).
    frees: Vec<(u64, u64, u64)>,
}

fn key(id: SegmentId) -> (u64, u32) {
    (id.shuffle.get(), id.partition.get())
}

impl Answers {
    /// Notes which of `ids` are sealed now, at `ops`.
    fn note_seals(&mut self, store: &BlockStore, ops: u64, ids: &[SegmentId]) {
        for &id in ids {
            if store.shuffles().map.lock().get(id).is_some_and(|s| s.state.lock().sealed.is_some()) {
                self.sealed.entry(key(id)).or_default().push(ops);
            }
        }
    }

    /// Checks what came back after a power cut at `point` against what had been answered.
    async fn check(&self, point: u64, keep: Keep, store: &BlockStore) {
        let at = |what: String| format!("crash after operation {point} ({keep:?}): {what}");
        for (&(shuffle, partition), pushes) in &self.pushed {
            let id = seg(shuffle, partition);
            let acked = pushes.iter().filter(|&&(ops, _)| ops <= point).map(|&(_, n)| n).max().unwrap_or(0);
            let started = self.pushing[&(shuffle, partition)].iter().filter(|&&ops| ops <= point).count() as u32;
            let freeing = self.frees.iter().any(|&(begun, _, s)| s == shuffle && begun <= point);
            let freed = self.frees.iter().any(|&(_, answered, s)| s == shuffle && answered <= point);
            match fetch_all(store, id).await {
                Some(found) => {
                    assert!(!freed, "{}", at(format!("{id} is back, though its shuffle was freed")));
                    // Every acknowledged batch, and at most the one push under way.
                    let n = found.len() as u32;
                    assert!(
                        acked <= n && n <= started,
                        "{}",
                        at(format!("{id} is back with {n} batches, {acked} acknowledged"))
                    );
                    assert_eq!(found, expected(id, n), "{}", at(format!("{id}'s batches")));
                }
                None => {
                    // Lost is allowed unless a seal was answered with no push or free begun since.
                    let last_seal = self
                        .sealed
                        .get(&(shuffle, partition))
                        .and_then(|s| s.iter().filter(|&&ops| ops <= point).max());
                    if let Some(&sealed) = last_seal {
                        let pushed_since =
                            self.pushing[&(shuffle, partition)].iter().any(|&ops| ops >= sealed && ops <= point);
                        assert!(
                            pushed_since || freeing,
                            "{}",
                            at(format!("{id} was sealed at operation {sealed}, yet it is lost"))
                        );
                    }
                }
            }
        }
    }
}

#[tokio::test]
async fn a_power_cut_at_any_point_never_brings_back_a_segment_short_of_an_acknowledged_batch() {
    let fs = SimFs::new();
    fs.record();
    let store = open_sim(&fs).await.unwrap();
    let mut answers = Answers::default();
    let (x, y, z) = (seg(1, 0), seg(2, 0), seg(1, 1));
    let mut counts: BTreeMap<(u64, u32), u32> = BTreeMap::new();
    // Pushes, each idle pass seals; a push after a seal unseals; a freed shuffle goes.
    let script: &[&[SegmentId]] = &[&[x, x, x, x, x, y], &[], &[x, z], &[], &[y, y, z], &[], &[x]];
    for (step, pushes) in script.iter().enumerate() {
        for &id in *pushes {
            let n = counts.entry(key(id)).or_default();
            answers.pushing.entry(key(id)).or_default().push(fs.ops());
            push(&store, id, StorageClass::Nvme, *n).await.unwrap();
            *n += 1;
            answers.pushed.entry(key(id)).or_default().push((fs.ops(), *n));
        }
        if pushes.is_empty() {
            settle(&store).await;
            answers.note_seals(&store, fs.ops(), &[x, y, z]);
        }
        if step == 4 {
            let begun = fs.ops();
            assert_eq!(store.free_shuffles([ShuffleId::from_wire(2)]), 1);
            answers.frees.push((begun, fs.ops(), 2));
        }
    }
    settle(&store).await;
    answers.note_seals(&store, fs.ops(), &[x, y, z]);
    assert!(answers.sealed[&key(x)].len() >= 3, "x was sealed, unsealed and sealed again");
    let mut checked = 0;
    for point in fs.points() {
        for keep in Keep::battery() {
            let crashed = point.crash_with(keep);
            let store = open_sim(&crashed).await.unwrap_or_else(|e| {
                panic!("crash after operation {} ({keep:?}): the store does not open: {e:#}", point.ops)
            });
            answers.check(point.ops, keep, &store).await;
            checked += 1;
        }
    }
    assert!(checked > 20 * Keep::battery().len(), "only {checked} crashes");
}
