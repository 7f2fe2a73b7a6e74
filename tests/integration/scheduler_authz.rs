//! Who may do what on the scheduler (ARCHITECTURE.md, "Who may do what"), through a real
//! `tern scheduler`: every RPC of `scheduler.proto`, called by every kind of caller, is allowed or
//! refused (`permission-denied`) as the table says, on a plain loopback cluster and on one whose
//! gRPC is mutual TLS. An RPC added to `scheduler.proto` fails the test until the table lists it.
//! Then the attacks, by a client of another tenant: it cannot see, cancel or scale a tenant's job
//! nor submit into its queue, and a client credential cannot take tasks; and a task acts for its
//! job's tenant, so what it writes outside its job's root is that tenant's.

use std::time::Duration;

use tern_proto::identity::{ClusterSecret, Identity, Role};
use tern_proto::sched as pb;
use tern_proto::ErrorKind;
use tern_scheduler_api::SchedulerClient;

use crate::common::table::Table;
use crate::common::{Cluster, Tls};
use crate::scheduler::Scheduler;

/// The tenant whose queue the jobs of the table are in.
const TENANT: &str = "etl";

/// The kinds of caller every RPC is tried with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// No credential: a client of the default tenant.
    Nobody,
    /// A client of the job's tenant.
    TenantClient,
    /// A client of another tenant.
    OtherTenant,
    /// An executor of the pool.
    Executor,
    /// A storage server.
    Server,
    /// An operator.
    Admin,
}

const KINDS: [Kind; 6] =
    [Kind::Nobody, Kind::TenantClient, Kind::OtherTenant, Kind::Executor, Kind::Server, Kind::Admin];

/// Who is allowed each RPC: the scheduler's part of the table in ARCHITECTURE.md.
fn allowed(rpc: &str) -> &'static [Kind] {
    use Kind::*;
    match rpc {
        // A job of the tenant's queue, or a submission into it: its clients, and operators.
        "SubmitJob" | "GetJob" | "CancelJob" | "ScaleStage" => &[TenantClient, Admin],
        // Every client lists (its own tenant's jobs only); operators list all.
        "ListJobs" => &[Nobody, TenantClient, OtherTenant, Admin],
        "PoolStatus" => &KINDS,
        "RegisterExecutor" | "Heartbeat" | "PollTasks" | "LeaveExecutor" => &[Executor],
        other => panic!(
            "RPC {other} is not in the scheduler's authorization table (tests/integration/scheduler_authz.rs and \
             ARCHITECTURE.md)"
        ),
    }
}

/// Every RPC of the Scheduler service, read from `scheduler.proto`.
fn rpcs() -> Vec<String> {
    let proto = include_str!("../../proto/proto/scheduler.proto");
    let rpcs: Vec<String> = proto
        .lines()
        .filter_map(|line| line.trim().strip_prefix("rpc "))
        .map(|rest| rest.split('(').next().unwrap().trim().to_string())
        .collect();
    assert!(rpcs.len() >= 10, "read {} RPCs from scheduler.proto", rpcs.len());
    rpcs
}

/// An elastic job of `TENANT`'s queue: it needs no executor to exist, and ScaleStage may act on it.
fn elastic_job(name: &str) -> pb::JobSpec {
    pb::JobSpec {
        name: name.into(),
        queue: TENANT.into(),
        stages: vec![pb::StageSpec {
            name: "workers".into(),
            operator: Some(pb::Operator { name: "noop".into(), ..Default::default() }),
            elastic: true,
            needs: Some(pb::Resources { cpu_milli: 1000, memory_bytes: 64 << 20, gpu_milli: 0 }),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn executor_registration(name: &str) -> pb::RegisterExecutorRequest {
    pb::RegisterExecutorRequest {
        name: name.into(),
        host: "127.0.0.1".into(),
        capacity: Some(pb::Resources { cpu_milli: 1000, memory_bytes: 1 << 30, gpu_milli: 0 }),
        ..Default::default()
    }
}

struct Fixture {
    cluster: Cluster,
    scheduler: Scheduler,
    secret: ClusterSecret,
    /// The test's own operator and executor, which make each cell's job and executor.
    admin: SchedulerClient,
    executor: SchedulerClient,
    cells: u32,
}

impl Fixture {
    async fn start(tls: Tls) -> Fixture {
        let cluster = Cluster::start_with(1, "64MiB", tls).await;
        let scheduler = Scheduler::start(&cluster);
        let secret = ClusterSecret::load(&cluster.dir.path().join("cluster.secret")).unwrap();
        let admin = connect(&cluster, &scheduler, credential(&secret, Kind::Admin).as_deref()).await;
        let executor = connect(&cluster, &scheduler, credential(&secret, Kind::Executor).as_deref()).await;
        Fixture { cluster, scheduler, secret, admin, executor, cells: 0 }
    }

    async fn client(&self, kind: Kind) -> SchedulerClient {
        connect(&self.cluster, &self.scheduler, credential(&self.secret, kind).as_deref()).await
    }

    /// Calls `rpc` as `caller` on a fresh job of `TENANT`'s queue and a fresh executor.
    async fn call(&mut self, rpc: &str, caller: &SchedulerClient) -> Result<(), tern_client::Error> {
        self.cells += 1;
        let job_id = self.admin.submit(elastic_job(&format!("cell-{}", self.cells))).await.unwrap();
        let executor_id = self
            .executor
            .register_executor(executor_registration(&format!("cell-{}", self.cells)))
            .await
            .unwrap()
            .executor_id;
        let scale = pb::ScaleStageRequest { job_id: job_id.clone(), stage: "workers".into(), ..Default::default() };
        match rpc {
            "SubmitJob" => caller.submit(elastic_job("submitted")).await.map(drop),
            "GetJob" => caller.job(&job_id).await.map(drop),
            "ListJobs" => caller.list_jobs(false).await.map(drop),
            "CancelJob" => caller.cancel(&job_id).await.map(drop),
            "PoolStatus" => caller.pool_status().await.map(drop),
            "ScaleStage" => caller.scale_stage(scale).await.map(drop),
            "RegisterExecutor" => caller.register_executor(executor_registration("caller")).await.map(drop),
            "Heartbeat" => caller.heartbeat(&executor_id).await.map(drop),
            "PollTasks" => caller.poll(&executor_id, vec![], 0, Duration::ZERO).await.map(drop),
            "LeaveExecutor" => caller.leave(&executor_id, vec![]).await.map(drop),
            other => panic!("no call for RPC {other}"),
        }
    }
}

/// The credential a caller of `kind` presents (none for `Nobody`).
fn credential(secret: &ClusterSecret, kind: Kind) -> Option<String> {
    let identity = match kind {
        Kind::Nobody => return None,
        Kind::TenantClient => Identity::new(Role::Client, TENANT, ""),
        Kind::OtherTenant => Identity::new(Role::Client, "ml", ""),
        Kind::Executor => Identity::new(Role::Executor, "", ""),
        Kind::Server => Identity::new(Role::Server, "", "127.0.0.1:1"),
        Kind::Admin => Identity::new(Role::Admin, "", ""),
    };
    Some(secret.credential(&identity))
}

/// A client of the scheduler presenting `credential`, once the scheduler answers.
async fn connect(cluster: &Cluster, scheduler: &Scheduler, credential: Option<&str>) -> SchedulerClient {
    let tls = if cluster.tls == Tls::Full { cluster.tls_dir.as_deref() } else { None };
    cluster
        .wait_for("the scheduler to answer", Duration::from_secs(20), || async {
            let client = SchedulerClient::connect(&scheduler.addr, tls, credential).await.ok()?;
            client.pool_status().await.ok().map(|_| client)
        })
        .await
}

/// Every RPC by every kind of caller: allowed (any answer but permission-denied) or refused
/// (permission-denied, naming the call and the caller) as the table says.
async fn every_scheduler_rpc_by_every_caller(tls: Tls) {
    let mut fixture = Fixture::start(tls).await;
    let mut table = Table::new();
    for rpc in rpcs() {
        for kind in KINDS {
            let caller = fixture.client(kind).await;
            let result = fixture.call(&rpc, &caller).await;
            let refused = result.as_ref().err().filter(|e| e.kind() == ErrorKind::PermissionDenied);
            let refusal = refused.map(|e| e.to_string());
            if let Some(message) = table.cell(&rpc, kind, allowed(&rpc).contains(&kind), refusal, &result) {
                assert!(message.contains("permission denied: "), "{rpc} by {kind:?}: {message}");
            }
        }
    }
    table.finish(&format!("scheduler authz table ({tls:?})"), || fixture.cluster.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_scheduler_rpc_by_every_caller_on_plain_loopback() {
    every_scheduler_rpc_by_every_caller(Tls::Off).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_scheduler_rpc_by_every_caller_over_mutual_tls() {
    every_scheduler_rpc_by_every_caller(Tls::Full).await;
}

/// Tenant `etl`'s job, with a real executor: a client of tenant `ml` does not see it in a listing,
/// cannot read, cancel or scale it, nor submit into `etl`'s queue, and is told so through the CLI
/// in the user's words; a client credential cannot take tasks. The job's command task acts for
/// `etl` (its executor hands it `etl`'s client credential, not its own), so the directory it makes
/// outside its job's root is `etl`'s: `ml` cannot list it, `etl` can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenant_cannot_touch_a_tenants_jobs_and_tasks_act_for_their_tenant() {
    let mut fixture = Fixture::start(Tls::Off).await;
    let cluster = &fixture.cluster;
    fixture.scheduler.executor(cluster, "1", "256MiB");
    let credential_file =
        |tenant: &str| crate::common::tenant_credential(cluster.dir.path(), tenant).to_string_lossy().into_owned();
    let (etl, ml) = (credential_file(TENANT), credential_file("ml"));
    let job = cluster.dir.path().join("mkdir.toml");
    std::fs::write(
        &job,
        format!(
            "name = \"mkdir\"\n[[stages]]\nname = \"make\"\ntasks = 1\n\
             command = [\"{}\", \"fs\", \"--metadata\", \"{}\", \"mkdir\", \"-p\", \"/etl-out/made-by-task\"]\n\
             needs = {{ cpus = 1, memory = \"64MiB\" }}\n",
            crate::common::TERN,
            cluster.metadata_addr
        ),
    )
    .unwrap();
    let job_cli = |credential: &str, args: &[&str]| {
        let scheduler = ["job", "--scheduler", &fixture.scheduler.addr, "--as", credential];
        cluster.tern(&[&scheduler[..], args].concat())
    };
    let submitted = job_cli(&etl, &["submit", "--wait", "--json", &job.to_string_lossy()]);
    let out = String::from_utf8_lossy(&submitted.stdout);
    assert!(submitted.status.success(), "etl's job failed: {out} {}", String::from_utf8_lossy(&submitted.stderr));
    let status: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let job_id = status["job_id"].as_str().unwrap().to_string();
    assert_eq!(status["queue"], TENANT, "a job submitted with no queue goes to its submitter's tenant's");

    // The task made its directory as `etl`: only `etl` (and operators) may look in it.
    let listed = cluster.tern(&["fs", "ls", "/etl-out", "--as", &etl]);
    assert!(listed.status.success(), "etl cannot list its task's output: {}", String::from_utf8_lossy(&listed.stderr));
    assert!(String::from_utf8_lossy(&listed.stdout).contains("made-by-task"));
    let refused = cluster.tern(&["fs", "ls", "/etl-out", "--as", &ml]);
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && said.contains("belongs to tenant etl"), "ml listed etl's files: {said}");

    // Tenant ml, through the CLI: etl's job is not in its listing, and it may not see or cancel it.
    let listed = job_cli(&ml, &["list", "--json"]);
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    assert!(!String::from_utf8_lossy(&listed.stdout).contains(&job_id), "ml's listing shows etl's job");
    let listed = job_cli(&etl, &["list", "--json"]);
    assert!(String::from_utf8_lossy(&listed.stdout).contains(&job_id), "etl's listing lacks its job");
    for args in [vec!["status", &job_id], vec!["cancel", &job_id]] {
        let out = job_cli(&ml, &args);
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "tern job {args:?} by ml succeeded");
        for words in ["permission denied: you act as client of tenant ml", "tenant etl's queue", "--as"] {
            assert!(said.contains(words), "tern job {args:?}: no {words:?} in: {said}");
        }
        assert!(!said.contains("_job by"), "the CLI names the RPC: {said}");
    }
    let into_etl = job_cli(&ml, &["submit", &job.to_string_lossy(), "--tenant", TENANT]);
    assert!(!into_etl.status.success(), "ml submitted into etl's queue");

    // A client's credential takes no tasks; a forged one is refused as such.
    let etl_client = fixture.client(Kind::TenantClient).await;
    for refused in [
        etl_client.register_executor(executor_registration("thief")).await.map(drop),
        etl_client.poll("e-1", vec![], 16, Duration::ZERO).await.map(drop),
    ] {
        let e = refused.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
        assert!(e.to_string().contains("executor credential"), "{e}");
    }
    let forged = ClusterSecret::generate().credential(&Identity::new(Role::Admin, "", ""));
    let forger = SchedulerClient::connect(&fixture.scheduler.addr, None, Some(&forged)).await.unwrap();
    let refused = forger.list_jobs(false).await.unwrap_err();
    assert!(refused.to_string().contains("not signed with this cluster's secret"), "{refused}");

    // The refusals are counted per call and reason.
    let metrics = crate::monitoring::http_get(fixture.scheduler.admin_addr.parse().unwrap(), "/metrics").unwrap();
    for counted in [
        "method=\"cancel_job\",reason=\"other_tenant\"",
        "method=\"poll_tasks\",reason=\"not_executor\"",
        "method=\"submit_job\",reason=\"other_tenant\"",
    ] {
        assert!(metrics.contains(&format!("tern_scheduler_refused_total{{{counted}}}")), "no {counted} in\n{metrics}");
    }
}
