//! `tern bench scale` at tiny sizes, so the scale model cannot rot: two steps, its JSON has every
//! figure of each step, and `--plot` draws an SVG.

use std::process::Command;

const TERN: &str = env!("CARGO_BIN_EXE_tern");

#[test]
fn tiny_steps_report_every_figure() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let plot = dir.path().join("scale.svg");
    let out = Command::new(TERN)
        .args(["bench", "scale", "--servers", "2,4", "--blocks", "3000", "--jobs", "8", "--maps", "8"])
        .args(["--partitions", "6", "--samples", "20", "--probe-rate", "500", "--heartbeat-rate", "200", "--json"])
        .arg("--dir")
        .arg(dir.path())
        .arg("--plot")
        .arg(&plot)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "tern bench scale failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let steps = report["steps"].as_array().unwrap();
    let servers: Vec<u64> = steps.iter().map(|s| s["servers"].as_u64().unwrap()).collect();
    assert_eq!(servers, [2, 4], "{stdout}");
    // The smaller step has half of everything; the largest has what the flags say.
    assert_eq!(steps[1]["blocks"].as_u64(), Some(3000), "{stdout}");
    assert_eq!(steps[0]["blocks"].as_u64(), Some(1500), "{stdout}");
    assert_eq!(steps[1]["committed_lengths"].as_u64(), Some(48), "{stdout}");
    for step in steps {
        for kind in ["create_allocate_seal", "allocate", "open", "register_shuffle", "commit_map", "heartbeat"] {
            let latency = &step[kind];
            let (p50, p99) = (latency["p50_us"].as_f64().unwrap(), latency["p99_us"].as_f64().unwrap());
            assert!(p50 > 0.0 && p50 <= p99, "{kind}: {latency}");
        }
        assert_eq!(step["create_allocate_seal"]["samples"].as_u64(), Some(20), "{step}");
        for figure in ["bytes_per_block", "bytes_per_job", "bytes_per_committed_length", "heartbeat_server_us"] {
            assert!(step[figure].as_f64().is_some_and(|v| v.is_finite() && v >= 0.0), "{figure}: {step}");
        }
        assert!(step["snapshot_bytes"].as_u64().unwrap() > 0, "no snapshot: {step}");
        assert!(step["restart_seconds"].as_f64().unwrap() > 0.0, "{step}");
    }
    assert!(report["raised"].as_array().unwrap().iter().any(|r| r.as_str().unwrap().starts_with("server_timeout_ms")));
    assert!(std::fs::read_to_string(&plot).unwrap().starts_with("<svg"), "--plot did not draw an SVG");
}
