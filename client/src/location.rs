//! Where data lives, in the client's terms: each copy of a block or of a shuffle segment names
//! its storage server by [`ServerId`] and its block by [`BlockId`]. Metadata replies are turned
//! into these at the gRPC edge; frames take the raw ids back when they are built.

use tern_proto::v1::{BlockLocation, Segment};
use tern_proto::{BlockId, ServerId};

/// A storage server that holds a copy, and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Holder {
    pub id: ServerId,
    /// The block service's host:port over TCP.
    pub address: String,
    /// Its QUIC endpoint; "" when it has none.
    pub quic_address: String,
}

/// One copy of one block: its id, its server, the bytes it holds and the grant its frames carry.
#[derive(Debug, Clone)]
pub(crate) struct BlockCopy {
    pub block: BlockId,
    pub holder: Holder,
    pub length: u32,
    pub grant: Vec<u8>,
}

impl From<BlockLocation> for BlockCopy {
    fn from(location: BlockLocation) -> BlockCopy {
        BlockCopy {
            block: BlockId::from_wire(location.block_id),
            holder: Holder {
                id: ServerId::from_wire(location.server_id),
                address: location.address,
                quic_address: location.quic_address,
            },
            length: location.length,
            grant: location.grant,
        }
    }
}

/// The readable copies of a shuffle segment, the first to try first.
pub(crate) fn segment_holders(segment: &Segment) -> Vec<Holder> {
    let mut holders = vec![Holder {
        id: ServerId::from_wire(segment.server_id),
        address: segment.address.clone(),
        quic_address: segment.quic_address.clone(),
    }];
    // Server id 0 is the wire's "no second copy".
    if segment.replica_server_id != 0 && !segment.replica_lost {
        holders.push(Holder {
            id: ServerId::from_wire(segment.replica_server_id),
            address: segment.replica_address.clone(),
            quic_address: segment.replica_quic_address.clone(),
        });
    }
    holders
}
