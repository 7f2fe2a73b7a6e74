//! Turning cluster answers into text for people and JSON for programs.
//!
//! The `--json` convention, the same for every command (README, "JSON output"): stdout carries
//! one JSON document on one line and nothing else; a list is an array of objects, anything else
//! one object; ids are strings ([`id`]), counts, bytes and times numbers.

use serde_json::{json, Value};
use tern_client::{BlockLocation, EntryKind, FileInfo, ServerStatus, StatusResponse};
use tern_common::ByteSize;
use tern_proto::v1::{MetadataMember, MetadataMembersResponse};

/// An id in JSON: a string, since ids reach past 2^53 (NVMe block ids carry a high bit, shuffle
/// ids start from the clock), beyond the integers JavaScript and jq hold exactly.
pub fn id(id: u64) -> Value {
    Value::String(id.to_string())
}

/// Prints a `--json` answer: one document, one line.
pub fn print_json(value: &Value) {
    outln!("{value}");
}

/// A storage server's state as `tern status` and `tern admin` show it.
pub fn server_state(server: &ServerStatus) -> &str {
    match server.state.as_str() {
        "" if server.alive => "alive",
        "" => "dead",
        state => state,
    }
}

pub fn server_json(s: &ServerStatus) -> Value {
    json!({
        "server_id": id(s.server_id),
        "address": s.address,
        "quic_address": s.quic_address,
        "alive": s.alive,
        "state": server_state(s),
        "allocated_blocks": s.allocated_blocks,
        "segments": s.segments,
        "last_heartbeat_ms_ago": s.last_heartbeat_ms_ago,
        "drain_waiting_for": s.drain_waiting_for,
        "drain_deadline_ms": s.drain_deadline_ms,
        "drained": s.drained,
        "sole_copy_blocks": s.sole_copy_blocks,
        "copies_pending": s.copies_pending,
        "tiers": s.tiers.iter().map(|t| json!({
            "tier": t.tier,
            "capacity_bytes": t.capacity_bytes,
            "used_bytes": t.used_bytes,
            "capacity_blocks": t.capacity_blocks,
            "used_blocks": t.used_blocks,
            "engine": t.engine,
        })).collect::<Vec<_>>(),
    })
}

pub fn size(bytes: u64) -> String {
    ByteSize(bytes).human()
}

/// What `fs ls -l` calls an entry: its kind, or `lost` for a file with a lost block.
pub fn listed_kind(info: &FileInfo) -> &'static str {
    if info.lost_blocks > 0 {
        "lost"
    } else {
        kind_name(info)
    }
}

pub fn kind_name(info: &FileInfo) -> &'static str {
    match info.kind() {
        EntryKind::Directory => "dir",
        EntryKind::File if info.sealed => "file",
        EntryKind::File => "writing",
        EntryKind::Unspecified => "?",
    }
}

pub fn file_json(info: &FileInfo) -> Value {
    json!({
        "path": info.path,
        "kind": kind_name(info),
        "length": info.length,
        "sealed": info.sealed,
        "file_id": id(info.file_id),
        "block_count": info.block_count,
        "created_unix_ms": info.created_unix_ms,
        "job": info.job,
        "storage_class": info.storage_class,
        "replicas": info.replicas,
        "lost_blocks": info.lost_blocks,
    })
}

pub fn block_json(block: &BlockLocation, alive: bool) -> Value {
    json!({
        "block_id": id(block.block_id),
        "tier": tern_client::Tier::of_block(block.block_id).name(),
        "server_id": id(block.server_id),
        "address": block.address,
        "quic_address": block.quic_address,
        "length": block.length,
        "alive": alive,
    })
}

pub fn status_json(status: &StatusResponse, members: &MetadataMembersResponse) -> Value {
    json!({
        "metadata": members_json(members),
        "block_size": status.block_size,
        "files": status.files,
        "lost_files": status.lost_files,
        "directories": status.directories,
        "servers": status.servers.iter().map(server_json).collect::<Vec<_>>(),
        "jobs": status.jobs.iter().map(job_json).collect::<Vec<_>>(),
        "copies": copies_json(&status.copies.unwrap_or_default()),
        // Limits of 0 are unlimited; bytes are files' blocks and shuffles together.
        "tenants": status.tenants.iter().map(|t| json!({
            "tenant": t.tenant,
            "jobs": t.jobs,
            "max_jobs": t.max_jobs,
            "dram_bytes": t.dram_bytes,
            "dram_shuffle_bytes": t.dram_shuffle_bytes,
            "dram_limit_bytes": t.dram_limit_bytes,
            "nvme_bytes": t.nvme_bytes,
            "nvme_shuffle_bytes": t.nvme_shuffle_bytes,
            "nvme_limit_bytes": t.nvme_limit_bytes,
        })).collect::<Vec<_>>(),
    })
}

/// The metadata service's members (`tern admin metadata members`); `replicated: false` and
/// no members for a single metadata server.
pub fn members_json(m: &MetadataMembersResponse) -> Value {
    json!({
        "replicated": m.replicated,
        "term": m.term,
        "last_log_index": m.last_log_index,
        "members": m.members.iter().map(|member| json!({
            "id": member.id,
            "address": member.addr,
            "voter": member.voter,
            "leader": member.leader,
            "matched_index": member.matched_index,
            "behind": behind(m, member),
        })).collect::<Vec<_>>(),
    })
}

/// How many log entries `member` is behind the leader; None while the leader does not know.
fn behind(m: &MetadataMembersResponse, member: &MetadataMember) -> Option<u64> {
    member.matched_index.map(|matched| m.last_log_index.saturating_sub(matched))
}

/// The members as a table, or one line for a single metadata server.
pub fn print_members(m: &MetadataMembersResponse) {
    if !m.replicated {
        outln!("metadata: one server, not replicated");
        return;
    }
    outln!(
        "metadata: {} (term {}, log at {})",
        tern_common::text::count(m.members.len() as u64, "member"),
        m.term,
        m.last_log_index
    );
    outln!("{:<6} {:<22} {:<8} {:<7} {:>8}", "MEMBER", "ADDRESS", "ROLE", "LEADER", "BEHIND");
    for member in &m.members {
        let behind = behind(m, member).map_or("unknown".to_string(), |entries| entries.to_string());
        outln!(
            "{:<6} {:<22} {:<8} {:<7} {:>8}",
            member.id,
            member.addr,
            if member.voter { "voter" } else { "learner" },
            if member.leader { "yes" } else { "" },
            behind
        );
    }
}

/// Re-replication and drain copies of blocks and shuffle segments (counts since the metadata
/// server started; bytes of both kinds together; rates in bytes per second, the limit 0 when
/// there is none).
pub fn copies_json(c: &tern_proto::v1::CopyStatus) -> Value {
    json!({
        "pending_blocks": c.pending_blocks,
        "pending_bytes": c.pending_bytes,
        "copied_blocks": c.copied_blocks,
        "copied_bytes": c.copied_bytes,
        "failed_blocks": c.failed_blocks,
        "recent_bytes_per_sec": c.recent_bytes_per_sec,
        "limit_bytes_per_sec": c.limit_bytes_per_sec,
        "pending_segments": c.pending_segments,
        "copied_segments": c.copied_segments,
        "failed_segments": c.failed_segments,
    })
}

pub fn job_json(j: &tern_client::JobStatus) -> Value {
    json!({
        "job_id": j.job_id,
        "tenant": j.tenant,
        "lease_ms": j.lease_ms,
        "expires_in_ms": j.expires_in_ms,
        "files": j.files,
        "bytes": j.bytes,
    })
}

/// "2026-11-21 07:35:12" (UTC) from milliseconds since the epoch.
pub fn utc_time(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_time_matches_known_dates() {
        assert_eq!(super::utc_time(0), "1970-01-01 00:00:00");
        assert_eq!(super::utc_time(951_782_400_000), "2000-02-29 00:00:00");
        assert_eq!(super::utc_time(1_795_305_600_000 + 3_723_000), "2026-11-22 01:02:03");
    }
}
