//! The DRAM tier's memory: one mapping, made once at start-up and never resized: anonymous, or,
//! to be shared read-only with clients on this host, a memfd.
//!
//! The arena hands out raw pointers only ([`memmap2::MmapRaw`]); the block store above it owns the
//! discipline that makes touching those bytes sound.

use std::os::fd::OwnedFd;

use anyhow::{bail, Context};
use memmap2::{Advice, MmapOptions, MmapRaw};

/// A memory mapping of a fixed size.
pub(crate) struct Arena {
    map: MmapRaw,
    /// The memfd behind a shared arena.
    memfd: Option<OwnedFd>,
}

impl Arena {
    /// Maps `len` bytes. With `huge_pages` the mapping is advised MADV_HUGEPAGE (a failure is
    /// logged, not fatal: the arena still works with small pages). With `prefault` every page is
    /// faulted in now, so first writes do not stall and a machine short of memory fails at once.
    pub(crate) fn map(len: u64, prefault: bool, huge_pages: bool) -> anyhow::Result<Arena> {
        Arena::map_with(len, prefault, huge_pages, false)
    }

    /// [`Arena::map`], on a memfd when `shared` (see [`Arena::memfd`]): its size sealed, so a
    /// client's mapping of it can never fault past a shrunk end.
    pub(crate) fn map_with(len: u64, prefault: bool, huge_pages: bool, shared: bool) -> anyhow::Result<Arena> {
        if len == 0 {
            bail!("cannot map an empty DRAM arena");
        }
        let len =
            usize::try_from(len).with_context(|| format!("a DRAM arena of {len} bytes exceeds the address space"))?;
        let mut options = MmapOptions::new();
        options.len(len);
        // MAP_POPULATE would fault the pages in before the huge-page advice could apply, leaving
        // the arena on small pages; with huge pages on, advise first and populate afterwards.
        if prefault && !huge_pages {
            options.populate();
        }
        let what = || format!("mapping a DRAM arena of {}", tern_common::ByteSize(len as u64));
        let (map, memfd): (MmapRaw, _) = if shared {
            use rustix::fs::{MemfdFlags, SealFlags};
            let fd = rustix::fs::memfd_create("tern-dram-arena", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
                .with_context(what)?;
            let file = std::fs::File::from(fd);
            file.set_len(len as u64).with_context(what)?;
            rustix::fs::fcntl_add_seals(&file, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
                .with_context(what)?;
            let map = options.map_raw(&file).with_context(what)?;
            (map, Some(OwnedFd::from(file)))
        } else {
            (options.map_anon().with_context(what)?.into(), None)
        };
        if huge_pages {
            if let Err(e) = map.advise(Advice::HugePage) {
                tracing::warn!("DRAM arena: transparent huge pages unavailable ({e}); using small pages");
            }
            if prefault {
                if let Err(e) = map.advise(Advice::PopulateWrite) {
                    tracing::warn!("DRAM arena: cannot prefault ({e}); pages will be faulted in on first write");
                }
            }
        }
        Ok(Arena { map, memfd })
    }

    /// The memfd of a shared arena: what same-host clients are handed (read-only).
    pub(crate) fn memfd(&self) -> Option<&OwnedFd> {
        self.memfd.as_ref()
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The first byte of the mapping. Valid for `len()` bytes for as long as the arena lives.
    pub(crate) fn base(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_with_every_option() {
        for (prefault, huge_pages) in [(false, false), (true, false), (false, true), (true, true)] {
            let arena = Arena::map(4 << 20, prefault, huge_pages).unwrap();
            assert_eq!(arena.len(), 4 << 20);
            assert!(!arena.base().is_null());
        }
        assert!(Arena::map(0, false, false).is_err());
    }

    #[test]
    fn a_shared_arena_is_a_sealed_memfd_of_its_size() {
        let arena = Arena::map_with(4 << 20, true, true, true).unwrap();
        let fd = arena.memfd().expect("a shared arena has a memfd");
        let file = std::fs::File::from(fd.try_clone().unwrap());
        assert_eq!(file.metadata().unwrap().len(), 4 << 20);
        assert!(file.set_len(1 << 20).is_err(), "the arena's size is sealed");
        assert!(Arena::map(4 << 20, false, false).unwrap().memfd().is_none());
    }
}
