//! `tern scheduler`: the gRPC service around the [`Policy`].
//!
//! One mutex guards the policy and the executor table; no lock is held across an await. The hot
//! path is PollTasks: one lock applies the executor's results and takes a batch of assignments,
//! so a poll costs one lock and a few hash lookups per task. Polls with nothing to do wait on a
//! [`Notify`] that fires when work appears (a job submitted, a stage started, a task queued
//! again, a backoff over) or, for one executor, when a gang placed tasks on it.
//!
//! Each scheduler job owns one Tern job (registered with its shuffles at submission, so they exist
//! before the stage that writes them starts; renewed while the job runs; ended when it finishes,
//! which frees the shuffles but not output files outside the job's root).

#![expect(
    clippy::disallowed_methods,
    reason = "the scheduler's edge: it reads the clock once per call and passes the time into the policy"
)]

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use parking_lot::Mutex;
use tern_client::{JobSession, ShuffleOptions};
use tern_common::unix_ms;
use tern_proto::identity::{ClusterSecret, Identity, Role};
use tern_proto::sched as pb;
use tern_proto::sched::scheduler_server::{Scheduler, SchedulerServer as SchedulerService};
use tern_proto::ErrorKind;
use tokio::sync::{watch, Notify, OnceCell};
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use tern_scheduler_api::Operator;

use crate::authz::{self, Authz, Needs};
use crate::config::Config;
use crate::metrics::{Metrics, OutcomeLabel};
use crate::policy::{AssignmentId, Event, ExecutorSlot, JobInfo, Policy, PolicyConfig, Res, StageInfo};

/// How often the ticker ends backoffs, reaps silent executors and refreshes gauges.
const TICK: Duration = Duration::from_millis(10);
/// How often the gauges are refreshed.
const METRICS_PERIOD: Duration = Duration::from_millis(500);
/// How long shutdown waits for in-flight RPCs.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A running scheduler. Dropping it stops it too; prefer [`SchedulerServer::shutdown`].
pub struct SchedulerServer {
    addr: SocketAddr,
    admin_addr: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    shared: Arc<Shared>,
    readiness: tern_common::admin::Readiness,
}

/// Validates `config`, binds, and starts serving in the background.
pub async fn start(config: Config) -> anyhow::Result<SchedulerServer> {
    config.validate().context("invalid scheduler configuration")?;
    // The scheduler acts for every queue's tenant on the metadata server: it proves its role.
    let secret_path = config.serve.cluster_secret_path(config.cluster_secret_file.as_deref()).ok_or_else(|| {
        anyhow::anyhow!(
            "no cluster secret: the scheduler proves its role to the metadata server with it (it registers \
             every queue's jobs); set cluster_secret_file (`tern up` and `tern cert init` make one; with \
             --tls-dir, cluster.secret there)"
        )
    })?;
    let secret = ClusterSecret::load(&secret_path).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut grpc = tonic::transport::Server::builder();
    if let Some(dir) = &config.serve.tls_dir {
        let tls = tern_transport::tls::TlsMaterial::load(dir)?;
        grpc = grpc.tls_config(tls.tonic_server()).with_context(|| format!("gRPC TLS from {}", dir.display()))?;
    }
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::register(&mut registry);
    let authz = Authz::new(secret, &mut registry);
    let listener = tokio::net::TcpListener::bind(config.serve.listen)
        .await
        .with_context(|| format!("binding scheduler to {}", config.serve.listen))?;
    let addr = listener.local_addr()?;
    let readiness = tern_common::admin::Readiness::starting("starting the gRPC service");
    let admin_addr =
        tern_common::admin::serve(config.serve.admin_listen, "scheduler", registry, readiness.clone()).await?;
    let (stop, stopped) = watch::channel(false);
    let shared = Arc::new(Shared::new(config, authz, metrics));
    let limit = tern_proto::MAX_GRPC_MESSAGE_BYTES;
    let service = SchedulerService::from_arc(Arc::new(Service { shared: shared.clone() }))
        .max_decoding_message_size(limit)
        .max_encoding_message_size(limit);
    let health = tern_proto::health::service(readiness.subscribe(), &[pb::scheduler_server::SERVICE_NAME]);
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let mut serve_stopped = stopped.clone();
    let server = tokio::spawn(async move {
        let result = grpc
            .add_service(service)
            .add_service(health)
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = serve_stopped.wait_for(|&stop| stop).await;
            })
            .await;
        if let Err(e) = result {
            tracing::error!("scheduler gRPC service stopped: {e}");
        }
    });
    let ticker = tokio::spawn(tick(shared.clone(), stopped));
    // Bound and serving: executors and clients may come.
    readiness.ready();
    Ok(SchedulerServer { addr, admin_addr, stop, tasks: vec![server, ticker], shared, readiness })
}

/// Runs a scheduler until SIGINT or SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let shutdown = tern_common::shutdown_signal();
    let server = start(config.clone()).await?;
    // Once started: a configuration that is refused is said in one line, not after the dump.
    tern_common::config::log_effective("scheduler", &config);
    info!("scheduler listening on {} (admin {})", server.addr(), server.admin_addr());
    shutdown.await;
    info!("scheduler shutting down");
    tern_common::systemd::notify_stopping();
    server.shutdown().await;
    Ok(())
}

impl SchedulerServer {
    /// The bound gRPC address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bound admin (Prometheus) address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Stops serving; unfinished jobs' Tern jobs are ended (their shuffles freed).
    pub async fn shutdown(self) {
        self.readiness.not_ready("shutting down");
        let _ = self.stop.send(true);
        let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
        for mut task in self.tasks {
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                task.abort();
            }
        }
        let sessions: Vec<JobSession> = self.shared.state.lock().sessions.drain().map(|(_, s)| s).collect();
        for session in sessions {
            let id = session.id().to_string();
            if let Err(e) = tokio::time::timeout(SHUTDOWN_GRACE, session.end())
                .await
                .unwrap_or_else(|_| Err(tern_client::Error::new(ErrorKind::Unavailable, "timed out")))
            {
                warn!("ending Tern job {id} at shutdown failed: {e}");
            }
        }
    }
}

struct ExecutorEntry {
    slot: ExecutorSlot,
    name: String,
    last_seen: Instant,
    /// Assignments it must stop, sent with its next poll or heartbeat.
    cancels: Vec<u64>,
    /// Wakes its poll when a gang placed tasks on it or there are cancels.
    wake: Arc<Notify>,
}

struct State {
    policy: Policy,
    executors: HashMap<String, ExecutorEntry>,
    /// Executor id by policy slot.
    slots: HashMap<ExecutorSlot, String>,
    next_executor: u64,
    next_job: u64,
    /// Tern jobs of unfinished scheduler jobs.
    sessions: HashMap<String, JobSession>,
    /// Finished jobs, oldest first, forgotten past `max_finished_jobs`.
    finished: VecDeque<String>,
    /// Tasks of unfinished jobs (for max_queued_tasks).
    active_tasks: u64,
    job_tasks: HashMap<String, u64>,
    /// Jobs being registered with the metadata server (counted against max_jobs).
    submitting: u32,
}

struct Shared {
    config: Config,
    metrics: Metrics,
    state: Mutex<State>,
    /// Fires when placeable work appears.
    work: Notify,
    started: Instant,
    /// The wall clock at `started`: stage times are kept relative to it.
    started_unix_ms: u64,
    /// Who may make each call; holds the cluster secret.
    authz: Authz,
    /// Its `scheduler` credential, for the metadata server.
    credential: String,
    tern: OnceCell<tern_client::Client>,
}

impl Shared {
    fn new(config: Config, authz: Authz, metrics: Metrics) -> Shared {
        let policy = Policy::new(PolicyConfig {
            default_max_attempts: config.default_max_attempts,
            default_backoff_ms: config.default_backoff_ms,
            max_backoff_ms: config.max_backoff_ms,
            locality_wait_ms: config.locality_wait_ms,
            max_tasks_per_executor: config.max_tasks_per_executor,
            default_queue_weight: config.default_queue_weight,
            queue_weights: config.queues.clone(),
        });
        let credential = authz.secret().credential(&Identity::new(Role::Scheduler, "", ""));
        Shared {
            config,
            metrics,
            authz,
            credential,
            state: Mutex::new(State {
                policy,
                executors: HashMap::new(),
                slots: HashMap::new(),
                next_executor: 1,
                next_job: 1,
                sessions: HashMap::new(),
                finished: VecDeque::new(),
                active_tasks: 0,
                job_tasks: HashMap::new(),
                submitting: 0,
            }),
            work: Notify::new(),
            started: Instant::now(),
            started_unix_ms: unix_ms(),
            tern: OnceCell::new(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    async fn tern(&self) -> Result<&tern_client::Client, Status> {
        self.tern
            .get_or_try_init(|| async {
                let options = tern_client::ClientOptions {
                    tls_dir: self.config.serve.tls_dir.clone(),
                    credential: Some(self.credential.clone()),
                    ..tern_client::ClientOptions::default()
                };
                tern_client::Client::connect_with(&self.config.metadata, options).await
            })
            .await
            .map_err(|e| e.kind().status(format!("scheduler cannot reach the metadata server: {e}")))
    }

    /// Acts on the policy's events: ends finished jobs' Tern jobs, queues cancels.
    fn handle_events(&self, state: &mut State) {
        for event in state.policy.take_events() {
            match event {
                Event::JobFinished { job_id, state: job_state } => {
                    info!(
                        "job {job_id} {}",
                        job_state.as_str_name().trim_start_matches("JOB_STATE_").to_ascii_lowercase()
                    );
                    if let Some(tasks) = state.job_tasks.remove(&job_id) {
                        state.active_tasks -= tasks;
                    }
                    if let Some(session) = state.sessions.remove(&job_id) {
                        let job_id = job_id.clone();
                        tokio::spawn(async move {
                            let id = session.id().to_string();
                            if let Err(e) = session.end().await {
                                warn!("ending Tern job {id} of job {job_id} failed (its lease will lapse): {e}");
                            }
                        });
                    }
                    state.finished.push_back(job_id);
                    while state.finished.len() > self.config.max_finished_jobs as usize {
                        if let Some(old) = state.finished.pop_front() {
                            state.policy.forget_job(&old);
                        }
                    }
                }
                Event::Cancel { executor, assignments } => {
                    if let Some(entry) = state.slots.get(&executor).and_then(|id| state.executors.get_mut(id)) {
                        entry.cancels.extend(assignments.into_iter().map(AssignmentId::to_wire));
                        entry.wake.notify_one();
                    }
                }
            }
        }
    }

    /// Removes an executor; its tasks are queued again.
    fn remove_executor(&self, state: &mut State, id: &str, why: &str) -> u32 {
        let Some(entry) = state.executors.remove(id) else { return 0 };
        state.slots.remove(&entry.slot);
        let requeued = state.policy.remove_executor(entry.slot, self.now_ms());
        info!("executor {id} ({}) {why}; {requeued} running tasks queued again", entry.name);
        self.handle_events(state);
        if requeued > 0 {
            self.work.notify_waiters();
        }
        requeued
    }
}

/// Ends backoffs, reaps executors that missed their heartbeats, nudges waiting polls while tasks
/// wait for their preferred hosts, and refreshes gauges.
async fn tick(shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    let mut ticks = tokio::time::interval(TICK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_metrics = Instant::now();
    let mut last_nudge = Instant::now();
    let timeout = shared.config.executor_timeout();
    let nudge = Duration::from_millis(shared.config.locality_wait_ms.max(TICK.as_millis() as u64));
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stopped.wait_for(|&stop| stop) => return,
        }
        let now = Instant::now();
        let mut state = shared.state.lock();
        let moved = state.policy.tick(shared.now_ms());
        if state.policy.expire_leases(shared.now_ms(), unix_ms()) > 0 {
            shared.handle_events(&mut state);
        }
        let silent: Vec<String> = state
            .executors
            .iter()
            .filter(|(_, e)| now.duration_since(e.last_seen) > timeout)
            .map(|(id, _)| id.clone())
            .collect();
        for id in silent {
            shared.metrics.executors_lost.inc();
            shared.remove_executor(&mut state, &id, "missed its heartbeats and is lost");
        }
        let backlog = state.policy.backlog();
        if moved > 0 || (backlog > 0 && now.duration_since(last_nudge) >= nudge) {
            last_nudge = now;
            shared.work.notify_waiters();
        }
        if now.duration_since(last_metrics) >= METRICS_PERIOD {
            last_metrics = now;
            shared.metrics.refresh(&state.policy.pool_counts(), &state.policy.queue_shares());
        }
    }
}

struct Service {
    shared: Arc<Shared>,
}

fn invalid(message: impl Into<String>) -> Status {
    ErrorKind::Invalid.status(message)
}

fn unknown_executor(id: &str) -> Status {
    ErrorKind::NotFound.status(format!("executor {id:?} is not registered (lost or never seen): register again"))
}

/// The host part of `host:port` (or `[v6]:port`).
fn host_of(address: &str) -> String {
    match address.rsplit_once(':') {
        Some((host, _)) => host.trim_start_matches('[').trim_end_matches(']').to_string(),
        None => address.to_string(),
    }
}

/// Refuses a job whose built-in part writers (teragen, the terasort reduces) would write into a
/// store directory that already holds parts: the first whole attempt of a part wins, so an
/// earlier run's part would silently stand in for this job's.
async fn refuse_stale_parts(tern: &tern_client::Client, spec: &pb::JobSpec) -> Result<(), Status> {
    for stage in &spec.stages {
        let operator = stage.operator.as_ref().and_then(|o| o.name.parse::<Operator>().ok());
        if !operator.is_some_and(Operator::writes_parts) {
            continue;
        }
        let Some(pb::data_ref::Kind::Path(dir)) = stage.output.as_ref().and_then(|d| d.kind.as_ref()) else { continue };
        if !dir.starts_with('/') {
            continue; // Under the job's own root: new with the job.
        }
        let entries = match tern.list(dir).await {
            Ok(entries) => entries,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(e.kind().status(format!("stage {:?}: listing its output {dir}: {e}", stage.name))),
        };
        if let Some(part) = entries.iter().find(|e| e.path.rsplit('/').next().is_some_and(|n| n.starts_with("part-"))) {
            return Err(ErrorKind::AlreadyExists.status(format!(
                "stage {:?}: its output {dir} already holds {} (an earlier run's?); its parts would mix with \
                 this job's: remove it or choose another output",
                stage.name, part.path
            )));
        }
    }
    Ok(())
}

impl Service {
    /// Ok when the caller is one of the pool's executors.
    fn executor_only<T>(&self, method: &'static str, request: &Request<T>) -> Result<(), Status> {
        let caller = self.shared.authz.caller(method, request)?;
        self.shared.authz.decide(method, &caller, Needs::Executor)
    }

    /// Registers the job's Tern job and shuffles, and works out each stage's facts.
    async fn prepare(&self, job_id: &str, spec: &pb::JobSpec) -> Result<(JobSession, Vec<StageInfo>), Status> {
        let tern = self.shared.tern().await?;
        refuse_stale_parts(tern, spec).await?;
        let lease = Duration::from_millis(self.shared.config.tern_job_lease_ms);
        // The job's queue is its tenant: Tern's quotas apply per queue.
        let session = tern
            .start_job_for(&spec.queue, None, lease)
            .await
            .map_err(|e| e.kind().status(format!("job {job_id}: registering its Tern job: {e}")))?;
        // Shuffles: id, partitions, writer's task count, hosts of partitions' first segments.
        let mut shuffles: HashMap<&str, (u64, u32, u32, Vec<String>)> = HashMap::new();
        for shuffle in &spec.shuffles {
            let writer = spec
                .stages
                .iter()
                .find(|s| matches!(s.output.as_ref().and_then(|d| d.kind.as_ref()), Some(pb::data_ref::Kind::Shuffle(n)) if *n == shuffle.name))
                .map_or(0, |s| s.tasks);
            let options = ShuffleOptions { maps: writer, replicas: spec.copies.max(1), ..ShuffleOptions::default() };
            let registered = tern
                .register_shuffle(session.id(), shuffle.partitions, options)
                .await
                .map_err(|e| e.kind().status(format!("job {job_id}: registering shuffle {:?}: {e}", shuffle.name)))?;
            let hosts = registered.segment_addresses().iter().map(|a| host_of(a)).collect();
            shuffles.insert(&shuffle.name, (registered.id().get(), shuffle.partitions, writer, hosts));
        }
        let shuffle_of = |d: &Option<pb::DataRef>| match d.as_ref().and_then(|d| d.kind.as_ref()) {
            Some(pb::data_ref::Kind::Shuffle(name)) => shuffles.get(name.as_str()),
            _ => None,
        };
        let stages = spec
            .stages
            .iter()
            .map(|s| {
                let input = shuffle_of(&s.input);
                let output = shuffle_of(&s.output);
                let hosts: Vec<String> = if !s.locality.is_empty() {
                    (0..s.tasks as usize).map(|i| s.locality[i % s.locality.len()].clone()).collect()
                } else if let Some((_, partitions, _, hosts)) = input {
                    // Task i reads partitions [i*P/T, (i+1)*P/T): prefer its first one's server.
                    (0..u64::from(s.tasks))
                        .map(|i| hosts[(i * u64::from(*partitions) / u64::from(s.tasks)) as usize].clone())
                        .collect()
                } else {
                    Vec::new()
                };
                StageInfo {
                    spec: s.clone(),
                    input_shuffle_id: input.map_or(0, |i| i.0),
                    input_partitions: input.map_or(0, |i| i.1),
                    input_maps: input.map_or(0, |i| i.2),
                    output_shuffle_id: output.map_or(0, |o| o.0),
                    output_partitions: output.map_or(0, |o| o.1),
                    hosts,
                }
            })
            .collect();
        Ok((session, stages))
    }

    /// Applies results and cancels of `executor`; returns its slot.
    fn apply_results(
        &self,
        state: &mut State,
        executor: &str,
        results: &[pb::TaskResult],
    ) -> Result<ExecutorSlot, Status> {
        let now_ms = self.shared.now_ms();
        let entry = state.executors.get_mut(executor).ok_or_else(|| unknown_executor(executor))?;
        entry.last_seen = Instant::now();
        let slot = entry.slot;
        if results.is_empty() {
            return Ok(slot);
        }
        let backlog = state.policy.backlog();
        let unix = unix_ms();
        for result in results {
            let outcome = pb::TaskOutcome::try_from(result.outcome).unwrap_or(pb::TaskOutcome::Unspecified);
            let name = outcome.as_str_name().trim_start_matches("TASK_OUTCOME_").to_ascii_lowercase();
            self.shared.metrics.results.get_or_create(&OutcomeLabel { outcome: name }).inc();
            state.policy.report(slot, result, now_ms, unix);
        }
        self.shared.handle_events(state);
        if state.policy.backlog() > backlog {
            self.shared.work.notify_waiters();
        }
        Ok(slot)
    }
}

#[tonic::async_trait]
impl Scheduler for Service {
    async fn submit_job(
        &self,
        request: Request<pb::SubmitJobRequest>,
    ) -> Result<Response<pb::SubmitJobResponse>, Status> {
        let caller = self.shared.authz.caller("submit_job", &request)?;
        let mut spec = request.into_inner().job.ok_or_else(|| invalid("SubmitJob without a job"))?;
        // The job's queue is its tenant's: the submitter's own unless it names one it may use.
        spec.queue = authz::queue_of(&caller, &spec.queue).to_string();
        self.shared.authz.decide("submit_job", &caller, Needs::Tenant(Some(&spec.queue)))?;
        let config = &self.shared.config;
        let dag = crate::spec::validate(&spec, &config.spec_limits()).map_err(|e| invalid(format!("{e:#}")))?;
        let tasks: u64 = spec.stages.iter().map(|s| u64::from(s.tasks)).sum();
        let job_id = {
            let mut state = self.shared.state.lock();
            let active = state.sessions.len() as u32 + state.submitting;
            if active >= config.max_jobs {
                return Err(ErrorKind::Unavailable.status(format!(
                    "{active} jobs are unfinished, the limit (max_jobs = {}); retry later",
                    config.max_jobs
                )));
            }
            if state.active_tasks + tasks > config.max_queued_tasks {
                return Err(ErrorKind::Unavailable.status(format!(
                    "{} tasks of unfinished jobs plus this job's {tasks} exceed max_queued_tasks = {}; retry later",
                    state.active_tasks, config.max_queued_tasks
                )));
            }
            state.submitting += 1;
            state.active_tasks += tasks;
            let id = format!("{}-{}", spec.name, state.next_job);
            state.next_job += 1;
            id
        };
        let prepared = self.prepare(&job_id, &spec).await;
        let mut state = self.shared.state.lock();
        state.submitting -= 1;
        let (session, stages) = match prepared {
            Ok(p) => p,
            Err(status) => {
                state.active_tasks -= tasks;
                return Err(status);
            }
        };
        let submitted = pb::SubmitJobResponse {
            job_id: job_id.clone(),
            tern_job_id: session.id().to_string(),
            tern_job_token: session.token(),
        };
        let info = JobInfo {
            job_id: job_id.clone(),
            name: spec.name.clone(),
            queue: spec.queue.clone(),
            priority: spec.priority,
            tern_job_id: session.id().to_string(),
            tern_job_root: session.root().to_string(),
            tern_job_token: session.token(),
            tenant_credential: self.shared.authz.secret().credential(&Identity::new(Role::Client, &spec.queue, "")),
            copies: spec.copies.max(1),
            submitted_unix_ms: unix_ms(),
        };
        state.sessions.insert(job_id.clone(), session);
        state.job_tasks.insert(job_id.clone(), tasks);
        let now_ms = self.shared.now_ms();
        state.policy.add_job(info, stages, &dag, now_ms);
        self.shared.handle_events(&mut state);
        drop(state);
        self.shared.metrics.jobs_submitted.inc();
        self.shared.work.notify_waiters();
        info!("job {job_id} submitted: {} stages, {tasks} tasks, queue {:?}", spec.stages.len(), spec.queue);
        Ok(Response::new(submitted))
    }

    async fn get_job(&self, request: Request<pb::GetJobRequest>) -> Result<Response<pb::GetJobResponse>, Status> {
        let caller = self.shared.authz.caller("get_job", &request)?;
        let job_id = request.into_inner().job_id;
        let state = self.shared.state.lock();
        self.shared.authz.decide("get_job", &caller, Needs::Tenant(state.policy.job_queue(&job_id)))?;
        let mut job = state
            .policy
            .job_status(&job_id, true)
            .ok_or_else(|| ErrorKind::NotFound.status(format!("no job {job_id:?} (unknown, or finished long ago)")))?;
        drop(state);
        let base = self.shared.started_unix_ms;
        for stage in &mut job.stages {
            for at in [&mut stage.started_unix_ms, &mut stage.finished_unix_ms] {
                if *at != 0 {
                    *at += base;
                }
            }
        }
        Ok(Response::new(pb::GetJobResponse { job: Some(job) }))
    }

    async fn list_jobs(&self, request: Request<pb::ListJobsRequest>) -> Result<Response<pb::ListJobsResponse>, Status> {
        let caller = self.shared.authz.caller("list_jobs", &request)?;
        self.shared.authz.decide("list_jobs", &caller, Needs::Client)?;
        let active_only = request.into_inner().active_only;
        let state = self.shared.state.lock();
        let jobs = state
            .policy
            .job_ids()
            .iter()
            // Other tenants' jobs are skipped before their status is built.
            .filter(|id| state.policy.job_queue(id).is_some_and(|queue| authz::sees(&caller, queue)))
            .filter_map(|id| state.policy.job_status(id, false))
            .filter(|j| !active_only || j.finished_unix_ms == 0)
            .collect();
        Ok(Response::new(pb::ListJobsResponse { jobs }))
    }

    async fn cancel_job(
        &self,
        request: Request<pb::CancelJobRequest>,
    ) -> Result<Response<pb::CancelJobResponse>, Status> {
        let caller = self.shared.authz.caller("cancel_job", &request)?;
        let job_id = request.into_inner().job_id;
        let mut state = self.shared.state.lock();
        self.shared.authz.decide("cancel_job", &caller, Needs::Tenant(state.policy.job_queue(&job_id)))?;
        let now_ms = self.shared.now_ms();
        let job_state = state
            .policy
            .cancel_job(&job_id, now_ms, unix_ms())
            .ok_or_else(|| ErrorKind::NotFound.status(format!("no job {job_id:?}")))?;
        self.shared.handle_events(&mut state);
        Ok(Response::new(pb::CancelJobResponse { state: job_state as i32 }))
    }

    async fn scale_stage(
        &self,
        request: Request<pb::ScaleStageRequest>,
    ) -> Result<Response<pb::ScaleStageResponse>, Status> {
        let caller = self.shared.authz.caller("scale_stage", &request)?;
        let r = request.into_inner();
        let config = &self.shared.config;
        let limits = config.spec_limits();
        if r.cancel.len() > limits.max_tasks_per_stage as usize {
            return Err(invalid(format!("ScaleStage: more than {} tasks to cancel", limits.max_tasks_per_stage)));
        }
        let mut state = self.shared.state.lock();
        self.shared.authz.decide("scale_stage", &caller, Needs::Tenant(state.policy.job_queue(&r.job_id)))?;
        if state.active_tasks + u64::from(r.add) > config.max_queued_tasks {
            return Err(ErrorKind::Unavailable.status(format!(
                "{} tasks of unfinished jobs plus {} more exceed max_queued_tasks = {}; retry later",
                state.active_tasks, r.add, config.max_queued_tasks
            )));
        }
        let now_ms = self.shared.now_ms();
        let refused = |e: crate::policy::ScaleError| match e {
            crate::policy::ScaleError::NotFound(m) => ErrorKind::NotFound.status(m),
            crate::policy::ScaleError::Invalid(m) => invalid(m),
        };
        if let Some(create) = r.create {
            let create = pb::StageSpec { name: r.stage.clone(), ..create };
            let needs = create.needs.unwrap_or_default();
            if state.policy.add_stage(&r.job_id, create, &limits, now_ms).map_err(refused)? {
                info!(
                    "job {}: elastic stage {:?} added ({} mCPU, {} bytes, {} mGPU a task)",
                    r.job_id, r.stage, needs.cpu_milli, needs.memory_bytes, needs.gpu_milli
                );
            }
        }
        let out = state
            .policy
            .scale_stage(
                &r.job_id,
                &r.stage,
                r.add,
                &r.cancel,
                r.finish,
                r.ended_from,
                limits.max_tasks_per_stage,
                now_ms,
                unix_ms(),
            )
            .map_err(refused)?;
        let added = out.added.len() as u64;
        if added > 0 {
            state.active_tasks += added;
            if let Some(tasks) = state.job_tasks.get_mut(&r.job_id) {
                *tasks += added;
            }
        }
        self.shared.handle_events(&mut state);
        drop(state);
        if added > 0 {
            self.shared.work.notify_waiters();
        }
        Ok(Response::new(pb::ScaleStageResponse {
            added: out.added,
            ended: out.ended,
            ended_next: out.ended_next,
            state: out.state as i32,
            queued: out.queued,
            running: out.running,
        }))
    }

    async fn pool_status(
        &self,
        request: Request<pb::PoolStatusRequest>,
    ) -> Result<Response<pb::PoolStatusResponse>, Status> {
        let caller = self.shared.authz.caller("pool_status", &request)?;
        self.shared.authz.decide("pool_status", &caller, Needs::Anyone)?;
        let counts = self.shared.state.lock().policy.pool_counts();
        Ok(Response::new(pb::PoolStatusResponse {
            backlog_tasks: counts.backlog_tasks,
            running_tasks: counts.running_tasks,
            executors: counts.executors,
            idle_executors: counts.idle_executors,
            backoff_tasks: counts.backoff_tasks,
            backlog_needs: Some(counts.backlog_needs.into()),
            active_jobs: counts.active_jobs,
        }))
    }

    async fn register_executor(
        &self,
        request: Request<pb::RegisterExecutorRequest>,
    ) -> Result<Response<pb::RegisterExecutorResponse>, Status> {
        self.executor_only("register_executor", &request)?;
        let r = request.into_inner();
        let config = &self.shared.config;
        let capacity: Res = r.capacity.unwrap_or_default().into();
        if capacity.cpu_milli == 0 || capacity.memory_bytes == 0 {
            return Err(invalid("RegisterExecutor: capacity needs cpu_milli and memory_bytes above 0"));
        }
        if r.gpu_addresses.len() > 256 || r.gpu_addresses.iter().any(|a| a.is_empty() || a.len() > 128) {
            return Err(invalid("RegisterExecutor: at most 256 GPU addresses of 1 to 128 bytes"));
        }
        if r.host.len() > 255 || r.name.len() > 255 || r.operators.len() > 64 {
            return Err(invalid("RegisterExecutor: host and name at most 255 bytes, at most 64 operators"));
        }
        // Parsed here, once: the policy matches on the enum.
        let operators = r
            .operators
            .iter()
            .map(|name| name.parse::<Operator>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid(format!("RegisterExecutor: {e}")))?;
        let mut state = self.shared.state.lock();
        if state.executors.len() >= config.max_executors as usize {
            return Err(ErrorKind::Unavailable
                .status(format!("{} executors are registered, the limit (max_executors)", config.max_executors)));
        }
        let id = format!("e-{}", state.next_executor);
        state.next_executor += 1;
        let slot = state.policy.add_executor(&r.host, capacity, &r.gpu_addresses, &operators);
        let name = if r.name.is_empty() { id.clone() } else { r.name.clone() };
        info!(
            "executor {id} ({name}) registered from host {:?}: {} CPUs, {} bytes, GPUs {:?}",
            r.host,
            capacity.cpu_milli as f64 / 1000.0,
            capacity.memory_bytes,
            r.gpu_addresses
        );
        state.slots.insert(slot, id.clone());
        state.executors.insert(
            id.clone(),
            ExecutorEntry { slot, name, last_seen: Instant::now(), cancels: Vec::new(), wake: Arc::new(Notify::new()) },
        );
        drop(state);
        Ok(Response::new(pb::RegisterExecutorResponse {
            executor_id: id,
            heartbeat_interval_ms: config.heartbeat_interval_ms,
            max_poll_wait_ms: config.max_poll_wait_ms,
            max_batch: config.max_batch,
            metadata: config.metadata.clone(),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        self.executor_only("heartbeat", &request)?;
        let id = request.into_inner().executor_id;
        let mut state = self.shared.state.lock();
        let entry = state.executors.get_mut(&id).ok_or_else(|| unknown_executor(&id))?;
        entry.last_seen = Instant::now();
        Ok(Response::new(pb::HeartbeatResponse { cancel: std::mem::take(&mut entry.cancels) }))
    }

    async fn poll_tasks(
        &self,
        request: Request<pb::PollTasksRequest>,
    ) -> Result<Response<pb::PollTasksResponse>, Status> {
        self.executor_only("poll_tasks", &request)?;
        let r = request.into_inner();
        let config = &self.shared.config;
        if r.results.len() > config.max_batch as usize {
            return Err(invalid(format!(
                "PollTasks carries {} results; at most max_batch = {}",
                r.results.len(),
                config.max_batch
            )));
        }
        let max = r.max_tasks.min(config.max_batch) as usize;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(r.wait_ms.min(config.max_poll_wait_ms));
        let (slot, wake) = {
            let mut state = self.shared.state.lock();
            let slot = self.apply_results(&mut state, &r.executor_id, &r.results)?;
            let wake = state.executors[&r.executor_id].wake.clone();
            (slot, wake)
        };
        loop {
            // Listen before looking, so work that appears in between is not missed.
            let work = self.shared.work.notified();
            tokio::pin!(work);
            work.as_mut().enable();
            {
                let mut state = self.shared.state.lock();
                let entry = state.executors.get_mut(&r.executor_id).ok_or_else(|| unknown_executor(&r.executor_id))?;
                entry.last_seen = Instant::now();
                let cancel = std::mem::take(&mut entry.cancels);
                let assignments =
                    if max > 0 { state.policy.assign(slot, max, self.shared.now_ms()) } else { Vec::new() };
                // A gang may have placed tasks on other executors: wake them.
                if !assignments.is_empty() {
                    self.shared.metrics.dispatched.inc_by(assignments.len() as u64);
                    for woken in state.policy.take_gang_wakes() {
                        if let Some(entry) = state.slots.get(&woken).and_then(|id| state.executors.get(id)) {
                            entry.wake.notify_one();
                        }
                    }
                }
                if !assignments.is_empty() || !cancel.is_empty() || max == 0 || tokio::time::Instant::now() >= deadline
                {
                    return Ok(Response::new(pb::PollTasksResponse { assignments, cancel }));
                }
            }
            tokio::select! {
                _ = &mut work => {}
                _ = wake.notified() => {}
                _ = tokio::time::sleep_until(deadline) => {}
            }
        }
    }

    async fn leave_executor(
        &self,
        request: Request<pb::LeaveExecutorRequest>,
    ) -> Result<Response<pb::LeaveExecutorResponse>, Status> {
        self.executor_only("leave_executor", &request)?;
        let r = request.into_inner();
        if r.results.len() > self.shared.config.max_batch as usize {
            return Err(invalid("LeaveExecutor carries more results than max_batch"));
        }
        let mut state = self.shared.state.lock();
        self.apply_results(&mut state, &r.executor_id, &r.results)?;
        let requeued = self.shared.remove_executor(&mut state, &r.executor_id, "left");
        Ok(Response::new(pb::LeaveExecutorResponse { requeued }))
    }
}
