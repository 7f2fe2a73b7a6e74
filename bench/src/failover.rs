//! `tern bench failover`: how long a replicated metadata service takes no writes when its leader
//! dies.
//!
//! A `tern up --metadata-replicas N` cluster at its defaults, supervised as an operator's is (the
//! killed replica is restarted and catches up). Each of `--kills` rounds finds the leader (the one
//! replica whose own `Status` answers; the others refuse with "not the leader"), SIGKILLs it by
//! the pid `tern up` reported, and from that instant has a client that knows every replica's
//! address, as users' clients do, create empty files one after another, each try started after
//! the kill, until one is answered: the failover time. `tern up` itself is paused (SIGSTOP) from
//! just before the kill until that answer, so the replica stays dead as a lost host's would:
//! restarted at once (tern up's first restart comes 0.5 s after an exit), openraft restores a
//! replica whose vote it holds committed as leader at startup, before any follower's election
//! timer runs out, and the bench would time a restart (0.8-4.3 s as tern up's restart backoff
//! grew, measured so) instead of an election. The round then resumes `tern up` and waits for it
//! to restart the replica and for that to have applied every entry the new leader had applied
//! (`tern_metadata_raft_applied_index`), so every kill meets a whole cluster: killed while a
//! restarted replica still lags (the leader retries an unreachable follower every 500 ms), only
//! one replica could win the election, and the lagging one's own candidacies split the votes
//! (seen so: 4.3-7 s).
//! At the end every file whose create was answered is listed back: nothing acknowledged is lost.
//!
//! There is no peer to run beside it: the targets are absolute (p50 <= 3 s and max <= 6 s over
//! 20 kills), set by the election timeout (1.5-3 s) that any Raft service waits out first.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use tern_common::percentile;
use tern_local::cluster::EmbeddedCluster;
use tern_proto::v1::metadata_client::MetadataClient;
use tonic::transport::Channel;

pub struct FailoverOptions {
    /// The `tern` binary to run (usually the running one).
    pub tern: std::path::PathBuf,
    /// Metadata replicas (3 or 5).
    pub replicas: u16,
    /// Leaders killed, one after another.
    pub kills: usize,
}

/// The targets: the failover time's median and maximum over the kills.
pub const TARGET_P50_SECONDS: f64 = 3.0;
pub const TARGET_MAX_SECONDS: f64 = 6.0;

/// The directory the bench's files are created in.
const DIR: &str = "/bench-failover";
/// The longest a round may wait for a write, and for the killed replica to be back.
const ROUND_LIMIT: Duration = Duration::from_secs(60);
/// The longest one create may take (the client itself tries every replica within it).
const TRY_LIMIT: Duration = Duration::from_secs(10);
/// The pause after a refused try, before the next.
const TRY_PAUSE: Duration = Duration::from_millis(20);
/// `tern up` restarts a daemon at most this many times within [`RESTART_WINDOW`] and then leaves
/// it down (`tern_local::RestartLimits`), so a replica is not killed more often than that.
const RESTARTS_PER_WINDOW: usize = 5;
const RESTART_WINDOW: Duration = Duration::from_secs(61);

/// One kill of the leader.
#[derive(Debug, Serialize)]
pub struct Kill {
    /// Which replica led and was killed (1-based, as `tern up` names them: `metadata-K`).
    pub replica: u16,
    /// From the SIGKILL to the answer of the first create started after it.
    pub failover_seconds: f64,
    /// Creates refused (or timed out) before that one.
    pub refused_tries: u32,
    /// The first refusal's words, as the client said them.
    pub first_refusal: Option<String>,
    /// From the SIGKILL until `tern up` had restarted the replica and it had caught up.
    pub rejoin_seconds: f64,
}

#[derive(Debug, Serialize)]
pub struct FailoverReport {
    pub replicas: u16,
    pub kills: Vec<Kill>,
    pub failover_p50_seconds: f64,
    pub failover_p90_seconds: f64,
    pub failover_min_seconds: f64,
    pub failover_max_seconds: f64,
    pub target_p50_seconds: f64,
    pub target_max_seconds: f64,
    /// Creates answered over the whole run (before and after each kill).
    pub acknowledged_creates: usize,
    /// Answered creates whose file was not there at the end: must be none.
    pub missing: Vec<String>,
}

impl FailoverReport {
    pub fn p50_met(&self) -> bool {
        self.failover_p50_seconds <= TARGET_P50_SECONDS
    }

    pub fn max_met(&self) -> bool {
        self.failover_max_seconds <= TARGET_MAX_SECONDS
    }
}

pub async fn run(options: &FailoverOptions) -> anyhow::Result<FailoverReport> {
    anyhow::ensure!(matches!(options.replicas, 3 | 5), "--replicas: give 3 or 5, not {}", options.replicas);
    anyhow::ensure!(options.kills >= 1, "--kills: at least 1");
    progress(&format!("starting tern up with {} metadata replicas", options.replicas));
    let mut cluster = EmbeddedCluster::start_replicated(&options.tern, options.replicas).await?;
    let replicas = Replicas::new(&cluster)?;
    // tern up writes its daemons.json once it has started them all, a moment after they answer.
    let started = Instant::now();
    while !cluster.dir().join("daemons.json").exists() {
        anyhow::ensure!(started.elapsed() < ROUND_LIMIT, "tern up wrote no daemons.json within {ROUND_LIMIT:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let client = tern_client::Client::connect(&cluster.metadata_addr).await?;
    client.mkdir(DIR, true).await.context("making the bench's directory")?;
    let mut acknowledged = BTreeSet::new();
    let mut recent_kills: HashMap<u16, VecDeque<Instant>> = HashMap::new();
    let mut kills = Vec::with_capacity(options.kills);
    for round in 1..=options.kills {
        // A write answered first: the cluster serves before each kill.
        let path = format!("{DIR}/r{round}-before");
        create(&client, &path).await.with_context(|| format!("round {round}: a create before the kill"))?;
        acknowledged.insert(path);

        let victim = replicas.leader().await.with_context(|| format!("round {round}: finding the leader"))?;
        let recent = recent_kills.entry(victim).or_default();
        while recent.front().is_some_and(|at| at.elapsed() > RESTART_WINDOW) {
            recent.pop_front();
        }
        if recent.len() >= RESTARTS_PER_WINDOW {
            let wait = RESTART_WINDOW - recent[0].elapsed();
            progress(&format!(
                "waiting {:.0} s: metadata-{victim} leads again and tern up restarts a daemon at most \
                 {RESTARTS_PER_WINDOW} times a minute",
                wait.as_secs_f64()
            ));
            tokio::time::sleep(wait).await;
        }
        let pid = daemon(&cluster, victim)?.pid.context("the leader has no pid in daemons.json")?;
        let paused = Paused::new(cluster.up_pid())?;
        signal(pid, libc::SIGKILL).with_context(|| format!("killing metadata-{victim}"))?;
        let killed_at = Instant::now();
        recent.push_back(killed_at);

        let (mut refused_tries, mut first_refusal) = (0u32, None);
        let failover_seconds = loop {
            anyhow::ensure!(
                killed_at.elapsed() < ROUND_LIMIT,
                "round {round}: no create answered within {ROUND_LIMIT:?} of killing metadata-{victim}; the \
                 first refusal: {}",
                first_refusal.as_deref().unwrap_or("none")
            );
            let path = format!("{DIR}/r{round}-after-{refused_tries}");
            match create(&client, &path).await {
                Ok(()) => {
                    acknowledged.insert(path);
                    break killed_at.elapsed().as_secs_f64();
                }
                Err(e) => {
                    refused_tries += 1;
                    first_refusal.get_or_insert(format!("{e:#}"));
                    tokio::time::sleep(TRY_PAUSE).await;
                }
            }
        };
        drop(paused);
        let leader = replicas.leader().await.with_context(|| format!("round {round}: the new leader"))?;
        replicas
            .rejoined(&cluster, (victim, pid, killed_at), leader)
            .await
            .with_context(|| format!("round {round}"))?;
        let rejoin_seconds = killed_at.elapsed().as_secs_f64();
        anyhow::ensure!(cluster.up_running(), "tern up stopped (its log: {})", cluster.dir().join("up.log").display());
        progress(&format!(
            "kill {round}/{}: metadata-{victim} (the leader) killed; a create answered {failover_seconds:.2} s \
             after, {refused_tries} refused before it; restarted and caught up after {rejoin_seconds:.1} s",
            options.kills
        ));
        kills.push(Kill { replica: victim, failover_seconds, refused_tries, first_refusal, rejoin_seconds });
    }

    let listed: BTreeSet<String> =
        client.list(DIR).await.context("listing the bench's files")?.into_iter().map(|f| f.path).collect();
    let missing: Vec<String> = acknowledged.difference(&listed).cloned().collect();
    let mut seconds: Vec<f64> = kills.iter().map(|k| k.failover_seconds).collect();
    seconds.sort_by(f64::total_cmp);
    Ok(FailoverReport {
        replicas: options.replicas,
        failover_p50_seconds: percentile(&seconds, 50.0),
        failover_p90_seconds: percentile(&seconds, 90.0),
        failover_min_seconds: seconds[0],
        failover_max_seconds: seconds[seconds.len() - 1],
        target_p50_seconds: TARGET_P50_SECONDS,
        target_max_seconds: TARGET_MAX_SECONDS,
        acknowledged_creates: acknowledged.len(),
        missing,
        kills,
    })
}

/// Sends `signal` to process `pid` (a daemon of the bench's own `tern up`, or `tern up`).
fn signal(pid: u32, signal: libc::c_int) -> anyhow::Result<()> {
    // SAFETY: kill(2) on a process this bench started, by the pid it reported.
    match unsafe { libc::kill(pid as libc::pid_t, signal) } {
        0 => Ok(()),
        _ => bail!("kill(2) of pid {pid}: {}", std::io::Error::last_os_error()),
    }
}

/// `tern up` stopped (SIGSTOP) while this lives, so it restarts no daemon; continued (SIGCONT)
/// when dropped, on every path out of a round.
struct Paused(u32);

impl Paused {
    fn new(pid: u32) -> anyhow::Result<Paused> {
        signal(pid, libc::SIGSTOP).context("pausing tern up")?;
        Ok(Paused(pid))
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        if let Err(e) = signal(self.0, libc::SIGCONT) {
            progress(&format!("could not resume tern up: {e:#}"));
        }
    }
}

/// One create of an empty file, within [`TRY_LIMIT`].
async fn create(client: &tern_client::Client, path: &str) -> anyhow::Result<()> {
    match tokio::time::timeout(TRY_LIMIT, client.create_empty(path, false)).await {
        Ok(answer) => Ok(answer?),
        Err(_) => bail!("not answered within {TRY_LIMIT:?}"),
    }
}

/// A channel to each replica alone (no failover), to ask each whether it leads, and each one's
/// admin (metrics) address.
struct Replicas {
    clients: Vec<MetadataClient<Channel>>,
    admins: Vec<std::net::SocketAddr>,
}

impl Replicas {
    fn new(cluster: &EmbeddedCluster) -> anyhow::Result<Replicas> {
        let count = cluster.metadata_replicas();
        let mut clients = Vec::new();
        for k in 0..count {
            let endpoint = tern_transport::tls::grpc_endpoint(&cluster.metadata_replica_addr(k), None)?
                .connect_timeout(Duration::from_secs(1))
                .timeout(Duration::from_secs(2));
            clients.push(MetadataClient::new(endpoint.connect_lazy()));
        }
        let admins = (0..count).map(|k| cluster.metadata_replica_admin(k)).collect();
        Ok(Replicas { clients, admins })
    }

    /// The last Raft entry replica `k` (1-based) applied, from its metrics.
    async fn applied(&self, k: u16) -> anyhow::Result<u64> {
        let text = crate::harness::scrape(self.admins[usize::from(k - 1)]).await?;
        let name = "tern_metadata_raft_applied_index";
        crate::harness::metric(&text, name).map(|v| v as u64).with_context(|| format!("metadata-{k} exports no {name}"))
    }

    /// What replica `k` (1-based) says of the leadership: Ok(true) when it leads, Ok(false) when it
    /// follows a leader it names, Err otherwise (down, starting, or in an election).
    async fn leads(&self, k: u16) -> Result<bool, String> {
        let mut client = self.clients[usize::from(k - 1)].clone();
        match client.status(tern_proto::v1::StatusRequest {}).await {
            Ok(_) => Ok(true),
            Err(status) if status.message().contains("the leader is ") => Ok(false),
            Err(status) => Err(status.message().to_string()),
        }
    }

    /// The replica that leads (1-based), once one does.
    async fn leader(&self) -> anyhow::Result<u16> {
        let deadline = Instant::now() + ROUND_LIMIT;
        let mut last = String::new();
        while Instant::now() < deadline {
            for k in 1..=self.clients.len() as u16 {
                match self.leads(k).await {
                    Ok(true) => return Ok(k),
                    Ok(false) => {}
                    Err(why) => last = format!("metadata-{k}: {why}"),
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("no replica led within {ROUND_LIMIT:?} ({last})")
    }

    /// Waits until `tern up` has restarted replica `k` (killed at `killed_at`, pid `pid`) and it
    /// has applied every entry the leader, `leader`, had applied when this was called.
    async fn rejoined(
        &self,
        cluster: &EmbeddedCluster,
        (k, pid, killed_at): (u16, u32, Instant),
        leader: u16,
    ) -> anyhow::Result<()> {
        let target = self.applied(leader).await.with_context(|| format!("asking the leader, metadata-{leader}"))?;
        let mut last = String::from("not restarted yet");
        while killed_at.elapsed() < ROUND_LIMIT {
            let now = daemon(cluster, k)?;
            match now.state.as_str() {
                "running" if now.pid.is_some_and(|p| p != pid) => match self.applied(k).await {
                    Ok(applied) if applied >= target => return Ok(()),
                    Ok(applied) => last = format!("applied entry {applied} of {target}"),
                    Err(e) => last = format!("{e:#}"),
                },
                "down" | "stopped" => {
                    bail!("tern up left metadata-{k} {}: {}", now.state, now.why.unwrap_or_default())
                }
                _ => {}
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("metadata-{k} did not catch up within {ROUND_LIMIT:?} of its kill ({last})")
    }
}

/// What `tern up`'s `daemons.json` says of one daemon.
#[derive(serde::Deserialize)]
struct DaemonEntry {
    name: String,
    state: String,
    pid: Option<u32>,
    why: Option<String>,
}

/// Metadata replica `k`'s (1-based) entry in `tern up`'s `daemons.json`.
fn daemon(cluster: &EmbeddedCluster, k: u16) -> anyhow::Result<DaemonEntry> {
    #[derive(serde::Deserialize)]
    struct File {
        daemons: Vec<DaemonEntry>,
    }
    let path = cluster.dir().join("daemons.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let file: File = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let name = format!("metadata-{k}");
    file.daemons.into_iter().find(|d| d.name == name).with_context(|| format!("no {name} in {}", path.display()))
}

fn progress(what: &str) {
    eprintln!("bench failover: {what}");
}

pub fn print_table(r: &FailoverReport) {
    println!("metadata failover, {} replicas, {} leader kills (SIGKILL):", r.replicas, r.kills.len());
    println!("  kill  replica  first write after  refused tries  caught up after");
    for (i, k) in r.kills.iter().enumerate() {
        println!(
            "  {:>4}  {:>7}  {:>15.2} s  {:>13}  {:>12.1} s",
            i + 1,
            format!("meta-{}", k.replica),
            k.failover_seconds,
            k.refused_tries,
            k.rejoin_seconds
        );
    }
    let verdict = |met: bool| if met { "met" } else { "MISSED" };
    println!(
        "  first write after a kill: p50 {:.2} s (target <= {} s: {}), p90 {:.2} s, range {:.2}-{:.2} s (max target <= {} s: {})",
        r.failover_p50_seconds,
        r.target_p50_seconds,
        verdict(r.p50_met()),
        r.failover_p90_seconds,
        r.failover_min_seconds,
        r.failover_max_seconds,
        r.target_max_seconds,
        verdict(r.max_met())
    );
    println!("  creates answered: {}, missing at the end: {}", r.acknowledged_creates, r.missing.len());
}
