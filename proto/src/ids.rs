//! Typed ids: the numbers that name servers, shuffles, files and blocks, each its own type so one
//! cannot be passed where another is meant. Their fields are private: on the wire (gRPC fields,
//! frame headers) and in log records they stay plain `u64`s, and a number becomes an id only
//! through the id's `from_wire` at an edge (so `grep from_wire` lists every such edge) or through
//! the allocator that mints it (`FIRST` and `next()`, [`ShuffleId::first_at`], [`BlockId::new`]);
//! `get()` gives the number back for the wire.

use std::fmt;

use crate::tier::Tier;

/// A newtype over the number the wire carries (`u64` ids, `u32` shuffle indexes), printed as the
/// number. There is no `From`: a bare number becomes one only through `from_wire`, at an edge.
macro_rules! wire_number {
    ($(#[$doc:meta])* $name:ident($raw:ty)) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name($raw);

        impl $name {
            /// The number a gRPC field, frame header, payload or log record carries. The one way a
            /// number becomes this type outside an allocator.
            pub const fn from_wire(raw: $raw) -> $name {
                $name(raw)
            }

            /// The number as the wire carries it.
            pub const fn get(self) -> $raw {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

/// Plain numeric ids, minted by an allocator: a `wire_number!` over `u64` that starts at 1.
macro_rules! numeric_id {
    ($(#[$doc:meta])* $name:ident) => {
        wire_number!($(#[$doc])* $name(u64));

        impl $name {
            /// The first id the allocator hands out: ids start at 1, so 0 on the wire never
            /// names one.
            pub const FIRST: $name = $name(1);

            /// The id the allocator hands out after this one.
            pub const fn next(self) -> $name {
                $name(self.0 + 1)
            }
        }
    };
}

numeric_id!(
    /// A storage server's registration, chosen by the metadata server. 0 is never a server (the
    /// wire uses it for "none", e.g. a segment without a second copy): the edge that reads such a
    /// field makes it an `Option<ServerId>`.
    ServerId
);
numeric_id!(
    /// A registered shuffle, unique for the metadata server's life (and across restarts, through
    /// its log).
    ShuffleId
);
numeric_id!(
    /// A file in the metadata server's namespace, unique for its life (and across restarts,
    /// through its log): how a writer names its unsealed file in AllocateBlocks, Seal and
    /// RenewWriter.
    FileId
);

impl ShuffleId {
    /// The first shuffle id a metadata server started at `unix_ms` hands out. Shuffle ids start
    /// from the clock, so they stay unique across restarts of that server (a stale client's
    /// shuffle id cannot name a new shuffle) unless a run registered more than 1024 shuffles per
    /// millisecond it ran, far beyond what RPCs can reach. Never below [`ShuffleId::FIRST`].
    pub const fn first_at(unix_ms: u64) -> ShuffleId {
        let first = unix_ms.saturating_mul(1024);
        if first < ShuffleId::FIRST.0 {
            ShuffleId::FIRST
        } else {
            ShuffleId(first)
        }
    }
}

/// Set on the ids of blocks that live in a storage server's NVMe tier.
pub const NVME_BLOCK_BIT: u64 = 1 << 63;

/// A block, naming its tier: the metadata server sets [`NVME_BLOCK_BIT`] on the ids of blocks it
/// places on NVMe, so a storage server routes Write, Read and Free without a lookup. The rest of
/// the id is the block's index within its tier's id space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(u64);

impl BlockId {
    /// The block numbered `index` in `tier`. `index` must leave the tier bit clear.
    pub fn new(tier: Tier, index: u64) -> BlockId {
        debug_assert_eq!(index & NVME_BLOCK_BIT, 0, "block index {index} overlaps the tier bit");
        match tier {
            Tier::Dram => BlockId(index),
            Tier::Nvme => BlockId(index | NVME_BLOCK_BIT),
        }
    }

    /// A block id from a gRPC field, frame header or log record (tier bit included); every `u64`
    /// names some block of some tier.
    pub const fn from_wire(raw: u64) -> BlockId {
        BlockId(raw)
    }

    /// The id as the wire carries it (tier bit included).
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The tier the id names.
    pub const fn tier(self) -> Tier {
        if self.0 & NVME_BLOCK_BIT != 0 {
            Tier::Nvme
        } else {
            Tier::Dram
        }
    }

    /// The block's number within its tier (tier bit clear).
    pub const fn index(self) -> u64 {
        self.0 & !NVME_BLOCK_BIT
    }
}

impl fmt::Display for BlockId {
    /// `nvme:17` or `dram:17`: the tier and the index, so logs never show the tier bit as a
    /// 19-digit number.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.tier(), self.index())
    }
}

// Shuffle indexes: where a map's output sits in a shuffle. Kept apart from the u64 ids above:
// they are u32 on the wire, and name a place within one shuffle rather than a thing in the
// cluster.

wire_number!(
    /// A reduce partition of a shuffle, 0 up to the partitions it was registered with.
    PartitionIndex(u32)
);
wire_number!(
    /// A map task of a shuffle: whose output a batch is. Reads ask for maps in ascending order.
    MapIndex(u32)
);
wire_number!(
    /// One run of a map task: several may push (retries, speculative copies); the first to
    /// commit is the map's output, and readers ask for exactly that attempt's batches.
    MapAttempt(u32)
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffle_indexes_round_trip_the_wire() {
        assert_eq!(PartitionIndex::from_wire(7).get(), 7);
        assert_eq!(MapIndex::from_wire(u32::MAX).get(), u32::MAX);
        assert!(MapIndex::from_wire(2) < MapIndex::from_wire(10), "maps order as their numbers");
        assert_eq!(MapAttempt::from_wire(3).to_string(), "3");
    }

    #[test]
    fn block_ids_name_their_tier() {
        let nvme = BlockId::new(Tier::Nvme, 17);
        assert_eq!(nvme.tier(), Tier::Nvme);
        assert_eq!(nvme.index(), 17);
        assert_eq!(nvme.get(), NVME_BLOCK_BIT | 17);
        assert_eq!(BlockId::from_wire(nvme.get()), nvme);
        assert_eq!(nvme.to_string(), "nvme:17");
        let dram = BlockId::new(Tier::Dram, 17);
        assert_eq!((dram.tier(), dram.get()), (Tier::Dram, 17));
        assert_ne!(dram, nvme);
    }

    #[test]
    fn numeric_ids_round_trip_the_wire() {
        assert_eq!(ServerId::from_wire(7).get(), 7);
        assert_eq!(ShuffleId::from_wire(9).get(), 9);
        assert_eq!(ServerId::from_wire(3).to_string(), "3");
        assert_eq!(FileId::FIRST.next(), FileId::from_wire(2));
    }
}
