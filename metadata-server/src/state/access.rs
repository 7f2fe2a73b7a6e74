//! What authorization asks of the state (`crate::authz`): whose a file or shuffle is, and which
//! address a storage server registered with.

use tern_proto::{FileId, ShuffleId};

use super::State;
use crate::path::Place;

impl State {
    /// The job owning file `file_id`: `Some(None)` for a file outside `/jobs`, `None` when there
    /// is no such file.
    pub fn job_of_file(&self, file_id: u64) -> Option<Option<String>> {
        let path = self.namespace.file_path(FileId::from_wire(file_id)).ok()?;
        Some(Place::of(&path).job().map(str::to_string))
    }

    /// The job owning shuffle `shuffle_id`, if it is registered.
    pub fn job_of_shuffle(&self, shuffle_id: u64) -> Option<String> {
        self.shuffles.job_of(ShuffleId::from_wire(shuffle_id)).map(str::to_string)
    }

    /// Whether job `job` is registered.
    pub fn job_registered(&self, job: &str) -> bool {
        self.jobs.serial(job).is_some()
    }

    /// The block-service address of the storage server `name` names (its id or its address), if
    /// one is registered.
    pub fn address_of_server(&self, name: &str) -> Option<String> {
        self.servers.find(name).ok().map(|id| self.servers.address(id))
    }
}
