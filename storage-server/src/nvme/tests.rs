//! The NVMe tier under both io engines: every test runs once per engine.

use std::sync::Arc;

use tern_common::ByteSize;
use tern_proto::{BlockId, ErrorKind, ServerId, Tier};

use super::device;
use super::engine::{self, IoEngineChoice};
use super::NvmeTier;
use crate::block_table::StoreError;

const BS: u32 = 64 << 10;
const ENGINES: [IoEngineChoice; 2] = [IoEngineChoice::Uring, IoEngineChoice::Psync];

/// A tier of `blocks` blocks in a fresh file on the real disk (tmpfs refuses O_DIRECT).
async fn tier(choice: IoEngineChoice, blocks: u64) -> (tempfile::TempDir, Arc<NvmeTier>) {
    let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let path = dir.path().join("tier.nvme");
    let device = device::open(&path, Some(ByteSize(blocks * u64::from(BS)))).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), blocks * u64::from(BS), "preallocated");
    let engine = engine::choose(choice, Arc::new(device.file), device.align as usize).await.unwrap();
    assert_eq!(engine.name(), choice.to_string());
    let store = NvmeTier::new(engine, device.size, device.align, BS).unwrap();
    (dir, Arc::new(store))
}

fn id(block: u64) -> BlockId {
    BlockId::from_wire(block)
}

async fn write(store: &Arc<NvmeTier>, block: u64, offset: u32, data: &[u8]) -> Result<u32, StoreError> {
    let mut pending = store.begin_write(id(block), offset, data.len() as u32)?;
    pending.payload().copy_from_slice(data);
    pending.commit(crc32c::crc32c(data)).await
}

async fn read(store: &NvmeTier, block: u64, offset: u32, len: u32) -> Result<Vec<u8>, StoreError> {
    store.read(id(block), offset, len, ServerId::from_wire(9)).await.map(|read| read.data.to_vec())
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[tokio::test]
async fn odd_appends_round_trip() {
    for choice in ENGINES {
        let (_dir, store) = tier(choice, 4).await;
        // Appends at unaligned offsets and lengths, crossing unit boundaries; written first, then
        // read (misaligned reads of never-written regions would succeed and hide bugs).
        let lengths = [1usize, 510, 3, 4096, 7000, 513, 1];
        let mut all = Vec::new();
        for (i, len) in lengths.iter().enumerate() {
            let data = pattern(*len, i as u8 + 1);
            let held = write(&store, 5, all.len() as u32, &data).await.unwrap();
            all.extend_from_slice(&data);
            assert_eq!(held as usize, all.len(), "{choice}");
        }
        assert_eq!(read(&store, 5, 0, all.len() as u32).await.unwrap(), all, "{choice}");
        // Reads carry the crc of what they read, from the crcs kept since the appends.
        for (offset, len) in [(0, all.len()), (1, 600), (0, 4096)] {
            let read = store.read(id(5), offset as u32, len as u32, ServerId::from_wire(9)).await.unwrap();
            assert_eq!(read.crc, crc32c::crc32c(&all[offset..offset + len]), "{choice} {offset}+{len}");
        }
        for (offset, len) in [(0, 1), (1, 600), (511, 2), (4000, 5000), (all.len() - 1, 1), (513, 0)] {
            let got = read(&store, 5, offset as u32, len as u32).await.unwrap();
            assert_eq!(got, all[offset..offset + len], "{choice} {offset}+{len}");
        }
        // A whole block, and a second block in another slot, keep their bytes apart.
        let full = pattern(BS as usize, 9);
        write(&store, 6, 0, &full).await.unwrap();
        assert_eq!(read(&store, 6, 0, BS).await.unwrap(), full, "{choice}");
        assert_eq!(read(&store, 5, 0, all.len() as u32).await.unwrap(), all, "{choice}");
        let usage = store.usage();
        assert_eq!((usage.used_blocks, usage.used_bytes), (2, (all.len() + full.len()) as u64), "{choice}");
        assert_eq!(usage.capacity_blocks, 4);
    }
}

#[tokio::test]
async fn append_rules_and_errors_match_dram() {
    for choice in ENGINES {
        let (_dir, store) = tier(choice, 2).await;
        write(&store, 1, 0, b"hello").await.unwrap();
        let err = store.begin_write(id(1), 0, 1).map(|_| ()).unwrap_err();
        assert_eq!(err, StoreError::NotAppend { block: id(1), offset: 0, held: 5 });
        let err = store.begin_write(id(1), 5, BS).map(|_| ()).unwrap_err();
        assert!(matches!(err, StoreError::PastBlockEnd { .. }) && err.kind() == ErrorKind::Invalid, "{err}");
        let held = store.begin_write(id(1), 5, 1).unwrap();
        assert_eq!(
            store.begin_write(id(1), 5, 1).map(|_| ()).unwrap_err(),
            StoreError::WriteInProgress { block: id(1) }
        );
        drop(held);
        let err = read(&store, 1, 3, 3).await.unwrap_err();
        assert_eq!(err, StoreError::ReadOutOfRange { block: id(1), offset: 3, len: 3, held: 5 });
        let err = read(&store, 7, 0, 1).await.unwrap_err();
        assert_eq!(
            (err.kind(), err.to_string()),
            (ErrorKind::NotFound, "block 7 is not held by storage server 9".into())
        );
        // An abandoned first write leaves no block behind.
        drop(store.begin_write(id(2), 0, 4).unwrap());
        assert!(matches!(read(&store, 2, 0, 0).await, Err(StoreError::NotHeld { .. })));
        assert_eq!(write(&store, 1, 5, b" world").await.unwrap(), 11);
        assert_eq!(read(&store, 1, 0, 11).await.unwrap(), b"hello world");
    }
}

#[tokio::test]
async fn bad_checksums_store_nothing() {
    for choice in ENGINES {
        let (_dir, store) = tier(choice, 2).await;
        let mut pending = store.begin_write(id(3), 0, 4).unwrap();
        pending.payload().copy_from_slice(b"abcd");
        let err = pending.commit(crc32c::crc32c(b"abcx")).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
        assert!(err.to_string().contains("block 3 range 0+4"), "{err}");
        assert!(matches!(read(&store, 3, 0, 0).await, Err(StoreError::NotHeld { .. })));
        assert_eq!(store.usage().used_blocks, 0);
        write(&store, 3, 0, b"abcd").await.unwrap();
        let mut pending = store.begin_write(id(3), 4, 2).unwrap();
        pending.payload().copy_from_slice(b"ef");
        assert!(pending.commit(0).await.is_err());
        assert_eq!(read(&store, 3, 0, 4).await.unwrap(), b"abcd");
        assert_eq!(write(&store, 3, 4, b"ef").await.unwrap(), 6);
        assert_eq!(read(&store, 3, 0, 6).await.unwrap(), b"abcdef");
    }
}

#[tokio::test]
async fn a_full_tier_refuses_then_reuses_freed_slots() {
    for choice in ENGINES {
        let (_dir, store) = tier(choice, 2).await;
        write(&store, 1, 0, &pattern(1000, 1)).await.unwrap();
        write(&store, 2, 0, &pattern(3000, 2)).await.unwrap();
        let err = write(&store, 3, 0, b"x").await.unwrap_err();
        assert_eq!(err, StoreError::Full { tier: Tier::Nvme, in_use: 2, total: 2 });
        assert_eq!(err.kind(), ErrorKind::OutOfSpace);
        // A read holding the bytes survives a free; the slot is reused afterwards.
        let held = store.read(id(1), 10, 20, ServerId::from_wire(0)).await.unwrap().data;
        assert_eq!(store.free(&[id(1), id(99)]), 1);
        assert!(read(&store, 1, 0, 1).await.is_err());
        let fresh = pattern(5000, 7);
        write(&store, 3, 0, &fresh).await.unwrap();
        assert_eq!(held[..], pattern(1000, 1)[10..30]);
        assert_eq!(read(&store, 3, 0, 5000).await.unwrap(), fresh);
        assert_eq!(store.clear(), 2);
        assert_eq!(store.usage().used_blocks, 0);
        assert_eq!(store.usage().used_bytes, 0);
    }
}

#[tokio::test]
async fn concurrent_ops_on_many_blocks() {
    for choice in ENGINES {
        let (_dir, store) = tier(choice, 16).await;
        let mut tasks = Vec::new();
        for id in 0..16u64 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let data = pattern(BS as usize - id as usize * 100, id as u8);
                write(&store, id, 0, &data).await.unwrap();
                assert_eq!(read(&store, id, 0, data.len() as u32).await.unwrap(), data);
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(store.usage().used_blocks, 16, "{choice}");
    }
}

#[test]
fn device_sizes_are_checked() {
    let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let path = dir.path().join("new.nvme");
    let err = device::open(&path, None).err().unwrap().to_string();
    assert!(err.contains("nvme-size is required"), "{err}");
    device::open(&path, Some(ByteSize::mib(1))).unwrap();
    // An existing file brings its size.
    let device = device::open(&path, None).unwrap();
    assert_eq!(device.size, 1 << 20);
    assert!(device.align.is_power_of_two() && device.align >= 512, "{}", device.align);
    if std::path::Path::new("/dev/shm").is_dir() {
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        // Kernels before 6.6 refuse O_DIRECT on tmpfs: then the error must say so.
        if let Err(err) = device::open(&shm.path().join("t.nvme"), Some(ByteSize::mib(1))) {
            assert!(err.to_string().contains("refuses O_DIRECT"), "{err}");
        }
    }
}
