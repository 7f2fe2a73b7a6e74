//! The one encoding of everything Raft keeps on disk (`store`) or sends to a peer (`net`):
//! bincode, with bytes as bytes. JSON wrote an entry's records (a map commit's 1000 lengths are
//! 8 KB of them) as an array of decimal numbers four times their size, and every hop parsed it
//! back: `tern bench replicas` measured map commits at 0.29x a single replica's rate with it.

use serde::de::DeserializeOwned;
use serde::Serialize;

use bincode::Options;

/// Largest encoded value read back (an entry is bounded well below: `MAX_ENTRY_BYTES`).
pub const MAX_BYTES: u64 = 256 << 20;

fn options() -> impl Options {
    bincode::DefaultOptions::new().with_limit(MAX_BYTES)
}

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    options().serialize(value).expect("Raft's types serialize: no maps with non-string keys or unsized sequences")
}

pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, bincode::Error> {
    options().deserialize(bytes)
}

#[cfg(test)]
mod tests {
    use openraft::error::{InstallSnapshotError, RaftError, SnapshotMismatch};
    use openraft::{BasicNode, CommittedLeaderId, Entry, EntryPayload, LogId, Membership, Vote};

    use super::{decode, encode};
    use crate::raft::{Batch, TypeConfig};

    /// Entries of every payload kind, votes and the errors a peer answers with come back as they
    /// went (bincode cannot carry self-describing serde forms such as untagged enums: this
    /// catches one appearing in openraft's types).
    #[test]
    fn raft_values_round_trip() {
        let log_id = LogId::new(CommittedLeaderId::new(3, 1), 42);
        let members = std::collections::BTreeMap::from([(1, BasicNode::new("a:1")), (2, BasicNode::new("b:2"))]);
        let entries: Vec<Entry<TypeConfig>> = vec![
            Entry { log_id, payload: EntryPayload::Blank },
            Entry { log_id, payload: EntryPayload::Normal(Batch { last_seq: 7, records: vec![0, 1, 255] }) },
            Entry { log_id, payload: EntryPayload::Membership(Membership::new(vec![[1, 2].into()], members)) },
        ];
        let back: Vec<Entry<TypeConfig>> = decode(&encode(&entries)).expect("decodes");
        assert_eq!(format!("{back:?}"), format!("{entries:?}"));
        let vote = Vote::new_committed(3, 1);
        assert_eq!(decode::<Vote<u64>>(&encode(&vote)).expect("decodes"), vote);
        let refused: Result<(), RaftError<u64, InstallSnapshotError>> =
            Err(RaftError::APIError(InstallSnapshotError::SnapshotMismatch(SnapshotMismatch {
                expect: Default::default(),
                got: Default::default(),
            })));
        let back: Result<(), RaftError<u64, InstallSnapshotError>> = decode(&encode(&refused)).expect("decodes");
        assert_eq!(back, refused);
        // The records are bytes on the wire: a length and the bytes, not one value per byte.
        let batch = Batch { last_seq: 1, records: vec![7; 8192] };
        assert!(encode(&batch).len() < 8192 + 16, "{} bytes", encode(&batch).len());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(decode::<Vec<Entry<TypeConfig>>>(&[0xff; 9]).is_err());
        assert!(decode::<Vote<u64>>(&[]).is_err());
    }
}
