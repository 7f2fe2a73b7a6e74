//! Raft's messages between metadata servers: the `Raft` gRPC service (on the metadata server's
//! own port) and the client side openraft calls through. Each message is openraft's request or
//! `Result<response, error>` in `codec`'s encoding in a `RaftMessage`, bounded by `max_message_size`; callers
//! present a `metadata` credential made from the cluster secret, and the service admits no
//! other (`Authz::decide_metadata`). With `tls_dir` the peers talk mutual TLS, as every other
//! gRPC caller does: each presents its node certificate and accepts only a peer certificate
//! from the cluster CA for the peer's address. Every RPC has a deadline (openraft's TTL, at most
//! `RPC_DEADLINE`).

use std::sync::Arc;
use std::time::Duration;

use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::{BasicNode, Raft};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tern_common::Now;
use tern_proto::identity::{ClusterSecret, Identity, Presenting, Presents, Role};
use tern_proto::v1::raft_client::RaftClient;
use tern_proto::v1::RaftMessage;
use tern_proto::ErrorKind;
use tern_transport::tls::{grpc_endpoint, TlsMaterial};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use tracing::debug;

use super::elect::{would_vote, Answers, Heard, PreVote, PRE_VOTE_DEADLINE};
use super::{codec, Replica, TypeConfig, RPC_DEADLINE};
use crate::authz::Authz;

/// Makes a client per peer, each presenting this node's `metadata` credential (and, with TLS,
/// its node certificate).
#[derive(Clone)]
pub struct Network {
    credential: String,
    max_message_bytes: usize,
    tls: Option<TlsMaterial>,
    /// When each peer last answered an AppendEntries as a follower of this node.
    pub answers: Arc<Answers>,
}

impl Network {
    pub fn new(
        secret: &ClusterSecret,
        me: u64,
        max_message_bytes: usize,
        tls: Option<TlsMaterial>,
    ) -> anyhow::Result<Network> {
        let credential = secret.credential(&Identity::new(Role::Metadata, "", &format!("node-{me}")));
        Presents::credential(&credential).map_err(|e| anyhow::anyhow!("{}", e.0))?;
        Ok(Network { credential, max_message_bytes, tls, answers: Arc::default() })
    }
}

/// One peer's client; the channel connects lazily (and again after a failure).
pub struct Peer {
    target: u64,
    client: Option<RaftClient<Presenting<Channel>>>,
    error: Option<String>,
    answers: Arc<Answers>,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Peer;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> Peer {
        let answers = self.answers.clone();
        match self.client(&node.addr) {
            Ok(client) => Peer { target, client: Some(client), error: None, answers },
            Err(error) => Peer { target, client: None, error: Some(error), answers },
        }
    }
}

/// A peer's `Raft` client.
pub type Client = RaftClient<Presenting<Channel>>;

impl Network {
    /// A lazily connected client of the peer at `addr`.
    pub fn client(&self, addr: &str) -> Result<Client, String> {
        let endpoint = grpc_endpoint(addr, self.tls.as_ref()).map_err(|e| format!("peer address {addr:?}: {e:#}"))?;
        let channel = endpoint.connect_timeout(RPC_DEADLINE).tcp_nodelay(true).connect_lazy();
        let presents = Presents::credential(&self.credential).expect("checked in Network::new");
        Ok(RaftClient::with_interceptor(channel, presents)
            .max_decoding_message_size(self.max_message_bytes)
            .max_encoding_message_size(self.max_message_bytes))
    }

    /// Whether the peer would vote for `ask`'s candidate (`elect`); no answer within
    /// `PRE_VOTE_DEADLINE`, or any error, is a no.
    pub async fn pre_vote(mut client: Client, ask: &PreVote) -> bool {
        let mut message = Request::new(encode(ask));
        message.set_timeout(PRE_VOTE_DEADLINE);
        match tokio::time::timeout(PRE_VOTE_DEADLINE, client.pre_vote(message)).await {
            Ok(Ok(reply)) => codec::decode::<bool>(&reply.into_inner().payload).unwrap_or(false),
            _ => false,
        }
    }
}

fn encode<T: Serialize>(value: &T) -> RaftMessage {
    RaftMessage { payload: codec::encode(value) }
}

impl Peer {
    /// Sends `request` by `call`, within the TTL; decodes the peer's `Result`.
    async fn send<Req, Resp, E>(
        &mut self,
        request: &Req,
        option: &RPCOption,
        which: &'static str,
    ) -> Result<Resp, RPCError<u64, BasicNode, RaftError<u64, E>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let Some(client) = self.client.as_mut() else {
            let why = self.error.clone().unwrap_or_default();
            return Err(RPCError::Unreachable(Unreachable::new(&std::io::Error::other(why))));
        };
        let deadline = option.hard_ttl().min(RPC_DEADLINE).max(Duration::from_millis(50));
        let mut message = Request::new(encode(request));
        message.set_timeout(deadline);
        let call = async {
            match which {
                "append_entries" => client.append_entries(message).await,
                "vote" => client.vote(message).await,
                _ => client.install_snapshot(message).await,
            }
        };
        let reply = match tokio::time::timeout(deadline, call).await {
            Err(_) => {
                let e = std::io::Error::new(std::io::ErrorKind::TimedOut, format!("{which} past {deadline:?}"));
                return Err(RPCError::Network(NetworkError::new(&e)));
            }
            Ok(Err(status)) if status.code() == tonic::Code::Unavailable => {
                return Err(RPCError::Unreachable(Unreachable::new(&std::io::Error::other(status.to_string()))));
            }
            Ok(Err(status)) => {
                return Err(RPCError::Network(NetworkError::new(&std::io::Error::other(status.to_string()))));
            }
            Ok(Ok(reply)) => reply.into_inner(),
        };
        let result: Result<Resp, RaftError<u64, E>> = codec::decode(&reply.payload)
            .map_err(|e| RPCError::Network(NetworkError::new(&std::io::Error::other(format!("{which} reply: {e}")))))?;
        result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for Peer {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        let reply = self.send(&rpc, &option, "append_entries").await;
        // Any answer but a higher vote is a follower's (a conflict too: it follows, behind).
        if reply.as_ref().is_ok_and(|answer| !matches!(answer, AppendEntriesResponse::HigherVote(_))) {
            #[expect(clippy::disallowed_methods, reason = "the edge: a peer's answer is timed as it comes")]
            let now = Now::read().instant;
            self.answers.touch(self.target, now);
        }
        reply
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<u64>, RPCError<u64, BasicNode, RaftError<u64, InstallSnapshotError>>> {
        self.send(&rpc, &option, "install_snapshot").await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<u64>,
        option: RPCOption,
    ) -> Result<VoteResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        self.send(&rpc, &option, "vote").await
    }
}

/// The `Raft` gRPC service: hands each message to this node's Raft.
/// Served by every metadata server: a single one (no `peers`) refuses other callers alike and
/// tells a metadata server that it is not replicated.
pub struct RaftService {
    /// This node's replica; None for a single server.
    replica: Option<Arc<Replica>>,
    authz: Arc<Authz>,
}

impl RaftService {
    pub fn new(replica: Option<Arc<Replica>>, authz: Arc<Authz>) -> RaftService {
        RaftService { replica, authz }
    }

    /// Checks the caller is a metadata server and decodes the request; the time it came in.
    fn admit<T: DeserializeOwned>(
        &self,
        method: &'static str,
        request: Request<RaftMessage>,
    ) -> Result<(&Raft<TypeConfig>, &Heard, T, Now), Status> {
        #[expect(clippy::disallowed_methods, reason = "the edge: each Raft message reads the clock once")]
        let now = Now::read();
        let caller = self.authz.caller(method, &request, now.instant)?;
        self.authz.decide_metadata(method, &caller, now.instant)?;
        let Some(replica) = &self.replica else {
            return Err(
                ErrorKind::Invalid.status(format!("{method}: this metadata server is not replicated (no peers)"))
            );
        };
        let rpc = codec::decode(&request.into_inner().payload)
            .map_err(|e| ErrorKind::Invalid.status(format!("{method}: the message does not decode: {e}")))?;
        Ok((&replica.raft, &replica.heard, rpc, now))
    }
}

#[tonic::async_trait]
impl tern_proto::v1::raft_server::Raft for RaftService {
    async fn append_entries(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let (raft, heard, rpc, now): (_, _, AppendEntriesRequest<TypeConfig>, _) =
            self.admit("raft_append_entries", request)?;
        let answer = raft.append_entries(rpc).await;
        // A leader of this term or a later one (a stale one is answered HigherVote).
        if answer.as_ref().is_ok_and(|a| !matches!(a, AppendEntriesResponse::HigherVote(_))) {
            heard.touch(now.instant);
        }
        Ok(Response::new(encode(&answer)))
    }

    async fn vote(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let (raft, _, rpc, _): (_, _, VoteRequest<u64>, _) = self.admit("raft_vote", request)?;
        Ok(Response::new(encode(&raft.vote(rpc).await)))
    }

    async fn install_snapshot(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let (raft, heard, rpc, now): (_, _, InstallSnapshotRequest<TypeConfig>, _) =
            self.admit("raft_install_snapshot", request)?;
        let vote = rpc.vote;
        let answer = raft.install_snapshot(rpc).await;
        // A stale sender is answered with this node's higher vote.
        if answer.as_ref().is_ok_and(|a| a.vote <= vote) {
            heard.touch(now.instant);
        }
        Ok(Response::new(encode(&answer)))
    }

    async fn pre_vote(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let (raft, heard, ask, now): (_, _, PreVote, _) = self.admit("raft_pre_vote", request)?;
        let granted = would_vote(raft, heard, &ask, now.instant);
        debug!(candidate = ask.candidate, granted, "pre-vote");
        Ok(Response::new(encode(&granted)))
    }
}
