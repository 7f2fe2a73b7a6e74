//! systemd's service notification protocol (sd_notify(3)), spoken directly: a datagram of
//! `KEY=value` lines to the socket named by `NOTIFY_SOCKET`. Units of `Type=notify` wait for
//! READY=1; `WatchdogSec=` expects WATCHDOG=1 more often than `WATCHDOG_USEC`. Outside systemd
//! (no `NOTIFY_SOCKET`) every call does nothing.

use std::os::unix::net::UnixDatagram;
use std::time::Duration;

/// Sends `state` (newline-separated `KEY=value` lines) to systemd, when it is listening.
/// Failures are logged, never fatal: the daemon works without systemd.
pub fn notify(state: &str) {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else { return };
    if let Err(e) = send(&socket, state) {
        tracing::warn!("telling systemd {state:?} through {socket:?}: {e}");
    }
}

fn send(socket: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let sender = UnixDatagram::unbound()?;
    let path = socket.as_bytes();
    // A leading '@' names a socket in the abstract namespace.
    if let Some(name) = path.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        sender.send_to_addr(state.as_bytes(), &addr)?;
    } else {
        sender.send_to(state.as_bytes(), std::path::Path::new(socket))?;
    }
    Ok(())
}

/// READY=1, and the watchdog's keep-alive from then on when the unit has one.
pub fn notify_ready() {
    notify("READY=1");
    if let Some(period) = watchdog_period() {
        // A runtime that stops running tasks stops the pings, and systemd restarts the daemon.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let mut ticker = tokio::time::interval(period);
                loop {
                    ticker.tick().await;
                    notify("WATCHDOG=1");
                }
            });
        }
    }
}

/// STOPPING=1: the daemon is shutting down (systemd shows it, and waits).
pub fn notify_stopping() {
    notify("STOPPING=1");
}

/// Half the watchdog timeout systemd set for this process, if it set one for this process.
fn watchdog_period() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    // WATCHDOG_PID, when set, names the process the watchdog is meant for.
    if let Ok(pid) = std::env::var("WATCHDOG_PID") {
        if pid.parse::<u32>().ok()? != std::process::id() {
            return None;
        }
    }
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagrams_reach_a_path_and_an_abstract_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        send(path.as_os_str(), "READY=1").unwrap();
        let mut buffer = [0u8; 64];
        let n = listener.recv(&mut buffer).unwrap();
        assert_eq!(&buffer[..n], b"READY=1");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("tern-test-{}", std::process::id());
        let abstract_addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixDatagram::bind_addr(&abstract_addr).unwrap();
        send(std::ffi::OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let n = listener.recv(&mut buffer).unwrap();
        assert_eq!(&buffer[..n], b"STOPPING=1");
    }
}
