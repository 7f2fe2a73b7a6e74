//! Power-loss tests of the NVMe tier: its data file and its block index both on a [`SimFs`] that
//! records its state after every file operation, while concurrent writers append to blocks and
//! free some (slots are reused). At each point, a power cut in each of [`Keep::battery`]'s modes
//! leaves a disk on which the tier must open, listing every block at least at the length its last
//! answered append published, no block whose free was answered, only lengths some append wrote,
//! and, for every block listed, the bytes that were written (so an index entry that names data a
//! power cut took back fails, as it would without the data's fdatasync). Then a new block is
//! written, the power cut again, and the tier must open with it and with every block it had taken
//! back.
//!
//! Which fsyncs these catch, each removed in turn: see the commit that added this file.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use tern_common::durable::sim::{Keep, Point, SimFs};
use tern_common::durable::{Fs, FsFile, Open};
use tern_proto::{BlockId, ServerId};

use crate::nvme::aligned::AlignedBuf;
use crate::nvme::engine::{IoEngine, IoFuture, KeepAlive};
use crate::nvme::NvmeTier;

const BS: u32 = 4096;
const ALIGN: u64 = 512;
const SLOTS: u64 = 10;
const INDEX: &str = "/nvme/tier.index";
const DATA: &str = "/nvme/tier";

/// The tier's data file on the simulated disk: what is not synced when the power goes is lost.
pub(crate) struct SimEngine(pub(crate) Box<dyn FsFile>);

impl IoEngine for SimEngine {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn read_at(&self, mut buf: AlignedBuf, offset: u64) -> IoFuture {
        let read = self.0.read_at(&mut buf, offset);
        Box::pin(async move { read.map(|()| buf) })
    }

    fn write_at(&self, buf: AlignedBuf, offset: u64, keep: KeepAlive) -> IoFuture {
        let written = self.0.write_at(&buf, offset);
        drop(keep);
        Box::pin(async move { written.map(|()| buf) })
    }

    fn sync_data(&self) -> std::io::Result<()> {
        self.0.sync_data()
    }
}

fn open(fs: &SimFs) -> anyhow::Result<NvmeTier> {
    let data = fs.open(Path::new(DATA), Open::Create)?;
    if data.size()? == 0 {
        // As device::open makes a new file: sized, then file and directory synced.
        data.set_len(SLOTS * u64::from(BS))?;
        data.sync_all()?;
        fs.sync_dir(Path::new("/nvme"))?;
    }
    NvmeTier::new(Arc::new(SimEngine(data)), SLOTS * u64::from(BS), ALIGN, BS)?
        .with_index_in(fs.shared(), Path::new(INDEX))
}

async fn append(tier: &NvmeTier, block: u64, offset: u32, len: u32) -> u32 {
    let mut write = tier.begin_write(BlockId::from_wire(block), offset, len).unwrap();
    write.payload().fill(block as u8);
    let crc = crc32c::crc32c(write.payload());
    write.commit(crc).await.unwrap()
}

/// The blocks a tier lists, with their lengths; each block's bytes must be the ones its appends
/// wrote (every byte of block b is `b as u8`).
async fn listed(tier: &NvmeTier) -> BTreeMap<u64, u32> {
    let mut blocks = BTreeMap::new();
    for id in tier.ids() {
        let len = tier.read(id, 0, 0, ServerId::from_wire(1)).await.unwrap().held;
        let read = tier.read(id, 0, len, ServerId::from_wire(1)).await.unwrap();
        // The index keeps no crcs: a block taken back at start is checksummed as it is read.
        assert_eq!(read.crc, crc32c::crc32c(&read.data), "block {}", id.get());
        let bytes = read.data;
        let wrong = bytes.iter().position(|&b| b != id.get() as u8);
        assert!(
            wrong.is_none(),
            "block {} is listed at {len} bytes, but byte {wrong:?} is not what was written",
            id.get()
        );
        blocks.insert(id.get(), len);
    }
    blocks
}

/// What the writers were told, with the operations done by then.
#[derive(Default)]
struct Answers {
    /// (ops, block, length published).
    appends: Vec<(u64, u64, u32)>,
    /// (ops, block): frees begun (from then on the block may be gone).
    freeing: Vec<(u64, u64)>,
    /// (ops, block): frees answered (from then on the block must be gone).
    frees: Vec<(u64, u64)>,
}

impl Answers {
    fn check(&self, point: &Point, keep: Keep, blocks: &BTreeMap<u64, u32>) {
        let at = |what: &str| format!("crash after operation {} ({keep:?}): {what}", point.ops);
        let before = |list: &[(u64, u64)]| -> Vec<u64> {
            list.iter().filter(|&&(ops, _)| ops <= point.ops).map(|&(_, b)| b).collect()
        };
        let (freeing, freed) = (before(&self.freeing), before(&self.frees));
        for &(ops, block, len) in &self.appends {
            if ops <= point.ops && !freeing.contains(&block) {
                let found = blocks.get(&block).copied();
                assert!(
                    found >= Some(len),
                    "{}",
                    at(&format!("block {block} answered at {len} bytes, found {found:?}"))
                );
            }
        }
        for (block, len) in blocks {
            assert!(!freed.contains(block), "{}", at(&format!("block {block} was freed, yet it is listed")));
            assert!(
                self.appends.iter().any(|&(_, b, l)| b == *block && l == *len),
                "{}",
                at(&format!("block {block} listed at {len} bytes, a length no append published"))
            );
        }
    }
}

#[tokio::test]
async fn answered_appends_and_frees_survive_a_power_cut_at_every_point() {
    let fs = SimFs::new();
    fs.record();
    let tier = Arc::new(open(&fs).unwrap());
    let answers = Arc::new(Mutex::new(Answers::default()));
    // Three writers, each appending to its blocks in three pieces and freeing every other block,
    // so slots are freed and reused.
    let mut writers = Vec::new();
    for task in 0..3u64 {
        let (fs, tier, answers) = (fs.clone(), tier.clone(), answers.clone());
        writers.push(tokio::spawn(async move {
            for i in 0..4u64 {
                let block = 1 + task * 100 + i;
                let mut offset = 0;
                for len in [100, 900, 1] {
                    offset = append(&tier, block, offset, len).await;
                    answers.lock().unwrap().appends.push((fs.ops(), block, offset));
                }
                if i % 2 == 0 {
                    answers.lock().unwrap().freeing.push((fs.ops(), block));
                    assert_eq!(tier.free(&[BlockId::from_wire(block)]), 1);
                    answers.lock().unwrap().frees.push((fs.ops(), block));
                }
                tokio::task::yield_now().await;
            }
        }));
    }
    for writer in writers {
        writer.await.unwrap();
    }
    let answers = std::mem::take(&mut *answers.lock().unwrap());
    assert_eq!((answers.appends.len(), answers.frees.len()), (36, 6));
    let mut checked = 0;
    for point in fs.points() {
        for keep in Keep::battery() {
            let crashed = point.crash_with(keep);
            let tier = open(&crashed).unwrap_or_else(|e| {
                panic!("crash after operation {} ({keep:?}): the tier does not open: {e:#}", point.ops)
            });
            let blocks = listed(&tier).await;
            answers.check(&point, keep, &blocks);
            // The tier goes on: a new block, answered, then another power cut.
            let len = append(&tier, 999, 0, 10).await;
            drop(tier);
            let again = listed(&open(&crashed.crash()).unwrap()).await;
            let mut expected = blocks.clone();
            expected.insert(999, len);
            assert_eq!(again, expected, "crash after operation {} ({keep:?}), a new block, crash", point.ops);
            checked += 1;
        }
    }
    assert!(checked > 50 * Keep::battery().len(), "only {checked} crashes");
}
