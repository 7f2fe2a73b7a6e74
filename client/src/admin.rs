//! Operators' calls (`tern admin`): cordon, uncordon and drain storage servers, end any job,
//! free any shuffle. They travel on the client's metadata channel, so they are authenticated as
//! every other control-plane call is (mutual TLS when the client has TLS material).

use std::time::Duration;

use tern_proto::v1::{self as pb, ServerMode, ServerStatus};

use crate::error::{Error, ErrorKind, Result};
use crate::Client;

impl Client {
    /// Sets what the planner may do with a storage server (`server`: its id or its address),
    /// and answers with the server as it is now. Draining takes `drain_timeout` (`None`: the
    /// metadata server's `drain_timeout_ms`).
    pub async fn set_server_mode(
        &self,
        server: &str,
        mode: ServerMode,
        drain_timeout: Option<Duration>,
    ) -> Result<ServerStatus> {
        let request = pb::SetServerModeRequest {
            server: server.to_string(),
            mode: mode as i32,
            drain_timeout_ms: drain_timeout.map_or(0, |t| (t.as_millis() as u64).max(1)),
        };
        let reply = self.inner.admin.clone().set_server_mode(request).await?.into_inner();
        reply.server.ok_or_else(|| Error::new(ErrorKind::Internal, format!("{server}: reply without the server")))
    }

    /// Ends job `job` without its token (an operator's call): every file it wrote and every
    /// shuffle it registered are freed.
    pub async fn end_job_as_admin(&self, job: &str) -> Result<pb::EndJobResponse> {
        Ok(self.inner.admin.clone().end_job(pb::AdminEndJobRequest { job_id: job.to_string() }).await?.into_inner())
    }

    /// Frees every segment of shuffle `shuffle_id`.
    pub async fn unregister_shuffle(&self, shuffle_id: u64) -> Result<()> {
        self.metadata()
            .unregister_shuffle(pb::UnregisterShuffleRequest { shuffle_id })
            .await
            .map_err(|s| Error::from(s).context(format_args!("shuffle {shuffle_id}")))?;
        Ok(())
    }

    /// The replicated metadata service's members as its leader sees them (`replicated: false`
    /// from a metadata server without peers).
    pub async fn metadata_members(&self) -> Result<pb::MetadataMembersResponse> {
        Ok(self.inner.admin.clone().metadata_members(pb::MetadataMembersRequest {}).await?.into_inner())
    }

    /// Adds metadata server `id` at `addr` as a voting member (it must be running); waits until
    /// it has caught up and the change has committed.
    pub async fn add_metadata_member(&self, id: u64, addr: &str) -> Result<pb::MetadataMembersResponse> {
        let request = pb::AddMetadataMemberRequest { id, addr: addr.to_string() };
        Ok(self.inner.admin.clone().add_metadata_member(request).await?.into_inner())
    }

    /// Removes metadata member `id`.
    pub async fn remove_metadata_member(&self, id: u64) -> Result<pb::MetadataMembersResponse> {
        Ok(self.inner.admin.clone().remove_metadata_member(pb::RemoveMetadataMemberRequest { id }).await?.into_inner())
    }
}
