//! Client request ids: what makes a retried change answered, not done twice.
//!
//! A client sends [`REQUEST_ID_HEADER`] on every call that changes metadata ([`is_mutating`]),
//! the same value on every retry of that call (`tern_client`'s failover channel adds it once and
//! resends the call's bytes and headers as they are). The metadata server remembers each
//! completed call's answer by its id, in its replicated state, and answers a retry with it
//! (`metadata-server/src/state/requests.rs`). Calls without the header behave as before.
//!
//! An id is 128 bits: a random 64-bit id per client process ([`RequestIds::new`]) and the call's
//! sequence number at that client, written as 32 lowercase hex digits.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};

use aws_lc_rs::rand;

/// The gRPC metadata header carrying a call's request id.
pub const REQUEST_ID_HEADER: &str = "x-tern-request-id";

/// The gRPC methods (paths, as on the wire) that change metadata: those a retry must not repeat.
/// Reads, and renewals that change no logged state, are safe to repeat and carry no id.
pub const MUTATING_METHODS: [&str; 16] = [
    "/tern.v1.Metadata/Mkdir",
    "/tern.v1.Metadata/Create",
    "/tern.v1.Metadata/AllocateBlocks",
    "/tern.v1.Metadata/Seal",
    "/tern.v1.Metadata/Abort",
    "/tern.v1.Metadata/Delete",
    "/tern.v1.Metadata/Rename",
    "/tern.v1.Metadata/RegisterJob",
    "/tern.v1.Metadata/EndJob",
    "/tern.v1.Metadata/RegisterShuffle",
    "/tern.v1.Metadata/AdvanceSegment",
    "/tern.v1.Metadata/CommitMap",
    "/tern.v1.Metadata/InvalidateMaps",
    "/tern.v1.Metadata/UnregisterShuffle",
    "/tern.v1.Admin/SetServerMode",
    "/tern.v1.Admin/EndJob",
];

/// Whether the call at gRPC `path` changes metadata (and so carries a request id).
pub fn is_mutating(path: &str) -> bool {
    MUTATING_METHODS.contains(&path)
}

/// One call's id: its client's random id and its number there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId {
    client: u64,
    sequence: u64,
}

impl RequestId {
    pub fn new(client: u64, sequence: u64) -> RequestId {
        RequestId { client, sequence }
    }

    pub fn client(&self) -> u64 {
        self.client
    }

    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// The id a call's headers carry: `None` without one (an older client), an error for one that
    /// is not 32 hex digits.
    pub fn of(headers: &tonic::metadata::MetadataMap) -> Result<Option<RequestId>, String> {
        let Some(value) = headers.get(REQUEST_ID_HEADER) else {
            return Ok(None);
        };
        let text = value.to_str().map_err(|_| format!("{REQUEST_ID_HEADER} is not text"))?;
        text.parse().map(Some)
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}{:016x}", self.client, self.sequence)
    }
}

impl FromStr for RequestId {
    type Err = String;

    fn from_str(text: &str) -> Result<RequestId, String> {
        let bad = || format!("{REQUEST_ID_HEADER} {text:?} is not 32 hex digits");
        if text.len() != 32 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let client = u64::from_str_radix(&text[..16], 16).map_err(|_| bad())?;
        let sequence = u64::from_str_radix(&text[16..], 16).map_err(|_| bad())?;
        Ok(RequestId { client, sequence })
    }
}

/// A client's source of request ids: its random id, and the next call's number.
#[derive(Debug)]
pub struct RequestIds {
    client: u64,
    next: AtomicU64,
}

impl RequestIds {
    /// Ids under a fresh random client id (from the system's random source: two clients never
    /// share one in practice, 2^-64 a pair).
    pub fn new() -> RequestIds {
        let mut bytes = [0u8; 8];
        rand::fill(&mut bytes).expect("the system random source works");
        RequestIds { client: u64::from_le_bytes(bytes), next: AtomicU64::new(1) }
    }

    /// The next call's id.
    pub fn next(&self) -> RequestId {
        RequestId { client: self.client, sequence: self.next.fetch_add(1, Ordering::Relaxed) }
    }
}

impl Default for RequestIds {
    fn default() -> RequestIds {
        RequestIds::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_reads_back_as_written_and_bad_ones_are_refused() {
        let ids = RequestIds::new();
        let (a, b) = (ids.next(), ids.next());
        assert_ne!(a, b);
        assert_eq!((a.client(), b.sequence()), (b.client(), a.sequence() + 1));
        for id in [a, RequestId::new(0, 0), RequestId::new(u64::MAX, 7)] {
            assert_eq!(id.to_string().len(), 32);
            assert_eq!(id.to_string().parse::<RequestId>(), Ok(id));
        }
        for bad in ["", "12", &"g".repeat(32), &"0".repeat(33), &format!("+{}", "0".repeat(31))] {
            assert!(bad.parse::<RequestId>().is_err(), "{bad:?}");
        }
        let mut headers = tonic::metadata::MetadataMap::new();
        assert_eq!(RequestId::of(&headers), Ok(None));
        headers.insert(REQUEST_ID_HEADER, a.to_string().parse().unwrap());
        assert_eq!(RequestId::of(&headers), Ok(Some(a)));
        headers.insert(REQUEST_ID_HEADER, "nope".parse().unwrap());
        assert!(RequestId::of(&headers).is_err());
    }

    #[test]
    fn changes_carry_ids_and_reads_do_not() {
        assert!(is_mutating("/tern.v1.Metadata/Create"));
        assert!(is_mutating("/tern.v1.Metadata/CommitMap"));
        assert!(is_mutating("/tern.v1.Admin/EndJob"));
        assert!(!is_mutating("/tern.v1.Metadata/Stat"));
        assert!(!is_mutating("/tern.v1.Metadata/RenewJob"));
        assert!(!is_mutating("/tern.v1.Registry/Heartbeat"));
    }
}
