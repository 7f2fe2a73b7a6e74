//! `tern status`: the cluster at a glance.

use clap::Args;

use crate::cli::MetadataAddr;
use crate::show;

#[derive(Args)]
pub struct StatusArgs {
    #[command(flatten)]
    metadata: MetadataAddr,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: StatusArgs) -> anyhow::Result<()> {
    let client = args.metadata.connect().await?;
    let status = client.status().await?;
    let members = client.metadata_members().await?;
    if args.json {
        show::print_json(&show::status_json(&status, &members));
        return Ok(());
    }
    let alive = status.servers.iter().filter(|s| s.alive).count();
    outln!(
        "cluster: block size {}, {} ({alive} alive), {}{}, {}, {}",
        show::size(status.block_size as u64),
        tern_common::text::count(status.servers.len() as u64, "storage server"),
        tern_common::text::count(status.files, "file"),
        match status.lost_files {
            0 => String::new(),
            lost => format!(" ({lost} with lost blocks: tern fs ls -l shows them `lost`)"),
        },
        tern_common::text::count(status.directories, "directory"),
        tern_common::text::count(status.jobs.len() as u64, "job")
    );
    show::print_members(&members);
    outln!();
    outln!(
        "{:<6} {:<22} {:<8} {:<5} {:<6} {:>10} {:>10} {:>10} {:>5} {:>15} {:>10}",
        "SERVER",
        "ADDRESS",
        "STATE",
        "TIER",
        "ENGINE",
        "USED",
        "SHUFFLE",
        "CAPACITY",
        "USE%",
        "BLOCKS",
        "HEARTBEAT"
    );
    for server in &status.servers {
        // Cordoned and draining servers are alive, and take nothing new.
        let state = show::server_state(server);
        let heartbeat = format!("{:.1}s ago", server.last_heartbeat_ms_ago as f64 / 1000.0);
        for tier in &server.tiers {
            let percent = if tier.capacity_bytes == 0 {
                0.0
            } else {
                100.0 * tier.used_bytes as f64 / tier.capacity_bytes as f64
            };
            outln!(
                "{:<6} {:<22} {:<8} {:<5} {:<6} {:>10} {:>10} {:>10} {:>4.0}% {:>15} {:>10}",
                server.server_id,
                server.address,
                state,
                tier.tier,
                if tier.engine.is_empty() { "-" } else { tier.engine.as_str() },
                show::size(tier.used_bytes),
                show::size(tier.shuffle_bytes),
                show::size(tier.capacity_bytes),
                percent,
                format!("{}/{}", tier.used_blocks, tier.capacity_blocks),
                heartbeat
            );
        }
    }
    let copies = status.copies.unwrap_or_default();
    let segments = copies.pending_segments + copies.copied_segments + copies.failed_segments;
    if copies.pending_blocks + copies.copied_blocks + copies.failed_blocks + segments > 0 {
        let limit = match copies.limit_bytes_per_sec {
            0 => "no limit".to_string(),
            limit => format!("limit {}/s", show::size(limit)),
        };
        // Shuffle segments are named once there have been any (their bytes count with blocks').
        let count = |blocks: u64, segments_of_kind: u64| match segments {
            0 => format!("{blocks} blocks"),
            _ => format!("{blocks} blocks and {segments_of_kind} shuffle segments"),
        };
        let failed = match segments {
            0 => copies.failed_blocks.to_string(),
            _ => count(copies.failed_blocks, copies.failed_segments),
        };
        outln!();
        outln!(
            "copies (re-replication, drains): {} ({}) pending, {} ({}) copied, {failed} failed; {}/s over the last \
             10 s ({limit})",
            count(copies.pending_blocks, copies.pending_segments),
            show::size(copies.pending_bytes),
            count(copies.copied_blocks, copies.copied_segments),
            show::size(copies.copied_bytes),
            show::size(copies.recent_bytes_per_sec),
        );
    }
    for server in status.servers.iter().filter(|s| show::server_state(s) == "draining") {
        let waiting = match server.drain_waiting_for.as_str() {
            "" => "nothing: told to exit".to_string(),
            waiting => waiting.to_string(),
        };
        outln!(
            "draining {} ({}): waiting for {waiting}; {} copies pending; deadline in {:.0}s",
            server.server_id,
            server.address,
            server.copies_pending,
            server.drain_deadline_ms as f64 / 1000.0
        );
    }
    if !status.jobs.is_empty() {
        outln!();
        outln!("{:<40} {:<16} {:>8} {:>10} {:>12}", "JOB", "TENANT", "FILES", "BYTES", "EXPIRES IN");
        for job in &status.jobs {
            outln!(
                "{:<40} {:<16} {:>8} {:>10} {:>11.1}s",
                job.job_id,
                job.tenant,
                job.files,
                show::size(job.bytes),
                job.expires_in_ms as f64 / 1000.0
            );
        }
    }
    if !status.tenants.is_empty() {
        // Used (of which shuffles) / limit.
        let of = |used: u64, shuffles: u64, limit: u64| {
            let limit = if limit == 0 { "-".to_string() } else { show::size(limit) };
            format!("{} ({})/{limit}", show::size(used), show::size(shuffles))
        };
        outln!();
        outln!("{:<24} {:>10} {:>30} {:>30}", "TENANT", "JOBS", "DRAM (SHUFFLES)/LIMIT", "NVME (SHUFFLES)/LIMIT");
        for t in &status.tenants {
            let jobs = match t.max_jobs {
                0 => format!("{}/-", t.jobs),
                max => format!("{}/{max}", t.jobs),
            };
            outln!(
                "{:<24} {:>10} {:>30} {:>30}",
                t.tenant,
                jobs,
                of(t.dram_bytes, t.dram_shuffle_bytes, t.dram_limit_bytes),
                of(t.nvme_bytes, t.nvme_shuffle_bytes, t.nvme_limit_bytes)
            );
        }
    }
    Ok(())
}
