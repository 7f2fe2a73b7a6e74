//! Redis as `tern bench io` measures it: a redis-server started on a free loopback port with
//! persistence off, driven through the bench's own RESP client (`resp.rs`), and that client
//! checked against redis-benchmark on the same payloads.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};

use super::resp::RespConnection;
use super::{human_size, Cell, CellResult, Op, WRITE_SET_BYTES};
use crate::harness::{go, join_all, payload, Budget, Recorder, Samples};

/// A redis-server started on a free loopback port with persistence off, stopped at the end.
pub(super) struct RedisTarget {
    child: Child,
    port: u16,
    version: String,
    _dir: tempfile::TempDir,
    /// Keys of the read set: (size, items).
    reads: Option<(u64, u64)>,
}

/// How to get redis-server when it is missing.
pub const REDIS_INSTALL_HINT: &str =
    "redis-server is not installed; install it with `apt-get install redis-server` (Debian/Ubuntu), \
     or leave redis out with --systems";

/// Whether `redis-server` is on PATH.
pub fn redis_installed() -> bool {
    find_on_path("redis-server").is_some()
}

fn find_on_path(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|dir| Path::new(dir).join(program)).find(|p| p.is_file())
}

impl RedisTarget {
    pub(super) async fn start() -> anyhow::Result<RedisTarget> {
        let server = find_on_path("redis-server").context(REDIS_INSTALL_HINT)?;
        let version = Command::new(&server)
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_default();
        let dir = tempfile::tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let log = std::fs::File::create(dir.path().join("redis.log"))?;
        let child = Command::new(&server)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--protected-mode", "no", "--dir", &dir.path().to_string_lossy()])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", server.display()))?;
        let mut redis = RedisTarget { child, port, version, _dir: dir, reads: None };
        let started = Instant::now();
        loop {
            if let Some(status) = redis.child.try_wait()? {
                let log = std::fs::read_to_string(redis._dir.path().join("redis.log")).unwrap_or_default();
                bail!("redis-server exited ({status}):\n{log}");
            }
            if let Ok(mut conn) = RespConnection::connect(port).await {
                if conn.ping().await.is_ok() {
                    return Ok(redis);
                }
            }
            if started.elapsed() > Duration::from_secs(10) {
                bail!("redis-server did not answer PING on port {port} within 10 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// What a reader needs to judge its figures: its version and how it was started.
    pub(super) fn describe(&self) -> String {
        format!("redis: {} on 127.0.0.1:{}, --save \"\" --appendonly no", self.version, self.port)
    }

    pub(super) async fn prepare_reads(&mut self, size: u64, items: u64) -> anyhow::Result<()> {
        let mut conn = RespConnection::connect(self.port).await?;
        for item in 0..items {
            conn.set(&read_key(size, item), &payload(size, item)).await?;
        }
        self.reads = Some((size, items));
        Ok(())
    }

    pub(super) async fn measure(&mut self, cell: Cell, budget: Budget) -> anyhow::Result<Samples> {
        let mut conns = Vec::new();
        for _ in 0..cell.concurrency {
            conns.push(RespConnection::connect(self.port).await?);
        }
        let (read_size, items) = self.reads.context("no Redis read set prepared")?;
        ensure!(read_size == cell.size, "the Redis read set holds {read_size}-byte values, not {}", cell.size);
        let budget = budget.start();
        let concurrency = u64::from(cell.concurrency);
        // Writers overwrite their own few keys, so Redis holds a bounded amount whatever the run.
        let write_keys = (WRITE_SET_BYTES / concurrency / cell.size).max(1);
        let mut tasks = Vec::new();
        for (worker, mut conn) in conns.into_iter().enumerate() {
            let size = cell.size;
            let op = cell.op;
            tasks.push(tokio::spawn(async move {
                let data = payload(size, 7);
                let mut recorder = Recorder::new(budget);
                let mut item = worker as u64;
                while go(&recorder).await {
                    let started = Instant::now();
                    match op {
                        Op::Write => conn.set(&format!("w:{worker}:{}", item % write_keys), &data).await?,
                        Op::Read => {
                            let value = conn.get(&read_key(size, item % items)).await?;
                            ensure!(value.len() as u64 == size, "GET returned {} bytes, not {size}", value.len());
                        }
                    }
                    recorder.record(started);
                    item += if op == Op::Read { concurrency } else { 1 };
                }
                Ok(recorder)
            }));
        }
        Samples::merge(join_all(tasks).await?)
    }

    /// Runs redis-benchmark (SET then GET of `ours`' payload size, at its concurrency, for about
    /// `seconds`) and says how its GET throughput compares with the bench's client's: more than
    /// 10% apart means one of the two clients is costing Redis' figure something.
    pub(super) fn check_against_redis_benchmark(&self, ours: &CellResult, seconds: f64) -> anyhow::Result<String> {
        let (size, concurrency) = (ours.size_bytes, ours.concurrency);
        let label = format!("redis-benchmark GET {} x{concurrency}", human_size(size));
        let Some(program) = find_on_path("redis-benchmark") else {
            return Ok(format!("{label}: not checked, redis-benchmark is not installed (it comes with redis-server)"));
        };
        let ops_per_s = ours.throughput_mib_s * f64::from(1 << 20) / size as f64;
        let requests = (ops_per_s * seconds.max(1.0)).clamp(200.0, 1_000_000.0) as u64;
        let out = Command::new(program)
            .args(["-p", &self.port.to_string(), "-t", "set,get", "--csv"])
            .args(["-d", &size.to_string(), "-c", &concurrency.to_string(), "-n", &requests.to_string()])
            .stdin(Stdio::null())
            .output()
            .context("running redis-benchmark")?;
        ensure!(out.status.success(), "{label}: {}", String::from_utf8_lossy(&out.stderr).trim());
        let csv = String::from_utf8_lossy(&out.stdout);
        let rps = csv
            .lines()
            .find_map(|line| line.strip_prefix("\"GET\",\""))
            .and_then(|rest| rest.split('"').next())
            .and_then(|rps| rps.parse::<f64>().ok())
            .with_context(|| format!("{label}: no GET figure in its output:\n{csv}"))?;
        let theirs = rps * size as f64 / f64::from(1 << 20);
        let ratio = ours.throughput_mib_s / theirs;
        let verdict = if (ratio - 1.0).abs() > 0.10 { "DIFFER by more than 10%" } else { "agree within 10%" };
        Ok(format!(
            "{label}: {theirs:.0} MiB/s; the bench's Redis client {:.0} MiB/s ({ratio:.2}x): {verdict}",
            ours.throughput_mib_s
        ))
    }

    pub(super) async fn stop(mut self) {
        if let Ok(mut conn) = RespConnection::connect(self.port).await {
            let _ = conn.command(&[b"SHUTDOWN", b"NOSAVE"]).await;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for RedisTarget {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn read_key(size: u64, item: u64) -> String {
    format!("r:{size}:{item}")
}
