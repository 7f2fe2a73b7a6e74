//! The ports of a local cluster, defined once: given a base port and a number of storage servers,
//! [`PortLayout`] names every daemon's ports. Also free loopback ports to put a cluster on.

use anyhow::{bail, Context};

/// A cluster's ports from `base`: the metadata server on `base` with its admin (metrics)
/// endpoint on `base+1`; the task scheduler on `base+2`, admin `base+3`; storage server `i` on
/// `base+10+2i`, admin `base+11+2i`; with more metadata replicas than one, replica `k` (from 1;
/// replica 0 is the metadata server above) on the two ports from `base+12+2s+2(k-1)` for `s`
/// storage servers, after every port of a layout of one replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortLayout {
    base: u16,
    storage_servers: u16,
    metadata_replicas: u16,
}

use tern_common::ports;

/// Offsets from the base, so that the layout from [`ports::METADATA`] is the daemons' defaults.
const METADATA_ADMIN_OFFSET: u16 = ports::METADATA_ADMIN - ports::METADATA;
const SCHEDULER_OFFSET: u16 = ports::SCHEDULER - ports::METADATA;
const SCHEDULER_ADMIN_OFFSET: u16 = ports::SCHEDULER_ADMIN - ports::METADATA;
/// Offset of storage server 0's port from the base; each storage server takes two ports.
const STORAGE_OFFSET: u16 = ports::STORAGE - ports::METADATA;
const STORAGE_ADMIN_OFFSET: u16 = ports::STORAGE_ADMIN - ports::STORAGE;

impl PortLayout {
    /// The layout from `base` for `storage_servers`; an error when its ports pass 65535.
    pub fn new(base: u16, storage_servers: u16) -> anyhow::Result<PortLayout> {
        PortLayout { base, storage_servers, metadata_replicas: 1 }.checked()
    }

    /// This layout with `replicas` metadata servers (replicating over Raft) instead of one.
    pub fn with_metadata_replicas(self, replicas: u16) -> anyhow::Result<PortLayout> {
        anyhow::ensure!(replicas >= 1, "a cluster needs at least one metadata server");
        PortLayout { metadata_replicas: replicas, ..self }.checked()
    }

    fn checked(self) -> anyhow::Result<PortLayout> {
        let span = self.span().context("too many daemons for one port range")?;
        let base = self.base;
        if u32::from(base) + u32::from(span) - 1 > u32::from(u16::MAX) {
            bail!("ports {base} to {base}+{} pass 65535", span - 1);
        }
        Ok(self)
    }

    /// A layout on a range of loopback ports that was free a moment ago ([`free_port_range`]).
    pub fn free(storage_servers: u16) -> anyhow::Result<PortLayout> {
        PortLayout::free_with_replicas(storage_servers, 1)
    }

    /// As [`PortLayout::free`], with `replicas` metadata servers.
    pub fn free_with_replicas(storage_servers: u16, replicas: u16) -> anyhow::Result<PortLayout> {
        let shape = PortLayout::new(0, storage_servers)?.with_metadata_replicas(replicas)?;
        let span = shape.span().context("too many daemons for one port range")?;
        PortLayout { base: free_port_range(span)?, ..shape }.checked()
    }

    /// How many consecutive ports a layout of one metadata server with `storage_servers` takes
    /// (the two past the last storage server's admin port are kept free too).
    fn single_span(storage_servers: u16) -> Option<u16> {
        storage_servers.checked_mul(2)?.checked_add(STORAGE_OFFSET + 2)
    }

    /// How many consecutive ports this layout takes.
    fn span(&self) -> Option<u16> {
        PortLayout::single_span(self.storage_servers)?.checked_add((self.metadata_replicas - 1).checked_mul(2)?)
    }

    pub fn storage_servers(&self) -> u16 {
        self.storage_servers
    }

    pub fn metadata_replicas(&self) -> u16 {
        self.metadata_replicas
    }

    /// The (first) metadata server's port.
    pub fn metadata(&self) -> u16 {
        self.base
    }

    /// The (first) metadata server's admin (metrics) port.
    pub fn metadata_admin(&self) -> u16 {
        self.base + METADATA_ADMIN_OFFSET
    }

    /// Metadata replica `k`'s gRPC port (`k` from 0: replica 0 is [`PortLayout::metadata`]).
    pub fn metadata_replica(&self, k: u16) -> u16 {
        assert!(k < self.metadata_replicas, "metadata replica {k} of {}", self.metadata_replicas);
        match k {
            0 => self.metadata(),
            k => self.base + PortLayout::single_span(self.storage_servers).expect("checked") + 2 * (k - 1),
        }
    }

    /// Metadata replica `k`'s admin (metrics) port.
    pub fn metadata_replica_admin(&self, k: u16) -> u16 {
        match k {
            0 => self.metadata_admin(),
            k => self.metadata_replica(k) + 1,
        }
    }

    pub fn scheduler(&self) -> u16 {
        self.base + SCHEDULER_OFFSET
    }

    pub fn scheduler_admin(&self) -> u16 {
        self.base + SCHEDULER_ADMIN_OFFSET
    }

    /// Storage server `i`'s block-service port.
    pub fn storage(&self, i: u16) -> u16 {
        assert!(i < self.storage_servers, "storage server {i} of {}", self.storage_servers);
        self.base + STORAGE_OFFSET + 2 * i
    }

    /// Storage server `i`'s admin (metrics) port.
    pub fn storage_admin(&self, i: u16) -> u16 {
        self.storage(i) + STORAGE_ADMIN_OFFSET
    }

    /// Every port the cluster will bind on `ip` (`scheduler`: with the task scheduler), named.
    pub fn ports(&self, scheduler: bool) -> Vec<(String, u16)> {
        let mut ports = vec![
            ("the metadata server".to_string(), self.metadata()),
            ("the metadata server's admin endpoint".to_string(), self.metadata_admin()),
        ];
        for k in 1..self.metadata_replicas {
            ports.push((format!("metadata replica {}", k + 1), self.metadata_replica(k)));
            ports.push((format!("metadata replica {}'s admin endpoint", k + 1), self.metadata_replica_admin(k)));
        }
        if scheduler {
            ports.push(("the scheduler".to_string(), self.scheduler()));
            ports.push(("the scheduler's admin endpoint".to_string(), self.scheduler_admin()));
        }
        for i in 0..self.storage_servers {
            ports.push((format!("storage server {i}"), self.storage(i)));
            ports.push((format!("storage server {i}'s admin endpoint"), self.storage_admin(i)));
        }
        ports
    }

    /// Fails, naming the port and who needs it, when a port of the cluster (TCP, and UDP for a
    /// storage server's QUIC endpoint) cannot be bound on `ip` now: checked before anything
    /// starts, so a busy port fails the start instead of a daemon after it.
    pub fn check_free(&self, ip: std::net::IpAddr, scheduler: bool) -> anyhow::Result<()> {
        for (who, port) in self.ports(scheduler) {
            std::net::TcpListener::bind((ip, port))
                .with_context(|| format!("port {port} on {ip} (for {who}) is not free: is a cluster running there?"))?;
            if who.starts_with("storage server") && !who.ends_with("endpoint") {
                std::net::UdpSocket::bind((ip, port)).with_context(|| {
                    format!(
                        "UDP port {port} on {ip} (for storage server QUIC) is not free: is a cluster running there?"
                    )
                })?;
            }
        }
        Ok(())
    }
}

/// Where ports are probed: below Linux's ephemeral range (32768 up), so that no socket the kernel
/// numbers itself (an outgoing connection, a bind to port 0) lands on one between its probe and
/// its daemon's bind.
const PROBED: std::ops::Range<u16> = 20_000..32_000;

/// Where this process starts probing, at random: processes probing at the same moment (parallel
/// tests) then rarely probe the same ports.
fn probe_start() -> u32 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    now.subsec_nanos() ^ std::process::id().rotate_left(16)
}

/// The ports this process has claimed: each an open file, locked, under [`claims_dir`]. A probed
/// port is only free until somebody binds it, and a daemon binds its port some milliseconds after
/// the probe; two test processes that probed the same port in that time both started a daemon on
/// it, and one died of "Address already in use" (CI, 2026-12-07). A port is now handed out only
/// to the process that holds its lock, and the lock lives as long as that process: its daemons,
/// restarted on the same ports, find them still theirs. The kernel drops the locks of a process
/// that dies, however it dies.
static CLAIMED: std::sync::Mutex<Vec<std::fs::File>> = std::sync::Mutex::new(Vec::new());

/// Where claims are locked: one empty file per port, shared by every process on the host; made
/// once per process.
fn claims_dir() -> anyhow::Result<&'static std::path::Path> {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    if let Some(dir) = DIR.get() {
        return Ok(dir);
    }
    let dir = std::env::temp_dir().join("tern-port-claims");
    std::fs::create_dir_all(&dir).with_context(|| format!("making {}", dir.display()))?;
    Ok(DIR.get_or_init(|| dir))
}

/// Claims `port` for this process if no other process holds it and it can be bound on loopback
/// now; false otherwise.
fn claim(port: u16) -> anyhow::Result<bool> {
    let path = claims_dir()?.join(port.to_string());
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Ok(false),
        Err(std::fs::TryLockError::Error(e)) => return Err(e).with_context(|| format!("locking {}", path.display())),
    }
    // Claimed among Tern's processes; the probe still skips ports anything else holds.
    if std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
        return Ok(false);
    }
    CLAIMED.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(file);
    Ok(true)
}

/// A loopback port that was free a moment ago and that no other process has been handed
/// ([`CLAIMED`]); this process is not handed it again until it has been handed every other port
/// of [`PROBED`].
pub fn free_port() -> anyhow::Result<u16> {
    // Not the kernel's pick for port 0: two test processes starting clusters at the same moment
    // were handed the same port, and one's storage servers registered with the other's metadata
    // server. Each process walks up [`PROBED`] from its own random start instead.
    static NEXT: std::sync::Mutex<Option<u32>> = std::sync::Mutex::new(None);
    let span = u32::from(PROBED.end - PROBED.start);
    let mut next = NEXT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let start = *next.get_or_insert_with(probe_start);
    for i in 0..span {
        let port = PROBED.start + (start.wrapping_add(i) % span) as u16;
        if claim(port)? {
            *next = Some(start.wrapping_add(i + 1));
            return Ok(port);
        }
    }
    bail!("no free port on 127.0.0.1 between {} and {}", PROBED.start, PROBED.end)
}

/// The first port of `len` consecutive free loopback ports, probed in [`PROBED`] from a random
/// start and claimed as [`free_port`] claims one.
pub fn free_port_range(len: u16) -> anyhow::Result<u16> {
    let (low, high) = (PROBED.start, PROBED.end);
    anyhow::ensure!(len > 0 && len < high - low, "a range of {len} ports");
    let seed = probe_start();
    let slots = (high - low) / len;
    for i in 0..u32::from(slots) {
        let start = low + ((seed.wrapping_add(i) % u32::from(slots)) as u16) * len;
        let mut claimed = 0;
        while claimed < len && claim(start + claimed)? {
            claimed += 1;
        }
        if claimed == len {
            return Ok(start);
        }
        // A range cut short keeps the ports it claimed: they are this process's, unused.
    }
    bail!("no {len} consecutive free ports on 127.0.0.1 between {low} and {high}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_names_every_daemons_ports() {
        let layout = PortLayout::new(9060, 2).unwrap();
        assert_eq!((layout.metadata(), layout.metadata_admin()), (9060, 9061));
        assert_eq!((layout.scheduler(), layout.scheduler_admin()), (9062, 9063));
        assert_eq!((layout.storage(0), layout.storage_admin(0)), (9070, 9071));
        assert_eq!((layout.storage(1), layout.storage_admin(1)), (9072, 9073));
    }

    #[test]
    fn the_layout_from_the_default_base_is_the_daemons_defaults() {
        let layout = PortLayout::new(ports::METADATA, 1).unwrap();
        assert_eq!((layout.metadata(), layout.metadata_admin()), (ports::METADATA, ports::METADATA_ADMIN));
        assert_eq!((layout.scheduler(), layout.scheduler_admin()), (ports::SCHEDULER, ports::SCHEDULER_ADMIN));
        assert_eq!((layout.storage(0), layout.storage_admin(0)), (ports::STORAGE, ports::STORAGE_ADMIN));
    }

    #[test]
    fn metadata_replicas_come_after_every_port_of_one() {
        let layout = PortLayout::new(9060, 2).unwrap().with_metadata_replicas(3).unwrap();
        let replicas: Vec<(u16, u16)> =
            (0..3).map(|k| (layout.metadata_replica(k), layout.metadata_replica_admin(k))).collect();
        assert_eq!(replicas, [(9060, 9061), (9076, 9077), (9078, 9079)]);
        assert_eq!(layout.storage_admin(1), 9073, "the storage servers' ports are as with one");
        let named: Vec<u16> = layout.ports(true).into_iter().map(|(_, port)| port).collect();
        assert!(named.contains(&9079) && named.len() == 12, "{named:?}");
        let high = PortLayout::new(65_515, 2).expect("one replica fits below 65536");
        assert!(high.with_metadata_replicas(5).is_err(), "five do not");
    }

    #[test]
    fn a_layout_past_the_last_port_is_refused() {
        assert!(PortLayout::new(65_520, 2).is_ok());
        assert!(PortLayout::new(65_530, 2).is_err());
    }

    #[test]
    fn a_free_layout_is_bindable() {
        let layout = PortLayout::free(3).unwrap();
        for port in [layout.metadata(), layout.scheduler_admin(), layout.storage_admin(2)] {
            std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        }
    }

    #[test]
    fn a_busy_port_is_named() {
        let layout = PortLayout::free(1).unwrap();
        let ip = std::net::IpAddr::from([127, 0, 0, 1]);
        layout.check_free(ip, true).unwrap();
        let _held = std::net::TcpListener::bind((ip, layout.storage_admin(0))).unwrap();
        let err = format!("{:#}", layout.check_free(ip, true).unwrap_err());
        assert!(
            err.contains(&format!("port {}", layout.storage_admin(0))) && err.contains("storage server 0"),
            "{err}"
        );
    }

    #[test]
    fn a_port_claimed_by_another_process_is_not_handed_out() {
        // Another process's claim is a lock on the same file by another open file description.
        let port = free_port().unwrap();
        let held = std::fs::File::open(claims_dir().unwrap().join(port.to_string())).unwrap();
        let second = std::fs::File::open(claims_dir().unwrap().join(port.to_string())).unwrap();
        assert!(second.try_lock().is_err(), "this process's claim holds the lock");
        drop((held, second));
        let range = free_port_range(4).unwrap();
        for port in range..range + 4 {
            let file = std::fs::File::open(claims_dir().unwrap().join(port.to_string())).unwrap();
            assert!(file.try_lock().is_err(), "port {port} of the range is claimed");
        }
    }

    #[test]
    fn free_ports_are_not_handed_out_twice() {
        let ports: std::collections::BTreeSet<u16> = (0..50).map(|_| free_port().unwrap()).collect();
        assert_eq!(ports.len(), 50);
    }
}
