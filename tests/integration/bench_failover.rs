//! `tern bench failover` with few kills, so the failover benchmark cannot rot: each kill's
//! leader is one of the replicas, its failover time is a real interval, the replica it killed
//! caught up, and every answered create was there at the end.

use std::process::Command;

const TERN: &str = env!("CARGO_BIN_EXE_tern");

#[test]
fn three_kills_of_the_leader_are_each_timed_and_lose_nothing() {
    let out = Command::new(TERN).args(["bench", "failover", "--kills", "3", "--json"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "tern bench failover failed:\n{stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let kills = report["kills"].as_array().unwrap();
    assert_eq!(kills.len(), 3, "{stdout}");
    for kill in kills {
        assert!((1..=3).contains(&kill["replica"].as_u64().unwrap()), "{kill}");
        let failover = kill["failover_seconds"].as_f64().unwrap();
        // Bounded by the bench's own 60 s per round; an election cannot end before the leader's
        // lease (1.2 s) has run out on a follower.
        assert!(failover > 0.5 && failover < 60.0, "{kill}");
        assert!(kill["rejoin_seconds"].as_f64().unwrap() >= failover, "{kill}");
    }
    assert_eq!(report["missing"].as_array().unwrap().len(), 0, "{stdout}");
    // Two creates a round: one before the kill, the first answered after it.
    assert_eq!(report["acknowledged_creates"].as_u64(), Some(6), "{stdout}");
    assert!(report["failover_max_seconds"].as_f64() >= report["failover_p50_seconds"].as_f64(), "{stdout}");
    assert!(stderr.contains("kill 3/3: metadata-"), "progress lines name each kill:\n{stderr}");
}
