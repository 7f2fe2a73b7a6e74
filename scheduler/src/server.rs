//! `tern scheduler`: the gRPC service around the policy. Skeleton: binds and serves; the
//! service's state machine follows in the next commits.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tern_proto::sched as pb;
use tern_proto::sched::scheduler_server::{Scheduler, SchedulerServer as SchedulerService};
use tern_proto::ErrorKind;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

use crate::config::Config;

/// A running scheduler. Dropping it stops it too.
pub struct SchedulerServer {
    addr: SocketAddr,
    admin_addr: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

/// Validates `config`, binds, and starts serving in the background.
pub async fn start(config: Config) -> anyhow::Result<SchedulerServer> {
    config.validate().context("invalid scheduler configuration")?;
    let mut grpc = tonic::transport::Server::builder();
    if let Some(dir) = &config.tls_dir {
        let tls = tern_transport::tls::TlsMaterial::load(dir)?;
        grpc = grpc.tls_config(tls.tonic_server()).with_context(|| format!("gRPC TLS from {}", dir.display()))?;
    }
    let registry = prometheus_client::registry::Registry::default();
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding scheduler to {}", config.listen))?;
    let addr = listener.local_addr()?;
    let admin_addr = tern_common::admin::serve(config.admin_listen, registry).await?;
    let (stop, mut stopped) = watch::channel(false);
    let service = Arc::new(Service { config });
    let limit = tern_proto::MAX_GRPC_MESSAGE_BYTES;
    let svc = SchedulerService::from_arc(service).max_decoding_message_size(limit).max_encoding_message_size(limit);
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let server = tokio::spawn(async move {
        let result = grpc
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = stopped.wait_for(|&stop| stop).await;
            })
            .await;
        if let Err(e) = result {
            tracing::error!("scheduler gRPC service stopped: {e}");
        }
    });
    Ok(SchedulerServer { addr, admin_addr, stop, tasks: vec![server] })
}

impl SchedulerServer {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

struct Service {
    config: Config,
}

fn not_yet() -> Status {
    ErrorKind::Unavailable.status("this scheduler build does not serve this call yet")
}

#[tonic::async_trait]
impl Scheduler for Service {
    async fn submit_job(
        &self,
        request: Request<pb::SubmitJobRequest>,
    ) -> Result<Response<pb::SubmitJobResponse>, Status> {
        let job = request.into_inner().job.ok_or_else(|| ErrorKind::Invalid.status("SubmitJob without a job"))?;
        crate::spec::validate(&job, &self.config.spec_limits())
            .map_err(|e| ErrorKind::Invalid.status(format!("{e:#}")))?;
        Err(not_yet())
    }
    async fn get_job(&self, _: Request<pb::GetJobRequest>) -> Result<Response<pb::GetJobResponse>, Status> {
        Err(not_yet())
    }
    async fn list_jobs(&self, _: Request<pb::ListJobsRequest>) -> Result<Response<pb::ListJobsResponse>, Status> {
        Err(not_yet())
    }
    async fn cancel_job(&self, _: Request<pb::CancelJobRequest>) -> Result<Response<pb::CancelJobResponse>, Status> {
        Err(not_yet())
    }
    async fn pool_status(&self, _: Request<pb::PoolStatusRequest>) -> Result<Response<pb::PoolStatusResponse>, Status> {
        Err(not_yet())
    }
    async fn register_executor(
        &self,
        _: Request<pb::RegisterExecutorRequest>,
    ) -> Result<Response<pb::RegisterExecutorResponse>, Status> {
        Err(not_yet())
    }
    async fn heartbeat(&self, _: Request<pb::HeartbeatRequest>) -> Result<Response<pb::HeartbeatResponse>, Status> {
        Err(not_yet())
    }
    async fn poll_tasks(&self, _: Request<pb::PollTasksRequest>) -> Result<Response<pb::PollTasksResponse>, Status> {
        Err(not_yet())
    }
    async fn leave_executor(
        &self,
        _: Request<pb::LeaveExecutorRequest>,
    ) -> Result<Response<pb::LeaveExecutorResponse>, Status> {
        Err(not_yet())
    }
}
