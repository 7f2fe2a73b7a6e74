//! The metadata server's whole state and one method per RPC.
//!
//! Each method that changes the state prepares the change (checks the request, chooses ids and
//! placements, changing nothing) and commits it through the one [`State::apply`] that log replay
//! runs too (`commit`); `durable` replays and snapshots.
//!
//! The namespace, the storage-server registry, the job table and the shuffle registry each keep
//! their own invariants; this module enforces the rules that span them (a job's files live under
//! its directory and die with it, as do its shuffles; deleted files free their blocks, reads fail
//! with DataLost when a block's server is gone, a dead server's shuffle partitions move on) and
//! turns refusals into statuses that name the operation. Methods take the time as an argument
//! ([`Now`], read once per call by the service or the reaper) and never read the clock, so tests
//! can move it and a replay never depends on the replaying host's clock; they never block, so
//! the service can call them under one mutex.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tern_common::Now;
use tern_proto::token::{GrantKind, JobToken, TokenKey, VOLUME_SERIAL};
use tern_proto::v1::log_record::Change;
use tern_proto::v1::*;
use tern_proto::{BlockId, ErrorKind, FileId, ServerId, ShuffleId, Tier};
use tonic::Status;
use tracing::{error, info, warn};

use crate::config::Config;
use crate::copies::Copies;
use crate::error::{invalid, not_found, Context, Refusal};
use crate::jobs::{Jobs, DEFAULT_TENANT};
use crate::metrics::Gauges;
use crate::namespace::{FileMeta, Namespace};
use crate::path::{self, Place, JOBS_DIR};
use crate::planner::{self, parse_storage_class, BlockRooms};
use crate::servers::Servers;
use crate::shuffles::{registration_record, segment_record, SegmentCopy, Shuffles};
use commit::Applied;

#[derive(Debug)]
pub struct State {
    block_size: u32,
    heartbeat_interval: Duration,
    server_timeout: Duration,
    writer_lease: Duration,
    drain_timeout: Duration,
    /// `durable_files`: files of class `any` are created as `nvme`.
    durable_files: bool,
    /// Unsealed files and when their writer last allocated or renewed (not logged: after a
    /// restart every writer's lease starts again).
    writers: HashMap<FileId, Instant>,
    max_list_entries: u32,
    namespace: Namespace,
    servers: Servers,
    jobs: Jobs,
    shuffles: Shuffles,
    /// Signs job tokens and grants; `true` once a log record carries it (`key`: replicated).
    key: (TokenKey, bool),
    /// Changes committed since the caller last took them, for the write-ahead log.
    journal: Vec<LogRecord>,
    /// Each storage server's last report of its shuffles' bytes, by job (not logged: the next
    /// heartbeats report them again): see `quota`.
    shuffle_usage: HashMap<ServerId, quota::UsageByJob>,
    /// Re-replication and drain copies under way (not logged: see `copies`).
    copies: Copies,
    /// Completed mutating calls by request id, so a retry is answered, not done twice (logged).
    requests: requests::Requests,
}

impl State {
    /// A fresh state for a validated `config`, made at `now`.
    pub fn new(config: &Config, now: Now) -> State {
        State {
            block_size: config.block_size_bytes(),
            heartbeat_interval: config.heartbeat_interval(),
            server_timeout: config.server_timeout(),
            writer_lease: config.writer_lease(),
            drain_timeout: config.drain_timeout(),
            durable_files: config.durable_files,
            writers: HashMap::new(),
            max_list_entries: config.max_list_entries,
            namespace: Namespace::new(config.max_entries),
            servers: Servers::default(),
            jobs: Jobs::new(
                Duration::from_millis(config.default_lease_ms),
                Duration::from_millis(config.max_lease_ms),
                config.max_jobs as usize,
            )
            .with_quotas(config.tenants.clone(), config.block_size_bytes()),
            key: (TokenKey::generate(), false),
            // Shuffle ids start from the clock, so they stay unique across restarts of this server.
            shuffles: Shuffles::new(ShuffleId::first_at(now.unix_ms)),
            journal: Vec::new(),
            shuffle_usage: HashMap::new(),
            copies: Copies::new(config.copy_rate.0, now.instant),
            requests: requests::Requests::default(),
        }
    }

    /// The serial of the principal owning `path`: its job's, or the volume principal's outside
    /// `/jobs`. A job that is gone gets a serial no token carries.
    fn serial_of_path(&self, path: &str) -> u64 {
        match Place::of(path).job() {
            Some(job) => self.jobs.serial(job).unwrap_or(u64::MAX),
            None => VOLUME_SERIAL,
        }
    }

    fn with_grants(&self, mut locations: Vec<BlockLocation>, serial: u64) -> Vec<BlockLocation> {
        for location in &mut locations {
            location.grant = self.key.0.grant(GrantKind::Block, location.block_id, serial).to_vec();
        }
        locations
    }

    /// A fresh token for a registered job, expiring when its lease does.
    fn token_for(&self, job: &str, now: Now) -> String {
        let Some((serial, lease, left)) = self.jobs.lease_of(job, now.instant) else {
            return String::new();
        };
        let expires = now.unix_ms.saturating_add(left.as_millis() as u64);
        self.key.0.issue(job, serial, expires, lease.as_millis() as u64).to_text()
    }

    /// A fresh token for the holder of a valid one whose job is live; the lease is not renewed.
    pub fn refresh_token(&mut self, req: RefreshTokenRequest, now: Now) -> Result<RefreshTokenResponse, Status> {
        let token = JobToken::from_text(&req.token)
            .map_err(|e| Refusal::new(e.kind(), e.to_string()).status("refresh a job token"))?;
        let job = token.job.clone();
        self.check_decoded_token(&job, &token, "refresh the token of")?;
        self.jobs.check_live(&job, now.instant).context(format_args!("refresh the token of job {job}"))?;
        Ok(RefreshTokenResponse { token: self.token_for(&job, now) })
    }

    /// The changes made since the last call, in order.
    pub fn take_journal(&mut self) -> Vec<LogRecord> {
        std::mem::take(&mut self.journal)
    }

    /// Whether anything changed since the journal was last taken.
    pub fn has_journal(&self) -> bool {
        !self.journal.is_empty()
    }

    pub fn mkdir(&mut self, req: MkdirRequest, now: Now) -> Result<MkdirResponse, Status> {
        let context = format!("mkdir {}", req.path);
        let path = path::normalize(&req.path).context(&context)?;
        self.check_new_entry(&path, true, req.parents, now).context(&context)?;
        self.commit(Change::Mkdir(MkdirRequest { path, parents: req.parents, owner: req.owner }), now)
            .context(&context)?;
        Ok(MkdirResponse {})
    }

    pub fn create(&mut self, req: CreateRequest, now: Now) -> Result<CreateResponse, Status> {
        let context = format!("create {}", req.path);
        let path = path::normalize(&req.path).context(&context)?;
        let asked = parse_storage_class(&req.storage_class).context(&context)?;
        let storage_class = planner::file_class(asked, self.durable_files);
        let replicas = parse_replicas(req.replicas).context(&context)?;
        if replicas > 1 && !req.sealed {
            planner::enough_live_for_copies(self.servers.block_rooms().servers(), replicas).context(&context)?;
        }
        self.check_new_entry(&path, false, req.parents, now).context(&context)?;
        let file_id = self.namespace.next_file_id();
        let job = Place::of(&path).job().unwrap_or_default().to_string();
        let request = CreateRequest { path, storage_class: storage_class.to_string(), replicas, ..req };
        let sealed = request.sealed;
        self.commit(Change::Create(LogCreate { request: Some(request), file_id: file_id.get() }), now)
            .context(&context)?;
        let writer_lease_ms = if sealed { 0 } else { self.writer_lease.as_millis() as u64 };
        Ok(CreateResponse { file_id: file_id.get(), block_size: self.block_size, job, writer_lease_ms })
    }

    pub fn allocate_blocks(&mut self, req: AllocateBlocksRequest, now: Now) -> Result<AllocateBlocksResponse, Status> {
        let file_id = FileId::from_wire(req.file_id);
        let path = self.namespace.file_path(file_id).context(format_args!("allocate blocks for file {file_id}"))?;
        let context = format!("allocate {} for {path}", tern_common::text::count(u64::from(req.count), "block"));
        if req.count == 0 || req.count > tern_proto::MAX_ALLOCATE_BLOCKS {
            return Err(invalid(format!("count must be 1 to {}", tern_proto::MAX_ALLOCATE_BLOCKS)).status(context));
        }
        let file = self.namespace.file_mut(file_id).context(&context)?;
        if file.sealed {
            return Err(invalid("the file is already sealed").status(context));
        }
        let (class, replicas) = (file.storage_class, file.replicas);
        let plan = planner::place_blocks(self.servers.block_rooms(), req.count, &req.client_host, class, replicas)
            .context(&context)?;
        // Placement picks the tiers; a batch taking the job's tenant past a tier's quota is
        // refused, and nothing is placed. Every copy counts: each takes a block of its tier.
        if let Some(job) = Place::of(&path).job() {
            let nvme = plan.iter().filter(|place| place.tier == Tier::Nvme).count() as u64;
            let dram = plan.len() as u64 - nvme;
            self.jobs
                .check_blocks(job, Tier::Dram, dram)
                .and_then(|()| self.jobs.check_blocks(job, Tier::Nvme, nvme))
                .context(&context)?;
        }
        let blocks = self.servers.name_blocks(&plan);
        let change = Change::Allocate(LogAllocate {
            file_id: req.file_id,
            block_ids: blocks.iter().map(|b| b.block_id.get()).collect(),
            server_ids: blocks.iter().map(|b| b.server_id.get()).collect(),
        });
        self.commit(change, now).context(&context)?;
        let locations = blocks.iter().map(|block| self.servers.location(block, 0)).collect();
        let serial = self.serial_of_path(&path);
        Ok(AllocateBlocksResponse { blocks: self.with_grants(locations, serial) })
    }

    pub fn seal(&mut self, req: SealRequest, now: Now) -> Result<SealResponse, Status> {
        let file_id = FileId::from_wire(req.file_id);
        let path = self.namespace.file_path(file_id).context(format_args!("seal file {file_id}"))?;
        let context = format!("seal {path}");
        self.commit(Change::Seal(req), now).context(&context)?;
        let info = self.namespace.file_info(file_id).context(&context)?;
        Ok(SealResponse { info: Some(info) })
    }

    /// Keeps an unsealed file's writer lease from lapsing.
    pub fn renew_writer(&mut self, req: RenewWriterRequest, now: Now) -> Result<RenewWriterResponse, Status> {
        let file_id = FileId::from_wire(req.file_id);
        let context = format!("renew the writer of file {file_id}");
        let file = self.namespace.file_mut(file_id).context(&context)?;
        if file.sealed {
            return Err(invalid("the file is already sealed").status(context));
        }
        self.writers.insert(file_id, now.instant);
        Ok(RenewWriterResponse {})
    }

    /// Deletes an unsealed file for its writer, which failed: its blocks go back now, not when
    /// its lease lapses. A file already gone or sealed is left alone (the call is idempotent).
    pub fn abort(&mut self, req: AbortRequest, now: Now) -> Result<AbortResponse, Status> {
        let file_id = FileId::from_wire(req.file_id);
        let context = format!("abort the write of file {file_id}");
        match self.delete_unsealed(file_id, now).context(&context)? {
            Some((_, applied)) => Ok(AbortResponse { aborted: true, blocks_freed: applied.blocks_freed }),
            None => Ok(AbortResponse { aborted: false, blocks_freed: 0 }),
        }
    }

    /// Deletes file `file_id` (a logged Delete) if it is still unsealed, and forgets its writer;
    /// its path and what the delete freed, or `None` when it is gone or sealed already. What a
    /// failed writer's Abort and the reaper of dead writers both do.
    fn delete_unsealed(&mut self, file_id: FileId, now: Now) -> Result<Option<(String, Applied)>, Refusal> {
        self.writers.remove(&file_id);
        let unsealed = self.namespace.file(file_id).is_ok_and(|file| !file.sealed);
        let Some(path) = self.namespace.file_path(file_id).ok().filter(|_| unsealed) else {
            return Ok(None);
        };
        let applied = self.commit(Change::Delete(DeleteRequest { path: path.clone(), recursive: false }), now)?;
        Ok(Some((path, applied)))
    }

    pub fn open(&mut self, req: OpenRequest, _now: Now) -> Result<OpenResponse, Status> {
        let context = format!("open {}", req.path);
        let path = path::normalize(&req.path).context(&context)?;
        let (info, meta) = self.namespace.stat(&path).context(&context)?;
        let Some(file) = meta else {
            return Err(invalid("is a directory").status(context));
        };
        if !file.sealed {
            return Err(not_found("is not sealed yet").status(context));
        }
        // A block is lost only when every copy is; the reason names each copy's loss.
        for copies in file.copies() {
            let lost: Vec<String> = copies.iter().filter_map(|block| self.servers.lost(block)).collect();
            if lost.len() == copies.len() {
                let why = if lost.len() == 1 {
                    lost.concat()
                } else {
                    format!("every copy of a block is lost: {}", lost.join("; "))
                };
                return Err(Refusal::new(ErrorKind::DataLost, why).status(context));
            }
        }
        let mut blocks = self.locations(file);
        // Within each block, the copies on readable servers first: readers start there.
        for (group, copies) in blocks.chunks_mut(file.replicas.max(1) as usize).zip(file.copies()) {
            let readable: Vec<bool> = copies.iter().map(|b| self.servers.block_readable(b)).collect();
            let mut order: Vec<usize> = (0..group.len()).collect();
            order.sort_by_key(|&i| !readable[i]);
            let sorted: Vec<BlockLocation> = order.iter().map(|&i| group[i].clone()).collect();
            group.clone_from_slice(&sorted);
        }
        let blocks = self.with_grants(blocks, self.serial_of_path(&path));
        Ok(OpenResponse { info: Some(info), blocks, block_size: self.block_size })
    }

    pub fn stat(&mut self, req: StatRequest, _now: Now) -> Result<StatResponse, Status> {
        let context = format!("stat {}", req.path);
        let path = path::normalize(&req.path).context(&context)?;
        let (mut info, meta) = self.namespace.stat(&path).context(&context)?;
        if let Some(file) = meta {
            info.lost_blocks = self.lost_blocks(file);
        }
        let mut response = StatResponse { info: Some(info), ..StatResponse::default() };
        if let Some(file) = meta.filter(|_| req.with_blocks) {
            response.blocks = self.with_grants(self.locations(file), self.serial_of_path(&path));
            response.blocks_alive = file.blocks.iter().map(|block| self.servers.block_readable(block)).collect();
        }
        Ok(response)
    }

    pub fn list(&mut self, req: ListRequest, _now: Now) -> Result<ListResponse, Status> {
        let context = format!("list {}", req.path);
        let path = path::normalize(&req.path).context(&context)?;
        let limit = if req.limit == 0 { self.max_list_entries } else { req.limit.min(self.max_list_entries) };
        let (mut entries, truncated) =
            self.namespace.list(&path, &req.start_after, limit as usize).context(&context)?;
        // Each file's blocks are looked at only when some block may be lost.
        if !self.servers.all_blocks_readable() {
            for entry in entries.iter_mut().filter(|entry| entry.kind() == EntryKind::File) {
                if let Ok(file) = self.namespace.file(FileId::from_wire(entry.file_id)) {
                    entry.lost_blocks = self.lost_blocks(file);
                }
            }
        }
        Ok(ListResponse { entries, truncated })
    }

    pub fn delete(&mut self, req: DeleteRequest, now: Now) -> Result<DeleteResponse, Status> {
        let context = format!("delete {}", req.path);
        let path = path::normalize(&req.path).context(&context)?;
        match Place::of(&path) {
            Place::JobsDir if !self.jobs.is_empty() => {
                return Err(
                    invalid("holds the directories of live jobs; end them first (tern admin end-job)").status(context)
                );
            }
            Place::JobRoot(job) if self.jobs.is_registered(job) => {
                return Err(invalid(format!("is the directory of live job {job}; end the job instead")).status(context));
            }
            _ => {}
        }
        let change = Change::Delete(DeleteRequest { path, recursive: req.recursive });
        let applied = self.commit(change, now).context(&context)?;
        Ok(DeleteResponse { files_deleted: applied.files_deleted, blocks_freed: applied.blocks_freed })
    }

    pub fn rename(&mut self, req: RenameRequest, now: Now) -> Result<RenameResponse, Status> {
        let context = format!("rename {} to {}", req.from, req.to);
        let from = path::normalize(&req.from).context(&context)?;
        let to = path::normalize(&req.to).context(&context)?;
        for path in [&from, &to] {
            if matches!(Place::of(path), Place::JobsDir | Place::JobRoot(_)) {
                let why = format!("{path} is a job directory, made when its job starts and removed when it ends");
                return Err(invalid(why).status(context));
            }
        }
        let (from_job, to_job) = (Place::of(&from).job(), Place::of(&to).job());
        if from_job != to_job {
            let owner = |job: Option<&str>| job.map_or("outside /jobs".to_string(), |job| format!("job {job}"));
            let why = format!("cannot move entries across jobs ({} to {})", owner(from_job), owner(to_job));
            return Err(invalid(why).status(context));
        }
        self.commit(Change::Rename(RenameRequest { from, to }), now).context(&context)?;
        Ok(RenameResponse {})
    }

    pub fn register_job(&mut self, req: RegisterJobRequest, now: Now) -> Result<RegisterJobResponse, Status> {
        let context = format!("register job {:?}", req.name);
        // A lapsed job the reaper has not reached yet still holds its name: end it now.
        if self.jobs.is_registered(&req.name) && self.jobs.check_live(&req.name, now.instant).is_err() {
            self.end(&req.name, "lease lapsed", now).context(&context)?;
        }
        let (name, serial) = self.jobs.prepare(&req.name, &req.tenant).context(&context)?;
        let tenant = if req.tenant.is_empty() { DEFAULT_TENANT.to_string() } else { req.tenant };
        let change =
            Change::RegisterJob(RegisterJobRequest { name: name.clone(), lease_ms: req.lease_ms, tenant, serial });
        self.commit(change, now).context(&context)?;
        let lease = self.jobs.lease_of(&name, now.instant).map_or(0, |(_, lease, _)| lease.as_millis() as u64);
        let token = self.token_for(&name, now);
        Ok(RegisterJobResponse { root: path::job_root(&name), job_id: name, lease_ms: lease, token })
    }

    pub fn renew_job(&mut self, req: RenewJobRequest, now: Now) -> Result<RenewJobResponse, Status> {
        let lease = self.jobs.renew(&req.job_id, now.instant).context(format_args!("renew job {}", req.job_id))?;
        Ok(RenewJobResponse { lease_ms: lease.as_millis() as u64, token: self.token_for(&req.job_id, now) })
    }

    pub fn end_job(&mut self, req: EndJobRequest, now: Now) -> Result<EndJobResponse, Status> {
        let context = format!("end job {}", req.job_id);
        if !self.jobs.is_registered(&req.job_id) {
            let refusal = not_found(format!("job {} is not registered (ended or lease lapsed)", req.job_id));
            return Err(refusal.status(context));
        }
        let released = self.end(&req.job_id, "ended", now).context(&context)?;
        Ok(EndJobResponse { files_deleted: released.files_deleted, blocks_freed: released.blocks_freed })
    }

    /// An operator ends a job (no token: the caller passed the control plane's authentication).
    pub fn admin_end_job(&mut self, req: AdminEndJobRequest, now: Now) -> Result<EndJobResponse, Status> {
        self.end_job(EndJobRequest { job_id: req.job_id, token: String::new() }, now)
    }

    /// Cordons, uncordons or drains a storage server.
    pub fn set_server_mode(&mut self, req: SetServerModeRequest, now: Now) -> Result<SetServerModeResponse, Status> {
        let Ok(mode) = ServerMode::try_from(req.mode) else {
            let context = format!("set the mode of storage server {}", req.server);
            return Err(invalid(format!("unknown server mode {}", req.mode)).status(context));
        };
        let verb = match mode {
            ServerMode::Active => "uncordon",
            ServerMode::Cordoned => "cordon",
            ServerMode::Draining => "drain",
        };
        let context = format!("{verb} storage server {}", req.server);
        let server_id = self.servers.find(&req.server).context(&context)?;
        if !self.servers.is_alive(server_id) {
            return Err(Refusal::new(ErrorKind::NotFound, "the server is dead").status(context));
        }
        let timeout = match req.drain_timeout_ms {
            0 => self.drain_timeout,
            ms => Duration::from_millis(ms),
        };
        let drain_deadline_unix_ms =
            if mode == ServerMode::Draining { now.unix_ms.saturating_add(timeout.as_millis() as u64) } else { 0 };
        let change =
            Change::ServerMode(LogServerMode { server_id: server_id.get(), mode: mode as i32, drain_deadline_unix_ms });
        self.commit(change, now).context(&context)?;
        info!("storage server {server_id} ({}): {verb}", self.servers.address(server_id));
        self.check_drains(now);
        let server = self.servers.status_of(server_id, now.instant);
        Ok(SetServerModeResponse { server })
    }

    /// A client cannot reach a storage server: while the server is alive, placement avoids it
    /// for a server timeout (a partition between it and clients that its heartbeats here do not
    /// show). Not logged: like liveness, it is rebuilt by what clients see.
    pub fn report_unreachable(
        &mut self,
        req: ReportUnreachableRequest,
        now: Now,
    ) -> Result<ReportUnreachableResponse, Status> {
        let Some((server_id, alive)) = self.servers.report_unreachable(&req.address, now.instant + self.server_timeout)
        else {
            return Err(not_found(format!("no storage server at {}", req.address)).status("report unreachable"));
        };
        if alive {
            warn!(
                "a client cannot reach storage server {server_id} ({}): {}; placing nothing new there for {:?}",
                req.address, req.reason, self.server_timeout
            );
        }
        Ok(ReportUnreachableResponse { alive })
    }

    pub fn status(&mut self, _req: StatusRequest, now: Now) -> Result<StatusResponse, Status> {
        Ok(StatusResponse {
            block_size: self.block_size,
            servers: self.servers.status(now.instant),
            jobs: self.jobs.status(now.instant),
            files: self.namespace.files(),
            directories: self.namespace.directories(),
            tenants: self.jobs.tenants(),
            copies: Some(self.copies.status(now.instant)),
            lost_files: self.lost_files(),
        })
        .map(|mut status| {
            for server in &mut status.servers {
                server.copies_pending = self.copies.pending_from(ServerId::from_wire(server.server_id));
            }
            status
        })
    }

    pub fn register_shuffle(
        &mut self,
        req: RegisterShuffleRequest,
        now: Now,
    ) -> Result<RegisterShuffleResponse, Status> {
        let context = format!("register a shuffle of {} partitions for job {}", req.partitions, req.job_id);
        self.jobs.check_live(&req.job_id, now.instant).context(&context)?;
        let registration = self.shuffles.check_register(&req, self.block_size).context(&context)?;
        self.check_shuffle_quota(&req.job_id, registration.storage_class).context(&context)?;
        let loads = self.servers.segment_rooms(registration.storage_class);
        let firsts =
            planner::place_segments(&loads, req.partitions as usize, &[], registration.replicas).context(&context)?;
        let mut response = Shuffles::first_segments(registration, &firsts, &self.servers).context(&context)?;
        let serial = self.jobs.serial(&req.job_id).unwrap_or(u64::MAX);
        response.grant = self.key.0.grant(GrantKind::Shuffle, response.shuffle_id, serial).to_vec();
        let record = registration_record(registration.shuffle_id, req, registration.split_size_bytes, &firsts);
        self.commit(Change::RegisterShuffle(record), now).context(&context)?;
        Ok(response)
    }

    pub fn advance_segment(&mut self, req: AdvanceSegmentRequest, now: Now) -> Result<AdvanceSegmentResponse, Status> {
        let context = format!(
            "advance past segment {} of partition {} of shuffle {}",
            req.full_segment, req.partition, req.shuffle_id
        );
        let shuffle_id = ShuffleId::from_wire(req.shuffle_id);
        // Many writers report the same full segment at once: all get the one successor.
        if let Some(next) = self.shuffles.check_advance(&req).context(&context)? {
            if let Some(job) = self.shuffles.job_of(shuffle_id) {
                self.check_shuffle_quota(job, next.storage_class).context(&context)?;
            }
            let loads = self.servers.segment_rooms(next.storage_class);
            let copies = planner::place_segments(&loads, 1, &next.avoid, next.replicas).context(&context)?[0];
            let change = Change::AddSegment(segment_record(shuffle_id, req.partition, copies));
            self.commit(change, now).context(&context)?;
            // The full segment is closed now: one with a copy gone is for re-replication.
            if next.replicas > 1 && next.avoid.iter().any(|&server| !self.servers.is_alive(server)) {
                self.copies.wake();
            }
        }
        let segment = self.shuffles.last_segment(shuffle_id, req.partition, &self.servers).context(&context)?;
        Ok(AdvanceSegmentResponse { segment: Some(segment) })
    }

    pub fn commit_map(&mut self, req: CommitMapRequest, now: Now) -> Result<CommitMapResponse, Status> {
        let context = format!("commit map {} attempt {} of shuffle {}", req.map_index, req.attempt, req.shuffle_id);
        // A map committed already (a winner's retry, or another attempt) changes nothing.
        if let Some(answer) = self.shuffles.check_commit(&req).context(&context)? {
            return Ok(answer);
        }
        let attempt = req.attempt;
        self.commit(Change::CommitMap(req), now).context(&context)?;
        Ok(CommitMapResponse { committed: true, winning_attempt: attempt })
    }

    pub fn locate_shuffle(&mut self, req: LocateShuffleRequest, _now: Now) -> Result<LocateShuffleResponse, Status> {
        let context = format!("locate shuffle {}", req.shuffle_id);
        let mut response = self.shuffles.locate(&req, &self.servers).context(context)?;
        let serial = self.jobs.serial(&response.job_id).unwrap_or(u64::MAX);
        response.grant = self.key.0.grant(GrantKind::Shuffle, req.shuffle_id, serial).to_vec();
        Ok(response)
    }

    pub fn invalidate_maps(&mut self, req: InvalidateMapsRequest, now: Now) -> Result<InvalidateMapsResponse, Status> {
        let context = format!("invalidate {} maps of shuffle {}", req.map_indexes.len(), req.shuffle_id);
        let invalidated = self.shuffles.check_invalidate(&req).context(&context)?;
        if invalidated > 0 {
            self.commit(Change::InvalidateMaps(req), now).context(&context)?;
        }
        Ok(InvalidateMapsResponse { invalidated })
    }

    pub fn unregister_shuffle(
        &mut self,
        req: UnregisterShuffleRequest,
        now: Now,
    ) -> Result<UnregisterShuffleResponse, Status> {
        let context = format!("unregister shuffle {}", req.shuffle_id);
        self.shuffles.check_registered(ShuffleId::from_wire(req.shuffle_id)).context(&context)?;
        self.commit(Change::UnregisterShuffle(req), now).context(&context)?;
        Ok(UnregisterShuffleResponse {})
    }

    pub fn register_server(&mut self, req: RegisterServerRequest, now: Now) -> Result<RegisterServerResponse, Status> {
        let context = format!("register storage server {}", req.address);
        // A server registering at start-up names its tiers in bytes (it learns the block size from
        // this reply); count their blocks here, so status and placement are right before its
        // first heartbeat reports them.
        let mut tiers = req.tiers;
        for tier in &mut tiers {
            if tier.capacity_blocks == 0 {
                tier.capacity_blocks = tier.capacity_bytes / u64::from(self.block_size.max(1));
            }
        }
        let (server_id, previous) =
            self.servers.check_registration(&req.address, &req.quic_address).context(&context)?;
        let change = Change::Server(LogServer {
            server_id: server_id.get(),
            address: req.address.clone(),
            quic_address: req.quic_address.clone(),
            instance_id: req.instance_id,
        });
        self.commit(change, now).context(&context)?;
        self.servers.take_registration(server_id, tiers, previous != Some(req.instance_id), now.instant);
        match previous {
            Some(old) if old != req.instance_id => {
                warn!(
                    "storage server {server_id} ({}) restarted; its DRAM blocks and the shuffle segments it does not \
                     report are lost",
                    req.address
                );
                self.lose_server(server_id, now);
            }
            Some(_) => info!("storage server {server_id} registered again from {}", req.address),
            None if req.quic_address.is_empty() => info!("storage server {server_id} registered from {}", req.address),
            None => info!("storage server {server_id} registered from {} (QUIC {})", req.address, req.quic_address),
        }
        Ok(RegisterServerResponse {
            server_id: server_id.get(),
            block_size: self.block_size,
            heartbeat_interval_ms: self.heartbeat_interval.as_millis() as u64,
            token_key: self.key.0.as_bytes().to_vec(),
        })
    }

    /// Takes a page of a registered server's inventory; the last page reconciles it with what
    /// the namespace and the shuffles reference there.
    pub fn report_inventory(
        &mut self,
        req: ReportInventoryRequest,
        now: Now,
    ) -> Result<ReportInventoryResponse, Status> {
        let context = format!("inventory of storage server {}", req.server_id);
        let server_id = ServerId::from_wire(req.server_id);
        let blocks: Vec<BlockId> = req.block_ids.iter().map(|&id| BlockId::from_wire(id)).collect();
        let shuffles: Vec<ShuffleId> = req.shuffle_ids.iter().map(|&id| ShuffleId::from_wire(id)).collect();
        let segments: Vec<SegmentCopy> = (req.segments.iter())
            .map(|s| SegmentCopy {
                shuffle_id: ShuffleId::from_wire(s.shuffle_id),
                partition: s.partition,
                index: s.index,
            })
            .collect();
        self.servers.inventory_page(server_id, &blocks, &shuffles, &segments, self.block_size).context(&context)?;
        if !req.last {
            return Ok(ReportInventoryResponse::default());
        }
        let mut referenced = std::collections::HashMap::new();
        for (file, block) in self.namespace.blocks() {
            if block.server_id == server_id {
                referenced.insert(block.block_id, file.sealed);
            }
        }
        let restarted = self.servers.restarted_since_log(server_id);
        let shuffles = &self.shuffles;
        // Segments the chains name there, or a copy under way is writing there.
        let copying: std::collections::HashSet<SegmentCopy> = self.copies.segments_to(server_id).collect();
        let needed = |segment: SegmentCopy| shuffles.holds(segment, server_id) || copying.contains(&segment);
        let (done, held) =
            self.servers.reconcile(server_id, &referenced, restarted, |id| shuffles.is_registered(id), needed);
        // A server taking placements again may be the room blocks waiting for a copy need.
        self.copies.wake();
        if restarted {
            // A new process: the segments it did not take back from NVMe are gone with its DRAM.
            for lost in self.shuffles.lost_on(server_id, &held) {
                self.commit_own(Change::LostSegments(lost), now);
            }
        }
        if done.lost > 0 || done.unreferenced > 0 || done.unknown_shuffles > 0 || done.unreferenced_segments > 0 {
            warn!(
                "storage server {server_id} reconciled: {} referenced blocks lost, {} unreferenced blocks, {} \
                 unknown shuffles and {} unreferenced segments to free",
                done.lost, done.unreferenced, done.unknown_shuffles, done.unreferenced_segments
            );
        }
        Ok(ReportInventoryResponse { blocks_unreferenced: done.unreferenced, blocks_lost: done.lost })
    }

    pub fn heartbeat(&mut self, req: HeartbeatRequest, now: Now) -> Result<HeartbeatResponse, Status> {
        let server_id = ServerId::from_wire(req.server_id);
        let mut response = self.servers.heartbeat(server_id, req.tiers, req.freed_through_seq, now.instant);
        if !response.reregister {
            let context = format!("heartbeat of storage server {server_id}");
            self.take_shuffle_usage(server_id, &req.shuffles).context(context)?;
            self.add_quota_stops(&mut response);
            self.take_copies_done(server_id, &req.copies_done, now);
            (response.copy_blocks, response.copy_segments) = self.hand_out_copies(server_id, now);
        }
        Ok(response)
    }

    /// Starts every lease and timeout kept in local time over from `now`: jobs' leases, writers'
    /// leases and storage servers' heartbeat timeouts (a server that has not registered here gets
    /// the whole timeout to). A replica that begins to serve (after a failover) calls it: renewals,
    /// writes and heartbeats reached the old leader, and none is logged, so how long ago this replica
    /// applied a registration says nothing about whether its holder is alive. A single server's
    /// restart gets the same from its replay, which applies everything at the start-up's time.
    pub fn count_leases_from(&mut self, now: Instant) {
        self.jobs.count_leases_from(now);
        self.writers.values_mut().for_each(|renewed| *renewed = now);
        self.servers.count_timeouts_from(now);
    }

    /// Ends jobs whose lease lapsed and declares silent storage servers dead. Run periodically.
    pub fn reap(&mut self, now: Now) {
        self.reap_writers(now);
        for job in self.jobs.lapsed(now.instant) {
            if let Err(refusal) = self.end(&job, "lease lapsed", now) {
                error!("ending job {job}, whose lease lapsed: {} ({:?})", refusal.reason, refusal.kind);
            }
        }
        for (server_id, dead) in self.servers.expire(now.instant, self.server_timeout) {
            warn!("{dead}; its blocks are lost");
            self.lose_server(server_id, now);
        }
        // After the deaths: their blocks' second copies are chosen in this same pass, and drains
        // are checked with the copies off them counted.
        self.plan_copies(now);
        self.check_drains(now);
    }

    /// Deletes unsealed files whose writer's lease lapsed: the writer died (a killed process
    /// cannot delete what it left), and the blocks it held go back.
    fn reap_writers(&mut self, now: Now) {
        let lease = self.writer_lease;
        let lapsed: Vec<FileId> = self
            .writers
            .iter()
            .filter(|(_, &renewed)| now.instant.saturating_duration_since(renewed) > lease)
            .map(|(&file_id, _)| file_id)
            .collect();
        for file_id in lapsed {
            // Gone or sealed already (deleted, or its job ended): nothing to reap.
            match self.delete_unsealed(file_id, now) {
                Ok(Some((path, applied))) => warn!(
                    "deleted unsealed {path}: its writer neither wrote nor renewed for {lease:?} (it died); {} blocks \
                     freed",
                    applied.blocks_freed
                ),
                Ok(None) => {}
                Err(refusal) => error!("reaping unsealed file {file_id}: {} ({:?})", refusal.reason, refusal.kind),
            }
        }
    }

    /// Checks every drain: a draining server is told to exit (in its heartbeat replies) once it
    /// holds nothing a live job or file still needs, or when its deadline passes. Needed: blocks
    /// of files that no other readable copy on a server taking placements backs, and segments of
    /// registered shuffles. Nothing is moved here (`plan_copies` copies sealed files' blocks and
    /// closed shuffle segments off); the rest keeps the server until its owner frees it (jobs
    /// end; files are deleted; shuffles are unregistered) or the deadline. While a drain is under way this
    /// is one pass over every block each reap period; with none, nothing.
    fn check_drains(&mut self, now: Now) {
        let drains = self.servers.drains(now.instant);
        if drains.is_empty() {
            return;
        }
        let draining: Vec<ServerId> = drains.iter().map(|d| d.server_id).collect();
        let mut sole: HashMap<ServerId, (u64, u64)> = HashMap::new();
        for file in self.namespace.file_metas() {
            for copies in file.copies() {
                for block in copies.iter().filter(|b| draining.contains(&b.server_id)) {
                    let backed = copies
                        .iter()
                        .any(|other| !draining.contains(&other.server_id) && self.servers.block_readable(other));
                    if !backed {
                        let entry = sole.entry(block.server_id).or_default();
                        entry.0 += 1;
                        if !file.sealed {
                            entry.1 += 1;
                        }
                    }
                }
            }
        }
        for drain in drains {
            let (blocks, unsealed) = sole.get(&drain.server_id).copied().unwrap_or_default();
            let segments = self.servers.segments_on(drain.server_id);
            let mut waiting = Vec::new();
            if blocks > 0 {
                let moving =
                    self.copies.draining_from(drain.server_id) - self.copies.segments_draining_from(drain.server_id);
                waiting.push(format!(
                    "{blocks} blocks no other copy backs ({unsealed} of files still being written, {moving} being copied \
                     off)"
                ));
            }
            if segments > 0 {
                let moving = match self.copies.segments_draining_from(drain.server_id) {
                    0 => String::new(),
                    n => format!(" ({n} being copied off)"),
                };
                waiting.push(format!("{segments} segments of registered shuffles{moving}"));
            }
            let waiting_for = waiting.join(", ");
            let expired = now.instant >= drain.deadline;
            self.servers.set_sole_copy_blocks(drain.server_id, blocks);
            if self.servers.settle_drain(drain.server_id, waiting_for.clone(), waiting_for.is_empty() || expired) {
                let address = self.servers.address(drain.server_id);
                if waiting_for.is_empty() {
                    info!(
                        "storage server {} ({address}) drained: nothing it holds is needed; telling it to exit",
                        drain.server_id
                    );
                } else {
                    warn!(
                        "storage server {} ({address}): drain deadline passed with {waiting_for} still there; telling it \
                         to exit (that data is lost)",
                        drain.server_id
                    );
                }
            }
        }
    }

    pub fn gauges(&self) -> Gauges {
        Gauges {
            files: self.namespace.files(),
            directories: self.namespace.directories(),
            jobs: self.jobs.len() as u64,
            live_servers: self.servers.live_count(),
            dead_servers: self.servers.dead_count(),
            allocated_blocks: self.servers.allocated_blocks(),
            shuffles: self.shuffles.len() as u64,
            copies: self.copies.totals(),
        }
    }

    /// After a storage server died (or restarted, losing its DRAM): shuffle partitions whose
    /// last segment was there get a new one on a live server, so map attempts can push again.
    /// (Readers see a dead server's segments as lost; a restarted server's inventory says which
    /// of its segments came back, and the rest are marked lost then.)
    fn lose_server(&mut self, server_id: ServerId, now: Now) {
        self.forget_shuffle_usage(server_id);
        // Its blocks' other copies are copied again (and copies from or to it are given up).
        self.copies.wake();
        let mut placed = 0;
        for shuffle_id in self.shuffles.ids() {
            // Placed shuffle by shuffle, each seeing the load the ones before it added.
            let Some(tails) = self.shuffles.tails_on(shuffle_id, server_id) else {
                continue;
            };
            let loads = self.servers.segment_rooms(tails.storage_class);
            let Ok(plan) = planner::place_segments(&loads, tails.partitions.len(), &[server_id], tails.replicas) else {
                continue;
            };
            for (&partition, &copies) in tails.partitions.iter().zip(&plan) {
                self.commit_own(Change::AddSegment(segment_record(shuffle_id, partition, copies)), now);
                placed += 1;
            }
        }
        if placed > 0 {
            info!("placed {placed} shuffle segments anew after storage server {server_id} was lost");
        }
    }

    /// Commits a change the state chose itself (not a request's), which its own checks allow:
    /// a refusal is a bug, logged rather than answered.
    fn commit_own(&mut self, change: Change, now: Now) {
        if let Err(refusal) = self.commit(change.clone(), now) {
            error!("an internal change was refused: {change:?}: {} ({:?})", refusal.reason, refusal.kind);
        }
    }

    /// Ends a registered job: forgets it, deletes its directory, frees its blocks and shuffles.
    fn end(&mut self, job: &str, why: &str, now: Now) -> Result<Applied, Refusal> {
        let change = Change::EndJob(EndJobRequest { job_id: job.to_string(), ..Default::default() });
        let released = self.commit(change, now)?;
        info!(
            "job {job} {why}: deleted {} files, freeing {} blocks and {} shuffles",
            released.files_deleted, released.blocks_freed, released.shuffles_freed
        );
        Ok(released)
    }

    /// Rules for new entries under `/jobs`, which belongs to the jobs: `/jobs/<job>` is made only
    /// by RegisterJob, and entries below it only while the job is live.
    fn check_new_entry(&self, path: &str, directory: bool, parents: bool, now: Now) -> Result<(), Refusal> {
        match Place::of(path) {
            Place::Outside => Ok(()),
            Place::JobsDir if directory => Ok(()),
            Place::JobsDir => Err(invalid(format!("{JOBS_DIR} is reserved for job directories"))),
            // `mkdir -p` of a live job's existing directory is a harmless no-op.
            Place::JobRoot(job) if directory && parents && self.jobs.check_live(job, now.instant).is_ok() => Ok(()),
            Place::JobRoot(_) => Err(invalid("job directories are made when their job starts")),
            Place::InJob(job) => self.jobs.check_live(job, now.instant),
        }
    }

    /// Where each copy of each block of a file lives and how many of the file's bytes the block
    /// holds, grouped by block as in `FileMeta::blocks`.
    fn locations(&self, file: &FileMeta) -> Vec<BlockLocation> {
        let block_size = u64::from(self.block_size);
        let count = file.block_count();
        let replicas = file.replicas.max(1) as usize;
        file.blocks
            .iter()
            .enumerate()
            .map(|(copy, block)| {
                let index = copy / replicas;
                let length = match (file.sealed, index as u64 + 1 == count) {
                    (false, _) => 0,
                    (true, false) => block_size,
                    (true, true) => file.length.saturating_sub((count - 1) * block_size),
                };
                self.servers.location(block, length as u32)
            })
            .collect()
    }
}

/// Copies of each block asked at create: 1 or 2 (0 = 1).
fn parse_replicas(replicas: u32) -> Result<u32, Refusal> {
    match replicas {
        0 => Ok(1),
        n if n <= tern_proto::MAX_REPLICAS => Ok(n),
        n => Err(invalid(format!("replicas must be 1 to {}, not {n}", tern_proto::MAX_REPLICAS))),
    }
}

mod access;
mod commit;
mod copying;
mod durable;
mod key;
mod lost;
mod quota;
mod requests;

#[cfg(test)]
#[allow(clippy::disallowed_methods, reason = "tests may read the clock")]
mod copy_tests;
#[cfg(test)]
#[allow(clippy::disallowed_methods, reason = "tests may read the clock")]
mod shuffle_tests;
#[cfg(test)]
#[allow(clippy::disallowed_methods, reason = "tests may read the clock")]
mod tests;
