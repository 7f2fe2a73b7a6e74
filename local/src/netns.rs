//! Several hosts on this machine: each a network namespace with its own address on a bridge the
//! [`Network`] makes, so daemons and clients talk across real (virtual) links that a test can cut,
//! heal and slow. See the project's multi-host notes for what the kernel offers here.
//!
//! Everything is named after the process that made it (`tern-<pid>-<n>-<host>` namespaces,
//! `tnb<pid>x<n>` bridges, `tnv<pid>x<n>h<i>` veths), so tests running in parallel never collide,
//! and a later run can tell what a crashed one left behind (its pid is gone) and remove it. The
//! bridge has no address and no namespace has a route beyond the bridge: traffic cannot leave the
//! hosts the test made. A [`Network`] removes what it made when dropped, also during a panic.

use std::ffi::OsStr;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{anyhow, bail, Context};

use crate::host::Host;

/// The hosts' subnet: host `i` is 10.231.0.(11 + i)/24.
const SUBNET_PREFIX: [u8; 3] = [10, 231, 0];
const FIRST_HOST_OCTET: u8 = 11;
/// Hosts one network may have (addresses and veth names stay short).
pub const MAX_HOSTS: usize = 9;
/// Linux interface names are at most this long.
const IFNAME_MAX: usize = 15;
const NETNS_PREFIX: &str = "tern-";
const BRIDGE_PREFIX: &str = "tnb";
const VETH_PREFIX: &str = "tnv";

/// Networks made by this process so far: part of every name, so two in one process differ.
static NETWORKS_MADE: AtomicU32 = AtomicU32::new(0);

/// Hosts as network namespaces on one bridge. Dropping it removes them.
#[derive(Debug)]
pub struct Network {
    bridge: String,
    hosts: Vec<Host>,
    /// Set once the bridge exists: what Drop must remove.
    made: Vec<Made>,
}

#[derive(Debug)]
enum Made {
    Bridge(String),
    Netns(String),
    Link(String),
}

impl Network {
    /// Makes a bridge and one namespace per name in `hosts` (at most [`MAX_HOSTS`]), each with
    /// its address on the bridge and loopback up. Removes what crashed earlier runs left first.
    /// Fails, saying why, where namespaces cannot be made (not root).
    pub fn create(hosts: &[&str]) -> anyhow::Result<Network> {
        if hosts.is_empty() || hosts.len() > MAX_HOSTS {
            bail!("a network has 1 to {MAX_HOSTS} hosts, not {}", hosts.len());
        }
        remove_stale();
        let pid = std::process::id();
        let n = NETWORKS_MADE.fetch_add(1, Ordering::Relaxed);
        let bridge = format!("{BRIDGE_PREFIX}{pid}x{n}");
        let mut network = Network { bridge: bridge.clone(), hosts: Vec::new(), made: Vec::new() };
        ip(["link", "add", &bridge, "type", "bridge"]).map_err(|e| {
            e.context(
                "cannot make a bridge for the multi-host test cluster: these tests need root \
                 (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces, bridges and veths; \
                 run them as root (CI does)",
            )
        })?;
        network.made.push(Made::Bridge(bridge.clone()));
        ip(["link", "set", &bridge, "up"])?;
        for (i, name) in hosts.iter().enumerate() {
            let netns = format!("{NETNS_PREFIX}{pid}-{n}-{name}");
            let link = format!("{VETH_PREFIX}{pid}x{n}h{i}");
            if link.len() > IFNAME_MAX {
                bail!("interface name {link} is longer than {IFNAME_MAX} characters");
            }
            let ip_addr =
                Ipv4Addr::new(SUBNET_PREFIX[0], SUBNET_PREFIX[1], SUBNET_PREFIX[2], FIRST_HOST_OCTET + i as u8);
            ip(["netns", "add", &netns])?;
            network.made.push(Made::Netns(netns.clone()));
            ip(["link", "add", &link, "type", "veth", "peer", "name", "eth0", "netns", &netns])?;
            network.made.push(Made::Link(link.clone()));
            ip(["link", "set", &link, "master", &bridge, "up"])?;
            ip(["-n", &netns, "addr", "add", &format!("{ip_addr}/24"), "dev", "eth0"])?;
            ip(["-n", &netns, "link", "set", "eth0", "up"])?;
            ip(["-n", &netns, "link", "set", "lo", "up"])?;
            network.hosts.push(Host::in_netns(name, IpAddr::V4(ip_addr), &netns, &link));
        }
        Ok(network)
    }

    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// The host named `name`.
    pub fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name() == name)
            .unwrap_or_else(|| panic!("no host {name} in network {}", self.bridge))
    }

    /// Cuts `host` off: its link goes down on the bridge's side. Packets vanish, nothing is
    /// refused: a hung host or a dead switch port, which only deadlines notice.
    pub fn cut(&self, host: &str) -> anyhow::Result<()> {
        ip(["link", "set", self.link_of(host)?, "down"])
    }

    /// Undoes [`Network::cut`].
    pub fn heal(&self, host: &str) -> anyhow::Result<()> {
        ip(["link", "set", self.link_of(host)?, "up"])
    }

    /// Shapes traffic towards `host` to `rate` (tc's syntax, e.g. "100mbit") with a token bucket
    /// (no netem in this kernel: no added delay or loss).
    pub fn slow(&self, host: &str, rate: &str) -> anyhow::Result<()> {
        let link = self.link_of(host)?;
        run("tc", ["qdisc", "replace", "dev", link, "root", "tbf", "rate", rate, "burst", "1mb", "latency", "50ms"])
    }

    /// Undoes [`Network::slow`].
    pub fn unslow(&self, host: &str) -> anyhow::Result<()> {
        run("tc", ["qdisc", "del", "dev", self.link_of(host)?, "root"])
    }

    /// Drops everything host `from` sends to host `to` (a blackhole route on `from`; its sockets
    /// get EINVAL): `to` stays reachable from every other host, a partition only `from` sees.
    pub fn block(&self, from: &str, to: &str) -> anyhow::Result<()> {
        let to = format!("{}/32", self.host(to).ip());
        ip(["-n", self.netns_of(from)?, "route", "add", "blackhole", &to])
    }

    /// Undoes [`Network::block`].
    pub fn unblock(&self, from: &str, to: &str) -> anyhow::Result<()> {
        let to = format!("{}/32", self.host(to).ip());
        ip(["-n", self.netns_of(from)?, "route", "del", "blackhole", &to])
    }

    fn netns_of(&self, host: &str) -> anyhow::Result<&str> {
        self.host(host).netns().ok_or_else(|| anyhow!("host {host} is not a namespace"))
    }

    /// Runs `f` on a thread inside `host`'s namespace: the sockets it opens are that host's (a
    /// test's own client, readiness probes). The rest of this process stays where it is.
    pub fn on_host<T: Send>(&self, host: &str, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
        let netns = self.netns_of(host)?.to_string();
        std::thread::scope(|scope| {
            let thread = scope.spawn(move || -> anyhow::Result<T> {
                enter_netns(&netns)?;
                Ok(f())
            });
            thread.join().map_err(|_| anyhow!("the thread on host {host} panicked"))?
        })
    }

    fn link_of(&self, host: &str) -> anyhow::Result<&str> {
        self.host(host).link().ok_or_else(|| anyhow!("host {host} has no link of its own"))
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        // Links first (a namespace still holding a process keeps its end alive), then the
        // namespaces, then the bridge; each best-effort, so one failure leaves no more behind.
        for made in self.made.iter().rev() {
            let _ = match made {
                Made::Link(link) => ip(["link", "del", link]),
                Made::Netns(netns) => ip(["netns", "del", netns]),
                Made::Bridge(bridge) => ip(["link", "del", bridge]),
            };
        }
    }
}

/// Moves the calling thread into the namespace `/run/netns/<netns>`.
fn enter_netns(netns: &str) -> anyhow::Result<()> {
    let path = format!("/run/netns/{netns}");
    let file = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    // SAFETY: setns(2) on a file descriptor we own; it changes only this thread's namespace.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("entering network namespace {netns}"));
    }
    Ok(())
}

/// Removes namespaces, bridges and veths that earlier runs (their pid gone) left behind.
fn remove_stale() {
    let is_stale = |rest: &str| -> bool {
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse::<u32>().is_ok_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
    };
    if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let name = line.split_whitespace().next().unwrap_or_default();
            if name.strip_prefix(NETNS_PREFIX).is_some_and(is_stale) {
                let _ = ip(["netns", "del", name]);
            }
        }
    }
    if let Ok(out) = Command::new("ip").args(["-o", "link", "show"]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // "7: tnv123x0h1@if2: <...": the name sits between the index and the '@' or ':'.
            let Some(name) = line.split(": ").nth(1).map(|n| n.split('@').next().unwrap_or(n)) else { continue };
            let ours = [VETH_PREFIX, BRIDGE_PREFIX].iter().find_map(|prefix| name.strip_prefix(prefix));
            if ours.is_some_and(is_stale) {
                let _ = ip(["link", "del", name]);
            }
        }
    }
}

fn ip<'a>(args: impl IntoIterator<Item = &'a str>) -> anyhow::Result<()> {
    run("ip", args)
}

/// Runs `program args`, failing with its stderr unless it succeeds.
fn run<'a>(program: &str, args: impl IntoIterator<Item = &'a str>) -> anyhow::Result<()> {
    let args: Vec<&str> = args.into_iter().collect();
    let out = Command::new(program)
        .args(args.iter().map(OsStr::new))
        .output()
        .with_context(|| format!("running {program} (is iproute2 installed?)"))?;
    if !out.status.success() {
        bail!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs root: it fails (as the multi-host tests do) rather than skipping where it has none.
    #[test]
    fn hosts_reach_each_other_until_cut_and_everything_is_removed_on_drop() {
        let network = Network::create(&["a", "b"]).unwrap();
        let (a, b) = (network.host("a").clone(), network.host("b").clone());
        assert_eq!(b.ip().to_string(), "10.231.0.12");
        // A listener's backlog completes the handshake: a connect from a proves the link works.
        let listener = network.on_host("b", || std::net::TcpListener::bind((b.ip(), 0))).unwrap().unwrap();
        let at = listener.local_addr().unwrap();
        let connects = || {
            let timeout = std::time::Duration::from_millis(500);
            network.on_host("a", || std::net::TcpStream::connect_timeout(&at, timeout).is_ok()).unwrap()
        };
        assert!(connects());
        network.cut("b").unwrap();
        assert!(!connects(), "a cut host answers");
        network.heal("b").unwrap();
        // The port and the neighbour entry take a moment to come back.
        assert!((0..20).any(|_| connects()), "a healed host stays unreachable");
        network.block("a", "b").unwrap();
        assert!(!connects(), "a reaches b through a blackhole");
        network.unblock("a", "b").unwrap();
        assert!(connects());
        // A slowed link has a token bucket on it, and loses it again.
        let qdisc = || {
            let out = Command::new("tc").args(["qdisc", "show", "dev", b.link().unwrap()]).output().unwrap();
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        network.slow("b", "100mbit").unwrap();
        assert!(qdisc().contains("tbf") && qdisc().contains("100Mbit"), "{}", qdisc());
        assert!(connects());
        network.unslow("b").unwrap();
        assert!(!qdisc().contains("tbf"), "{}", qdisc());
        // A thread on a host sees that host's interfaces only.
        let seen = network.on_host("a", || std::fs::read_to_string("/proc/thread-self/net/dev").unwrap()).unwrap();
        assert!(seen.contains("eth0") && !seen.contains(a.link().unwrap()), "{seen}");
        let (netns, link) = (a.netns().unwrap().to_string(), a.link().unwrap().to_string());
        drop(network);
        let listed = Command::new("ip").args(["netns", "list"]).output().unwrap();
        assert!(!String::from_utf8_lossy(&listed.stdout).contains(&netns));
        assert!(!Command::new("ip").args(["link", "show", &link]).output().unwrap().status.success());
    }

    /// What a killed run left behind (its pid gone) is removed by the next run's start.
    #[test]
    fn a_dead_runs_namespaces_and_links_are_removed_at_the_next_start() {
        let dead_pid =
            (4_000_000..4_100_000).find(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists()).unwrap();
        let (netns, bridge) = (format!("{NETNS_PREFIX}{dead_pid}-0-x"), format!("{BRIDGE_PREFIX}{dead_pid}x0"));
        ip(["netns", "add", &netns]).unwrap();
        ip(["link", "add", &bridge, "type", "bridge"]).unwrap();
        let network = Network::create(&["a"]).unwrap();
        let listed = Command::new("ip").args(["netns", "list"]).output().unwrap();
        let left = String::from_utf8_lossy(&listed.stdout).contains(&netns);
        let bridge_left = Command::new("ip").args(["link", "show", &bridge]).output().unwrap().status.success();
        drop(network);
        assert!(!left && !bridge_left, "a dead run's namespace ({left}) or bridge ({bridge_left}) was left");
    }
}
