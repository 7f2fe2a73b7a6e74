//! Who may make each call of the Metadata, Registry and Admin services: the one place that
//! decides, from the caller's identity (its credential, `tern_proto::identity`), the job tokens it
//! presents and the state. ARCHITECTURE.md ("Who may do what") lists every RPC's rule; each
//! service method names its rule as a [`Needs`], and [`Authz::decide`] judges it.
//!
//! A refusal is `permission-denied` naming the call, the caller and what it lacked; it is counted
//! per call and reason (`tern_metadata_refused_total`) and logged at most once a minute per
//! caller and reason, so a hostile caller cannot flood the log.

use std::time::Instant;

use tern_common::refusals::Refusals;
use tern_proto::identity::{ClusterSecret, Identity, Role, JOB_TOKEN_HEADER, MAX_TOKENS_PER_CALL};
use tern_proto::token::JobToken;
use tern_proto::v1::ServerMode;
use tern_proto::ErrorKind;
use tonic::Status;

use crate::path::{self, Place};
use crate::state::State;

/// What a call needs of its caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Needs {
    /// Nothing: any caller (calls whose own fields carry the proof, like RenewJob's token, or that
    /// reveal and change nothing of a job).
    Anyone,
    /// A token of the job owning the path (files under `/jobs/<job>`); outside `/jobs`, the
    /// tenant owning it (`Namespace::owner`: the entry's, or the directory a new one goes in).
    Path(String),
    /// Both paths' owners' tokens (a rename).
    Paths(String, String),
    /// A token of the job owning the file with this id, or outside `/jobs` its tenant (an
    /// unknown file: the call says so).
    File(u64),
    /// A token of this job.
    Job(String),
    /// Acting for this tenant ("": the caller's own): its clients (and executors), the
    /// scheduler (which registers its submitters' jobs) and operators (RegisterJob).
    Tenant(String),
    /// A token of the job owning the shuffle with this id.
    Shuffle(u64),
    /// The storage server whose block-service address this is (RegisterServer).
    ServerAt(String),
    /// The registered storage server with this id (Heartbeat, ReportInventory).
    ServerId(u64),
    /// An operator, or the storage server named, draining itself (its SIGTERM).
    SetMode { server: String, mode: i32 },
    /// An operator.
    Admin,
}

/// A caller: who it is, and the job tokens it presented.
#[derive(Debug, Clone)]
pub struct Caller {
    pub identity: Identity,
    tokens: Vec<String>,
}

/// The decisions, and their metrics and log.
#[derive(Debug)]
pub struct Authz {
    secret: ClusterSecret,
    refusals: Refusals,
}

/// Why a call is refused: the reason's metric label, and what the caller lacked.
struct Lacks {
    reason: &'static str,
    what: String,
}

impl Authz {
    pub fn new(secret: ClusterSecret, registry: &mut prometheus_client::registry::Registry) -> Authz {
        Authz { secret, refusals: Refusals::register(registry, "tern_metadata_refused") }
    }

    /// The caller of a request: the identity its credential proves (none: a client of the
    /// default tenant), and its job tokens. A credential that does not verify is refused here.
    pub fn caller<T>(&self, method: &'static str, request: &tonic::Request<T>, now: Instant) -> Result<Caller, Status> {
        let headers = request.metadata();
        let identity = self.secret.caller(headers).map_err(|e| {
            self.refuse(method, &Identity::anonymous(), Lacks { reason: "bad_credential", what: e.0 }, now)
        })?;
        let tokens = headers
            .get_all(JOB_TOKEN_HEADER)
            .iter()
            .take(MAX_TOKENS_PER_CALL)
            .filter_map(|value| value.to_str().ok().map(str::to_string))
            .collect();
        Ok(Caller { identity, tokens })
    }

    /// Ok when `caller` may make call `method` needing `needs`; the refusal otherwise.
    pub fn decide(
        &self,
        method: &'static str,
        caller: &Caller,
        needs: &Needs,
        state: &State,
        now: Instant,
    ) -> Result<(), Status> {
        match judge(caller, needs, state) {
            Ok(()) => Ok(()),
            Err(lacks) => Err(self.refuse(method, &caller.identity, lacks, now)),
        }
    }

    /// Ok when `caller` is one of the cluster's metadata servers (the Raft service's one rule,
    /// decided without the state).
    pub fn decide_metadata(&self, method: &'static str, caller: &Caller, now: Instant) -> Result<(), Status> {
        metadata_only(&caller.identity).map_err(|lacks| self.refuse(method, &caller.identity, lacks, now))
    }

    fn refuse(&self, method: &'static str, identity: &Identity, lacks: Lacks, now: Instant) -> Status {
        let message = format!("permission denied: {method} by {identity}: {}", lacks.what);
        self.refusals.record(method, &identity.to_string(), lacks.reason, &message, now);
        ErrorKind::PermissionDenied.status(message)
    }
}

/// The rule of [`Needs`] for `caller`.
fn judge(caller: &Caller, needs: &Needs, state: &State) -> Result<(), Lacks> {
    let identity = &caller.identity;
    let admin = identity.role == Role::Admin;
    let server = |address: &str| -> Result<(), Lacks> {
        match (identity.role, identity.subject == address) {
            (Role::Server, true) => Ok(()),
            (Role::Server, false) => Err(Lacks {
                reason: "other_server",
                what: format!("its credential is storage server {}'s, not {address}'s", identity.subject),
            }),
            _ => Err(Lacks {
                reason: "not_server",
                what: "only storage servers (holding the cluster secret) may do this".to_string(),
            }),
        }
    };
    match needs {
        Needs::Anyone => Ok(()),
        Needs::Admin if admin => Ok(()),
        Needs::Admin => {
            Err(Lacks { reason: "not_admin", what: "only an operator (an admin credential) may do this".into() })
        }
        _ if admin && job_needs(needs) => Ok(()),
        Needs::Path(raw) => path_owner(caller, raw, state),
        Needs::Paths(from, to) => path_owner(caller, from, state).and_then(|()| path_owner(caller, to, state)),
        Needs::File(file_id) => match state.job_of_file(*file_id) {
            Some(Some(job)) => job_token(caller, &job, state),
            Some(None) => tenant_owns(identity, state.owner_of_file(*file_id), &format!("file {file_id}")),
            // No such file: the call itself says so.
            None => Ok(()),
        },
        Needs::Job(job) => job_token(caller, job, state),
        Needs::Tenant(tenant) => acts_for(identity, tenant),
        Needs::Shuffle(shuffle_id) => match state.job_of_shuffle(*shuffle_id) {
            Some(job) => job_token(caller, &job, state),
            None => Ok(()),
        },
        Needs::ServerAt(address) => server(address),
        Needs::ServerId(id) => match state.address_of_server(&id.to_string()) {
            Some(address) => server(&address),
            None => server(&identity.subject),
        },
        Needs::SetMode { server: name, mode } => {
            let own = state.address_of_server(name).is_some_and(|address| {
                identity.role == Role::Server && identity.subject == address && *mode == ServerMode::Draining as i32
            });
            match (admin, own) {
                (true, _) | (_, true) => Ok(()),
                _ => Err(Lacks {
                    reason: "not_admin",
                    what: "only an operator (an admin credential) may set a server's mode; a storage server may only drain itself".into(),
                }),
            }
        }
    }
}

/// Whether `needs` is a job's (which operators may act on too).
fn job_needs(needs: &Needs) -> bool {
    matches!(needs, Needs::Path(_) | Needs::Paths(..) | Needs::File(_) | Needs::Job(_) | Needs::Shuffle(_))
}

fn path_owner(caller: &Caller, raw: &str, state: &State) -> Result<(), Lacks> {
    // A path that does not normalize is refused by the call itself, with why.
    let Ok(path) = path::normalize(raw) else {
        return Ok(());
    };
    match Place::of(&path).job() {
        Some(job) => job_token(caller, job, state),
        None => tenant_owns(&caller.identity, state.owner_of_path(&path), &path),
    }
}

/// Another metadata server of this cluster: a `metadata` credential.
fn metadata_only(identity: &Identity) -> Result<(), Lacks> {
    match identity.role {
        Role::Metadata => Ok(()),
        _ => Err(Lacks {
            reason: "not_metadata",
            what: "only the cluster's metadata servers (a metadata credential) may do this".into(),
        }),
    }
}

/// Whether `identity` may act for `tenant` ("": its own).
fn acts_for(identity: &Identity, tenant: &str) -> Result<(), Lacks> {
    match identity.role {
        Role::Admin | Role::Scheduler => Ok(()),
        Role::Client | Role::Executor if tenant.is_empty() || tenant == identity.tenant => Ok(()),
        Role::Client | Role::Executor => Err(Lacks {
            reason: "other_tenant",
            what: format!(
                "it names tenant {tenant}, and a client acts for its own tenant only (a credential of tenant \
                 {tenant} may)"
            ),
        }),
        _ => {
            Err(Lacks { reason: "not_client", what: "only a tenant's clients, the scheduler and operators may".into() })
        }
    }
}

/// Outside `/jobs` an entry is its owning tenant's: that tenant's clients (and executors, which
/// run its tasks), operators (passed before this) and the scheduler (which runs every tenant's
/// jobs) may act on it; nobody's entries are everyone's. Storage servers have no business there.
fn tenant_owns(identity: &Identity, owner: Option<&str>, what: &str) -> Result<(), Lacks> {
    let tenants_own = matches!(identity.role, Role::Client | Role::Executor) && owner == Some(&identity.tenant);
    match owner {
        None => Ok(()),
        Some(_) if tenants_own || identity.role == Role::Scheduler => Ok(()),
        Some(owner) => Err(Lacks {
            reason: "other_tenant",
            what: format!("{what} belongs to tenant {owner} (only its tenant and operators may act on it)"),
        }),
    }
}

fn job_token(caller: &Caller, job: &str, state: &State) -> Result<(), Lacks> {
    // No such job: nothing of it to protect (it ended, and everything it had with it); the call
    // itself says what is not there.
    if !state.job_registered(job) {
        return Ok(());
    }
    if caller.tokens.is_empty() {
        return Err(Lacks {
            reason: "no_token",
            what: format!(
                "it presented no token of job {job} (only the job's holders may act on its files and shuffles)"
            ),
        });
    }
    // A client presents every token it holds (up to 16): only those naming the job are checked,
    // so a busy executor's call costs one HMAC, not sixteen (each about 1.3 us here).
    let mut why = "it presented tokens of other jobs only".to_string();
    for token in caller.tokens.iter().filter_map(|text| JobToken::from_text(text).ok()).filter(|t| t.job == job) {
        match state.check_decoded_token(job, &token, "act for") {
            Ok(()) => return Ok(()),
            Err(status) => why = status.message().to_string(),
        }
    }
    Err(Lacks { reason: "wrong_token", what: format!("no token it presented is job {job}'s: {why}") })
}
