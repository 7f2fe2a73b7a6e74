//! The local executor pool: `tern up` starts `tern executor` processes as the scheduler's
//! backlog grows and lets idle ones go (min, max, idle timeout, scale to zero).
//!
//! Every [`PoolConfig::tick`] the pool reads the scheduler's PoolStatus (what external
//! autoscalers read from its metrics) and:
//! - keeps `min` "pinned" executors alive (restarting any that exit);
//! - when tasks wait unplaced, starts as many more executors as their summed needs take (CPU
//!   and memory, net of idle executors), up to `max` in all; these are started with
//!   `--idle-exit-after IDLE_TIMEOUT`, so each one leaves by itself once it has had nothing to do
//!   for that long. The executor decides between its polls, so it can never leave holding a task
//!   it was just given, and the pool needs no per-executor bookkeeping to scale down.
//!
//! With `min = 0` the pool goes back to no executors at all once the work is done.
//!
//! While an executor the pool started is still young ([`STARTUP_GRACE`]) no more are started:
//! it may not have registered or pulled its tasks yet, and the backlog would count them twice.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tern_local::{Daemon, DaemonSpec};
use tern_scheduler_api::SchedulerClient;

/// An executor this young may not have registered or taken tasks yet.
pub const STARTUP_GRACE: Duration = Duration::from_millis(500);
/// How long an executor gets to leave after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// Most executors one pool runs.
pub const MAX_POOL_EXECUTORS: u32 = 256;

/// How the pool runs and what each executor it starts offers.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Executors kept running whatever the load (0 = scale to zero).
    pub min: u32,
    /// Most executors at once.
    pub max: u32,
    /// An executor above `min` leaves after this long with nothing to run.
    pub idle_timeout: Duration,
    /// How often the pool looks at the scheduler.
    pub tick: Duration,
    pub scheduler: String,
    /// Passed on to executors (`None`: they use the scheduler's).
    pub metadata: Option<String>,
    pub tls_dir: Option<PathBuf>,
    /// The executors' `executor` credential file (`--credential-file`).
    pub credential_file: PathBuf,
    /// Each executor's offer.
    pub executor_cpu_milli: u64,
    pub executor_memory_bytes: u64,
    /// `--gpus N` for each executor; `None` lets each detect its own.
    pub executor_gpus: Option<u32>,
    /// `--gpu-discovery-script PATH` for each executor (when `executor_gpus` is not given): its
    /// GPUs as Spark's discovery scripts name them.
    pub executor_gpu_discovery_script: Option<PathBuf>,
    /// The `tern` binary.
    pub tern: PathBuf,
    /// Directory of the executors' logs (`executor-<slot>.log`, appended to).
    pub logs: PathBuf,
    /// Each log rotates to `executor-<slot>.log.1` past this size (`None`: it grows).
    pub log_max_bytes: Option<u64>,
}

impl PoolConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.min > self.max {
            bail!("the pool's min executors ({}) is above its max ({})", self.min, self.max);
        }
        if self.max > MAX_POOL_EXECUTORS {
            bail!("the pool's max executors ({}) is above {MAX_POOL_EXECUTORS}", self.max);
        }
        if self.executor_cpu_milli == 0 {
            bail!("the pool's executors need some CPU (executor cpus above 0)");
        }
        if self.tick.is_zero() {
            bail!("the pool's tick must be above 0");
        }
        Ok(())
    }
}

/// One executor process the pool started.
struct Member {
    slot: u32,
    pinned: bool,
    started: Instant,
    daemon: Daemon,
}

/// The pool's processes.
pub struct Pool {
    config: PoolConfig,
    members: Vec<Member>,
    client: Option<SchedulerClient>,
    /// Executors started over the pool's life.
    started_total: u64,
}

/// What one tick saw and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tick {
    pub executors: u32,
    pub started: u32,
    pub exited: u32,
    pub backlog_tasks: u64,
}

impl Pool {
    pub fn new(config: PoolConfig) -> anyhow::Result<Pool> {
        config.validate()?;
        std::fs::create_dir_all(&config.logs).with_context(|| format!("creating {}", config.logs.display()))?;
        Ok(Pool { config, members: Vec::new(), client: None, started_total: 0 })
    }

    /// Executors the pool runs now.
    pub fn executors(&self) -> u32 {
        self.members.len() as u32
    }

    /// Runs the pool until `shutdown` resolves, then stops every executor it started.
    pub async fn run(mut self, shutdown: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
        tokio::pin!(shutdown);
        let mut tick = tokio::time::interval(self.config.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = Tick::default();
        let outcome = loop {
            tokio::select! {
                _ = &mut shutdown => break Ok(()),
                _ = tick.tick() => {}
            }
            match self.tick().await {
                Ok(now) => {
                    if now.started > 0 || now.exited > 0 || now.executors != last.executors {
                        tracing::info!(
                            executors = now.executors,
                            started = now.started,
                            exited = now.exited,
                            backlog = now.backlog_tasks,
                            "pool"
                        );
                    }
                    last = now;
                }
                Err(e) => break Err(e),
            }
        };
        self.stop_all().await;
        outcome
    }

    /// One look at the scheduler and the executors; starts what is needed.
    pub async fn tick(&mut self) -> anyhow::Result<Tick> {
        let exited = self.reap();
        let mut started = 0;
        // Pinned executors first: they need no backlog.
        let pinned = self.members.iter().filter(|m| m.pinned).count() as u32;
        for _ in pinned..self.config.min {
            self.start(true)?;
            started += 1;
        }
        let status = match self.status().await {
            Ok(status) => status,
            Err(e) => {
                tracing::warn!("pool: cannot read the scheduler's status: {e}");
                return Ok(Tick { executors: self.executors(), started, exited, backlog_tasks: 0 });
            }
        };
        let young = self.members.iter().any(|m| m.started.elapsed() < STARTUP_GRACE);
        if status.backlog_tasks > 0 && !young {
            let wanted = self.wanted(&status);
            let room = self.config.max.saturating_sub(self.executors());
            for _ in 0..wanted.min(room) {
                self.start(false)?;
                started += 1;
            }
        }
        Ok(Tick { executors: self.executors(), started, exited, backlog_tasks: status.backlog_tasks })
    }

    /// More executors the backlog asks for: its summed CPU, memory and (where executors declare
    /// a GPU count) GPUs over one executor's, at least one, less the executors idle now (they are
    /// about to take tasks). Executors that detect their own GPUs are of unknown GPU count, so a
    /// GPU backlog counts only through its CPU and memory then.
    fn wanted(&self, status: &tern_proto::sched::PoolStatusResponse) -> u32 {
        let needs = status.backlog_needs.unwrap_or_default();
        let by_cpu = needs.cpu_milli.div_ceil(self.config.executor_cpu_milli);
        let by_memory = match self.config.executor_memory_bytes {
            0 => 0,
            per => needs.memory_bytes.div_ceil(per),
        };
        let by_gpu = match self.config.executor_gpus {
            Some(gpus) if gpus > 0 => needs.gpu_milli.div_ceil(u64::from(gpus) * 1000),
            _ => 0,
        };
        let wanted = by_cpu.max(by_memory).max(by_gpu).max(1).min(u64::from(MAX_POOL_EXECUTORS)) as u32;
        wanted.saturating_sub(status.idle_executors)
    }

    async fn status(&mut self) -> anyhow::Result<tern_proto::sched::PoolStatusResponse> {
        if self.client.is_none() {
            // PoolStatus is anyone's: the pool needs no credential to watch the backlog.
            self.client =
                Some(SchedulerClient::connect(&self.config.scheduler, self.config.tls_dir.as_deref(), None).await?);
        }
        let client = self.client.as_ref().context("no scheduler client")?;
        match client.pool_status().await {
            Ok(status) => Ok(status),
            Err(e) => {
                self.client = None;
                Err(e.into())
            }
        }
    }

    /// Forgets executors that exited; returns how many.
    fn reap(&mut self) -> u32 {
        let before = self.members.len();
        self.members.retain_mut(|member| match member.daemon.try_wait() {
            Ok(Some(status)) => {
                if !status.success() {
                    tracing::warn!(
                        slot = member.slot,
                        "pool: executor exited with {status}; see {}",
                        log_path(&self.config.logs, member.slot).display()
                    );
                }
                false
            }
            _ => true,
        });
        (before - self.members.len()) as u32
    }

    fn start(&mut self, pinned: bool) -> anyhow::Result<()> {
        let slot = (0..).find(|slot| self.members.iter().all(|m| m.slot != *slot)).unwrap_or(0);
        let config = &self.config;
        let mut spec = DaemonSpec::new(format!("executor-{slot}"), &config.tern, log_path(&config.logs, slot))
            .append_log()
            .without_tern_env()
            .args(["executor", "--scheduler", &config.scheduler])
            .args(["--cpus", &format!("{}", config.executor_cpu_milli as f64 / 1000.0)])
            .args(["--memory", &config.executor_memory_bytes.to_string()])
            .args(["--name", &format!("pool-{slot}")])
            .args([std::ffi::OsStr::new("--credential-file"), config.credential_file.as_os_str()]);
        if let Some(bytes) = config.log_max_bytes {
            spec = spec.rotate_log_at(bytes);
        }
        if let Some(metadata) = &config.metadata {
            spec = spec.args(["--metadata", metadata]);
        }
        if let Some(dir) = &config.tls_dir {
            spec = spec.args([std::ffi::OsStr::new("--tls-dir"), dir.as_os_str()]);
        }
        if let Some(gpus) = config.executor_gpus {
            spec = spec.args(["--gpus", &gpus.to_string()]);
        } else if let Some(script) = &config.executor_gpu_discovery_script {
            spec = spec.args([std::ffi::OsStr::new("--gpu-discovery-script"), script.as_os_str()]);
        }
        if !pinned {
            spec = spec.args(["--idle-exit-after", &format!("{}ms", config.idle_timeout.as_millis())]);
        }
        let daemon = spec.spawn().context("starting an executor")?;
        self.started_total += 1;
        self.members.push(Member { slot, pinned, started: Instant::now(), daemon });
        Ok(())
    }

    /// SIGTERM to every executor (they leave, reporting their tasks lost); SIGKILL after a grace.
    pub async fn stop_all(&mut self) {
        let killed = tern_local::stop_together(self.members.iter_mut().map(|m| &mut m.daemon), STOP_GRACE).await;
        for name in killed {
            tracing::warn!("pool: {name} did not leave within {STOP_GRACE:?}; killed it");
        }
        self.members.clear();
    }
}

fn log_path(logs: &std::path::Path, slot: u32) -> PathBuf {
    logs.join(format!("executor-{slot}.log"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tern_proto::sched::{PoolStatusResponse, Resources};

    fn config(min: u32, max: u32) -> PoolConfig {
        PoolConfig {
            min,
            max,
            idle_timeout: Duration::from_secs(1),
            tick: Duration::from_millis(100),
            scheduler: "127.0.0.1:1".into(),
            metadata: None,
            tls_dir: None,
            credential_file: PathBuf::from("executor.credential"),
            executor_cpu_milli: 2000,
            executor_memory_bytes: 4 << 30,
            executor_gpus: None,
            executor_gpu_discovery_script: None,
            tern: "tern".into(),
            logs: std::env::temp_dir(),
            log_max_bytes: None,
        }
    }

    #[test]
    fn limits_are_checked() {
        assert!(config(2, 1).validate().unwrap_err().to_string().contains("above its max"));
        assert!(config(0, 10_000).validate().is_err());
        config(0, 4).validate().unwrap();
    }

    #[test]
    fn backlog_asks_for_executors_by_cpu_and_memory_less_idle_ones() {
        let pool = Pool { config: config(0, 8), members: Vec::new(), client: None, started_total: 0 };
        let status = |cpu_milli, memory_bytes, idle| PoolStatusResponse {
            backlog_tasks: 10,
            backlog_needs: Some(Resources { cpu_milli, memory_bytes, gpu_milli: 0 }),
            idle_executors: idle,
            ..Default::default()
        };
        assert_eq!(pool.wanted(&status(5000, 0, 0)), 3);
        assert_eq!(pool.wanted(&status(1000, 10 << 30, 0)), 3);
        assert_eq!(pool.wanted(&status(5000, 0, 2)), 1);
        // Tasks that need nothing measurable still need one executor.
        assert_eq!(pool.wanted(&status(0, 0, 0)), 1);
    }

    #[test]
    fn a_gpu_backlog_asks_for_executors_by_gpus_where_executors_declare_them() {
        let mut pool = Pool { config: config(0, 8), members: Vec::new(), client: None, started_total: 0 };
        let status = |gpu_milli| PoolStatusResponse {
            backlog_tasks: 6,
            backlog_needs: Some(Resources { cpu_milli: 1000, memory_bytes: 0, gpu_milli }),
            ..Default::default()
        };
        assert_eq!(pool.wanted(&status(6000)), 1, "GPU count unknown: by CPU only");
        pool.config.executor_gpus = Some(2);
        assert_eq!(pool.wanted(&status(6000)), 3, "6 GPUs wanted, 2 per executor");
        assert_eq!(pool.wanted(&status(500)), 1);
    }
}
