//! The DRAM tier's memory: one anonymous mapping, made once at start-up and never resized.
//!
//! The arena hands out raw pointers only ([`memmap2::MmapRaw`]); the block store above it owns the
//! discipline that makes touching those bytes sound.

use anyhow::{bail, Context};
use memmap2::{Advice, MmapOptions, MmapRaw};

/// An anonymous, private memory mapping of a fixed size.
pub(crate) struct Arena {
    map: MmapRaw,
}

impl Arena {
    /// Maps `len` bytes. With `huge_pages` the mapping is advised MADV_HUGEPAGE (a failure is
    /// logged, not fatal: the arena still works with small pages). With `prefault` every page is
    /// faulted in now, so first writes do not stall and a machine short of memory fails at once.
    pub(crate) fn map(len: u64, prefault: bool, huge_pages: bool) -> anyhow::Result<Arena> {
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
        let map: MmapRaw = options
            .map_anon()
            .with_context(|| format!("mapping a DRAM arena of {}", tern_common::ByteSize(len as u64)))?
            .into();
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
        Ok(Arena { map })
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
}
