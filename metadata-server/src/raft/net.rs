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

use super::{codec, TypeConfig, RPC_DEADLINE};
use crate::authz::Authz;

/// Makes a client per peer, each presenting this node's `metadata` credential (and, with TLS,
/// its node certificate).
pub struct Network {
    credential: String,
    max_message_bytes: usize,
    tls: Option<TlsMaterial>,
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
        Ok(Network { credential, max_message_bytes, tls })
    }
}

/// One peer's client; the channel connects lazily (and again after a failure).
pub struct Peer {
    target: u64,
    client: Option<RaftClient<Presenting<Channel>>>,
    error: Option<String>,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Peer;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> Peer {
        let made = grpc_endpoint(&node.addr, self.tls.as_ref()).map(|endpoint| {
            let channel = endpoint.connect_timeout(RPC_DEADLINE).tcp_nodelay(true).connect_lazy();
            let presents = Presents::credential(&self.credential).expect("checked in Network::new");
            RaftClient::with_interceptor(channel, presents)
                .max_decoding_message_size(self.max_message_bytes)
                .max_encoding_message_size(self.max_message_bytes)
        });
        match made {
            Ok(client) => Peer { target, client: Some(client), error: None },
            Err(e) => Peer { target, client: None, error: Some(format!("peer address {:?}: {e:#}", node.addr)) },
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
        self.send(&rpc, &option, "append_entries").await
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
    raft: Option<Raft<TypeConfig>>,
    authz: Arc<Authz>,
}

impl RaftService {
    pub fn new(raft: Option<Raft<TypeConfig>>, authz: Arc<Authz>) -> RaftService {
        RaftService { raft, authz }
    }

    /// Checks the caller is a metadata server and decodes the request.
    fn admit<T: DeserializeOwned>(
        &self,
        method: &'static str,
        request: Request<RaftMessage>,
    ) -> Result<(&Raft<TypeConfig>, T), Status> {
        #[expect(clippy::disallowed_methods, reason = "the edge: the refusal log's time is read here")]
        let now = Now::read();
        let caller = self.authz.caller(method, &request, now.instant)?;
        self.authz.decide_metadata(method, &caller, now.instant)?;
        let Some(raft) = &self.raft else {
            return Err(
                ErrorKind::Invalid.status(format!("{method}: this metadata server is not replicated (no peers)"))
            );
        };
        let rpc = codec::decode(&request.into_inner().payload)
            .map_err(|e| ErrorKind::Invalid.status(format!("{method}: the message does not decode: {e}")))?;
        Ok((raft, rpc))
    }
}

#[tonic::async_trait]
impl tern_proto::v1::raft_server::Raft for RaftService {
    async fn append_entries(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let (raft, rpc): (_, AppendEntriesRequest<TypeConfig>) = self.admit("raft_append_entries", request)?;
        Ok(Response::new(encode(&raft.append_entries(rpc).await)))
    }

    async fn vote(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let (raft, rpc): (_, VoteRequest<u64>) = self.admit("raft_vote", request)?;
        Ok(Response::new(encode(&raft.vote(rpc).await)))
    }

    async fn install_snapshot(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let (raft, rpc): (_, InstallSnapshotRequest<TypeConfig>) = self.admit("raft_install_snapshot", request)?;
        Ok(Response::new(encode(&raft.install_snapshot(rpc).await)))
    }
}
