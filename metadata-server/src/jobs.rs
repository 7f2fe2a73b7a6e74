//! Jobs and their leases.
//!
//! A job owns `/jobs/<job>/` and holds a lease that its driver renews. When the job ends, or its
//! lease lapses, everything under its directory is deleted and its blocks freed: nothing a job
//! wrote outlives it. This module keeps the table of live jobs and their usage; the caller does
//! the deleting.

use std::collections::hash_map::RandomState;
use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::time::{Duration, Instant};

use tern_proto::v1::{JobStatus, TenantStatus};
use tern_proto::{BlockId, ErrorKind, Tier};

use crate::config::TenantQuota;
use crate::error::{already_exists, invalid, not_found, Refusal};

/// Longest job name, in bytes.
pub const MAX_JOB_NAME_BYTES: usize = 128;
pub use tern_proto::identity::DEFAULT_TENANT;

#[derive(Debug)]
struct Job {
    lease: Duration,
    expires_at: Instant,
    /// Files under the job's directory, and the sealed bytes among them.
    files: u64,
    bytes: u64,
    /// Names this registration of the job: tokens and grants carry it (names are reused).
    serial: u64,
    tenant: String,
    /// Blocks allocated to the job's files per tier (DRAM, NVMe), for the tenant's quotas.
    blocks: [u64; 2],
    /// Bytes its shuffles hold per tier, as the storage servers last reported them.
    shuffle_bytes: [u64; 2],
}

#[derive(Debug)]
pub struct Jobs {
    jobs: BTreeMap<String, Job>,
    /// Numbers generated names, so they are unique for the life of the server.
    next_generated: u64,
    /// Random per server, so generated names also differ across restarts.
    salt: RandomState,
    default_lease: Duration,
    max_lease: Duration,
    max_jobs: usize,
    quotas: BTreeMap<String, TenantQuota>,
    block_size: u64,
}

/// Whether a registration is checked against the tenants' quotas: a replay is not (it passed
/// when it was made, and quotas may have been lowered since).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quota {
    Enforce,
    Skip,
}

impl Jobs {
    pub fn new(default_lease: Duration, max_lease: Duration, max_jobs: usize) -> Jobs {
        Jobs {
            jobs: BTreeMap::new(),
            next_generated: 1,
            salt: RandomState::new(),
            default_lease,
            max_lease,
            max_jobs,
            quotas: BTreeMap::new(),
            block_size: u64::from(tern_proto::DEFAULT_BLOCK_SIZE),
        }
    }

    /// Sets the tenants' quotas and the block size their byte quotas count in.
    pub fn with_quotas(mut self, quotas: BTreeMap<String, TenantQuota>, block_size: u32) -> Jobs {
        self.quotas = quotas;
        self.block_size = u64::from(block_size);
        self
    }

    /// Checks a registration of a job named `name` (generated when empty) for `tenant` ("" = the
    /// default) against the bounds and the tenant's quota, and chooses its serial; returns the
    /// name and the serial. Registers nothing: [`Jobs::register`] does, with what this chose.
    pub fn prepare(&mut self, name: &str, tenant: &str) -> Result<(String, u64), Refusal> {
        let name = if name.is_empty() { self.generate_name() } else { name.to_string() };
        self.admit(&name, tenant, Quota::Enforce)?;
        Ok((name, new_serial()))
    }

    /// Registers a job named `name` (generated when empty) for `tenant` ("" = the default) with a
    /// lease of `lease_ms` (0: the default; clamped to the maximum) and registration `serial`
    /// (0: a new random one); returns the name, the lease granted and the serial.
    pub fn register(
        &mut self,
        name: &str,
        lease_ms: u64,
        tenant: &str,
        serial: u64,
        quota: Quota,
        now: Instant,
    ) -> Result<(String, Duration, u64), Refusal> {
        let name = if name.is_empty() { self.generate_name() } else { name.to_string() };
        self.admit(&name, tenant, quota)?;
        let tenant = if tenant.is_empty() { DEFAULT_TENANT } else { tenant };
        let lease = match lease_ms {
            0 => self.default_lease,
            ms => Duration::from_millis(ms).min(self.max_lease),
        };
        let serial = if serial != 0 { serial } else { new_serial() };
        let job = Job {
            lease,
            expires_at: now + lease,
            files: 0,
            bytes: 0,
            serial,
            tenant: tenant.to_string(),
            blocks: [0; 2],
            shuffle_bytes: [0; 2],
        };
        self.jobs.insert(name.clone(), job);
        Ok((name, lease, serial))
    }

    /// Ok when job `name` of `tenant` may be registered: valid names, not registered yet, within
    /// the bound on jobs and (with `Quota::Enforce`) the tenant's quota of jobs.
    fn admit(&self, name: &str, tenant: &str, quota: Quota) -> Result<(), Refusal> {
        validate_name(name)?;
        let tenant = if tenant.is_empty() { DEFAULT_TENANT } else { tenant };
        validate_tenant(tenant)?;
        if self.jobs.contains_key(name) {
            return Err(already_exists(format!("job {name} is already registered")));
        }
        if self.jobs.len() >= self.max_jobs {
            return Err(Refusal::new(
                ErrorKind::OutOfSpace,
                format!("{} jobs are live, the limit (max_jobs); end some first", self.max_jobs),
            ));
        }
        let limit = self.quota(tenant).max_jobs;
        // Counted only for a tenant with a quota: the count is a pass over every job, and made
        // for every registration it made registering J jobs O(J^2) (`tern bench scale`: 40,000
        // jobs took 74 s, 10,000 took 1.8 s).
        if quota == Quota::Enforce && limit > 0 {
            let live = self.jobs.values().filter(|job| job.tenant == tenant).count() as u64;
            if live >= limit {
                return Err(Refusal::new(
                    ErrorKind::QuotaExceeded,
                    format!("tenant {tenant}: jobs quota exceeded: limit {limit} jobs, {live} in use"),
                ));
            }
        }
        Ok(())
    }

    fn quota(&self, tenant: &str) -> TenantQuota {
        self.quotas.get(tenant).copied().unwrap_or_default()
    }

    /// The registration serial of a registered job.
    pub fn serial(&self, name: &str) -> Option<u64> {
        self.jobs.get(name).map(|job| job.serial)
    }

    /// A registered job's serial, lease and time left.
    pub fn lease_of(&self, name: &str, now: Instant) -> Option<(u64, Duration, Duration)> {
        self.jobs.get(name).map(|job| (job.serial, job.lease, job.expires_at.saturating_duration_since(now)))
    }

    /// Ok when `count` more blocks of `tier` for job `name` keep its tenant within its quota.
    pub fn check_blocks(&self, name: &str, tier: Tier, count: u64) -> Result<(), Refusal> {
        let Some(job) = self.jobs.get(name) else {
            return Ok(());
        };
        match self.over_quota(&job.tenant, tier, count * self.block_size) {
            Some(why) => Err(Refusal::new(ErrorKind::QuotaExceeded, format!("{why} (job {name})"))),
            None => Ok(()),
        }
    }

    /// Why `more` bytes of `tier` would take `tenant` past its quota of the tier; None when they
    /// would not (or it has none).
    fn over_quota(&self, tenant: &str, tier: Tier, more: u64) -> Option<String> {
        let quota = self.quota(tenant);
        let limit = match tier {
            Tier::Dram => quota.dram_bytes.bytes(),
            Tier::Nvme => quota.nvme_bytes.bytes(),
        };
        if limit == 0 {
            // Unlimited (the usual case): no need to sum the tenant's jobs, which every
            // allocation and segment placement would otherwise pay for.
            return None;
        }
        let (files, shuffles) = self.tenant_bytes(tenant);
        let used = files[tier_index(tier)] + shuffles[tier_index(tier)];
        (used + more > limit).then(|| {
            let asked = if more > 0 { format!(", {more} more asked") } else { String::new() };
            format!(
                "tenant {tenant}: {tier} bytes quota exceeded: limit {limit} bytes, {used} in use ({} of shuffles){asked}",
                shuffles[tier_index(tier)]
            )
        })
    }

    /// Ok when job `name`'s tenant is below its quota of `tier`: new shuffle segments may be
    /// placed for it.
    pub fn check_below_quota(&self, name: &str, tier: Tier) -> Result<(), Refusal> {
        match self.jobs.get(name).and_then(|job| self.over_quota(&job.tenant, tier, 1)) {
            Some(why) => Err(Refusal::new(ErrorKind::QuotaExceeded, format!("{why} (job {name})"))),
            None => Ok(()),
        }
    }

    /// Every tenant at (or past) its quota of a tier, with why, per tier (DRAM, NVMe).
    pub fn at_quota(&self) -> BTreeMap<&str, [Option<String>; 2]> {
        self.quotas
            .keys()
            .filter_map(|tenant| {
                let why = [Tier::Dram, Tier::Nvme].map(|tier| self.over_quota(tenant, tier, 1));
                why.iter().any(Option::is_some).then_some((tenant.as_str(), why))
            })
            .collect()
    }

    /// The registered jobs of a tenant.
    pub fn of_tenant<'a>(&'a self, tenant: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.jobs.iter().filter(move |(_, job)| job.tenant == tenant).map(|(name, _)| name.as_str())
    }

    /// Adds (or with `add` false, takes away) a report of bytes a job's shuffles hold, per tier.
    pub fn count_shuffle_bytes(&mut self, name: &str, bytes: [u64; 2], add: bool) {
        let Some(job) = self.jobs.get_mut(name) else {
            return;
        };
        for (held, b) in job.shuffle_bytes.iter_mut().zip(bytes) {
            *held = if add { held.saturating_add(b) } else { held.saturating_sub(b) };
        }
    }

    /// Counts blocks allocated to (`delta` > 0) or released from a job's files, by their ids' tier.
    pub fn count_blocks(&mut self, name: &str, block_ids: impl IntoIterator<Item = BlockId>, delta: i64) {
        let Some(job) = self.jobs.get_mut(name) else {
            return;
        };
        for id in block_ids {
            let slot = &mut job.blocks[tier_index(id.tier())];
            *slot = slot.saturating_add_signed(delta);
        }
    }

    /// Bytes a tenant's jobs hold per tier: in their files' blocks, and in their shuffles.
    fn tenant_bytes(&self, tenant: &str) -> ([u64; 2], [u64; 2]) {
        let (mut files, mut shuffles) = ([0u64; 2], [0u64; 2]);
        for job in self.jobs.values().filter(|job| job.tenant == tenant) {
            for tier in 0..2 {
                files[tier] += job.blocks[tier] * self.block_size;
                shuffles[tier] += job.shuffle_bytes[tier];
            }
        }
        (files, shuffles)
    }

    /// Every tenant with a live job or a quota: jobs and bytes in use against the limits.
    pub fn tenants(&self) -> Vec<TenantStatus> {
        let mut names: Vec<&str> = self.quotas.keys().map(String::as_str).collect();
        names.extend(self.jobs.values().map(|job| job.tenant.as_str()));
        names.sort_unstable();
        names.dedup();
        names
            .into_iter()
            .map(|tenant| {
                let quota = self.quota(tenant);
                let (files, shuffles) = self.tenant_bytes(tenant);
                TenantStatus {
                    tenant: tenant.to_string(),
                    jobs: self.jobs.values().filter(|job| job.tenant == tenant).count() as u64,
                    max_jobs: quota.max_jobs,
                    dram_bytes: files[0] + shuffles[0],
                    dram_limit_bytes: quota.dram_bytes.bytes(),
                    nvme_bytes: files[1] + shuffles[1],
                    nvme_limit_bytes: quota.nvme_bytes.bytes(),
                    dram_shuffle_bytes: shuffles[0],
                    nvme_shuffle_bytes: shuffles[1],
                }
            })
            .collect()
    }

    /// Every job's registration as logged (for snapshots): name, lease, tenant, serial.
    pub fn registrations(&self) -> Vec<(String, u64, String, u64)> {
        self.jobs
            .iter()
            .map(|(name, job)| (name.clone(), job.lease.as_millis() as u64, job.tenant.clone(), job.serial))
            .collect()
    }

    /// Extends a live job's lease by its full length from `now`.
    pub fn renew(&mut self, name: &str, now: Instant) -> Result<Duration, Refusal> {
        match self.jobs.get_mut(name) {
            Some(job) if job.expires_at > now => {
                job.expires_at = now + job.lease;
                Ok(job.lease)
            }
            _ => Err(not_registered(name)),
        }
    }

    /// Gives every job its full lease from `now` (see `State::count_leases_from`).
    pub fn count_leases_from(&mut self, now: Instant) {
        for job in self.jobs.values_mut() {
            job.expires_at = now + job.lease;
        }
    }

    /// Forgets a job (ended, or its lease lapsed); NotFound when it is not registered.
    pub fn remove(&mut self, name: &str) -> Result<(), Refusal> {
        self.jobs.remove(name).map(|_| ()).ok_or_else(|| not_registered(name))
    }

    /// True when the job is registered, even if its lease lapsed a moment ago and the reaper has not
    /// yet ended it: its directory still exists.
    pub fn is_registered(&self, name: &str) -> bool {
        self.jobs.contains_key(name)
    }

    /// Ok when new entries may be made under the job: registered and within its lease.
    pub fn check_live(&self, name: &str, now: Instant) -> Result<(), Refusal> {
        match self.jobs.get(name) {
            Some(job) if job.expires_at > now => Ok(()),
            _ => Err(not_registered(name)),
        }
    }

    /// Jobs whose lease has lapsed by `now`.
    pub fn lapsed(&self, now: Instant) -> Vec<String> {
        self.jobs.iter().filter(|(_, job)| job.expires_at <= now).map(|(name, _)| name.clone()).collect()
    }

    /// Adjusts a job's usage as files under it are created, sealed and deleted.
    pub fn add_usage(&mut self, name: &str, files: i64, bytes: i64) {
        if let Some(job) = self.jobs.get_mut(name) {
            job.files = job.files.saturating_add_signed(files);
            job.bytes = job.bytes.saturating_add_signed(bytes);
        }
    }

    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    pub fn status(&self, now: Instant) -> Vec<JobStatus> {
        self.jobs
            .iter()
            .map(|(name, job)| JobStatus {
                job_id: name.clone(),
                lease_ms: job.lease.as_millis() as u64,
                expires_in_ms: job.expires_at.saturating_duration_since(now).as_millis() as u64,
                files: job.files,
                bytes: job.bytes,
                tenant: job.tenant.clone(),
            })
            .collect()
    }

    fn generate_name(&mut self) -> String {
        let n = self.next_generated;
        self.next_generated += 1;
        format!("job-{n}-{:08x}", self.salt.hash_one(n) as u32)
    }
}

fn tier_index(tier: Tier) -> usize {
    match tier {
        Tier::Dram => 0,
        Tier::Nvme => 1,
    }
}

/// A random non-zero serial (0 is the volume principal's).
fn new_serial() -> u64 {
    loop {
        let serial = tern_proto::token::random_u64();
        if serial != tern_proto::token::VOLUME_SERIAL {
            return serial;
        }
    }
}

/// Tenant names: [A-Za-z0-9._-], 1 to 64 bytes.
pub fn validate_tenant(name: &str) -> Result<(), Refusal> {
    tern_proto::identity::validate_tenant(name).map_err(|e| invalid(e.0))
}

fn not_registered(name: &str) -> Refusal {
    not_found(format!("job {name} is not registered (ended or lease lapsed)"))
}

/// Job names become path components: [A-Za-z0-9._-], 1 to 128 bytes, and not "." or "..".
fn validate_name(name: &str) -> Result<(), Refusal> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() || name.len() > MAX_JOB_NAME_BYTES || !name.chars().all(allowed) || name == "." || name == ".." {
        return Err(invalid(format!(
            "job name {name:?} is not 1 to {MAX_JOB_NAME_BYTES} of [A-Za-z0-9._-] (and not \".\" or \"..\")"
        )));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::disallowed_methods, reason = "tests may read the clock")]
mod tests {
    use super::*;

    fn jobs() -> Jobs {
        Jobs::new(Duration::from_secs(30), Duration::from_secs(60), 3)
    }

    #[test]
    fn registers_validates_and_clamps() {
        let mut jobs = jobs();
        let now = Instant::now();
        assert_eq!(jobs.register("j1", 0, "", 0, Quota::Enforce, now).unwrap().1, Duration::from_secs(30));
        assert_eq!(jobs.register("j1", 0, "", 0, Quota::Enforce, now).unwrap_err().kind, ErrorKind::AlreadyExists);
        assert_eq!(jobs.register("j2", 999_999, "", 0, Quota::Enforce, now).unwrap().1, Duration::from_secs(60));
        for bad in ["a/b", ".", "..", "sp ace", &"x".repeat(129)] {
            assert_eq!(
                jobs.register(bad, 0, "", 0, Quota::Enforce, now).unwrap_err().kind,
                ErrorKind::Invalid,
                "{bad:?}"
            );
        }
        let (generated, _, _) = jobs.register("", 100, "", 0, Quota::Enforce, now).unwrap();
        assert!(generated.starts_with("job-1-"), "{generated}");
        assert_eq!(jobs.register("j4", 0, "", 0, Quota::Enforce, now).unwrap_err().kind, ErrorKind::OutOfSpace);
        assert_eq!(jobs.len(), 3);
    }

    #[test]
    fn leases_lapse_unless_renewed() {
        let mut jobs = jobs();
        let start = Instant::now();
        jobs.register("a", 100, "", 0, Quota::Enforce, start).unwrap();
        jobs.register("b", 100, "", 0, Quota::Enforce, start).unwrap();
        let mid = start + Duration::from_millis(80);
        assert_eq!(jobs.renew("a", mid).unwrap(), Duration::from_millis(100));
        let after = start + Duration::from_millis(120);
        assert_eq!(jobs.lapsed(after), ["b"]);
        jobs.check_live("a", after).unwrap();
        assert_eq!(jobs.check_live("b", after).unwrap_err().kind, ErrorKind::NotFound);
        assert_eq!(jobs.renew("b", after).unwrap_err().kind, ErrorKind::NotFound);
        assert!(jobs.is_registered("b"));
        jobs.remove("b").unwrap();
        assert_eq!(jobs.remove("b").unwrap_err().kind, ErrorKind::NotFound);
        let status = jobs.status(after);
        assert_eq!(status.len(), 1);
        assert_eq!((status[0].job_id.as_str(), status[0].expires_in_ms), ("a", 60));
    }

    #[test]
    fn tenants_count_jobs_and_blocks_against_their_quotas() {
        let quota = TenantQuota {
            max_jobs: 2,
            dram_bytes: tern_common::ByteSize(3 * 4096),
            nvme_bytes: tern_common::ByteSize(0),
        };
        let mut jobs = Jobs::new(Duration::from_secs(30), Duration::from_secs(60), 10)
            .with_quotas(BTreeMap::from([("etl".to_string(), quota)]), 4096);
        let now = Instant::now();
        let (_, _, s1) = jobs.register("a", 0, "etl", 0, Quota::Enforce, now).unwrap();
        let (_, _, s2) = jobs.register("b", 0, "etl", 0, Quota::Enforce, now).unwrap();
        assert_ne!(s1, s2);
        let err = jobs.register("c", 0, "etl", 0, Quota::Enforce, now).unwrap_err();
        assert_eq!(err.kind, ErrorKind::QuotaExceeded);
        assert!(
            err.reason.contains("tenant etl") && err.reason.contains("limit 2") && err.reason.contains("2 in use"),
            "{}",
            err.reason
        );
        // A replay is not refused, and keeps its serial; other tenants are unlimited.
        assert_eq!(jobs.register("c", 0, "etl", 77, Quota::Skip, now).unwrap().2, 77);
        jobs.register("d", 0, "", 0, Quota::Enforce, now).unwrap();
        jobs.count_blocks("a", [BlockId::from_wire(1), BlockId::from_wire(2)], 1);
        jobs.check_blocks("b", Tier::Dram, 1).unwrap();
        let err = jobs.check_blocks("b", Tier::Dram, 2).unwrap_err();
        assert_eq!(err.kind, ErrorKind::QuotaExceeded);
        assert!(err.reason.contains("limit 12288 bytes, 8192 in use"), "{}", err.reason);
        jobs.check_blocks("b", Tier::Nvme, 1000).unwrap();
        jobs.check_blocks("d", Tier::Dram, 1000).unwrap();
        let etl = jobs.tenants().into_iter().find(|t| t.tenant == "etl").unwrap();
        assert_eq!((etl.jobs, etl.dram_bytes, etl.dram_limit_bytes), (3, 8192, 12288));
        jobs.count_blocks("a", [BlockId::from_wire(1)], -1);
        jobs.remove("a").unwrap();
        let etl = jobs.tenants().into_iter().find(|t| t.tenant == "etl").unwrap();
        assert_eq!((etl.jobs, etl.dram_bytes), (2, 0));
        assert_eq!(jobs.register("e", 0, "bad tenant", 0, Quota::Enforce, now).unwrap_err().kind, ErrorKind::Invalid);
    }
}
