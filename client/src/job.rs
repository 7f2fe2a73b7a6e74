//! Job sessions: a job owns `/jobs/<job>/`; while its lease is renewed its files live, and when
//! it ends (or its lease lapses) everything under it is freed.

use std::time::Duration;

use tern_proto::v1 as pb;
use tokio::task::JoinHandle;

use crate::error::{Error, ErrorKind, Result};
use crate::Client;

/// A registered job whose lease is renewed in the background, every third of the lease.
/// [`JobSession::end`] frees its data at once; dropping the session ends it in the background.
pub struct JobSession {
    client: Client,
    job_id: String,
    root: String,
    lease: Duration,
    renewer: Option<JoinHandle<()>>,
}

impl JobSession {
    pub(crate) async fn start(client: Client, name: Option<&str>, lease: Duration) -> Result<JobSession> {
        let reply = client
            .metadata()
            .register_job(pb::RegisterJobRequest {
                name: name.unwrap_or_default().into(),
                lease_ms: lease.as_millis() as u64,
            })
            .await?
            .into_inner();
        let lease = Duration::from_millis(reply.lease_ms);
        let renewer = tokio::spawn(renew_forever(client.clone(), reply.job_id.clone(), lease));
        Ok(JobSession { client, job_id: reply.job_id, root: reply.root, lease, renewer: Some(renewer) })
    }

    pub fn id(&self) -> &str {
        &self.job_id
    }

    /// `/jobs/<job>`: where the job's files go.
    pub fn root(&self) -> &str {
        &self.root
    }

    /// The lease granted by the metadata server.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Renews the lease now.
    pub async fn renew(&self) -> Result<()> {
        self.client.metadata().renew_job(pb::RenewJobRequest { job_id: self.job_id.clone() }).await?;
        Ok(())
    }

    /// Ends the job: every file under its root is deleted and its blocks freed.
    pub async fn end(mut self) -> Result<pb::EndJobResponse> {
        self.stop_renewing();
        let job_id = std::mem::take(&mut self.job_id);
        Ok(self.client.metadata().end_job(pb::EndJobRequest { job_id }).await?.into_inner())
    }

    /// Stops renewing without ending the job, as if this client had crashed: the lease lapses
    /// and the metadata server frees the job's data then.
    pub fn abandon(mut self) {
        self.stop_renewing();
        self.job_id.clear();
    }

    fn stop_renewing(&mut self) {
        if let Some(renewer) = self.renewer.take() {
            renewer.abort();
        }
    }
}

async fn renew_forever(client: Client, job_id: String, lease: Duration) {
    let period = (lease / 3).max(Duration::from_millis(10));
    loop {
        tokio::time::sleep(period).await;
        match client.metadata().renew_job(pb::RenewJobRequest { job_id: job_id.clone() }).await {
            Ok(_) => {}
            Err(status) => {
                let e = Error::from(status);
                if e.kind() == ErrorKind::NotFound {
                    tracing::warn!("job {job_id} is gone (ended or lease lapsed); stopped renewing: {e}");
                    return;
                }
                tracing::warn!("renewing job {job_id} failed, retrying: {e}");
            }
        }
    }
}

impl Drop for JobSession {
    fn drop(&mut self) {
        self.stop_renewing();
        if self.job_id.is_empty() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let client = self.client.clone();
            let job_id = std::mem::take(&mut self.job_id);
            runtime.spawn(async move {
                if let Err(status) = client.metadata().end_job(pb::EndJobRequest { job_id: job_id.clone() }).await {
                    tracing::warn!("ending job {job_id} on drop failed: {}", Error::from(status));
                }
            });
        }
    }
}
