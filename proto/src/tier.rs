//! Storage tiers and storage classes, shared by the metadata server (placement), storage servers
//! (routing a block op to its tier) and clients (choosing a class at create).
//! Block ids name their tier: see [`crate::ids::BlockId`].

use std::fmt;
use std::str::FromStr;

use crate::ids::BlockId;

/// A storage server's tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Dram,
    Nvme,
}

impl Tier {
    /// The tier a wire block id names (see [`BlockId::tier`]).
    pub fn of_block(block_id: u64) -> Tier {
        BlockId::from_wire(block_id).tier()
    }

    /// The name used in registrations, heartbeats, metrics and `tern status`: the one definition
    /// of the tier names, which every crate takes from here.
    pub const fn name(self) -> &'static str {
        match self {
            Tier::Dram => "dram",
            Tier::Nvme => "nvme",
        }
    }

    /// The tier named `name` in a usage report, if it is one.
    pub fn from_name(name: &str) -> Option<Tier> {
        match name {
            "dram" => Some(Tier::Dram),
            "nvme" => Some(Tier::Nvme),
            _ => None,
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a file's blocks may go, chosen at create.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum StorageClass {
    /// DRAM only.
    Dram,
    /// NVMe only.
    Nvme,
    /// DRAM first, cluster-wide; NVMe only when no live server has DRAM room.
    #[default]
    Any,
}

impl StorageClass {
    pub fn name(self) -> &'static str {
        match self {
            StorageClass::Dram => Tier::Dram.name(),
            StorageClass::Nvme => Tier::Nvme.name(),
            StorageClass::Any => "any",
        }
    }

    /// Its code on the wire (in a Push header).
    pub fn code(self) -> u8 {
        match self {
            StorageClass::Any => 0,
            StorageClass::Dram => 1,
            StorageClass::Nvme => 2,
        }
    }

    pub fn from_code(code: u8) -> Option<StorageClass> {
        [StorageClass::Any, StorageClass::Dram, StorageClass::Nvme].into_iter().find(|class| class.code() == code)
    }

    /// The tiers the class may use, in the order placement tries them.
    pub fn tiers(self) -> &'static [Tier] {
        match self {
            StorageClass::Dram => &[Tier::Dram],
            StorageClass::Nvme => &[Tier::Nvme],
            StorageClass::Any => &[Tier::Dram, Tier::Nvme],
        }
    }
}

impl fmt::Display for StorageClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a storage-class name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("storage class {0:?} is not one of \"dram\", \"nvme\" or \"any\"")]
pub struct BadStorageClass(pub String);

impl FromStr for StorageClass {
    type Err = BadStorageClass;

    /// "dram", "nvme" or "any"; "" is "any" (what a request that names no class carries).
    fn from_str(s: &str) -> Result<StorageClass, BadStorageClass> {
        match s {
            "" | "any" => Ok(StorageClass::Any),
            "dram" => Ok(StorageClass::Dram),
            "nvme" => Ok(StorageClass::Nvme),
            other => Err(BadStorageClass(other.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_ids_name_their_tier() {
        assert_eq!(Tier::of_block(1), Tier::Dram);
        assert_eq!(Tier::of_block(crate::ids::NVME_BLOCK_BIT | 1), Tier::Nvme);
        assert_eq!(Tier::from_name("nvme"), Some(Tier::Nvme));
        assert_eq!(Tier::from_name("ssd"), None);
    }

    #[test]
    fn storage_classes_parse_and_print() {
        for class in [StorageClass::Dram, StorageClass::Nvme, StorageClass::Any] {
            assert_eq!(class.to_string().parse::<StorageClass>().unwrap(), class);
        }
        assert_eq!("".parse::<StorageClass>().unwrap(), StorageClass::Any);
        let err = "ssd".parse::<StorageClass>().unwrap_err().to_string();
        assert!(err.contains("\"ssd\"") && err.contains("\"nvme\""), "{err}");
        assert_eq!(StorageClass::Any.tiers(), [Tier::Dram, Tier::Nvme]);
    }
}
