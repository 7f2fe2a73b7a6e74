//! Typed ids: the numbers that name servers, shuffles and blocks, each its own type so one cannot
//! be passed where another is meant. On the wire (gRPC fields, frame headers) they stay plain
//! `u64`s; code converts at the edge with [`ServerId::get`] / `ServerId::from(u64)` and the like.

use std::fmt;

use crate::tier::Tier;

/// Plain numeric ids: a newtype over the wire's `u64`, printed as the number.
macro_rules! numeric_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
        pub struct $name(pub u64);

        impl $name {
            /// The id as the wire carries it.
            pub const fn get(self) -> u64 {
                self.0
            }
        }

        impl From<u64> for $name {
            fn from(raw: u64) -> Self {
                $name(raw)
            }
        }

        impl From<$name> for u64 {
            fn from(id: $name) -> u64 {
                id.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

numeric_id!(
    /// A storage server's registration, chosen by the metadata server. 0 is never a server (the
    /// wire uses it for "none", e.g. a segment without a second copy).
    ServerId
);
numeric_id!(
    /// A registered shuffle, unique for the metadata server's life (and across restarts, through
    /// its log).
    ShuffleId
);

/// Set on the ids of blocks that live in a storage server's NVMe tier.
pub const NVME_BLOCK_BIT: u64 = 1 << 63;

/// A block, naming its tier: the metadata server sets [`NVME_BLOCK_BIT`] on the ids of blocks it
/// places on NVMe, so a storage server routes Write, Read and Free without a lookup. The rest of
/// the id is the block's index within its tier's id space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
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

impl From<u64> for BlockId {
    /// A block id from the wire; every `u64` names some block of some tier.
    fn from(raw: u64) -> BlockId {
        BlockId(raw)
    }
}

impl From<BlockId> for u64 {
    fn from(id: BlockId) -> u64 {
        id.0
    }
}

impl fmt::Display for BlockId {
    /// `nvme:17` or `dram:17`: the tier and the index, so logs never show the tier bit as a
    /// 19-digit number.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.tier(), self.index())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_ids_name_their_tier() {
        let nvme = BlockId::new(Tier::Nvme, 17);
        assert_eq!(nvme.tier(), Tier::Nvme);
        assert_eq!(nvme.index(), 17);
        assert_eq!(nvme.get(), NVME_BLOCK_BIT | 17);
        assert_eq!(BlockId::from(nvme.get()), nvme);
        assert_eq!(nvme.to_string(), "nvme:17");
        let dram = BlockId::new(Tier::Dram, 17);
        assert_eq!((dram.tier(), dram.get()), (Tier::Dram, 17));
        assert_ne!(dram, nvme);
    }

    #[test]
    fn numeric_ids_round_trip_the_wire() {
        assert_eq!(ServerId::from(7).get(), 7);
        assert_eq!(u64::from(ShuffleId(9)), 9);
        assert_eq!(ServerId(3).to_string(), "3");
    }
}
