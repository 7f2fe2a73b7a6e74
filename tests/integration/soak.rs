//! `tern bench soak` as the real binary: 64 concurrent clients doing mixed file and shuffle work
//! for 60 s on a cluster whose tiers fill. Zero unexpected errors, storage-server memory within
//! its DRAM tier plus the bound, and the cluster really pushed back (the tiers filled), with the
//! work still getting done.

use std::process::Command;

const TERN: &str = env!("CARGO_BIN_EXE_tern");

#[test]
fn sixty_seconds_of_64_clients_push_back_and_never_fail() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = Command::new(TERN)
        .args(["bench", "soak", "--clients", "64", "--duration", "60s", "--json"])
        // An NVMe tier too, so NVMe-class files are in the mix.
        .args(["--nvme", "32MiB"])
        .arg("--dir")
        .arg(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: serde_json::Value = stdout
        .lines()
        .last()
        .and_then(|line| serde_json::from_str(line).ok())
        .unwrap_or_else(|| panic!("no JSON report (exit {}):\n{stdout}\n{stderr}", out.status));
    let get = |field: &str| report[field].as_u64().unwrap_or_else(|| panic!("{field} missing: {report}"));
    assert_eq!(get("unexpected_errors"), 0, "{report}");
    assert!(report["within_bound"].as_bool().unwrap(), "{report}");
    assert!(get("peak_rss_beyond_dram_bytes") <= get("rss_bound_bytes"), "{report}");
    assert!(get("rss_samples") > 100, "memory was hardly sampled: {report}");
    // The tiers filled: the cluster said so instead of failing.
    assert!(get("pushbacks_total") > 0, "no pushback: the tiers never filled: {report}");
    // And the work went on all the same: every kind of operation, many times.
    for op in ["put", "get", "stat", "list", "delete", "job", "shuffle"] {
        let count = report["ops"][op].as_u64().unwrap_or(0);
        assert!(count >= 10, "only {count} {op} operations: {report}");
    }
    assert!(report["bytes_verified"].as_u64().unwrap() > 0, "{report}");
    assert!(out.status.success(), "tern bench soak failed:\n{stdout}\n{stderr}");
}
