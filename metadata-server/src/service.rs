//! The gRPC services (Metadata for clients, Registry for storage servers, Admin for operators)
//! over the shared state.
//!
//! Every RPC goes through [`Service::call`]: read the clock (once: the state takes the time from
//! here, see [`Now`]), lock the state, run the state's method for it, hand
//! the changes it made to the write-ahead log, unlock, wait until the log is durable that far,
//! record metrics. The lock is never held across an await; the state's methods do no I/O.
//!
//! Every call waits, reads too: a reply may show changes other calls made a moment before, and
//! nothing may be shown that a crash could still take back. With nothing in flight the wait is
//! nothing.

use std::sync::Arc;

use parking_lot::Mutex;
use tern_common::Now;
use tern_proto::v1::admin_server::Admin;
use tern_proto::v1::metadata_server::Metadata;
use tern_proto::v1::registry_server::Registry;
use tern_proto::v1::*;
use tern_proto::ErrorKind;
use tonic::{Request, Response, Status};

use crate::metrics::Metrics;
use crate::state::State;
use crate::wal::Wal;

pub struct Service {
    state: Arc<Mutex<State>>,
    wal: Arc<Wal>,
    metrics: Metrics,
}

impl Service {
    pub fn new(state: Arc<Mutex<State>>, wal: Arc<Wal>, metrics: Metrics) -> Service {
        Service { state, wal, metrics }
    }

    async fn call<T>(
        &self,
        method: &'static str,
        op: impl FnOnce(&mut State, Now) -> Result<T, Status>,
    ) -> Result<Response<T>, Status> {
        #[expect(clippy::disallowed_methods, reason = "the edge: each call reads the clock once and passes it in")]
        let now = Now::read();
        let (mut result, lsn) = {
            let mut state = self.state.lock();
            let result = op(&mut state, now);
            let changes = state.take_journal();
            (result, self.wal.append(&changes))
        };
        if let Err(why) = self.wal.wait(lsn).await {
            result = Err(ErrorKind::Internal
                .status(format!("{method}: the metadata log cannot be written, so nothing is acknowledged: {why}")));
        }
        self.metrics.record(method, now.instant.elapsed(), result.as_ref().err());
        if let Err(status) = &result {
            // Refusals are the caller's business; only our own failures deserve an error line.
            match ErrorKind::of_status(status) {
                ErrorKind::Internal => tracing::error!("{method}: {}", status.message()),
                _ => tracing::debug!("{method}: {}", status.message()),
            }
        }
        result.map(Response::new)
    }
}

#[tonic::async_trait]
impl Metadata for Service {
    async fn mkdir(&self, request: Request<MkdirRequest>) -> Result<Response<MkdirResponse>, Status> {
        self.call("mkdir", |state, now| state.mkdir(request.into_inner(), now)).await
    }

    async fn create(&self, request: Request<CreateRequest>) -> Result<Response<CreateResponse>, Status> {
        self.call("create", |state, now| state.create(request.into_inner(), now)).await
    }

    async fn allocate_blocks(
        &self,
        request: Request<AllocateBlocksRequest>,
    ) -> Result<Response<AllocateBlocksResponse>, Status> {
        self.call("allocate_blocks", |state, now| state.allocate_blocks(request.into_inner(), now)).await
    }

    async fn seal(&self, request: Request<SealRequest>) -> Result<Response<SealResponse>, Status> {
        self.call("seal", |state, now| state.seal(request.into_inner(), now)).await
    }

    async fn renew_writer(
        &self,
        request: Request<RenewWriterRequest>,
    ) -> Result<Response<RenewWriterResponse>, Status> {
        self.call("renew_writer", |state, now| state.renew_writer(request.into_inner(), now)).await
    }

    async fn abort(&self, request: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        self.call("abort", |state, now| state.abort(request.into_inner(), now)).await
    }

    async fn open(&self, request: Request<OpenRequest>) -> Result<Response<OpenResponse>, Status> {
        self.call("open", |state, now| state.open(request.into_inner(), now)).await
    }

    async fn stat(&self, request: Request<StatRequest>) -> Result<Response<StatResponse>, Status> {
        self.call("stat", |state, now| state.stat(request.into_inner(), now)).await
    }

    async fn list(&self, request: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        self.call("list", |state, now| state.list(request.into_inner(), now)).await
    }

    async fn delete(&self, request: Request<DeleteRequest>) -> Result<Response<DeleteResponse>, Status> {
        self.call("delete", |state, now| state.delete(request.into_inner(), now)).await
    }

    async fn rename(&self, request: Request<RenameRequest>) -> Result<Response<RenameResponse>, Status> {
        self.call("rename", |state, now| state.rename(request.into_inner(), now)).await
    }

    async fn register_job(
        &self,
        request: Request<RegisterJobRequest>,
    ) -> Result<Response<RegisterJobResponse>, Status> {
        self.call("register_job", |state, now| state.register_job(request.into_inner(), now)).await
    }

    async fn renew_job(&self, request: Request<RenewJobRequest>) -> Result<Response<RenewJobResponse>, Status> {
        let req = request.into_inner();
        self.call("renew_job", |state, now| {
            state.check_job_token(&req.job_id, &req.token, "renew")?;
            state.renew_job(req, now)
        })
        .await
    }

    async fn end_job(&self, request: Request<EndJobRequest>) -> Result<Response<EndJobResponse>, Status> {
        let req = request.into_inner();
        self.call("end_job", |state, now| {
            state.check_job_token(&req.job_id, &req.token, "end")?;
            state.end_job(req, now)
        })
        .await
    }

    async fn refresh_token(
        &self,
        request: Request<RefreshTokenRequest>,
    ) -> Result<Response<RefreshTokenResponse>, Status> {
        self.call("refresh_token", |state, now| state.refresh_token(request.into_inner(), now)).await
    }

    async fn status(&self, request: Request<StatusRequest>) -> Result<Response<StatusResponse>, Status> {
        self.call("status", |state, now| state.status(request.into_inner(), now)).await
    }

    async fn report_unreachable(
        &self,
        request: Request<ReportUnreachableRequest>,
    ) -> Result<Response<ReportUnreachableResponse>, Status> {
        self.call("report_unreachable", |state, now| state.report_unreachable(request.into_inner(), now)).await
    }

    async fn register_shuffle(
        &self,
        request: Request<RegisterShuffleRequest>,
    ) -> Result<Response<RegisterShuffleResponse>, Status> {
        self.call("register_shuffle", |state, now| state.register_shuffle(request.into_inner(), now)).await
    }

    async fn advance_segment(
        &self,
        request: Request<AdvanceSegmentRequest>,
    ) -> Result<Response<AdvanceSegmentResponse>, Status> {
        self.call("advance_segment", |state, now| state.advance_segment(request.into_inner(), now)).await
    }

    async fn commit_map(&self, request: Request<CommitMapRequest>) -> Result<Response<CommitMapResponse>, Status> {
        self.call("commit_map", |state, now| state.commit_map(request.into_inner(), now)).await
    }

    async fn locate_shuffle(
        &self,
        request: Request<LocateShuffleRequest>,
    ) -> Result<Response<LocateShuffleResponse>, Status> {
        self.call("locate_shuffle", |state, now| state.locate_shuffle(request.into_inner(), now)).await
    }

    async fn invalidate_maps(
        &self,
        request: Request<InvalidateMapsRequest>,
    ) -> Result<Response<InvalidateMapsResponse>, Status> {
        self.call("invalidate_maps", |state, now| state.invalidate_maps(request.into_inner(), now)).await
    }

    async fn unregister_shuffle(
        &self,
        request: Request<UnregisterShuffleRequest>,
    ) -> Result<Response<UnregisterShuffleResponse>, Status> {
        self.call("unregister_shuffle", |state, now| state.unregister_shuffle(request.into_inner(), now)).await
    }
}

#[tonic::async_trait]
impl Registry for Service {
    async fn register_server(
        &self,
        request: Request<RegisterServerRequest>,
    ) -> Result<Response<RegisterServerResponse>, Status> {
        self.call("register_server", |state, now| state.register_server(request.into_inner(), now)).await
    }

    async fn heartbeat(&self, request: Request<HeartbeatRequest>) -> Result<Response<HeartbeatResponse>, Status> {
        self.call("heartbeat", |state, now| state.heartbeat(request.into_inner(), now)).await
    }

    async fn report_inventory(
        &self,
        request: Request<ReportInventoryRequest>,
    ) -> Result<Response<ReportInventoryResponse>, Status> {
        self.call("report_inventory", |state, now| state.report_inventory(request.into_inner(), now)).await
    }
}

#[tonic::async_trait]
impl Admin for Service {
    async fn set_server_mode(
        &self,
        request: Request<SetServerModeRequest>,
    ) -> Result<Response<SetServerModeResponse>, Status> {
        self.call("set_server_mode", |state, now| state.set_server_mode(request.into_inner(), now)).await
    }

    async fn end_job(&self, request: Request<AdminEndJobRequest>) -> Result<Response<EndJobResponse>, Status> {
        self.call("admin_end_job", |state, now| state.admin_end_job(request.into_inner(), now)).await
    }
}
