//! Byte sizes with units, as users type them: `512MiB`, `4GiB`, `1.5GB`, `4096`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A number of bytes, parsed from and shown with units. Binary units (KiB, MiB, GiB, TiB) are
/// powers of 1024; decimal ones (KB, MB, GB, TB) powers of 1000; `K`, `M`, `G`, `T` are binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub const fn kib(n: u64) -> ByteSize {
        ByteSize(n << 10)
    }
    pub const fn mib(n: u64) -> ByteSize {
        ByteSize(n << 20)
    }
    pub const fn gib(n: u64) -> ByteSize {
        ByteSize(n << 30)
    }
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<ByteSize, String> {
        let s = s.trim();
        let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
        let (number, unit) = s.split_at(split);
        let number: f64 = number
            .parse()
            .map_err(|_| format!("invalid size {s:?}: expected a number with an optional unit, e.g. 512MiB"))?;
        let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kib" => 1 << 10,
            "m" | "mib" => 1 << 20,
            "g" | "gib" => 1 << 30,
            "t" | "tib" => 1 << 40,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            other => {
                return Err(format!(
                    "invalid size {s:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
                ))
            }
        };
        let bytes = number * multiplier as f64;
        if !bytes.is_finite() || bytes > u64::MAX as f64 || bytes.fract() != 0.0 {
            return Err(format!("invalid size {s:?}: not a whole number of bytes that fits in 64 bits"));
        }
        Ok(ByteSize(bytes as u64))
    }
}

const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];

/// Exact: the largest unit that divides the size (`512MiB`, `1280MiB`, `1000B`), so what is
/// printed, in a config dump or on a command line, parses back to the same number of bytes.
impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut value = self.0;
        let mut unit = 0;
        while unit + 1 < UNITS.len() && value >= 1024 && value.is_multiple_of(1024) {
            value /= 1024;
            unit += 1;
        }
        write!(f, "{value}{}", UNITS[unit])
    }
}

impl ByteSize {
    /// Approximate, for people: `1.5GiB`, `812.3MiB`, `17B`.
    pub fn human(self) -> String {
        let mut value = self.0 as f64;
        let mut unit = 0;
        while value >= 1024.0 && unit + 1 < UNITS.len() {
            value /= 1024.0;
            unit += 1;
        }
        if unit == 0 || value.fract() == 0.0 {
            format!("{value:.0}{}", UNITS[unit])
        } else {
            format!("{value:.1}{}", UNITS[unit])
        }
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ByteSize, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(ByteSize(n)),
            Raw::Text(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!("4096".parse(), Ok(ByteSize(4096)));
        assert_eq!("512MiB".parse(), Ok(ByteSize::mib(512)));
        assert_eq!("4GiB".parse(), Ok(ByteSize::gib(4)));
        assert_eq!("4g".parse(), Ok(ByteSize::gib(4)));
        assert_eq!("1.5GB".parse(), Ok(ByteSize(1_500_000_000)));
        assert_eq!("2 KiB".parse(), Ok(ByteSize(2048)));
        assert!("12XB".parse::<ByteSize>().unwrap_err().contains("unknown unit"));
        assert!("MiB".parse::<ByteSize>().is_err());
        assert!("0.5B".parse::<ByteSize>().is_err());
        assert!("99999999999TiB".parse::<ByteSize>().is_err());
    }

    #[test]
    fn display_is_exact_and_parses_back() {
        for n in [0, 1, 1023, 1024, 1536, 1_000_000, ByteSize::mib(1280).0, ByteSize::gib(3).0, 5 << 40, u64::MAX] {
            let shown = ByteSize(n).to_string();
            assert_eq!(shown.parse(), Ok(ByteSize(n)), "{shown}");
        }
        assert_eq!(ByteSize::mib(512).to_string(), "512MiB");
        assert_eq!(ByteSize::mib(1280).to_string(), "1280MiB");
    }

    #[test]
    fn human_is_short() {
        assert_eq!(ByteSize(17).human(), "17B");
        assert_eq!(ByteSize::mib(1280).human(), "1.2GiB");
        assert_eq!(ByteSize::gib(2).human(), "2GiB");
        assert_eq!(ByteSize(1536 * 1024 + 1).human(), "1.5MiB");
    }
}
