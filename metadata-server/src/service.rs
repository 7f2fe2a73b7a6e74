//! The gRPC services (Metadata for clients, Registry for storage servers, Admin for operators)
//! over the shared state.
//!
//! Every RPC goes through [`Service::call`]: read the clock (once: the state takes the time from
//! here, see [`Now`]), learn the caller (`crate::authz`), lock the state, decide whether the
//! caller may make the call (each method names what it needs), run the state's method for it, hand
//! the changes it made to the write-ahead log, unlock, wait until the log is durable that far,
//! record metrics. The lock is never held across an await; the state's methods do no I/O.
//!
//! Every call waits, reads too: a reply may show changes other calls made a moment before, and
//! nothing may be shown that a crash could still take back. With nothing in flight the wait is
//! nothing.

use std::sync::Arc;

use parking_lot::Mutex;
use tern_common::Now;
use tern_proto::identity::Identity;
use tern_proto::request_id::RequestId;
use tern_proto::v1::admin_server::Admin;
use tern_proto::v1::metadata_server::Metadata;
use tern_proto::v1::registry_server::Registry;
use tern_proto::v1::*;
use tern_proto::ErrorKind;
use tonic::{Request, Response, Status};

use crate::authz::{Authz, Needs};
use crate::metrics::Metrics;
use crate::raft::Replica;
use crate::state::State;
use crate::wal::Wal;

/// Where a call's changes go to become durable: the write-ahead log of a single server, or the
/// Raft log of a replicated one (`crate::raft`: committed on a majority).
#[derive(Debug, Clone)]
pub enum Log {
    Wal(Arc<Wal>),
    Raft(Arc<Replica>),
}

impl Log {
    /// The Raft replica beneath, if the service is replicated.
    pub fn replica(&self) -> Option<&Arc<Replica>> {
        match self {
            Log::Raft(replica) => Some(replica),
            Log::Wal(_) => None,
        }
    }

    /// Hands `changes` on (under the state's lock); the ticket to wait for.
    pub fn append(&self, changes: Vec<tern_proto::v1::LogRecord>) -> u64 {
        match self {
            Log::Wal(wal) => wal.append(&changes),
            Log::Raft(replica) => replica.propose(changes),
        }
    }

    /// Waits until `ticket` is durable (a majority's, for Raft; a read confirms the leadership).
    /// The refusal: `internal` when the WAL cannot be written, `unavailable` when a replica lost
    /// its leadership or its majority (the failover channel asks the new leader).
    pub async fn wait(&self, ticket: u64, read: bool) -> Result<(), Status> {
        match self {
            Log::Wal(wal) => wal.wait(ticket).await.map_err(|why| {
                ErrorKind::Internal
                    .status(format!("the metadata log cannot be written, so nothing is acknowledged: {why}"))
            }),
            Log::Raft(replica) => replica.wait(ticket, read).await,
        }
    }
}

pub struct Service {
    state: Arc<Mutex<State>>,
    log: Log,
    metrics: Metrics,
    authz: Arc<Authz>,
}

impl Service {
    pub fn new(state: Arc<Mutex<State>>, log: Log, metrics: Metrics, authz: Arc<Authz>) -> Service {
        Service { state, log, metrics, authz }
    }

    /// Serves one call: who the caller is, whether `needs` allows it, then `op` on the state.
    async fn call<R, T: prost::Message + Default>(
        &self,
        method: &'static str,
        request: Request<R>,
        needs: impl FnOnce(&R) -> Needs,
        op: impl FnOnce(&mut State, Now, R) -> Result<T, Status>,
    ) -> Result<Response<T>, Status> {
        self.call_as(method, request, needs, |state, now, req, _| op(state, now, req)).await
    }

    /// [`Service::call`] for an `op` that needs the caller's identity too (what it makes is
    /// the caller's tenant's).
    ///
    /// A call carrying a request id ([`RequestId`]) that the state remembers is answered as it
    /// was the first time, without running `op` or deciding again (the same caller was allowed
    /// it then; what it changed may since refuse it, a deleted file say); it then waits as a
    /// read does, for what it saw to be committed. One that succeeds and changes something is
    /// remembered, its answer logged after its changes (`state/requests.rs`).
    async fn call_as<R, T: prost::Message + Default>(
        &self,
        method: &'static str,
        request: Request<R>,
        needs: impl FnOnce(&R) -> Needs,
        op: impl FnOnce(&mut State, Now, R, &Identity) -> Result<T, Status>,
    ) -> Result<Response<T>, Status> {
        #[expect(clippy::disallowed_methods, reason = "the edge: each call reads the clock once and passes it in")]
        let now = Now::read();
        let (mut result, lsn) = self.serve(method, request, needs, op, now);
        if let Some((lsn, read)) = lsn {
            if let Err(status) = self.log.wait(lsn, read).await {
                result = Err(ErrorKind::of_status(&status).status(format!("{method}: {}", status.message())));
            }
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

    /// The part of [`Service::call_as`] under the state's lock: who the caller is, whether it may,
    /// and `op` (or the answer remembered for its request id); with the log ticket to wait for
    /// and whether the call was a read, or no ticket when nothing was looked at.
    fn serve<R, T: prost::Message + Default>(
        &self,
        method: &'static str,
        request: Request<R>,
        needs: impl FnOnce(&R) -> Needs,
        op: impl FnOnce(&mut State, Now, R, &Identity) -> Result<T, Status>,
        now: Now,
    ) -> (Result<T, Status>, Option<(u64, bool)>) {
        let caller = match self.authz.caller(method, &request, now.instant) {
            Ok(caller) => caller,
            Err(refused) => return (Err(refused), None),
        };
        let id = match RequestId::of(request.metadata()) {
            Ok(id) => id,
            Err(why) => return (Err(ErrorKind::Invalid.status(format!("{method}: {why}"))), None),
        };
        let needs = needs(request.get_ref());
        let req = request.into_inner();
        let mut state = self.state.lock();
        if let Log::Raft(replica) = &self.log {
            // Not the leader: nothing was looked at, nothing to wait for.
            if let Err(refused) = replica.check_serving() {
                return (Err(refused), None);
            }
        }
        // Only a call with an id needs its caller's name (reads have none).
        let who = id.map(|_| caller.identity.to_string()).unwrap_or_default();
        let result = match id.and_then(|id| state.answered(id, method, &who)) {
            Some(answered) => answered,
            None => {
                let result = self
                    .authz
                    .decide(method, &caller, &needs, &state, now.instant)
                    .and_then(|()| op(&mut state, now, req, &caller.identity));
                if let (Some(id), Ok(response)) = (id, &result) {
                    if state.has_journal() {
                        state.remember(id, method, &who, response, now);
                    }
                }
                result
            }
        };
        let changes = state.take_journal();
        let read = changes.is_empty();
        (result, Some((self.log.append(changes), read)))
    }
}

#[tonic::async_trait]
impl Metadata for Service {
    async fn mkdir(&self, request: Request<MkdirRequest>) -> Result<Response<MkdirResponse>, Status> {
        let mkdir = |state: &mut State, now, req, caller: &Identity| {
            state.mkdir(MkdirRequest { owner: caller.tenant.clone(), ..req }, now)
        };
        self.call_as("mkdir", request, |r| Needs::Path(r.path.clone()), mkdir).await
    }

    async fn create(&self, request: Request<CreateRequest>) -> Result<Response<CreateResponse>, Status> {
        let create = |state: &mut State, now, req, caller: &Identity| {
            state.create(CreateRequest { owner: caller.tenant.clone(), ..req }, now)
        };
        self.call_as("create", request, |r| Needs::Path(r.path.clone()), create).await
    }

    async fn allocate_blocks(
        &self,
        request: Request<AllocateBlocksRequest>,
    ) -> Result<Response<AllocateBlocksResponse>, Status> {
        self.call(
            "allocate_blocks",
            request,
            |r| Needs::File(r.file_id),
            |state, now, req| state.allocate_blocks(req, now),
        )
        .await
    }

    async fn seal(&self, request: Request<SealRequest>) -> Result<Response<SealResponse>, Status> {
        self.call("seal", request, |r| Needs::File(r.file_id), |state, now, req| state.seal(req, now)).await
    }

    async fn renew_writer(
        &self,
        request: Request<RenewWriterRequest>,
    ) -> Result<Response<RenewWriterResponse>, Status> {
        self.call("renew_writer", request, |r| Needs::File(r.file_id), |state, now, req| state.renew_writer(req, now))
            .await
    }

    async fn abort(&self, request: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        self.call("abort", request, |r| Needs::File(r.file_id), |state, now, req| state.abort(req, now)).await
    }

    async fn open(&self, request: Request<OpenRequest>) -> Result<Response<OpenResponse>, Status> {
        self.call("open", request, |r| Needs::Path(r.path.clone()), |state, now, req| state.open(req, now)).await
    }

    async fn stat(&self, request: Request<StatRequest>) -> Result<Response<StatResponse>, Status> {
        self.call("stat", request, |r| Needs::Path(r.path.clone()), |state, now, req| state.stat(req, now)).await
    }

    async fn list(&self, request: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        self.call("list", request, |r| Needs::Path(r.path.clone()), |state, now, req| state.list(req, now)).await
    }

    async fn delete(&self, request: Request<DeleteRequest>) -> Result<Response<DeleteResponse>, Status> {
        self.call("delete", request, |r| Needs::Path(r.path.clone()), |state, now, req| state.delete(req, now)).await
    }

    async fn rename(&self, request: Request<RenameRequest>) -> Result<Response<RenameResponse>, Status> {
        self.call(
            "rename",
            request,
            |r| Needs::Paths(r.from.clone(), r.to.clone()),
            |state, now, req| state.rename(req, now),
        )
        .await
    }

    async fn register_job(
        &self,
        request: Request<RegisterJobRequest>,
    ) -> Result<Response<RegisterJobResponse>, Status> {
        // A job counts against its caller's tenant unless the request names one (which the
        // authorization allows only as that tenant, or for the scheduler and operators).
        let register = |state: &mut State, now, req: RegisterJobRequest, caller: &Identity| {
            let tenant = if req.tenant.is_empty() { caller.tenant.clone() } else { req.tenant };
            state.register_job(RegisterJobRequest { tenant, ..req }, now)
        };
        self.call_as("register_job", request, |r| Needs::Tenant(r.tenant.clone()), register).await
    }

    async fn renew_job(&self, request: Request<RenewJobRequest>) -> Result<Response<RenewJobResponse>, Status> {
        // Its token is in the request, checked with it.
        self.call(
            "renew_job",
            request,
            |_| Needs::Anyone,
            |state, now, req| {
                state.check_job_token(&req.job_id, &req.token, "renew")?;
                state.renew_job(req, now)
            },
        )
        .await
    }

    async fn end_job(&self, request: Request<EndJobRequest>) -> Result<Response<EndJobResponse>, Status> {
        self.call(
            "end_job",
            request,
            |_| Needs::Anyone,
            |state, now, req| {
                state.check_job_token(&req.job_id, &req.token, "end")?;
                state.end_job(req, now)
            },
        )
        .await
    }

    async fn refresh_token(
        &self,
        request: Request<RefreshTokenRequest>,
    ) -> Result<Response<RefreshTokenResponse>, Status> {
        self.call("refresh_token", request, |_| Needs::Anyone, |state, now, req| state.refresh_token(req, now)).await
    }

    async fn status(&self, request: Request<StatusRequest>) -> Result<Response<StatusResponse>, Status> {
        self.call("status", request, |_| Needs::Anyone, |state, now, req| state.status(req, now)).await
    }

    async fn report_unreachable(
        &self,
        request: Request<ReportUnreachableRequest>,
    ) -> Result<Response<ReportUnreachableResponse>, Status> {
        self.call(
            "report_unreachable",
            request,
            |_| Needs::Anyone,
            |state, now, req| state.report_unreachable(req, now),
        )
        .await
    }

    async fn register_shuffle(
        &self,
        request: Request<RegisterShuffleRequest>,
    ) -> Result<Response<RegisterShuffleResponse>, Status> {
        self.call(
            "register_shuffle",
            request,
            |r| Needs::Job(r.job_id.clone()),
            |state, now, req| state.register_shuffle(req, now),
        )
        .await
    }

    async fn advance_segment(
        &self,
        request: Request<AdvanceSegmentRequest>,
    ) -> Result<Response<AdvanceSegmentResponse>, Status> {
        self.call(
            "advance_segment",
            request,
            |r| Needs::Shuffle(r.shuffle_id),
            |state, now, req| state.advance_segment(req, now),
        )
        .await
    }

    async fn commit_map(&self, request: Request<CommitMapRequest>) -> Result<Response<CommitMapResponse>, Status> {
        self.call("commit_map", request, |r| Needs::Shuffle(r.shuffle_id), |state, now, req| state.commit_map(req, now))
            .await
    }

    async fn locate_shuffle(
        &self,
        request: Request<LocateShuffleRequest>,
    ) -> Result<Response<LocateShuffleResponse>, Status> {
        self.call(
            "locate_shuffle",
            request,
            |r| Needs::Shuffle(r.shuffle_id),
            |state, now, req| state.locate_shuffle(req, now),
        )
        .await
    }

    async fn invalidate_maps(
        &self,
        request: Request<InvalidateMapsRequest>,
    ) -> Result<Response<InvalidateMapsResponse>, Status> {
        self.call(
            "invalidate_maps",
            request,
            |r| Needs::Shuffle(r.shuffle_id),
            |state, now, req| state.invalidate_maps(req, now),
        )
        .await
    }

    async fn unregister_shuffle(
        &self,
        request: Request<UnregisterShuffleRequest>,
    ) -> Result<Response<UnregisterShuffleResponse>, Status> {
        self.call(
            "unregister_shuffle",
            request,
            |r| Needs::Shuffle(r.shuffle_id),
            |state, now, req| state.unregister_shuffle(req, now),
        )
        .await
    }
}

#[tonic::async_trait]
impl Registry for Service {
    async fn register_server(
        &self,
        request: Request<RegisterServerRequest>,
    ) -> Result<Response<RegisterServerResponse>, Status> {
        self.call(
            "register_server",
            request,
            |r| Needs::ServerAt(r.address.clone()),
            |state, now, req| state.register_server(req, now),
        )
        .await
    }

    async fn heartbeat(&self, request: Request<HeartbeatRequest>) -> Result<Response<HeartbeatResponse>, Status> {
        self.call("heartbeat", request, |r| Needs::ServerId(r.server_id), |state, now, req| state.heartbeat(req, now))
            .await
    }

    async fn report_inventory(
        &self,
        request: Request<ReportInventoryRequest>,
    ) -> Result<Response<ReportInventoryResponse>, Status> {
        self.call(
            "report_inventory",
            request,
            |r| Needs::ServerId(r.server_id),
            |state, now, req| state.report_inventory(req, now),
        )
        .await
    }
}

#[tonic::async_trait]
impl Admin for Service {
    async fn set_server_mode(
        &self,
        request: Request<SetServerModeRequest>,
    ) -> Result<Response<SetServerModeResponse>, Status> {
        self.call(
            "set_server_mode",
            request,
            |r| Needs::SetMode { server: r.server.clone(), mode: r.mode },
            |state, now, req| state.set_server_mode(req, now),
        )
        .await
    }

    async fn end_job(&self, request: Request<AdminEndJobRequest>) -> Result<Response<EndJobResponse>, Status> {
        self.call("admin_end_job", request, |_| Needs::Admin, |state, now, req| state.admin_end_job(req, now)).await
    }

    async fn metadata_members(
        &self,
        request: Request<MetadataMembersRequest>,
    ) -> Result<Response<MetadataMembersResponse>, Status> {
        self.membership("metadata_members", request, Needs::Anyone, async |replica, _| match replica {
            Some(replica) => replica.members(),
            None => Ok(MetadataMembersResponse::default()),
        })
        .await
    }

    async fn add_metadata_member(
        &self,
        request: Request<AddMetadataMemberRequest>,
    ) -> Result<Response<MetadataMembersResponse>, Status> {
        self.membership("add_metadata_member", request, Needs::Admin, async |replica, req| {
            not_replicated(replica)?.add_member(req.id, &req.addr).await
        })
        .await
    }

    async fn remove_metadata_member(
        &self,
        request: Request<RemoveMetadataMemberRequest>,
    ) -> Result<Response<MetadataMembersResponse>, Status> {
        self.membership("remove_metadata_member", request, Needs::Admin, async |replica, req| {
            not_replicated(replica)?.remove_member(req.id).await
        })
        .await
    }
}

/// The replica a membership change goes to; a refusal for a metadata server without peers.
fn not_replicated(replica: Option<&Replica>) -> Result<&Replica, Status> {
    replica.ok_or_else(|| {
        ErrorKind::Invalid.status("this metadata server is not replicated (no peers): it has no members to change")
    })
}

impl Service {
    /// A membership call: who the caller is and whether `needs` allows it, then `op` on the
    /// replica (None for a single server). Membership lives in Raft's log beneath the state, so
    /// `op` runs outside the state's lock and is not a request-id call (a retried add or remove
    /// finds its change made and answers the members).
    async fn membership<R, T: prost::Message>(
        &self,
        method: &'static str,
        request: Request<R>,
        needs: Needs,
        op: impl AsyncFnOnce(Option<&Replica>, R) -> Result<T, Status>,
    ) -> Result<Response<T>, Status> {
        #[expect(clippy::disallowed_methods, reason = "the edge: each call reads the clock once")]
        let now = Now::read();
        let admitted = self
            .authz
            .caller(method, &request, now.instant)
            .and_then(|caller| self.authz.decide(method, &caller, &needs, &self.state.lock(), now.instant));
        let result = match admitted {
            Ok(()) => op(self.log.replica().map(|replica| &**replica), request.into_inner())
                .await
                .map_err(|status| ErrorKind::of_status(&status).status(format!("{method}: {}", status.message()))),
            Err(refused) => Err(refused),
        };
        self.metrics.record(method, now.instant.elapsed(), result.as_ref().err());
        result.map(Response::new)
    }
}

#[cfg(test)]
#[path = "service_tests.rs"]
mod tests;
