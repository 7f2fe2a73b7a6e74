//! Tenant quotas over shuffle bytes. Storage servers report on every heartbeat how many bytes
//! each shuffle holds there per tier; the state keeps each server's last report, summed by job
//! (a server's report replaces its previous one, so nothing is counted twice, and a dead or
//! restarted server's shuffles stop counting). A tenant's use of a tier is its files' blocks plus
//! its shuffles' bytes there, against one quota per tier.
//!
//! Pushes go straight to storage servers, so the metadata server cannot refuse them itself: each
//! heartbeat reply lists the shuffles of tenants at a tier's quota (`QuotaStop`), and the server
//! keeps new batches of those off that tier (to NVMe instead of DRAM where the shuffle's class
//! allows, else refused with QuotaExceeded). A tenant may so pass its quota by what its writers
//! push in about two heartbeat intervals (a report, then a reply) and what open slots still take;
//! new segments are refused here at once.

use std::collections::HashMap;

use tern_proto::v1::{HeartbeatResponse, QuotaStop, ShuffleUsage};
use tern_proto::{ServerId, StorageClass, Tier};

use super::State;
use crate::error::{invalid, Refusal};

/// A server's last report, summed by job (name, registration serial): bytes per tier.
pub(super) type UsageByJob = HashMap<(String, u64), [u64; 2]>;

impl State {
    /// Takes a server's report of its shuffles' bytes in place of its last one.
    pub(super) fn take_shuffle_usage(&mut self, server_id: ServerId, report: &[ShuffleUsage]) -> Result<(), Refusal> {
        if report.len() > crate::shuffles::MAX_SHUFFLES {
            return Err(invalid(format!(
                "the heartbeat reports {} shuffles, more than the {} that may be registered",
                report.len(),
                crate::shuffles::MAX_SHUFFLES
            )));
        }
        let mut by_job = UsageByJob::new();
        for usage in report {
            // A shuffle unregistered since the server counted it no longer counts.
            let Some(job) = self.shuffles.job_of(tern_proto::ShuffleId::from_wire(usage.shuffle_id)) else { continue };
            let Some(serial) = self.jobs.serial(job) else { continue };
            let held = by_job.entry((job.to_string(), serial)).or_default();
            held[0] = held[0].saturating_add(usage.dram_bytes);
            held[1] = held[1].saturating_add(usage.nvme_bytes);
        }
        self.count_shuffle_usage(server_id, by_job);
        Ok(())
    }

    /// Stops counting a server's shuffles (it died, or restarted and reports them again).
    pub(super) fn forget_shuffle_usage(&mut self, server_id: ServerId) {
        self.count_shuffle_usage(server_id, UsageByJob::new());
    }

    fn count_shuffle_usage(&mut self, server_id: ServerId, by_job: UsageByJob) {
        let previous = match by_job.is_empty() {
            true => self.shuffle_usage.remove(&server_id),
            false => self.shuffle_usage.insert(server_id, by_job),
        };
        for ((job, serial), bytes) in previous.unwrap_or_default() {
            if self.jobs.serial(&job) == Some(serial) {
                self.jobs.count_shuffle_bytes(&job, bytes, false);
            }
        }
        for ((job, _), &bytes) in self.shuffle_usage.get(&server_id).into_iter().flatten() {
            self.jobs.count_shuffle_bytes(job, bytes, true);
        }
    }

    /// Lists in a heartbeat reply every registered shuffle whose tenant is at a tier's quota.
    pub(super) fn add_quota_stops(&self, response: &mut HeartbeatResponse) {
        for (tenant, why) in self.jobs.at_quota() {
            let reason = why.iter().flatten().cloned().collect::<Vec<_>>().join("; ");
            for job in self.jobs.of_tenant(tenant) {
                response.quota_stops.extend(self.shuffles.of_job(job).map(|shuffle_id| QuotaStop {
                    shuffle_id: shuffle_id.get(),
                    dram: why[0].is_some(),
                    nvme: why[1].is_some(),
                    reason: reason.clone(),
                }));
            }
        }
    }

    /// Ok when job `job`'s tenant is below its quota of some tier a shuffle of `class` may use:
    /// a new segment could take data.
    pub(super) fn check_shuffle_quota(&self, job: &str, class: StorageClass) -> Result<(), Refusal> {
        let dram = self.jobs.check_below_quota(job, Tier::Dram);
        match (dram, class) {
            (Ok(()), _) => Ok(()),
            (Err(refusal), StorageClass::Dram) => Err(refusal),
            (Err(dram), _) => self
                .jobs
                .check_below_quota(job, Tier::Nvme)
                .map_err(|nvme| Refusal::new(nvme.kind, format!("{}; {}", dram.reason, nvme.reason))),
        }
    }
}
