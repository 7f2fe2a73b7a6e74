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
    pub(crate) async fn start(client: Client, tenant: &str, name: Option<&str>, lease: Duration) -> Result<JobSession> {
        let reply = client
            .metadata()
            .register_job(pb::RegisterJobRequest {
                name: name.unwrap_or_default().into(),
                lease_ms: lease.as_millis() as u64,
                tenant: tenant.to_string(),
                serial: 0,
            })
            .await?
            .into_inner();
        client.add_job_token(&reply.token)?;
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

    /// The job's token (text form): hand it to the job's other processes, which add it with
    /// [`Client::add_job_token`] (or `TERN_JOB_TOKEN`).
    pub fn token(&self) -> String {
        self.client.job_token(&self.job_id).unwrap_or_default()
    }

    /// Renews the lease now.
    pub async fn renew(&self) -> Result<()> {
        renew_once(&self.client, &self.job_id, self.lease).await
    }

    /// Ends the job: every file under its root is deleted and its blocks freed.
    pub async fn end(mut self) -> Result<pb::EndJobResponse> {
        self.stop_renewing();
        let job_id = std::mem::take(&mut self.job_id);
        let token = self.client.job_token(&job_id).unwrap_or_default();
        let ended = self.client.metadata().end_job(pb::EndJobRequest { job_id: job_id.clone(), token }).await;
        self.client.forget_job_token(&job_id);
        Ok(ended?.into_inner())
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

/// Renews the lease (of `lease`) with the token held, and holds the fresh token the reply brings.
async fn renew_once(client: &Client, job_id: &str, lease: Duration) -> Result<()> {
    let token = client.job_token(job_id).unwrap_or_default();
    let mut request = tonic::Request::new(pb::RenewJobRequest { job_id: job_id.to_string(), token });
    request.set_timeout(crate::renewal_deadline(lease));
    let reply = client.metadata().renew_job(request).await?;
    client.add_job_token(&reply.into_inner().token)?;
    Ok(())
}

async fn renew_forever(client: Client, job_id: String, lease: Duration) {
    let period = (lease / 3).max(Duration::from_millis(10));
    loop {
        tokio::time::sleep(period).await;
        match renew_once(&client, &job_id, lease).await {
            Ok(()) => {}
            Err(e) => {
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
            let token = client.job_token(&job_id).unwrap_or_default();
            runtime.spawn(async move {
                let ended = client.metadata().end_job(pb::EndJobRequest { job_id: job_id.clone(), token }).await;
                client.forget_job_token(&job_id);
                if let Err(status) = ended {
                    tracing::warn!("ending job {job_id} on drop failed: {}", Error::from(status));
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::renewal_deadline;

    /// A renewal's tries hold a silent leader a third of the lease, within 1 s and 30 s.
    #[test]
    fn renewal_deadlines_are_a_third_of_the_lease_within_bounds() {
        assert_eq!(renewal_deadline(Duration::from_secs(2)), Duration::from_secs(1));
        assert_eq!(renewal_deadline(Duration::from_secs(6)), Duration::from_secs(2));
        assert_eq!(renewal_deadline(Duration::from_secs(600)), Duration::from_secs(30));
    }
}
