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

use tern_proto::v1::JobStatus;
use tern_proto::ErrorKind;

use crate::error::{already_exists, invalid, not_found, Refusal};

/// Longest job name, in bytes.
pub const MAX_JOB_NAME_BYTES: usize = 128;

#[derive(Debug)]
struct Job {
    lease: Duration,
    expires_at: Instant,
    /// Files under the job's directory, and the sealed bytes among them.
    files: u64,
    bytes: u64,
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
}

impl Jobs {
    pub fn new(default_lease: Duration, max_lease: Duration, max_jobs: usize) -> Jobs {
        Jobs { jobs: BTreeMap::new(), next_generated: 1, salt: RandomState::new(), default_lease, max_lease, max_jobs }
    }

    /// Registers a job named `name` (generated when empty) with a lease of `lease_ms` (0: the
    /// default; clamped to the maximum); returns the name and the lease granted.
    pub fn register(&mut self, name: &str, lease_ms: u64, now: Instant) -> Result<(String, Duration), Refusal> {
        let name = if name.is_empty() { self.generate_name() } else { name.to_string() };
        validate_name(&name)?;
        if self.jobs.contains_key(&name) {
            return Err(already_exists(format!("job {name} is already registered")));
        }
        if self.jobs.len() >= self.max_jobs {
            return Err(Refusal::new(
                ErrorKind::OutOfSpace,
                format!("{} jobs are live, the limit (max_jobs); end some first", self.max_jobs),
            ));
        }
        let lease = match lease_ms {
            0 => self.default_lease,
            ms => Duration::from_millis(ms).min(self.max_lease),
        };
        self.jobs.insert(name.clone(), Job { lease, expires_at: now + lease, files: 0, bytes: 0 });
        Ok((name, lease))
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

    /// Every job's name and lease as asked (for snapshots; 0 never appears: the lease granted is
    /// kept, and it is already clamped).
    pub fn leases(&self) -> Vec<(String, u64)> {
        self.jobs.iter().map(|(name, job)| (name.clone(), job.lease.as_millis() as u64)).collect()
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
            })
            .collect()
    }

    fn generate_name(&mut self) -> String {
        let n = self.next_generated;
        self.next_generated += 1;
        format!("job-{n}-{:08x}", self.salt.hash_one(n) as u32)
    }
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
mod tests {
    use super::*;

    fn jobs() -> Jobs {
        Jobs::new(Duration::from_secs(30), Duration::from_secs(60), 3)
    }

    #[test]
    fn registers_validates_and_clamps() {
        let mut jobs = jobs();
        let now = Instant::now();
        assert_eq!(jobs.register("j1", 0, now).unwrap(), ("j1".to_string(), Duration::from_secs(30)));
        assert_eq!(jobs.register("j1", 0, now).unwrap_err().kind, ErrorKind::AlreadyExists);
        assert_eq!(jobs.register("j2", 999_999, now).unwrap().1, Duration::from_secs(60));
        for bad in ["a/b", ".", "..", "sp ace", &"x".repeat(129)] {
            assert_eq!(jobs.register(bad, 0, now).unwrap_err().kind, ErrorKind::Invalid, "{bad:?}");
        }
        let (generated, _) = jobs.register("", 100, now).unwrap();
        assert!(generated.starts_with("job-1-"), "{generated}");
        assert_eq!(jobs.register("j4", 0, now).unwrap_err().kind, ErrorKind::OutOfSpace);
        assert_eq!(jobs.len(), 3);
    }

    #[test]
    fn leases_lapse_unless_renewed() {
        let mut jobs = jobs();
        let start = Instant::now();
        jobs.register("a", 100, start).unwrap();
        jobs.register("b", 100, start).unwrap();
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
}
