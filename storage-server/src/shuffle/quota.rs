//! Tenant quotas: the shuffles whose tenant is at a tier's quota, as the metadata server lists
//! them (a push reads them to keep new batches off that tier, see [`super::push`]), and each
//! shuffle's bytes per tier, which the heartbeat reports for the metadata server to count.

use std::collections::BTreeMap;
use std::sync::Arc;

use tern_proto::v1::{QuotaStop, ShuffleUsage};
use tern_proto::ShuffleId;

use super::segment::Segment;
use super::{ShuffleBytes, Shuffles};

impl Shuffles {
    /// Each shuffle's bytes per tier, for the tenants' quotas.
    pub(crate) fn usage(&self) -> Vec<ShuffleUsage> {
        let segments: Vec<(ShuffleId, Arc<Segment>)> = {
            let map = self.map.lock();
            map.shuffles.iter().flat_map(|(&id, segments)| segments.values().map(move |s| (id, s.clone()))).collect()
        };
        let mut by_shuffle: BTreeMap<ShuffleId, ShuffleBytes> = BTreeMap::new();
        for (id, segment) in segments {
            *by_shuffle.entry(id).or_default() += segment.state.lock().bytes_by_tier();
        }
        by_shuffle
            .into_iter()
            .map(|(id, bytes)| ShuffleUsage { shuffle_id: id.get(), dram_bytes: bytes.dram, nvme_bytes: bytes.nvme })
            .collect()
    }

    /// Takes the metadata server's list of shuffles at a tier's quota in place of the last one.
    pub(crate) fn set_quota_stops(&self, stops: &[QuotaStop]) {
        *self.quota_stops.lock() =
            stops.iter().map(|stop| (ShuffleId::from_wire(stop.shuffle_id), stop.clone())).collect();
    }
}
