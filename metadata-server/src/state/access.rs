//! What authorization asks of the state (`crate::authz`): whether a job token is genuine, whose
//! a file, path or shuffle is, and which address a storage server registered with.

use tern_proto::token::JobToken;
use tern_proto::{ErrorKind, FileId, ShuffleId};
use tonic::Status;

use super::State;
use crate::error::{not_found, Refusal};
use crate::path::Place;

impl State {
    /// Ok when `token` is a token of job `job`'s current registration signed by this server (it
    /// may have expired: a job holder renewing late is still its holder).
    pub fn check_job_token(&self, job: &str, token: &str, what: &str) -> Result<(), Status> {
        if token.is_empty() {
            let why = format!("no token given: only the holder of job {job}'s token may {what} it");
            return Err(Refusal::new(ErrorKind::PermissionDenied, why).status(format_args!("{what} job {job}")));
        }
        let token = JobToken::from_text(token)
            .map_err(|e| Refusal::new(e.kind(), e.to_string()).status(format_args!("{what} job {job}")))?;
        self.check_decoded_token(job, &token, what)
    }

    /// [`State::check_job_token`] for a token already decoded (authorization decodes each
    /// presented token once, to find those naming the call's job).
    pub fn check_decoded_token(&self, job: &str, token: &JobToken, what: &str) -> Result<(), Status> {
        let context = format!("{what} job {job}");
        let refuse = |why: String| Refusal::new(ErrorKind::PermissionDenied, why).status(&context);
        self.key.0.verify(token).map_err(|e| refuse(e.to_string()))?;
        let Some(serial) = self.jobs.serial(job) else {
            return Err(not_found(format!("job {job} is not registered (ended or lease lapsed)")).status(&context));
        };
        if token.job != job || token.serial != serial {
            return Err(refuse(format!(
                "the token given is job {}'s (another job, or an earlier job of that name)",
                token.job
            )));
        }
        Ok(())
    }

    /// The job owning file `file_id`: `Some(None)` for a file outside `/jobs`, `None` when there
    /// is no such file.
    pub fn job_of_file(&self, file_id: u64) -> Option<Option<String>> {
        let path = self.namespace.file_path(FileId::from_wire(file_id)).ok()?;
        Some(Place::of(&path).job().map(str::to_string))
    }

    /// The tenant owning `path` outside `/jobs` (`Namespace::owner`; None: everyone's).
    pub fn owner_of_path(&self, path: &str) -> Option<&str> {
        self.namespace.owner(path)
    }

    /// The tenant owning file `file_id` (None: everyone's, or no such file).
    pub fn owner_of_file(&self, file_id: u64) -> Option<&str> {
        self.namespace.file_owner(FileId::from_wire(file_id))
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
