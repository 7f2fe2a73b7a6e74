//! A thin typed client of the scheduler, for `tern job` (jobs) and `tern executor` (executors).
//! Errors are [`tern_client::Error`]s, whose kind says what to do (NotFound from a heartbeat:
//! register again; Unavailable: retry).

use std::path::Path;
use std::time::Duration;

use tern_client::{Error, ErrorKind, Result};
use tern_proto::identity::{Presenting, Presents};
use tern_proto::sched as pb;
use tern_proto::sched::scheduler_client::SchedulerClient as Grpc;
use tonic::transport::Channel;

/// How long a call may take beyond the poll wait it asked for.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A connection to `tern scheduler`. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct SchedulerClient {
    grpc: Grpc<Presenting<Channel>>,
    addr: String,
}

impl SchedulerClient {
    /// Connects to `addr` (`host:port`, `http://` or `https://`); with `tls_dir`, mutual TLS.
    /// Every call presents `credential` (`tern_proto::identity`): a tenant's client submits to and
    /// sees its tenant's queue, an executor's takes tasks; none is a client of the default tenant.
    pub async fn connect(addr: &str, tls_dir: Option<&Path>, credential: Option<&str>) -> Result<SchedulerClient> {
        SchedulerClient::connect_with_tls(addr, tern_client::load_tls(tls_dir)?.as_ref(), credential).await
    }

    /// As [`SchedulerClient::connect`], with TLS material already loaded (the Spark plugin's).
    pub async fn connect_with_tls(
        addr: &str,
        tls: Option<&tern_client::TlsMaterial>,
        credential: Option<&str>,
    ) -> Result<SchedulerClient> {
        let presents = match credential {
            Some(credential) => Presents::credential(credential).map_err(|e| Error::new(ErrorKind::Invalid, e.0))?,
            None => Presents::default(),
        };
        let channel = tern_client::grpc_channel(addr, tls, "the scheduler", |endpoint| {
            endpoint.connect_timeout(Duration::from_secs(5))
        })
        .await?;
        let limit = tern_proto::MAX_GRPC_MESSAGE_BYTES;
        let grpc =
            Grpc::with_interceptor(channel, presents).max_decoding_message_size(limit).max_encoding_message_size(limit);
        Ok(SchedulerClient { grpc, addr: addr.to_string() })
    }

    /// The address it was connected to.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn request<T>(message: T, timeout: Duration) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(timeout);
        request
    }

    /// Submits a job (already validated by [`crate::spec`]); returns its id.
    pub async fn submit(&self, job: pb::JobSpec) -> Result<String> {
        Ok(self.submit_with_tern_job(job).await?.job_id)
    }

    /// As [`SchedulerClient::submit`], with the job's Tern job id and token.
    pub async fn submit_with_tern_job(&self, job: pb::JobSpec) -> Result<pb::SubmitJobResponse> {
        let request = Self::request(pb::SubmitJobRequest { job: Some(job) }, CALL_TIMEOUT);
        Ok(self.grpc.clone().submit_job(request).await?.into_inner())
    }

    pub async fn job(&self, job_id: &str) -> Result<pb::JobStatus> {
        let request = Self::request(pb::GetJobRequest { job_id: job_id.into() }, CALL_TIMEOUT);
        self.grpc
            .clone()
            .get_job(request)
            .await?
            .into_inner()
            .job
            .ok_or_else(|| Error::new(ErrorKind::Internal, format!("the scheduler sent no status for job {job_id}")))
    }

    pub async fn list_jobs(&self, active_only: bool) -> Result<Vec<pb::JobStatus>> {
        let request = Self::request(pb::ListJobsRequest { active_only }, CALL_TIMEOUT);
        Ok(self.grpc.clone().list_jobs(request).await?.into_inner().jobs)
    }

    /// Cancels a job; returns its state after (a finished job stays as it finished).
    pub async fn cancel(&self, job_id: &str) -> Result<pb::JobState> {
        let request = Self::request(pb::CancelJobRequest { job_id: job_id.into() }, CALL_TIMEOUT);
        let state = self.grpc.clone().cancel_job(request).await?.into_inner().state;
        Ok(pb::JobState::try_from(state).unwrap_or(pb::JobState::Unspecified))
    }

    /// Scales an elastic stage (see `ScaleStage` in scheduler.proto).
    pub async fn scale_stage(&self, request: pb::ScaleStageRequest) -> Result<pb::ScaleStageResponse> {
        Ok(self.grpc.clone().scale_stage(Self::request(request, CALL_TIMEOUT)).await?.into_inner())
    }

    pub async fn pool_status(&self) -> Result<pb::PoolStatusResponse> {
        let request = Self::request(pb::PoolStatusRequest {}, CALL_TIMEOUT);
        Ok(self.grpc.clone().pool_status(request).await?.into_inner())
    }

    /// Waits until the job finishes, asking every `period`; `progress` sees every status.
    pub async fn wait(
        &self,
        job_id: &str,
        period: Duration,
        mut progress: impl FnMut(&pb::JobStatus),
    ) -> Result<pb::JobStatus> {
        loop {
            let status = self.job(job_id).await?;
            progress(&status);
            if is_finished(status.state()) {
                return Ok(status);
            }
            tokio::time::sleep(period).await;
        }
    }

    pub async fn register_executor(
        &self,
        request: pb::RegisterExecutorRequest,
    ) -> Result<pb::RegisterExecutorResponse> {
        Ok(self.grpc.clone().register_executor(Self::request(request, CALL_TIMEOUT)).await?.into_inner())
    }

    /// Returns the assignments to stop.
    pub async fn heartbeat(&self, executor_id: &str) -> Result<Vec<u64>> {
        let request = Self::request(pb::HeartbeatRequest { executor_id: executor_id.into() }, CALL_TIMEOUT);
        Ok(self.grpc.clone().heartbeat(request).await?.into_inner().cancel)
    }

    /// Reports `results` and asks for up to `max_tasks` assignments, waiting up to `wait`.
    pub async fn poll(
        &self,
        executor_id: &str,
        results: Vec<pb::TaskResult>,
        max_tasks: u32,
        wait: Duration,
    ) -> Result<pb::PollTasksResponse> {
        let message = pb::PollTasksRequest {
            executor_id: executor_id.into(),
            results,
            max_tasks,
            wait_ms: wait.as_millis() as u64,
        };
        Ok(self.grpc.clone().poll_tasks(Self::request(message, CALL_TIMEOUT + wait)).await?.into_inner())
    }

    /// Leaves, reporting the last results; returns how many tasks were queued again.
    pub async fn leave(&self, executor_id: &str, results: Vec<pb::TaskResult>) -> Result<u32> {
        let request =
            Self::request(pb::LeaveExecutorRequest { executor_id: executor_id.into(), results }, CALL_TIMEOUT);
        Ok(self.grpc.clone().leave_executor(request).await?.into_inner().requeued)
    }
}

/// Succeeded, failed or cancelled.
pub fn is_finished(state: pb::JobState) -> bool {
    matches!(state, pb::JobState::Succeeded | pb::JobState::Failed | pb::JobState::Cancelled)
}
