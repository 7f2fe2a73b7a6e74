//! Who may make each call of the scheduler's service: the one place that decides, from the
//! caller's identity (its credential, `tern_proto::identity`, verified with the cluster secret)
//! and the job it names. ARCHITECTURE.md ("Who may do what") lists every RPC's rule; each service
//! method names its rule as a [`Needs`], and [`Authz::decide`] judges it.
//!
//! A job's queue is its tenant: a client submits into its own tenant's queue and sees, cancels
//! and scales only that tenant's jobs; operators may act on every queue. Only executors (an
//! `executor` credential) take tasks, which carry jobs' tokens. A refusal is `permission-denied`
//! naming the call, the caller and what it lacked, counted in `tern_scheduler_refused_total`
//! and logged at most once a minute per caller and reason (`tern_common::refusals`).

use std::time::Instant;

use tern_common::refusals::Refusals;
use tern_proto::identity::{ClusterSecret, Identity, Role};
use tern_proto::ErrorKind;
use tonic::Status;

/// What a call needs of its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs<'a> {
    /// Any caller (PoolStatus: counts of the whole pool, nothing of any job).
    Anyone,
    /// Acting for this tenant: a job's queue, or the queue a submission names. `None`: the job
    /// is unknown, and the call itself says so.
    Tenant(Option<&'a str>),
    /// A tenant's client or an operator (ListJobs, whose answer holds the caller's tenant's jobs
    /// only, or every job for an operator).
    Client,
    /// An executor of the pool (registering, polling for tasks, reporting, leaving).
    Executor,
}

/// The decisions, and their record.
#[derive(Debug)]
pub struct Authz {
    secret: ClusterSecret,
    refusals: Refusals,
}

impl Authz {
    pub fn new(secret: ClusterSecret, registry: &mut prometheus_client::registry::Registry) -> Authz {
        Authz { secret, refusals: Refusals::register(registry, "tern_scheduler_refused") }
    }

    /// The cluster secret (the scheduler makes its own credential and its tasks' with it).
    pub fn secret(&self) -> &ClusterSecret {
        &self.secret
    }

    /// The caller of a request: the identity its credential proves (none: a client of the
    /// default tenant). A credential that does not verify is refused here.
    pub fn caller<T>(&self, method: &'static str, request: &tonic::Request<T>) -> Result<Identity, Status> {
        self.secret
            .caller(request.metadata())
            .map_err(|e| self.refuse(method, &Identity::anonymous(), Lacks { reason: "bad_credential", what: e.0 }))
    }

    /// Ok when `caller` may make call `method` needing `needs`; the refusal otherwise.
    pub fn decide(&self, method: &'static str, caller: &Identity, needs: Needs) -> Result<(), Status> {
        judge(caller, needs).map_err(|lacks| self.refuse(method, caller, lacks))
    }

    #[expect(
        clippy::disallowed_methods,
        reason = "the service's edge, as server.rs: only the refusal log's rate limit reads the clock"
    )]
    fn refuse(&self, method: &'static str, caller: &Identity, lacks: Lacks) -> Status {
        let message = format!("permission denied: {method} by {caller}: {}", lacks.what);
        self.refusals.record(method, &caller.to_string(), lacks.reason, &message, Instant::now());
        ErrorKind::PermissionDenied.status(message)
    }
}

/// Whether `caller` sees the jobs of `tenant` in a listing.
pub fn sees(caller: &Identity, tenant: &str) -> bool {
    caller.role == Role::Admin || (caller.role == Role::Client && caller.tenant == tenant)
}

/// The queue a submission goes to: the one it names, or the caller's tenant's.
pub fn queue_of<'a>(caller: &'a Identity, named: &'a str) -> &'a str {
    if named.is_empty() {
        &caller.tenant
    } else {
        named
    }
}

/// Why a call is refused: the reason's metric label, and what the caller lacked.
struct Lacks {
    reason: &'static str,
    what: String,
}

fn judge(caller: &Identity, needs: Needs) -> Result<(), Lacks> {
    let client_or_admin = || match caller.role {
        Role::Client | Role::Admin => Ok(()),
        _ => Err(Lacks {
            reason: "not_client",
            what: "only a tenant's clients and operators may submit, see, cancel or scale jobs".into(),
        }),
    };
    match needs {
        Needs::Anyone | Needs::Tenant(None) => Ok(()),
        Needs::Client => client_or_admin(),
        Needs::Tenant(Some(tenant)) => {
            client_or_admin()?;
            if sees(caller, tenant) {
                Ok(())
            } else {
                Err(Lacks {
                    reason: "other_tenant",
                    what: format!(
                        "the job is in tenant {tenant}'s queue, and a client acts for its own tenant only (a \
                         credential of tenant {tenant} may)"
                    ),
                })
            }
        }
        Needs::Executor if caller.role == Role::Executor => Ok(()),
        Needs::Executor => Err(Lacks {
            reason: "not_executor",
            what: "only the pool's executors (an executor credential) may take tasks".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_need_admits_whom_the_table_says() {
        let client = |tenant: &str| Identity::new(Role::Client, tenant, "");
        let admin = Identity::new(Role::Admin, "", "");
        let executor = Identity::new(Role::Executor, "", "");
        let server = Identity::new(Role::Server, "", "a:1");
        let ok = |who: &Identity, needs| judge(who, needs).is_ok();
        assert!(ok(&client("etl"), Needs::Tenant(Some("etl"))));
        assert!(!ok(&client("etl"), Needs::Tenant(Some("ml"))));
        assert!(ok(&admin, Needs::Tenant(Some("ml"))));
        assert!(!ok(&executor, Needs::Tenant(Some("default"))), "an executor submits no jobs");
        assert!(ok(&executor, Needs::Executor));
        for who in [client("etl"), admin.clone(), server.clone()] {
            assert!(!ok(&who, Needs::Executor), "{who} took tasks");
        }
        assert!(ok(&client("etl"), Needs::Client) && !ok(&server, Needs::Client));
        assert!(ok(&server, Needs::Anyone) && ok(&server, Needs::Tenant(None)));
        assert!(sees(&admin, "ml") && sees(&client("ml"), "ml") && !sees(&client("etl"), "ml"));
        assert_eq!(queue_of(&client("etl"), ""), "etl");
        assert_eq!(queue_of(&client("etl"), "ml"), "ml");
    }
}
