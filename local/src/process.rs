//! Daemon processes: started from a [`DaemonSpec`] on its host with stdout and stderr in a log
//! file and a parent-death signal; watched for exits; stopped gracefully (SIGTERM, a grace
//! period, then SIGKILL) or killed. A [`Daemon`] dropped while running is killed, so none
//! outlives its owner.

use std::ffi::OsString;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{anyhow, Context};

use crate::host::Host;
use crate::ready::{Backoff, Deadline};

/// Lines of a daemon's log that errors quote.
const LOG_TAIL_LINES: usize = 5;

/// How to start a daemon: what to run, where, and where its output goes.
#[derive(Debug, Clone)]
pub struct DaemonSpec {
    name: String,
    host: Host,
    program: PathBuf,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    /// Leave out inherited `TERN_*` variables (but the log format).
    without_tern_env: bool,
    addr: Option<SocketAddr>,
    log: PathBuf,
    append: bool,
    /// Rotate the log at this size (`None`: let it grow).
    log_limit: Option<u64>,
}

impl DaemonSpec {
    /// `program` named `name` (in errors) on the local host, its output replacing the file `log`.
    pub fn new(name: impl Into<String>, program: impl Into<PathBuf>, log: impl Into<PathBuf>) -> DaemonSpec {
        DaemonSpec {
            name: name.into(),
            host: Host::local(),
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            without_tern_env: false,
            addr: None,
            log: log.into(),
            append: false,
            log_limit: None,
        }
    }

    /// Runs it on `host`.
    pub fn on(mut self, host: Host) -> DaemonSpec {
        self.host = host;
        self
    }

    /// Adds command-line arguments.
    pub fn args(mut self, args: impl IntoIterator<Item = impl Into<OsString>>) -> DaemonSpec {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets an environment variable for it (beside the ones it inherits).
    pub fn env(mut self, name: impl Into<OsString>, value: impl Into<OsString>) -> DaemonSpec {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Does not pass on this process's `TERN_*` variables (which set daemon config keys and
    /// client options) but `TERN_LOG_FORMAT`: a cluster started here is configured by the flags
    /// it is started with alone, whatever the shell exported for clients (`TERN_TLS_DIR`).
    pub fn without_tern_env(mut self) -> DaemonSpec {
        self.without_tern_env = true;
        self
    }

    /// The address it serves, for errors about it.
    pub fn serving(mut self, addr: SocketAddr) -> DaemonSpec {
        self.addr = Some(addr);
        self
    }

    /// Its output goes to `log` (replacing the file, unless appending).
    pub fn log_to(mut self, log: impl Into<PathBuf>) -> DaemonSpec {
        self.log = log.into();
        self
    }

    /// Appends its output to the log file rather than replacing it.
    pub fn append_log(mut self) -> DaemonSpec {
        self.append = true;
        self
    }

    /// Bounds its log: past `bytes` the file becomes `<log>.1` (replacing the one before) and a
    /// new one starts, so the two together stay under twice `bytes`. Its output then goes
    /// through a pipe that a thread of this process copies into the file.
    pub fn rotate_log_at(mut self, bytes: u64) -> DaemonSpec {
        self.log_limit = Some(bytes);
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn host(&self) -> &Host {
        &self.host
    }

    /// The address it serves, as errors show it.
    pub(crate) fn addr_text(&self) -> String {
        self.addr.map_or_else(|| format!("on {}", self.host.name()), |addr| addr.to_string())
    }

    /// Starts it. The parent-death signal (SIGTERM) follows the thread that calls this: call it
    /// from a thread that lives as long as the daemon should (a runtime's worker, a test's own).
    pub fn spawn(&self) -> anyhow::Result<Daemon> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(self.append)
            .truncate(!self.append)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let mut command = self.host.command(&self.program);
        command.args(&self.args).stdin(Stdio::null());
        if self.without_tern_env {
            for (name, _) in std::env::vars_os() {
                let text = name.to_string_lossy();
                if text.starts_with("TERN_") && text != "TERN_LOG_FORMAT" {
                    command.env_remove(&name);
                }
            }
        }
        command.envs(self.env.iter().map(|(k, v)| (k, v)));
        let copier = match self.log_limit {
            None => {
                command.stdout(out.try_clone()?).stderr(out);
                None
            }
            Some(limit) => {
                let (reader, writer) = io::pipe().context("making a pipe for the daemon's output")?;
                command.stdout(writer.try_clone()?).stderr(writer);
                Some((reader, RotatingLog::new(self.log.clone(), out, limit)?))
            }
        };
        // SAFETY: prctl is async-signal-safe; it only asks the kernel to SIGTERM the daemon if
        // its parent dies, so no daemon outlives the process that started it.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut command, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {} ({}) on {}", self.name, self.program.display(), self.host.name()))?;
        // The command holds the pipe's write end: dropped, the copier sees the end of the output
        // when the daemon exits.
        drop(command);
        if let Some((reader, log)) = copier {
            std::thread::Builder::new()
                .name(format!("{}-log", self.name))
                .spawn(move || log.copy_from(reader))
                .context("starting the log copier")?;
        }
        Ok(Daemon { spec: self.clone(), child })
    }
}

/// A log file that rotates to `<path>.1` past `limit` bytes.
struct RotatingLog {
    path: PathBuf,
    file: std::fs::File,
    written: u64,
    limit: u64,
}

impl RotatingLog {
    fn new(path: PathBuf, file: std::fs::File, limit: u64) -> io::Result<RotatingLog> {
        let written = file.metadata()?.len();
        Ok(RotatingLog { path, file, written, limit: limit.max(1) })
    }

    /// Copies the daemon's output until it ends; a write that fails ends the copy (and the
    /// daemon then meets a closed pipe, as it would a full disk).
    fn copy_from(mut self, mut output: impl io::Read) {
        let mut buffer = vec![0u8; 64 << 10];
        loop {
            let n = match output.read(&mut buffer) {
                Ok(0) => return,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            };
            if self.write(&buffer[..n]).is_err() {
                return;
            }
        }
    }

    /// Writes `bytes`, rotating before the file would pass the limit; a cut falls after a
    /// newline where there is one, so lines stay whole.
    fn write(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        use std::io::Write;
        while !bytes.is_empty() {
            let room = self.limit.saturating_sub(self.written) as usize;
            let take = if bytes.len() <= room {
                bytes.len()
            } else {
                match bytes[..room].iter().rposition(|&b| b == b'\n') {
                    Some(newline) => newline + 1,
                    // No line ends within the room: a fresh file takes what fits.
                    None if self.written == 0 => room,
                    None => 0,
                }
            };
            self.file.write_all(&bytes[..take])?;
            self.written += take as u64;
            bytes = &bytes[take..];
            if !bytes.is_empty() {
                self.rotate()?;
            }
        }
        Ok(())
    }

    fn rotate(&mut self) -> io::Result<()> {
        let mut old = self.path.clone().into_os_string();
        old.push(".1");
        std::fs::rename(&self.path, &old)?;
        self.file = std::fs::File::create(&self.path)?;
        self.written = 0;
        Ok(())
    }
}

/// How [`Daemon::stop`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// It exited within the grace period (or had already).
    Exited(ExitStatus),
    /// It did not, and was killed.
    Killed,
}

/// A running (or exited) daemon process.
#[derive(Debug)]
pub struct Daemon {
    spec: DaemonSpec,
    child: Child,
}

impl Daemon {
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// How it was started: to start it again.
    pub fn spec(&self) -> &DaemonSpec {
        &self.spec
    }

    pub fn log(&self) -> &Path {
        &self.spec.log
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status, if it has exited.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.child.try_wait()
    }

    /// Blocks until it exits.
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        self.child.wait()
    }

    /// Sends SIGKILL (nothing if it has exited); [`Daemon::wait`] then reaps it at once.
    pub fn kill(&mut self) -> io::Result<()> {
        self.child.kill()
    }

    /// Sends SIGTERM, asking it to stop cleanly; nothing if it has exited.
    pub fn terminate(&mut self) -> io::Result<()> {
        // Only while unreaped: a reaped pid may already belong to another process.
        if self.child.try_wait()?.is_none() {
            // SAFETY: plain kill(2) on our own unreaped child's pid.
            if unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// Waits until it exits, or `deadline` passes (`None`).
    pub async fn wait_until(&mut self, deadline: &Deadline) -> Option<ExitStatus> {
        crate::ready::poll_until(deadline, || std::future::ready(self.child.try_wait().ok().flatten().ok_or(())))
            .await
            .ok()
    }

    /// SIGTERM, up to `grace` to exit, then SIGKILL.
    pub async fn stop(&mut self, grace: Duration) -> Stopped {
        let _ = self.terminate();
        match self.wait_until(&Deadline::after(grace)).await {
            Some(status) => Stopped::Exited(status),
            None => {
                self.kill_and_reap();
                Stopped::Killed
            }
        }
    }

    /// SIGKILL and reap. A killed process exits at once, so the blocking wait is short.
    fn kill_and_reap(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.spec.log).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(LOG_TAIL_LINES).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    /// If it has exited: an error saying so, with the tail of its log.
    fn exit_error(&mut self) -> Option<anyhow::Error> {
        let status = self.child.try_wait().ok().flatten()?;
        Some(anyhow!("{} exited ({status}); last lines of {}:\n{}", self.name(), self.log().display(), self.log_tail()))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill_and_reap();
        }
    }
}

/// The error describing the first of `daemons` found to have exited, if any.
pub fn first_exited(daemons: &mut [Daemon]) -> Option<anyhow::Error> {
    daemons.iter_mut().find_map(Daemon::exit_error)
}

/// Resolves when any of `daemons` exits, with an error naming it and quoting its log.
pub async fn first_exit(daemons: &mut [Daemon]) -> anyhow::Error {
    let mut backoff = Backoff::new();
    loop {
        if let Some(died) = first_exited(daemons) {
            return died;
        }
        backoff.pause(None).await;
    }
}

/// SIGTERM to all of `daemons` at once, up to `grace` for all to exit, then SIGKILL to the rest;
/// returns the names of those killed.
pub async fn stop_together<'a>(daemons: impl IntoIterator<Item = &'a mut Daemon>, grace: Duration) -> Vec<String> {
    let mut daemons: Vec<&mut Daemon> = daemons.into_iter().collect();
    for daemon in &mut daemons {
        let _ = daemon.terminate();
    }
    let deadline = Deadline::after(grace);
    let mut killed = Vec::new();
    for daemon in daemons {
        if daemon.wait_until(&deadline).await.is_none() {
            daemon.kill_and_reap();
            killed.push(daemon.name().to_string());
        }
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(dir: &Path, name: &str, script: &str) -> DaemonSpec {
        DaemonSpec::new(name, "/bin/sh", dir.join(format!("{name}.log"))).args(["-c", script])
    }

    #[tokio::test]
    async fn output_goes_to_the_log_and_an_exit_is_reported_with_its_tail() {
        let dir = tempfile::tempdir().unwrap();
        let mut daemons = vec![
            sh(dir.path(), "sleeper", "sleep 30").spawn().unwrap(),
            sh(dir.path(), "failer", "echo starting; echo cannot bind >&2; exit 3").spawn().unwrap(),
        ];
        let died = tokio::time::timeout(Duration::from_secs(10), first_exit(&mut daemons)).await.unwrap();
        let text = format!("{died:#}");
        assert!(text.contains("failer exited") && text.contains("starting\ncannot bind"), "{text}");
    }

    #[tokio::test]
    async fn stop_terminates_and_kills_one_that_ignores_sigterm() {
        let dir = tempfile::tempdir().unwrap();
        let mut polite = sh(dir.path(), "polite", "sleep 30").spawn().unwrap();
        assert!(matches!(polite.stop(Duration::from_secs(10)).await, Stopped::Exited(_)));
        // The shell ignores SIGTERM once it has said "ready".
        let mut stubborn =
            sh(dir.path(), "stubborn", "trap '' TERM; echo ready; while :; do sleep 1; done").spawn().unwrap();
        let deadline = Deadline::after(Duration::from_secs(10));
        crate::ready::poll_until(&deadline, || {
            std::future::ready(stubborn.log_tail().contains("ready").then_some(()).ok_or(()))
        })
        .await
        .unwrap();
        assert_eq!(stubborn.stop(Duration::from_millis(200)).await, Stopped::Killed);
        assert!(stubborn.try_wait().unwrap().is_some());
    }

    #[tokio::test]
    async fn stop_together_and_drop_leave_nothing_running() {
        let dir = tempfile::tempdir().unwrap();
        let mut daemons: Vec<Daemon> =
            (0..3).map(|i| sh(dir.path(), &format!("d{i}"), "sleep 30").spawn().unwrap()).collect();
        assert!(stop_together(&mut daemons, Duration::from_secs(10)).await.is_empty());
        assert!(daemons.iter_mut().all(|d| d.try_wait().unwrap().is_some()));
        let dropped = sh(dir.path(), "dropped", "sleep 30").spawn().unwrap();
        let pid = dropped.id() as libc::pid_t;
        drop(dropped);
        // Killed and reaped: the pid is gone.
        // SAFETY: signal 0 only checks whether the pid exists.
        assert_eq!(unsafe { libc::kill(pid, 0) }, -1);
    }

    #[test]
    fn a_restart_appends_or_replaces_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let spec = sh(dir.path(), "echo", "echo once");
        spec.spawn().unwrap().wait().unwrap();
        spec.clone().append_log().spawn().unwrap().wait().unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join("echo.log")).unwrap(), "once\nonce\n");
        spec.spawn().unwrap().wait().unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join("echo.log")).unwrap(), "once\n");
    }

    #[tokio::test]
    async fn a_bounded_log_rotates_and_keeps_the_latest_output() {
        let dir = tempfile::tempdir().unwrap();
        // 2,000 lines of 10 bytes, then "done": 20 KB through a log bounded at 4 KB.
        let spec = sh(
            dir.path(),
            "chatty",
            "i=0; while [ $i -lt 2000 ]; do printf 'line %04d\\n' $i; i=$((i+1)); done; echo done >&2",
        )
        .rotate_log_at(4096);
        spec.spawn().unwrap().wait().unwrap();
        let log = dir.path().join("chatty.log");
        // The copier thread finishes after the daemon exits.
        let deadline = Deadline::after(Duration::from_secs(10));
        crate::ready::poll_until(&deadline, || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            std::future::ready(text.ends_with("line 1999\ndone\n").then_some(()).ok_or(()))
        })
        .await
        .unwrap();
        let old = dir.path().join("chatty.log.1");
        let (current, previous) = (std::fs::metadata(&log).unwrap().len(), std::fs::metadata(&old).unwrap().len());
        assert!(current <= 4096 && previous <= 4096, "{current} and {previous} bytes");
        // Nothing lost at the cut: the old file ends where the new one starts.
        let last_old = std::fs::read_to_string(&old).unwrap().lines().last().unwrap().to_string();
        let first_new = std::fs::read_to_string(&log).unwrap().lines().next().unwrap().to_string();
        let number = |line: &str| line.trim_start_matches("line ").parse::<u32>().unwrap();
        assert_eq!(number(&last_old) + 1, number(&first_new));
    }
}
