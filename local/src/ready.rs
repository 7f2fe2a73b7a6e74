//! Waiting with a deadline: polls with a bounded backoff (a short first pause, doubling up to a
//! cap, never past the deadline), so a fast daemon is seen at once and a slow one costs few polls.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::anyhow;

use crate::process::{first_exited, Daemon};

/// The first pause between polls.
const FIRST_PAUSE: Duration = Duration::from_millis(5);
/// The longest pause between polls: how late a condition may be seen after it holds.
const MAX_PAUSE: Duration = Duration::from_millis(100);

/// A moment to give up at, with the budget it was set from (for messages).
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    at: Instant,
    budget: Duration,
}

impl Deadline {
    /// `budget` from now.
    pub fn after(budget: Duration) -> Deadline {
        Deadline { at: Instant::now() + budget, budget }
    }

    pub fn budget(&self) -> Duration {
        self.budget
    }

    fn left(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }
}

/// Pauses between polls: doubling from [`FIRST_PAUSE`] up to [`MAX_PAUSE`], with the jitter of
/// the one retry backoff ([`tern_common::Backoff`]).
pub(crate) struct Backoff(tern_common::Backoff);

impl Backoff {
    pub(crate) fn new() -> Backoff {
        Backoff(tern_common::Backoff::new(FIRST_PAUSE, MAX_PAUSE))
    }

    /// Sleeps for the next pause, but not past `until`.
    pub(crate) async fn pause(&mut self, until: Option<&Deadline>) {
        let next = self.0.next().expect("an unbounded backoff always has a next delay");
        let pause = until.map_or(next, |deadline| next.min(deadline.left()));
        tokio::time::sleep(pause).await;
    }
}

/// Polls `check` until it succeeds; at `deadline` returns its last error.
pub async fn poll_until<T, E, Fut>(deadline: &Deadline, mut check: impl FnMut() -> Fut) -> Result<T, E>
where
    Fut: Future<Output = Result<T, E>>,
{
    let mut backoff = Backoff::new();
    loop {
        match check().await {
            Ok(value) => return Ok(value),
            Err(e) if deadline.left().is_zero() => return Err(e),
            Err(_) => backoff.pause(Some(deadline)).await,
        }
    }
}

/// Polls `check` until daemon `daemons[subject]` is ready (`check` succeeds). Fails as soon as any
/// of `daemons` exits (naming it, its exit status and the tail of its log), and at `deadline` with
/// an error naming the subject, its address, `what` was awaited, `check`'s last error and the
/// tail of the subject's log.
pub async fn wait_ready<T, Fut>(
    daemons: &mut [Daemon],
    subject: usize,
    deadline: &Deadline,
    what: &str,
    mut check: impl FnMut() -> Fut,
) -> anyhow::Result<T>
where
    Fut: Future<Output = anyhow::Result<T>>,
{
    // An exit ends the wait at once: it is carried out of the poll as its own outcome, not as
    // the probe's error, so it is never retried.
    let outcome = poll_until(deadline, || {
        let exited = first_exited(daemons);
        let probe = check();
        async move {
            match exited {
                Some(died) => Ok(Err(died)),
                None => probe.await.map(Ok),
            }
        }
    })
    .await;
    match outcome {
        Ok(ready) => ready,
        Err(last) => {
            let daemon = &daemons[subject];
            Err(anyhow!(
                "{} ({}) was not ready within {:?}: waited for {what}; last probe: {last:#}; last lines of {}:\n{}",
                daemon.name(),
                daemon.spec().addr_text(),
                deadline.budget(),
                daemon.log().display(),
                daemon.log_tail()
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn polls_until_the_check_succeeds() {
        let mut calls = 0;
        let value: Result<u32, &str> = poll_until(&Deadline::after(Duration::from_secs(10)), || {
            calls += 1;
            let now = calls;
            async move {
                if now < 4 {
                    Err("not yet")
                } else {
                    Ok(now)
                }
            }
        })
        .await;
        assert_eq!(value, Ok(4));
    }

    #[tokio::test]
    async fn gives_the_last_error_at_the_deadline() {
        let started = Instant::now();
        let mut calls = 0;
        let value: Result<(), u32> = poll_until(&Deadline::after(Duration::from_millis(300)), || {
            calls += 1;
            let now = calls;
            async move { Err(now) }
        })
        .await;
        let elapsed = started.elapsed();
        assert!(elapsed >= Duration::from_millis(300) && elapsed < Duration::from_secs(5), "{elapsed:?}");
        // A bounded backoff: a few polls, not a busy loop nor one long sleep.
        let last = value.unwrap_err();
        assert!((4..=20).contains(&last), "{last} polls");
    }

    fn sh(dir: &std::path::Path, name: &str, script: &str) -> crate::DaemonSpec {
        crate::DaemonSpec::new(name, "/bin/sh", dir.join(format!("{name}.log")))
            .serving("127.0.0.1:9060".parse().unwrap())
            .args(["-c", script])
    }

    #[tokio::test]
    async fn a_timeout_names_the_daemon_its_address_and_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let mut daemons = vec![sh(dir.path(), "metadata", "echo binding the port; sleep 30").spawn().unwrap()];
        let deadline = Deadline::after(Duration::from_millis(300));
        let check = || async { Err::<(), _>(anyhow!("connection refused")) };
        let text = format!("{:#}", wait_ready(&mut daemons, 0, &deadline, "it to answer", check).await.unwrap_err());
        for part in
            ["metadata (127.0.0.1:9060)", "within 300ms", "it to answer", "connection refused", "binding the port"]
        {
            assert!(text.contains(part), "{part:?} in {text}");
        }
    }

    #[tokio::test]
    async fn an_exit_ends_the_wait_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let mut daemons = vec![
            sh(dir.path(), "metadata", "sleep 30").spawn().unwrap(),
            sh(dir.path(), "storage-0", "echo no such flag >&2; exit 2").spawn().unwrap(),
        ];
        let started = Instant::now();
        let deadline = Deadline::after(Duration::from_secs(30));
        let check = || async { Err::<(), _>(anyhow!("not yet")) };
        let text = format!("{:#}", wait_ready(&mut daemons, 0, &deadline, "it to answer", check).await.unwrap_err());
        assert!(text.contains("storage-0 exited") && text.contains("no such flag"), "{text}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}
