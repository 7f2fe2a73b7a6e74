//! Request validation under arbitrary input, for the fuzz targets (`fuzz/`) and the bounded
//! property test (`tests/bad_requests.rs`): bytes decoded as the gRPC request types and handed to
//! the same state methods the gRPC handlers call, with the checks that must hold whatever comes in.
//!
//! What is checked, beyond "nothing panics":
//! - every refusal is a status whose message is not empty and that carries a `tern-kind`, so the
//!   caller learns what was wrong and why;
//! - every change an accepted call journals replays on a second state (as a restart would replay
//!   the log): a record the live state wrote but a replay refuses would keep the server from
//!   starting again.
//!
//! Not part of the server's API: hidden from its docs, used by tests and fuzzing only.

use std::time::Duration;

use prost::Message;
use tern_common::Now;
use tern_proto::error::KIND_METADATA_KEY;
use tern_proto::v1::*;
use tonic::Status;

use crate::config::Config;
use crate::state::State;

/// How many request types [`Harness::call`] knows: a method index is taken modulo this.
pub const METHODS: u8 = 22;

/// The name of method `index` (modulo [`METHODS`]), as the gRPC service calls it.
pub fn method_name(index: u8) -> &'static str {
    const NAMES: [&str; METHODS as usize] = [
        "mkdir",
        "create",
        "allocate_blocks",
        "seal",
        "open",
        "stat",
        "list",
        "delete",
        "rename",
        "register_job",
        "renew_job",
        "end_job",
        "status",
        "register_shuffle",
        "advance_segment",
        "commit_map",
        "locate_shuffle",
        "invalidate_maps",
        "unregister_shuffle",
        "register_server",
        "heartbeat",
        "report_inventory",
    ];
    NAMES[(index % METHODS) as usize]
}

/// A metadata state with one storage server registered (so allocations and shuffles can be
/// placed), small limits (so they are reached), and a replica fed every journaled change.
pub struct Harness {
    state: State,
    replica: State,
    start: Now,
    now: Now,
    /// Jobs and shuffles registered, by order: see [`Harness::call`].
    jobs: Vec<String>,
    shuffles: Vec<u64>,
}

/// What one call came to.
#[derive(Debug)]
pub enum Outcome {
    /// The bytes are not a valid encoding of the request type: the gRPC layer refuses them before
    /// any handler runs.
    Undecodable,
    Accepted,
    Refused(Status),
}

impl Default for Harness {
    fn default() -> Harness {
        Harness::new()
    }
}

impl Harness {
    #[expect(clippy::disallowed_methods, reason = "the harness starts its clock here; it moves on only by `advance`")]
    pub fn new() -> Harness {
        let config = Config {
            block_size: tern_common::ByteSize::kib(64),
            max_list_entries: 64,
            max_jobs: 16,
            max_entries: 512,
            ..Config::default()
        };
        let start = Now::read();
        let mut harness = Harness {
            state: State::new(&config, start),
            replica: State::new(&config, start),
            start,
            now: start,
            jobs: Vec::new(),
            shuffles: Vec::new(),
        };
        // Placement takes a server only after its registration and its (here empty) inventory.
        let tiers = vec![TierUsage {
            tier: "dram".to_string(),
            capacity_bytes: 64 * 65536,
            capacity_blocks: 64,
            ..TierUsage::default()
        }];
        let request = RegisterServerRequest { address: "127.0.0.1:9070".to_string(), tiers, ..Default::default() };
        let registered = harness.state.register_server(request, start).expect("registering the harness's server");
        let inventory = ReportInventoryRequest { server_id: registered.server_id, last: true, ..Default::default() };
        harness.state.report_inventory(inventory, start).expect("the harness server's inventory");
        harness.replay();
        harness
    }

    /// Moves the clock on (leases lapse, servers go silent) and runs the reaper as the server does.
    pub fn advance(&mut self, by: Duration) {
        // Bounded so that an Instant never overflows, whatever a fuzzer asks for.
        if self.now.instant.duration_since(self.start.instant) < Duration::from_secs(1 << 30) {
            self.now += by;
        }
        self.state.reap(self.now);
        self.replay();
    }

    /// Decodes `body` as the request of method `method` (modulo [`METHODS`]) and calls it.
    /// Panics if a check in the module doc fails.
    ///
    /// Shuffle ids are clock-based and job ids generated, so random bytes would never name one
    /// that exists: a shuffle id below 64, or a job id of one character, is taken as an alias of
    /// the n-th shuffle or job this harness registered (modulo how many), so requests reach them.
    pub fn call(&mut self, method: u8, body: &[u8]) -> Outcome {
        let now = self.now;
        macro_rules! decode {
            ($req:ty) => {
                match <$req>::decode(body) {
                    Ok(req) => req,
                    Err(_) => return Outcome::Undecodable,
                }
            };
        }
        let result = match method % METHODS {
            0 => self.state.mkdir(decode!(MkdirRequest), now).map(drop),
            1 => self.state.create(decode!(CreateRequest), now).map(drop),
            2 => self.state.allocate_blocks(decode!(AllocateBlocksRequest), now).map(drop),
            3 => self.state.seal(decode!(SealRequest), now).map(drop),
            4 => self.state.open(decode!(OpenRequest), now).map(drop),
            5 => self.state.stat(decode!(StatRequest), now).map(drop),
            6 => self.state.list(decode!(ListRequest), now).map(drop),
            7 => self.state.delete(decode!(DeleteRequest), now).map(drop),
            8 => self.state.rename(decode!(RenameRequest), now).map(drop),
            9 => self.state.register_job(decode!(RegisterJobRequest), now).map(|r| self.jobs.push(r.job_id)),
            10 => {
                let mut req = decode!(RenewJobRequest);
                req.job_id = self.job(req.job_id);
                self.state.renew_job(req, now).map(drop)
            }
            11 => {
                let mut req = decode!(EndJobRequest);
                req.job_id = self.job(req.job_id);
                self.state.end_job(req, now).map(drop)
            }
            12 => self.state.status(decode!(StatusRequest), now).map(drop),
            13 => {
                let mut req = decode!(RegisterShuffleRequest);
                req.job_id = self.job(req.job_id);
                self.state.register_shuffle(req, now).map(|r| self.shuffles.push(r.shuffle_id))
            }
            14 => {
                let mut req = decode!(AdvanceSegmentRequest);
                req.shuffle_id = self.shuffle(req.shuffle_id);
                self.state.advance_segment(req, now).map(drop)
            }
            15 => {
                let mut req = decode!(CommitMapRequest);
                req.shuffle_id = self.shuffle(req.shuffle_id);
                self.state.commit_map(req, now).map(drop)
            }
            16 => {
                let mut req = decode!(LocateShuffleRequest);
                req.shuffle_id = self.shuffle(req.shuffle_id);
                self.state.locate_shuffle(req, now).map(drop)
            }
            17 => {
                let mut req = decode!(InvalidateMapsRequest);
                req.shuffle_id = self.shuffle(req.shuffle_id);
                self.state.invalidate_maps(req, now).map(drop)
            }
            18 => {
                let mut req = decode!(UnregisterShuffleRequest);
                req.shuffle_id = self.shuffle(req.shuffle_id);
                self.state.unregister_shuffle(req, now).map(drop)
            }
            19 => self.state.register_server(decode!(RegisterServerRequest), now).map(drop),
            20 => self.state.heartbeat(decode!(HeartbeatRequest), now).map(drop),
            _ => self.state.report_inventory(decode!(ReportInventoryRequest), now).map(drop),
        };
        // Bounded, whatever the input: the aliases only need a few.
        self.jobs.truncate(64);
        self.shuffles.truncate(64);
        self.replay();
        match result {
            Ok(()) => Outcome::Accepted,
            Err(status) => {
                let name = method_name(method);
                assert!(!status.message().trim().is_empty(), "{name}: refused with an empty message: {status:?}");
                assert!(
                    status.metadata().get(KIND_METADATA_KEY).is_some(),
                    "{name}: refusal without a {KIND_METADATA_KEY}: {status:?}"
                );
                Outcome::Refused(status)
            }
        }
    }

    /// See [`Harness::call`]: a one-character job id names the n-th job registered.
    fn job(&self, id: String) -> String {
        match (id.as_bytes(), self.jobs.len()) {
            ([n], len) if len > 0 => self.jobs[usize::from(*n) % len].clone(),
            _ => id,
        }
    }

    /// See [`Harness::call`]: a shuffle id below 64 names the n-th shuffle registered.
    fn shuffle(&self, id: u64) -> u64 {
        match self.shuffles.len() {
            len if len > 0 && id < 64 => self.shuffles[id as usize % len],
            _ => id,
        }
    }

    /// Feeds the journal to the replica, as a restart replays the log.
    fn replay(&mut self) {
        for record in self.state.take_journal() {
            if let Err(refusal) = self.replica.replay(&record, self.now) {
                panic!("a journaled change does not replay: {record:?}: {} ({:?})", refusal.reason, refusal.kind);
            }
        }
    }
}
