//! Keeping a local cluster's daemons running (`tern up`): a daemon that exits unexpectedly (a
//! failure status, or killed by a signal) is started again after a pause that doubles from 0.5 s
//! to 10 s, at most 5 times in any minute; past that it stays down. One that exits with status 0
//! chose to stop and is left stopped: a storage server exits 0 once the metadata server drained
//! it (`tern admin drain`), and every daemon exits 0 when a signal tells it to stop.
//!
//! [`RestartPolicy`] decides, with time passed in, so its bounds are tested without waiting;
//! [`Supervisor`] watches the processes and hands every exit, restart and give-up to its caller
//! as an [`Event`] to print, and its daemons' states as a [`DaemonReport`] each.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use tern_common::backoff::{Backoff, Jitter};

use crate::process::Daemon;

/// How often the supervisor looks at its daemons: how late an exit may be seen.
const POLL: Duration = Duration::from_millis(100);

/// The bounds on restarting one daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartLimits {
    /// The pause before the first restart (and the first after the daemon stayed up a window).
    pub first_delay: Duration,
    /// The longest pause: each restart doubles the one before up to this.
    pub max_delay: Duration,
    /// The sliding window restarts are counted in.
    pub window: Duration,
    /// Restarts allowed within one window; the next exit leaves the daemon down.
    pub max_per_window: usize,
}

impl Default for RestartLimits {
    /// `tern up`'s: 0.5 s doubling to 10 s, at most 5 restarts a minute. A daemon that fails at
    /// once each time is given up on after about 16 s, with its five logs' worth of reasons.
    fn default() -> RestartLimits {
        RestartLimits {
            first_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(10),
            window: Duration::from_secs(60),
            max_per_window: 5,
        }
    }
}

/// What to do about a daemon that exited unexpectedly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Start it again after `after`; this is its `restart`th restart since it was first started.
    Restart { restart: u32, after: Duration },
    /// Leave it down: it was restarted `within_window` times in the last window already.
    GiveUp { within_window: usize },
}

/// One daemon's restarts: the pause before the next, and the recent ones counted against the limit.
#[derive(Debug, Clone)]
pub struct RestartPolicy {
    limits: RestartLimits,
    backoff: Backoff,
    /// When each restart within the last window was decided, oldest first.
    recent: VecDeque<Instant>,
    restarts: u32,
}

impl RestartPolicy {
    pub fn new(limits: RestartLimits) -> RestartPolicy {
        // No jitter: one daemon restarting has no peers to fall in step with, and the pauses
        // the README promises are the ones it gets.
        let backoff = Backoff::new(limits.first_delay, limits.max_delay).jitter(Jitter::None);
        RestartPolicy { limits, backoff, recent: VecDeque::new(), restarts: 0 }
    }

    /// Restarts so far.
    pub fn restarts(&self) -> u32 {
        self.restarts
    }

    /// The verdict on an unexpected exit at `now` of a daemon that had been running `ran_for`.
    pub fn after_exit(&mut self, now: Instant, ran_for: Duration) -> Verdict {
        // A daemon that stayed up a whole window had recovered: this failure is a new one.
        if ran_for >= self.limits.window {
            self.backoff.reset();
        }
        while self.recent.front().is_some_and(|&at| now.saturating_duration_since(at) >= self.limits.window) {
            self.recent.pop_front();
        }
        if self.recent.len() >= self.limits.max_per_window {
            return Verdict::GiveUp { within_window: self.recent.len() };
        }
        self.recent.push_back(now);
        self.restarts += 1;
        let after = self.backoff.next().expect("a backoff without bounds always has a next delay");
        Verdict::Restart { restart: self.restarts, after }
    }
}

/// Something that happened to a supervised daemon, printed by the caller as one line.
#[derive(Debug)]
pub enum Event {
    /// It exited unexpectedly and will be started again after `after`.
    Exited { name: String, status: ExitStatus, restart: u32, after: Duration, log: PathBuf },
    /// It was started again.
    Restarted { name: String, restart: u32, pid: u32 },
    /// It exited unexpectedly once too often, or could not be started again: it stays down.
    GaveUp { name: String, why: String, log: PathBuf },
    /// It exited with status 0, as it does when drained or told to stop: it stays stopped.
    Stopped { name: String, status: ExitStatus },
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Event::Exited { name, status, restart, after, log } => write!(
                f,
                "{name} exited unexpectedly ({status}); restart {restart} in {after:?} (its log: {})",
                log.display()
            ),
            Event::Restarted { name, restart, pid } => write!(f, "{name} restarted (restart {restart}, pid {pid})"),
            Event::GaveUp { name, why, log } => write!(f, "{name} stays down: {why}; see {}", log.display()),
            Event::Stopped { name, status } => write!(
                f,
                "{name} exited cleanly ({status}), as a drained storage server or one told to stop does; \
                 not restarted"
            ),
        }
    }
}

/// Where a supervised daemon stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DaemonState {
    Running,
    /// Exited unexpectedly; to be started again at the instant held.
    Restarting(Instant),
    /// Given up on: exited too often, or could not be started again.
    Down,
    /// Exited with status 0 by its own choice.
    Stopped,
}

impl DaemonState {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            DaemonState::Running => "running",
            DaemonState::Restarting(_) => "restarting",
            DaemonState::Down => "down",
            DaemonState::Stopped => "stopped",
        }
    }
}

/// One daemon as [`Supervisor::report`] describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonReport {
    pub name: String,
    pub state: DaemonState,
    /// The running process's id (`None` unless running).
    pub pid: Option<u32>,
    pub restarts: u32,
    /// How it last exited, e.g. "signal: 9 (SIGKILL)".
    pub last_exit: Option<String>,
    /// Why it is down or stopped.
    pub why: Option<String>,
    pub log: PathBuf,
}

impl DaemonReport {
    /// A running daemon nobody restarts (`tern up --exit-on-failure`).
    pub fn running(daemon: &Daemon) -> DaemonReport {
        DaemonReport {
            name: daemon.name().to_string(),
            state: DaemonState::Running,
            pid: Some(daemon.id()),
            restarts: 0,
            last_exit: None,
            why: None,
            log: daemon.log().to_path_buf(),
        }
    }
}

struct Member {
    daemon: Daemon,
    policy: RestartPolicy,
    started: Instant,
    state: DaemonState,
    last_exit: Option<ExitStatus>,
    why: Option<String>,
}

/// Daemons kept running under a [`RestartPolicy`] each.
pub struct Supervisor {
    members: Vec<Member>,
}

impl Supervisor {
    /// Supervises `daemons` (running) under `limits`.
    pub fn new(daemons: Vec<Daemon>, limits: RestartLimits) -> Supervisor {
        let now = Instant::now();
        let members = daemons
            .into_iter()
            .map(|daemon| Member {
                daemon,
                policy: RestartPolicy::new(limits),
                started: now,
                state: DaemonState::Running,
                last_exit: None,
                why: None,
            })
            .collect();
        Supervisor { members }
    }

    /// The next thing that happens to any daemon. Cancel-safe: what it saw is acted on and
    /// returned in one step, with no await between.
    pub async fn next_event(&mut self) -> Event {
        loop {
            if let Some(event) = self.poll(Instant::now()) {
                return event;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Looks at every daemon once: the first exit seen or restart due, acted on.
    fn poll(&mut self, now: Instant) -> Option<Event> {
        self.members.iter_mut().find_map(|member| member.poll(now))
    }

    /// Every daemon's state, in the order they were given.
    pub fn report(&self) -> Vec<DaemonReport> {
        self.members
            .iter()
            .map(|member| DaemonReport {
                name: member.daemon.name().to_string(),
                state: member.state,
                pid: (member.state == DaemonState::Running).then(|| member.daemon.id()),
                restarts: member.policy.restarts(),
                last_exit: member.last_exit.map(|status| status.to_string()),
                why: member.why.clone(),
                log: member.daemon.log().to_path_buf(),
            })
            .collect()
    }

    /// The daemons, to stop them (those not running have exited and stop at once).
    pub fn into_daemons(self) -> Vec<Daemon> {
        self.members.into_iter().map(|member| member.daemon).collect()
    }
}

impl Member {
    fn poll(&mut self, now: Instant) -> Option<Event> {
        let name = self.daemon.name().to_string();
        let log = self.daemon.log().to_path_buf();
        match self.state {
            DaemonState::Running => {
                let status = self.daemon.try_wait().ok().flatten()?;
                self.last_exit = Some(status);
                if status.success() {
                    self.state = DaemonState::Stopped;
                    self.why = Some(format!("it exited cleanly ({status}), as when drained or told to stop"));
                    return Some(Event::Stopped { name, status });
                }
                match self.policy.after_exit(now, now.saturating_duration_since(self.started)) {
                    Verdict::Restart { restart, after } => {
                        self.state = DaemonState::Restarting(now + after);
                        Some(Event::Exited { name, status, restart, after, log })
                    }
                    Verdict::GiveUp { within_window } => {
                        let why = format!(
                            "it exited unexpectedly ({status}) after {within_window} restarts within {:?}",
                            self.policy.limits.window
                        );
                        self.state = DaemonState::Down;
                        self.why = Some(why.clone());
                        Some(Event::GaveUp { name, why, log })
                    }
                }
            }
            DaemonState::Restarting(at) if now >= at => {
                // Its log goes on after the exit's last lines, which say why it exited.
                match self.daemon.spec().clone().append_log().spawn() {
                    Ok(daemon) => {
                        self.daemon = daemon;
                        self.started = now;
                        self.state = DaemonState::Running;
                        let (restart, pid) = (self.policy.restarts(), self.daemon.id());
                        Some(Event::Restarted { name, restart, pid })
                    }
                    Err(e) => {
                        let why = format!("it could not be started again: {e:#}");
                        self.state = DaemonState::Down;
                        self.why = Some(why.clone());
                        Some(Event::GaveUp { name, why, log })
                    }
                }
            }
            DaemonState::Restarting(_) | DaemonState::Down | DaemonState::Stopped => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::DaemonSpec;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn restarts_back_off_from_half_a_second_to_ten_and_stop_after_five_a_minute() {
        let mut policy = RestartPolicy::new(RestartLimits::default());
        let start = Instant::now();
        // A daemon that dies a second after each start.
        let mut now = start;
        let mut pauses = Vec::new();
        for restart in 1..=5 {
            now += SECOND;
            match policy.after_exit(now, SECOND) {
                Verdict::Restart { restart: n, after } => {
                    assert_eq!(n, restart);
                    pauses.push(after);
                    now += after;
                }
                other => panic!("restart {restart}: {other:?}"),
            }
        }
        assert_eq!(pauses, [500, 1000, 2000, 4000, 8000].map(Duration::from_millis));
        assert_eq!(policy.after_exit(now + SECOND, SECOND), Verdict::GiveUp { within_window: 5 });
        // A minute after the first restart, one restart is allowed again, at the capped pause.
        let later = start + Duration::from_secs(61);
        assert_eq!(policy.after_exit(later, SECOND), Verdict::Restart { restart: 6, after: 10 * SECOND });
    }

    #[test]
    fn a_daemon_that_stayed_up_a_minute_restarts_after_the_short_pause_again() {
        let mut policy = RestartPolicy::new(RestartLimits::default());
        let mut now = Instant::now();
        for _ in 0..3 {
            now += SECOND;
            policy.after_exit(now, SECOND);
        }
        now += Duration::from_secs(120);
        let verdict = policy.after_exit(now, Duration::from_secs(120));
        assert_eq!(verdict, Verdict::Restart { restart: 4, after: Duration::from_millis(500) });
    }

    fn sh(dir: &std::path::Path, name: &str, script: &str) -> Daemon {
        DaemonSpec::new(name, "/bin/sh", dir.join(format!("{name}.log"))).args(["-c", script]).spawn().unwrap()
    }

    const QUICK: RestartLimits = RestartLimits {
        first_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(40),
        window: Duration::from_secs(60),
        max_per_window: 3,
    };

    #[tokio::test]
    async fn a_failing_daemon_is_restarted_until_the_limit_and_a_clean_exit_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let daemons = vec![
            sh(dir.path(), "failer", "echo started; exit 3"),
            sh(dir.path(), "drained", "exit 0"),
            sh(dir.path(), "steady", "sleep 30"),
        ];
        let mut supervisor = Supervisor::new(daemons, QUICK);
        // Three restarts of the failer, each after its exit, then it stays down; the clean one
        // stops once.
        let mut events = Vec::new();
        let done = |events: &[Event]| {
            events.iter().any(|e| matches!(e, Event::GaveUp { .. }))
                && events.iter().any(|e| matches!(e, Event::Stopped { .. }))
        };
        while !done(&events) {
            let event = tokio::time::timeout(Duration::from_secs(20), supervisor.next_event()).await.unwrap();
            events.push(event);
        }
        let lines: Vec<String> = events.iter().map(ToString::to_string).collect();
        let failer: Vec<&String> = lines.iter().filter(|l| l.starts_with("failer")).collect();
        assert_eq!(failer.len(), 7, "3 exits, 3 restarts, 1 give-up: {lines:#?}");
        assert!(failer[0].contains("exit status: 3") && failer[0].contains("restart 1 in 10ms"), "{lines:#?}");
        assert!(failer[1].starts_with("failer restarted (restart 1"), "{lines:#?}");
        assert!(failer[6].contains("stays down") && failer[6].contains("after 3 restarts"), "{lines:#?}");
        assert_eq!(lines.iter().filter(|l| l.starts_with("drained")).count(), 1, "{lines:#?}");
        assert!(lines.iter().any(|l| l.starts_with("drained exited cleanly") && l.contains("not restarted")));
        // Each restart's output was appended to the log, not put in place of it.
        let log = std::fs::read_to_string(dir.path().join("failer.log")).unwrap();
        assert_eq!(log, "started\n".repeat(4));
        let report = supervisor.report();
        let states: Vec<(&str, &str, u32)> =
            report.iter().map(|r| (r.name.as_str(), r.state.name(), r.restarts)).collect();
        assert_eq!(states, [("failer", "down", 3), ("drained", "stopped", 0), ("steady", "running", 0)]);
        assert!(report[0].why.as_deref().unwrap().contains("exit status: 3") && report[0].pid.is_none());
        assert!(report[2].pid.is_some());
        for mut daemon in supervisor.into_daemons() {
            daemon.stop(Duration::from_secs(5)).await;
        }
    }
}
