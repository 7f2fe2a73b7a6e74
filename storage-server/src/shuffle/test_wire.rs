//! For the shuffle tests: the typed indexes of the shuffle payloads from plain numbers and back,
//! so a test names map 3 attempt 1 as `(3, 1)`.

use tern_proto::shuffle::{BatchHeader, PushHeader};
use tern_proto::{MapAttempt, MapIndex, StorageClass};

/// The header of a batch that attempt `attempt` of map `map` pushes to a `class` shuffle.
pub(crate) fn pushed_by(map: u32, attempt: u32, class: StorageClass) -> PushHeader {
    PushHeader { map: MapIndex::from_wire(map), attempt: MapAttempt::from_wire(attempt), class }
}

/// The `(map, attempt)` pairs a Fetch lists.
pub(crate) fn wanted(maps: &[(u32, u32)]) -> Vec<(MapIndex, MapAttempt)> {
    maps.iter().map(|&(map, attempt)| (MapIndex::from_wire(map), MapAttempt::from_wire(attempt))).collect()
}

/// Who wrote a fetched batch, as `(map, attempt)`.
pub(crate) fn written_by(header: &BatchHeader) -> (u32, u32) {
    (header.map.get(), header.attempt.get())
}
