//! `tern admin`: operators' commands over the control plane, authenticated as every client
//! command is (--metadata, --tls-dir). The logic lives where it belongs: placement, drains and
//! ending jobs in the metadata server, the calls in `tern_client`; this module parses and prints.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use tern_client::{Client, ServerMode, ServerStatus};

use crate::cli::MetadataAddr;
use crate::show;

#[derive(Args)]
pub struct AdminArgs {
    #[command(flatten)]
    metadata: MetadataAddr,
    #[command(subcommand)]
    command: AdminCommand,
}

#[derive(Subcommand)]
enum AdminCommand {
    /// Storage servers: address, state (alive, dead, cordoned, draining, unreachable), tiers with
    /// capacity and use, blocks, shuffle segments, last heartbeat.
    Servers {
        /// Print one JSON array, an object per server.
        #[arg(long)]
        json: bool,
    },
    /// One storage server in detail, with what a drain of it waits for.
    Server {
        /// Its id or its address host:port, as `tern admin servers` lists them.
        server: String,
        /// Print one JSON object: the server, its tiers, and what a drain of it waits for.
        #[arg(long)]
        json: bool,
    },
    /// Place no new blocks or shuffle segments on SERVER; what it holds stays readable.
    Cordon {
        /// Its id or its address host:port.
        server: String,
        /// Print the server, as it stands after the cordon, as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Let the planner place on SERVER again (undoes cordon, and a drain not yet finished).
    Uncordon {
        /// Its id or its address host:port.
        server: String,
        /// Print the server, as it stands after the uncordon, as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Cordon SERVER, copy the blocks of sealed files and the closed shuffle segments that no other
    /// copy backs to other servers, and have it exit once it holds nothing a live job or file still
    /// needs, or when the timeout passes: what is still held only there then (unsealed files, open
    /// segments) is lost.
    Drain {
        /// Its id or its address host:port.
        server: String,
        /// Wait until the server is told to exit, showing what the drain waits for.
        #[arg(long)]
        wait: bool,
        /// The server exits after this long even if data there is still needed, e.g. 10m
        /// [default: the metadata server's drain_timeout_ms].
        #[arg(long, value_parser = tern_common::parse_duration)]
        timeout: Option<Duration>,
        /// Print the server, as it stands after the call (or the wait), as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Jobs registered with the metadata server: id, tenant, lease left, files, bytes.
    Jobs {
        /// Print one JSON array, an object per job.
        #[arg(long)]
        json: bool,
    },
    /// End JOB without its token: every file it wrote and every shuffle it registered are freed.
    EndJob {
        /// The job's id, as `tern admin jobs` lists it.
        job: String,
        /// Print {"job_id", "files_deleted", "blocks_freed"} as JSON.
        #[arg(long)]
        json: bool,
    },
    /// The replicated metadata service's members: list, add or remove one at a time.
    Metadata {
        #[command(subcommand)]
        command: MetadataCommand,
    },
    /// Free every segment of shuffle SHUFFLE (its id, as `tern job status` shows it).
    UnregisterShuffle {
        /// The shuffle's id.
        shuffle: u64,
        /// Print {"shuffle_id", "unregistered"} as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum MetadataCommand {
    /// Members as the leader sees them: id, address, voter or learner, leader, log entries behind.
    Members {
        /// Print the answer as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Add metadata server ID at ADDR as a voter, once it has caught up. Start it first, with
    /// `node_id = ID` and `peers` naming the members and itself (an empty state: it only follows).
    Add {
        /// Its Raft node id: at least 1 and no other member's.
        id: u64,
        /// Its gRPC address host:port, as the other members reach it.
        address: String,
        /// Print the members after the change as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Remove member ID (a voter or a learner); stop that server afterwards.
    Remove {
        /// Its id, as `tern admin metadata members` lists it.
        id: u64,
        /// Print the members after the change as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

/// How often `drain --wait` looks at the server.
const DRAIN_POLL: Duration = Duration::from_millis(250);
/// How long `drain --wait` waits beyond the drain's own deadline before giving up on the answer.
const DRAIN_WAIT_MARGIN: Duration = Duration::from_secs(30);

pub async fn run(args: AdminArgs) -> anyhow::Result<()> {
    let client = args.metadata.connect().await?;
    match args.command {
        AdminCommand::Servers { json } => {
            let servers = client.status().await?.servers;
            if json {
                show::print_json(&Value::Array(servers.iter().map(show::server_json).collect()));
            } else {
                print_servers(&servers);
            }
        }
        AdminCommand::Server { server, json } => {
            let found = find(&client, &server).await?;
            if json {
                show::print_json(&show::server_json(&found));
            } else {
                print_server(&found);
            }
        }
        AdminCommand::Cordon { server, json } => {
            let now = client.set_server_mode(&server, ServerMode::Cordoned, None).await?;
            report(&now, json, "cordoned: no new blocks or shuffle segments go there");
        }
        AdminCommand::Uncordon { server, json } => {
            let now = client.set_server_mode(&server, ServerMode::Active, None).await?;
            report(&now, json, "uncordoned: it takes new blocks and shuffle segments again");
        }
        AdminCommand::Drain { server, wait, timeout, json } => {
            let mut now = client.set_server_mode(&server, ServerMode::Draining, timeout).await?;
            if wait {
                now = wait_drained(&client, now, json).await?;
            }
            let what = match (now.drained, now.drain_waiting_for.as_str()) {
                (true, "") => "drained: nothing it holds is needed; told to exit".to_string(),
                (true, waiting) => format!("drain deadline passed; told to exit with {waiting} still there"),
                (false, waiting) => format!(
                    "draining: waiting for {waiting}; it exits when they are freed or in {:.0}s",
                    now.drain_deadline_ms as f64 / 1000.0
                ),
            };
            report(&now, json, &what);
        }
        AdminCommand::Jobs { json } => {
            let jobs = client.status().await?.jobs;
            if json {
                show::print_json(&Value::Array(jobs.iter().map(show::job_json).collect()));
            } else {
                outln!("{:<40} {:<16} {:>10} {:>8} {:>10}", "JOB", "TENANT", "LEASE LEFT", "FILES", "BYTES");
                for job in &jobs {
                    outln!(
                        "{:<40} {:<16} {:>9.1}s {:>8} {:>10}",
                        job.job_id,
                        job.tenant,
                        job.expires_in_ms as f64 / 1000.0,
                        job.files,
                        show::size(job.bytes)
                    );
                }
            }
        }
        AdminCommand::EndJob { job, json } => {
            let ended = client.end_job_as_admin(&job).await?;
            if json {
                show::print_json(&json!({
                    "job_id": job,
                    "files_deleted": ended.files_deleted,
                    "blocks_freed": ended.blocks_freed,
                }));
            } else {
                outln!(
                    "job {job} ended: {} deleted, {} freed",
                    tern_common::text::count(ended.files_deleted, "file"),
                    tern_common::text::count(ended.blocks_freed, "block")
                );
            }
        }
        AdminCommand::Metadata { command } => {
            let (members, json, done) = match command {
                MetadataCommand::Members { json } => (client.metadata_members().await?, json, None),
                MetadataCommand::Add { id, address, json } => {
                    let added = client.add_metadata_member(id, &address).await?;
                    (added, json, Some(format!("member {id} at {address} added: it votes")))
                }
                MetadataCommand::Remove { id, json } => (
                    client.remove_metadata_member(id).await?,
                    json,
                    Some(format!("member {id} removed: stop that metadata server now")),
                ),
            };
            if json {
                show::print_json(&show::members_json(&members));
            } else {
                if let Some(done) = done {
                    outln!("{done}");
                }
                show::print_members(&members);
            }
        }
        AdminCommand::UnregisterShuffle { shuffle, json } => {
            client.unregister_shuffle(shuffle).await?;
            if json {
                show::print_json(&json!({ "shuffle_id": show::id(shuffle), "unregistered": true }));
            } else {
                outln!("shuffle {shuffle} unregistered: its segments are being freed");
            }
        }
    }
    Ok(())
}

/// The server `name` names (its id or address), from the cluster's status.
async fn find(client: &Client, name: &str) -> anyhow::Result<ServerStatus> {
    let servers = client.status().await?.servers;
    let name = name.trim();
    servers.into_iter().find(|s| s.server_id.to_string() == name || s.address == name).with_context(|| {
        format!("no storage server {name:?} (give its id or its address, as `tern admin servers` lists them)")
    })
}

/// Polls until the drained server is told to exit, printing (to stderr) what the drain still
/// waits for whenever that changes; bounded by the drain's deadline and a margin.
async fn wait_drained(client: &Client, mut server: ServerStatus, quiet: bool) -> anyhow::Result<ServerStatus> {
    let give_up = Instant::now() + Duration::from_millis(server.drain_deadline_ms) + DRAIN_WAIT_MARGIN;
    let name = server.server_id.to_string();
    let mut last = String::new();
    while !server.drained {
        if server.state == "dead" {
            bail!("storage server {name} ({}) died while draining", server.address);
        }
        if server.state != "draining" {
            bail!("storage server {name} ({}) is {} now: its drain was undone", server.address, server.state);
        }
        if !quiet && server.drain_waiting_for != last {
            eprintln!("draining storage server {name}: waiting for {}", server.drain_waiting_for);
            last = server.drain_waiting_for.clone();
        }
        if Instant::now() > give_up {
            bail!("storage server {name} is still draining after its deadline; is the metadata server reaping?");
        }
        tokio::time::sleep(DRAIN_POLL).await;
        server = find(client, &name).await?;
    }
    Ok(server)
}

fn report(server: &ServerStatus, json: bool, what: &str) {
    if json {
        show::print_json(&show::server_json(server));
    } else {
        outln!("storage server {} ({}) {what}", server.server_id, server.address);
    }
}

fn print_servers(servers: &[ServerStatus]) {
    outln!(
        "{:<6} {:<22} {:<8} {:>10} {:>10} {:>8} {:>8} {:>10}",
        "SERVER",
        "ADDRESS",
        "STATE",
        "DRAM",
        "NVME",
        "BLOCKS",
        "SEGMENTS",
        "HEARTBEAT"
    );
    for s in servers {
        let tier = |name: &str| {
            s.tiers
                .iter()
                .find(|t| t.tier == name)
                .map_or("-".to_string(), |t| format!("{}/{}", show::size(t.used_bytes), show::size(t.capacity_bytes)))
        };
        outln!(
            "{:<6} {:<22} {:<8} {:>10} {:>10} {:>8} {:>8} {:>9.1}s",
            s.server_id,
            s.address,
            show::server_state(s),
            tier("dram"),
            tier("nvme"),
            s.allocated_blocks,
            s.segments,
            s.last_heartbeat_ms_ago as f64 / 1000.0
        );
    }
}

fn print_server(s: &ServerStatus) {
    outln!("server:          {}", s.server_id);
    outln!("address:         {}", s.address);
    outln!("quic address:    {}", if s.quic_address.is_empty() { "-" } else { &s.quic_address });
    outln!("state:           {}", show::server_state(s));
    outln!("last heartbeat:  {:.1}s ago", s.last_heartbeat_ms_ago as f64 / 1000.0);
    outln!("blocks:          {} (placed, not yet freed)", s.allocated_blocks);
    outln!("shuffle segments: {}", s.segments);
    for t in &s.tiers {
        outln!(
            "tier {:<5}       {} of {} used ({}/{} blocks){}",
            t.tier,
            show::size(t.used_bytes),
            show::size(t.capacity_bytes),
            t.used_blocks,
            t.capacity_blocks,
            if t.engine.is_empty() { String::new() } else { format!(", io engine {}", t.engine) }
        );
    }
    if show::server_state(s) == "draining" {
        let waiting = if s.drain_waiting_for.is_empty() { "nothing" } else { &s.drain_waiting_for };
        outln!("drain:           waiting for {waiting}; deadline in {:.0}s", s.drain_deadline_ms as f64 / 1000.0);
        if s.drained {
            outln!("                 told to exit");
        }
    }
}
