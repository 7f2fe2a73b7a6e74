//! Who may do what on the control plane (ARCHITECTURE.md, "Who may do what"), through a real
//! cluster: every RPC of the Metadata, Registry and Admin services, called by every kind of
//! caller, is allowed or refused (`permission-denied`) as the table says, on a plain loopback
//! cluster and on one whose gRPC is mutual TLS. An RPC added to `tern.proto` fails the test until
//! the table lists it. The namespace's calls are tried twice: on a job's files under `/jobs`, and
//! on files outside it, which belong to the tenant that made them.

use std::time::Duration;

use tern_proto::identity::{ClusterSecret, Identity, Presenting, Presents, Role};
use tern_proto::v1::admin_client::AdminClient;
use tern_proto::v1::metadata_client::MetadataClient;
use tern_proto::v1::raft_client::RaftClient;
use tern_proto::v1::registry_client::RegistryClient;
use tern_proto::v1::*;
use tern_proto::ErrorKind;
use tonic::transport::Channel;

use crate::common::table::Table;
use crate::common::{Cluster, Tls};

/// The kinds of caller every RPC is tried with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// No credential, no token.
    Nobody,
    /// A client of the job's tenant (its credential) without the job's token.
    TenantClient,
    /// A client of the job's tenant holding the job's token.
    JobHolder,
    /// A client of another tenant, holding its own job's token.
    OtherTenant,
    /// A storage server (its credential, bound to its address).
    Server,
    /// An operator.
    Admin,
}

const KINDS: [Kind; 6] =
    [Kind::Nobody, Kind::TenantClient, Kind::JobHolder, Kind::OtherTenant, Kind::Server, Kind::Admin];

/// Who is allowed each RPC: the table of ARCHITECTURE.md, "Who may do what".
fn allowed(rpc: &str) -> &'static [Kind] {
    use Kind::*;
    match rpc {
        // A job's files and shuffles: its token's holders, and operators.
        "Mkdir" | "Create" | "AllocateBlocks" | "Seal" | "RenewWriter" | "Abort" | "Open" | "Stat" | "List"
        | "Delete" | "Rename" | "RegisterShuffle" | "AdvanceSegment" | "CommitMap" | "LocateShuffle"
        | "InvalidateMaps" | "UnregisterShuffle" => &[JobHolder, Admin],
        // The token is in the request: only its holder.
        "RenewJob" | "EndJob" | "RefreshToken" => &[JobHolder],
        // Naming the default tenant: its clients (no credential is one) and operators.
        "RegisterJob" => &[Nobody, TenantClient, JobHolder, Admin],
        "Status" | "ReportUnreachable" => &[Nobody, TenantClient, JobHolder, OtherTenant, Server, Admin],
        "RegisterServer" | "Heartbeat" | "ReportInventory" => &[Server],
        "SetServerMode" | "Admin.EndJob" | "AddMetadataMember" | "RemoveMetadataMember" => &[Admin],
        // The members and who leads, as Status shows the servers.
        "MetadataMembers" => &[Nobody, TenantClient, JobHolder, OtherTenant, Server, Admin],
        // Between metadata servers only (a `metadata` credential, which no kind here holds).
        "AppendEntries" | "Vote" | "InstallSnapshot" | "PreVote" => &[],
        other => {
            panic!("RPC {other} is not in the authorization table (tests/integration/authz.rs and ARCHITECTURE.md)")
        }
    }
}

/// Who is allowed each namespace RPC on files outside `/jobs` made by a client of the default
/// tenant (a caller without a credential is one): that tenant's clients and operators. None for
/// the RPCs that act on no path.
fn allowed_outside_jobs(rpc: &str) -> Option<&'static [Kind]> {
    use Kind::*;
    match rpc {
        "Mkdir" | "Create" | "AllocateBlocks" | "Seal" | "RenewWriter" | "Abort" | "Open" | "Stat" | "List"
        | "Delete" | "Rename" => Some(&[Nobody, TenantClient, JobHolder, Admin]),
        _ => None,
    }
}

/// Every RPC of the Metadata, Registry and Admin services, read from `tern.proto` (Admin's EndJob
/// as "Admin.EndJob").
fn rpcs() -> Vec<String> {
    let proto = include_str!("../../proto/proto/tern.proto");
    let mut service = "";
    let mut rpcs = Vec::new();
    for line in proto.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("service ") {
            service = rest.split_whitespace().next().unwrap_or_default();
        } else if let Some(rest) = line.strip_prefix("rpc ") {
            let name = rest.split('(').next().unwrap().trim();
            rpcs.push(if service == "Admin" && name == "EndJob" {
                "Admin.EndJob".to_string()
            } else {
                name.to_string()
            });
        }
    }
    assert!(rpcs.len() >= 28, "read {} RPCs from tern.proto", rpcs.len());
    rpcs
}

/// A caller's three clients on one channel, presenting what its kind has.
struct Caller {
    metadata: MetadataClient<Presenting<Channel>>,
    registry: RegistryClient<Presenting<Channel>>,
    admin: AdminClient<Presenting<Channel>>,
    raft: RaftClient<Presenting<Channel>>,
    /// The job token it holds, if any, as text.
    token: Option<String>,
}

/// What one cell of the table acts on: a job of the default tenant with a shuffle, and a directory
/// (the job's root, or one outside `/jobs`) with a sealed file and an unsealed one, made fresh for
/// each cell so destructive calls do not disturb others.
struct Target {
    job: String,
    token: String,
    root: String,
    sealed: String,
    unsealed: u64,
    shuffle: u64,
}

struct Fixture {
    cluster: Cluster,
    secret: ClusterSecret,
    /// A (fake) storage server's address and id: the Server caller is that server.
    server_address: String,
    server_id: u64,
    /// A job of tenant "other", whose token the OtherTenant caller holds.
    other_token: String,
    channel: Channel,
    cells: u64,
}

impl Fixture {
    async fn start(tls: Tls) -> Fixture {
        let cluster = Cluster::start_with(1, "64MiB", tls).await;
        let secret = ClusterSecret::load(&cluster.dir.path().join("cluster.secret")).unwrap();
        let channel = channel(&cluster).await;
        let server_address = format!("127.0.0.1:{}", crate::common::free_port());
        let server =
            Presents::credential(&secret.credential(&Identity::new(Role::Server, "", &server_address))).unwrap();
        let tiers = vec![TierUsage { tier: "dram".into(), ..TierUsage::default() }];
        let ask =
            RegisterServerRequest { address: server_address.clone(), tiers, instance_id: 7, ..Default::default() };
        let registered =
            RegistryClient::with_interceptor(channel.clone(), server).register_server(ask).await.unwrap().into_inner();
        assert!(!registered.token_key.is_empty(), "a storage server gets the key");
        let other = Presents::credential(&secret.credential(&Identity::new(Role::Client, "other", ""))).unwrap();
        let ask = RegisterJobRequest { name: "other-job".into(), ..Default::default() };
        let other_job =
            MetadataClient::with_interceptor(channel.clone(), other).register_job(ask).await.unwrap().into_inner();
        assert!(!other_job.token.is_empty());
        Fixture {
            cluster,
            secret,
            server_address,
            server_id: registered.server_id,
            other_token: other_job.token,
            channel,
            cells: 0,
        }
    }

    fn caller(&self, kind: Kind, target: &Target) -> Caller {
        let credential = |identity: Identity| Some(self.secret.credential(&identity));
        let (credential, token) = match kind {
            Kind::Nobody => (None, None),
            Kind::TenantClient => (credential(Identity::new(Role::Client, "default", "")), None),
            Kind::JobHolder => (credential(Identity::new(Role::Client, "default", "")), Some(target.token.clone())),
            Kind::OtherTenant => (credential(Identity::new(Role::Client, "other", "")), Some(self.other_token.clone())),
            Kind::Server => (credential(Identity::new(Role::Server, "", &self.server_address)), None),
            Kind::Admin => (credential(Identity::new(Role::Admin, "", "")), None),
        };
        let mut presents = Presents::default();
        if let Some(credential) = &credential {
            presents = Presents::credential(credential).unwrap();
        }
        if let Some(token) = &token {
            presents = presents.and_job_token(token).unwrap();
        }
        Caller {
            metadata: MetadataClient::with_interceptor(self.channel.clone(), presents.clone()),
            registry: RegistryClient::with_interceptor(self.channel.clone(), presents.clone()),
            admin: AdminClient::with_interceptor(self.channel.clone(), presents.clone()),
            raft: RaftClient::with_interceptor(self.channel.clone(), presents),
            token,
        }
    }

    /// A fresh job with its objects, made by its holder (a client of the default tenant without
    /// a credential); its files are in the job's root, or `outside_jobs` in a directory of theirs.
    async fn target(&mut self, outside_jobs: bool) -> Target {
        self.cells += 1;
        let ask = RegisterJobRequest { name: format!("cell-{}", self.cells), ..Default::default() };
        let job = MetadataClient::new(self.channel.clone()).register_job(ask).await.unwrap().into_inner();
        let mut holder =
            MetadataClient::with_interceptor(self.channel.clone(), Presents::job_token(&job.token).unwrap());
        let root = if outside_jobs { format!("/tenant-files/cell-{}", self.cells) } else { job.root.clone() };
        let sealed = format!("{root}/sealed");
        let ask = CreateRequest { path: sealed.clone(), sealed: true, parents: true, ..Default::default() };
        holder.create(ask).await.unwrap();
        let ask = CreateRequest { path: format!("{root}/unsealed"), ..Default::default() };
        let unsealed = holder.create(ask).await.unwrap().into_inner().file_id;
        let ask = RegisterShuffleRequest { job_id: job.job_id.clone(), partitions: 1, maps: 1, ..Default::default() };
        let shuffle = holder.register_shuffle(ask).await.unwrap().into_inner().shuffle_id;
        Target { job: job.job_id, token: job.token, root, sealed, unsealed, shuffle }
    }

    /// Calls `rpc` as `caller` on `target`; the status it failed with, if it did.
    async fn call(&self, rpc: &str, caller: &mut Caller, target: &Target) -> Result<(), tonic::Status> {
        let root = &target.root;
        // The body's token, for the calls that carry it: the holder's, or another job's.
        let body_token =
            caller.token.clone().filter(|t| *t == target.token).unwrap_or_else(|| self.other_token.clone());
        let m = &mut caller.metadata;
        let done = match rpc {
            "Mkdir" => m.mkdir(MkdirRequest { path: format!("{root}/dir"), ..Default::default() }).await.map(drop),
            "Create" => m.create(CreateRequest { path: format!("{root}/new"), ..Default::default() }).await.map(drop),
            "AllocateBlocks" => {
                let ask = AllocateBlocksRequest { file_id: target.unsealed, count: 1, client_host: "127.0.0.1".into() };
                m.allocate_blocks(ask).await.map(drop)
            }
            "Seal" => m.seal(SealRequest { file_id: target.unsealed, length: 0 }).await.map(drop),
            "RenewWriter" => m.renew_writer(RenewWriterRequest { file_id: target.unsealed }).await.map(drop),
            "Abort" => m.abort(AbortRequest { file_id: target.unsealed }).await.map(drop),
            "Open" => m.open(OpenRequest { path: target.sealed.clone() }).await.map(drop),
            "Stat" => m.stat(StatRequest { path: target.sealed.clone(), with_blocks: true }).await.map(drop),
            "List" => m.list(ListRequest { path: root.clone(), ..Default::default() }).await.map(drop),
            "Delete" => m.delete(DeleteRequest { path: target.sealed.clone(), recursive: false }).await.map(drop),
            "Rename" => {
                let ask = RenameRequest { from: target.sealed.clone(), to: format!("{root}/moved") };
                m.rename(ask).await.map(drop)
            }
            "RegisterJob" => {
                m.register_job(RegisterJobRequest { tenant: "default".into(), ..Default::default() }).await.map(drop)
            }
            "RenewJob" => {
                m.renew_job(RenewJobRequest { job_id: target.job.clone(), token: body_token }).await.map(drop)
            }
            "EndJob" => m.end_job(EndJobRequest { job_id: target.job.clone(), token: body_token }).await.map(drop),
            "RefreshToken" => {
                // Who does not hold the job's token can only forge one.
                let token = match caller.token.as_deref() == Some(target.token.as_str()) {
                    true => target.token.clone(),
                    false => tern_proto::token::TokenKey::generate().issue(&target.job, 1, u64::MAX, 1).to_text(),
                };
                m.refresh_token(RefreshTokenRequest { token }).await.map(drop)
            }
            "Status" => m.status(StatusRequest {}).await.map(drop),
            "ReportUnreachable" => {
                let ask = ReportUnreachableRequest { address: self.server_address.clone(), reason: "test".into() };
                m.report_unreachable(ask).await.map(drop)
            }
            "RegisterShuffle" => {
                let ask =
                    RegisterShuffleRequest { job_id: target.job.clone(), partitions: 1, maps: 1, ..Default::default() };
                m.register_shuffle(ask).await.map(drop)
            }
            "AdvanceSegment" => {
                let ask = AdvanceSegmentRequest { shuffle_id: target.shuffle, partition: 0, full_segment: 0 };
                m.advance_segment(ask).await.map(drop)
            }
            "CommitMap" => {
                let ask =
                    CommitMapRequest { shuffle_id: target.shuffle, partition_bytes: vec![0], ..Default::default() };
                m.commit_map(ask).await.map(drop)
            }
            "LocateShuffle" => {
                let ask = LocateShuffleRequest {
                    shuffle_id: target.shuffle,
                    end_partition: 1,
                    end_map: 1,
                    ..Default::default()
                };
                m.locate_shuffle(ask).await.map(drop)
            }
            "InvalidateMaps" => {
                let ask = InvalidateMapsRequest { shuffle_id: target.shuffle, map_indexes: vec![0] };
                m.invalidate_maps(ask).await.map(drop)
            }
            "UnregisterShuffle" => {
                m.unregister_shuffle(UnregisterShuffleRequest { shuffle_id: target.shuffle }).await.map(drop)
            }
            "RegisterServer" => {
                let tiers = vec![TierUsage { tier: "dram".into(), ..TierUsage::default() }];
                let ask = RegisterServerRequest {
                    address: self.server_address.clone(),
                    tiers,
                    instance_id: 7,
                    ..Default::default()
                };
                caller.registry.register_server(ask).await.map(drop)
            }
            "Heartbeat" => caller
                .registry
                .heartbeat(HeartbeatRequest { server_id: self.server_id, ..Default::default() })
                .await
                .map(drop),
            "ReportInventory" => {
                let ask = ReportInventoryRequest { server_id: self.server_id, last: true, ..Default::default() };
                caller.registry.report_inventory(ask).await.map(drop)
            }
            "SetServerMode" => {
                let mode = ServerMode::Cordoned as i32;
                let ask = SetServerModeRequest { server: self.server_address.clone(), mode, drain_timeout_ms: 0 };
                caller.admin.set_server_mode(ask).await.map(drop)
            }
            "Admin.EndJob" => caller.admin.end_job(AdminEndJobRequest { job_id: target.job.clone() }).await.map(drop),
            "MetadataMembers" => caller.admin.metadata_members(MetadataMembersRequest {}).await.map(drop),
            // An operator is told this single server has no members to change.
            "AddMetadataMember" => {
                let ask = AddMetadataMemberRequest { id: 2, addr: "127.0.0.1:1".into() };
                caller.admin.add_metadata_member(ask).await.map(drop)
            }
            "RemoveMetadataMember" => {
                caller.admin.remove_metadata_member(RemoveMetadataMemberRequest { id: 1 }).await.map(drop)
            }
            "AppendEntries" => caller.raft.append_entries(RaftMessage::default()).await.map(drop),
            "Vote" => caller.raft.vote(RaftMessage::default()).await.map(drop),
            "InstallSnapshot" => caller.raft.install_snapshot(RaftMessage::default()).await.map(drop),
            "PreVote" => caller.raft.pre_vote(RaftMessage::default()).await.map(drop),
            other => panic!("no call for RPC {other}"),
        };
        done
    }
}

async fn channel(cluster: &Cluster) -> Channel {
    let material = cluster.tls_dir.as_ref().map(|dir| tern_transport::tls::TlsMaterial::load(dir).unwrap());
    let material = if cluster.tls == Tls::Full { material } else { None };
    tern_transport::tls::grpc_endpoint(&cluster.metadata_url(), material.as_ref()).unwrap().connect().await.unwrap()
}

/// Every RPC by every kind of caller: allowed (any answer but permission-denied) or refused
/// (permission-denied, naming the call and the caller) as the table says.
async fn every_rpc_by_every_caller(tls: Tls) {
    let mut fixture = Fixture::start(tls).await;
    let mut table = Table::new();
    let cells = rpcs().into_iter().flat_map(|rpc| {
        let outside = allowed_outside_jobs(&rpc).map(|kinds| (rpc.clone(), true, kinds));
        [(rpc.clone(), false, allowed(&rpc))].into_iter().chain(outside)
    });
    for (rpc, outside_jobs, allowed) in cells.collect::<Vec<_>>() {
        let name = if outside_jobs { format!("{rpc} outside /jobs") } else { rpc.clone() };
        for kind in KINDS {
            let target = fixture.target(outside_jobs).await;
            let mut caller = fixture.caller(kind, &target);
            let result = fixture.call(&rpc, &mut caller, &target).await;
            let refused = result.as_ref().err().filter(|s| ErrorKind::of_status(s) == ErrorKind::PermissionDenied);
            let refusal = refused.map(|s| s.message().to_string());
            if let Some(message) = table.cell(&name, kind, allowed.contains(&kind), refusal, &result) {
                assert!(
                    message.starts_with("permission denied:") || rpc.ends_with("Job") || rpc == "RefreshToken",
                    "{name} by {kind:?}: the refusal does not say so: {message}"
                );
            }
        }
    }
    table.finish(&format!("authz table ({tls:?})"), || fixture.cluster.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_by_every_caller_on_plain_loopback() {
    every_rpc_by_every_caller(Tls::Off).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_by_every_caller_over_mutual_tls() {
    every_rpc_by_every_caller(Tls::Full).await;
}

/// The attacks of issue 33 on a default cluster, each by a caller that holds nothing of the
/// victim: the signing key, another tenant's directory, deleting in it, ending the job; and a
/// storage server's credential used for another server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_holding_nothing_gets_no_key_no_listing_no_delete_no_end_and_servers_stay_bound() {
    let fixture = Fixture::start(Tls::Off).await;
    let cluster = &fixture.cluster;
    let victim = cluster.client().await;
    let job = victim.start_job(Some("victim"), Duration::from_secs(30)).await.unwrap();
    victim.put("/jobs/victim/secret", bytes::Bytes::from_static(b"tenant data")).await.unwrap();

    // Through the command line, as a user would: refused, saying what to do.
    for args in
        [vec!["fs", "ls", "/jobs/victim"], vec!["fs", "rm", "/jobs/victim/secret"], vec!["admin", "end-job", "victim"]]
    {
        let out = cluster.tern(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "tern {args:?} succeeded for a stranger");
        assert!(stderr.contains("permission denied"), "tern {args:?}: {stderr}");
    }
    let mut stranger = RegistryClient::new(fixture.channel.clone());
    let ask = RegisterServerRequest { address: "10.6.6.6:1".into(), ..Default::default() };
    let refused = stranger.register_server(ask).await.unwrap_err();
    assert_eq!(ErrorKind::of_status(&refused), ErrorKind::PermissionDenied);
    assert!(refused.message().contains("register_server") && refused.message().contains("client of tenant default"));
    // A tenant's credential is no better, and a forged one is refused as such.
    let tenant = Presents::credential(&fixture.secret.credential(&Identity::new(Role::Client, "default", ""))).unwrap();
    let refused = RegistryClient::with_interceptor(fixture.channel.clone(), tenant)
        .heartbeat(HeartbeatRequest { server_id: 1, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(ErrorKind::of_status(&refused), ErrorKind::PermissionDenied);
    let forged = ClusterSecret::generate().credential(&Identity::new(Role::Admin, "", ""));
    let refused = AdminClient::with_interceptor(fixture.channel.clone(), Presents::credential(&forged).unwrap())
        .end_job(AdminEndJobRequest { job_id: "victim".into() })
        .await
        .unwrap_err();
    assert!(refused.message().contains("not signed with this cluster's secret"), "{refused:?}");

    // The fake server's credential cannot act for the real storage server: not register its
    // address, nor heartbeat or report for its id, nor drain it; it may drain itself.
    let real = &cluster.storage_addrs[0];
    let status = victim.status().await.unwrap();
    let real_id = status.servers.iter().find(|s| &s.address == real).unwrap().server_id;
    let fake =
        Presents::credential(&fixture.secret.credential(&Identity::new(Role::Server, "", &fixture.server_address)))
            .unwrap();
    let mut fake_registry = RegistryClient::with_interceptor(fixture.channel.clone(), fake.clone());
    let ask = RegisterServerRequest { address: real.clone(), instance_id: 99, ..Default::default() };
    let refused = fake_registry.register_server(ask).await.unwrap_err();
    assert!(refused.message().contains(&format!("not {real}'s")), "{refused:?}");
    let refused = fake_registry.heartbeat(HeartbeatRequest { server_id: real_id, ..Default::default() }).await;
    assert_eq!(ErrorKind::of_status(&refused.unwrap_err()), ErrorKind::PermissionDenied);
    let mut fake_admin = AdminClient::with_interceptor(fixture.channel.clone(), fake);
    let drain = |server: &str| SetServerModeRequest {
        server: server.to_string(),
        mode: ServerMode::Draining as i32,
        drain_timeout_ms: 1000,
    };
    let refused = fake_admin.set_server_mode(drain(real)).await.unwrap_err();
    assert_eq!(ErrorKind::of_status(&refused), ErrorKind::PermissionDenied);
    let own = fake_admin.set_server_mode(drain(&fixture.server_address)).await;
    assert!(own.as_ref().err().is_none_or(|s| ErrorKind::of_status(s) != ErrorKind::PermissionDenied), "{own:?}");

    // Outside /jobs the victim's files are its tenant's: a client of another tenant (its own
    // credential, through the CLI) cannot list, read or delete them, and is told whose they are.
    victim.put("/victim-data/f", bytes::Bytes::from_static(b"tenant file")).await.unwrap();
    let other = cluster.dir.path().join("other-tenant.credential");
    tern_proto::identity::write_credential(
        &other,
        &fixture.secret.credential(&Identity::new(Role::Client, "other", "")),
    )
    .unwrap();
    let other = other.to_string_lossy();
    for args in [["fs", "ls", "/victim-data"], ["fs", "cat", "/victim-data/f"], ["fs", "rm", "/victim-data/f"]] {
        let out = cluster.tern(&[&args[..], &["--as", &other][..]].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "tern {args:?} by tenant other succeeded");
        for said in ["you act as client of tenant other", "belongs to tenant default", "act as a client of that tenant"]
        {
            assert!(stderr.contains(said), "tern {args:?}: no {said:?} in: {stderr}");
        }
    }

    // The victim's job and data are untouched; the refusals are counted per call and reason.
    let kept = victim.open("/jobs/victim/secret").await.unwrap().read_to_end().await.unwrap();
    assert_eq!(&kept[..], b"tenant data");
    let kept = victim.open("/victim-data/f").await.unwrap().read_to_end().await.unwrap();
    assert_eq!(&kept[..], b"tenant file");
    job.end().await.unwrap();
    let metrics = crate::monitoring::http_get(cluster.metadata_admin_addr().parse().unwrap(), "/metrics").unwrap();
    let counted = [
        "method=\"register_server\",reason=\"not_server\"",
        "method=\"list\",reason=\"no_token\"",
        "method=\"list\",reason=\"other_tenant\"",
    ];
    for counted in counted {
        assert!(metrics.contains(&format!("tern_metadata_refused_total{{{counted}}}")), "no {counted} in\n{metrics}");
    }
}
