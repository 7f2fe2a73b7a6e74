//! `tern bench io` in its quickest form on a real `tern up` cluster: its JSON Lines follow the
//! schema exactly (field names and types, one line per cell, op values), and Redis rows are there
//! whenever redis-server is (CI installs it and sets TERN_TEST_REQUIRE_REDIS=1, so they must be).

use std::collections::BTreeSet;
use std::process::Command;

const TERN: &str = env!("CARGO_BIN_EXE_tern");

const FIELDS: [&str; 13] = tern_bench::io::CellResult::JSON_FIELDS;

fn redis_on_path() -> bool {
    std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).any(|dir| dir.join("redis-server").is_file()))
        .unwrap_or(false)
}

#[test]
fn quick_run_writes_json_lines_of_the_schema() {
    let require_redis = std::env::var("TERN_TEST_REQUIRE_REDIS").is_ok_and(|v| v == "1");
    let with_redis = redis_on_path();
    assert!(with_redis || !require_redis, "TERN_TEST_REQUIRE_REDIS=1 but redis-server is not on PATH");
    let systems = if with_redis {
        "tern-tcp,tern-tls,tern-quic,tern-nvme,tern-local,tcp-raw,tls-raw,quic-raw,redis,file,file-direct"
    } else {
        "tern-tcp,tern-tls,tern-quic,tern-nvme,tern-local,tcp-raw,tls-raw,quic-raw,file,file-direct"
    };
    // O_DIRECT (tern-nvme, file-direct) needs a disk filesystem: the target dir is on one.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let json = dir.path().join("io.jsonl");
    let plot = dir.path().join("io.svg");
    let out = Command::new(TERN)
        .args(["bench", "io", "--quick", "--systems", systems, "--seconds", "0.1", "--warmup", "0.02"])
        .args(["--max-bytes", "64MiB", "--dram", "512MiB", "--no-progress"])
        .arg("--dir")
        .arg(dir.path())
        .arg("--json")
        .arg(&json)
        .arg("--plot")
        .arg(&plot)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "tern bench io failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));

    let text = std::fs::read_to_string(&json).unwrap();
    let mut cells = BTreeSet::new();
    for line in text.lines() {
        let value: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        let object = value.as_object().unwrap_or_else(|| panic!("not an object: {line}"));
        let keys: BTreeSet<&str> = object.keys().map(String::as_str).collect();
        assert_eq!(keys, FIELDS.into_iter().collect::<BTreeSet<_>>(), "{line}");
        let system = object["system"].as_str().unwrap_or_else(|| panic!("system is not a string: {line}"));
        let op = object["op"].as_str().unwrap_or_else(|| panic!("op is not a string: {line}"));
        assert!(op == "write" || op == "read", "{line}");
        for field in ["size_bytes", "concurrency", "ops"] {
            assert!(object[field].is_u64(), "{field} is not an unsigned integer: {line}");
        }
        for field in ["seconds", "throughput_mib_s", "throughput_min_mib_s", "throughput_max_mib_s", "p50_us"] {
            assert!(object[field].as_f64().is_some_and(|v| v.is_finite() && v >= 0.0), "{field}: {line}");
        }
        assert!(object["ops"].as_u64().unwrap() > 0, "a cell measured no op: {line}");
        assert_eq!(object["runs"].as_u64(), Some(3), "three runs by default: {line}");
        let p = |f: &str| object[f].as_f64().unwrap();
        assert!(
            p("throughput_min_mib_s") <= p("throughput_mib_s") && p("throughput_mib_s") <= p("throughput_max_mib_s")
        );
        // A tail percentile is null when the runs had too few samples for it, never the maximum.
        let tail = |f: &str| match &object[f] {
            serde_json::Value::Null => None,
            v => Some(v.as_f64().unwrap_or_else(|| panic!("{f} is neither null nor a number: {line}"))),
        };
        assert!(p("p50_us") > 0.0, "{line}");
        if let Some(p99) = tail("p99_us") {
            assert!(p("p50_us") <= p99 && tail("p999_us").is_none_or(|p999| p99 <= p999), "{line}");
        }
        let cell = (
            system.to_string(),
            op.to_string(),
            object["size_bytes"].as_u64().unwrap(),
            object["concurrency"].as_u64().unwrap(),
        );
        assert!(cells.insert(cell), "two lines for one cell: {line}");
    }
    let mut want = BTreeSet::new();
    for system in systems.split(',') {
        for op in ["write", "read"] {
            for (size, concurrency) in [(1u64 << 20, 4u64), (4 << 10, 1)] {
                want.insert((system.to_string(), op.to_string(), size, concurrency));
            }
        }
    }
    assert_eq!(cells, want, "one line per (system, op, size, concurrency) of --quick");
    assert!(stdout.contains("x redis") && stdout.contains("x raw") && stdout.contains("tern-tls"), "{stdout}");
    if with_redis {
        assert!(stdout.contains("redis-benchmark GET 1MiB x4: "), "no check against redis-benchmark:\n{stdout}");
    }
    assert!(std::fs::read_to_string(&plot).unwrap().starts_with("<svg"), "--plot did not draw an SVG");
}

#[test]
fn redis_missing_says_how_to_install_it() {
    let out = Command::new(TERN)
        .args(["bench", "io", "--quick", "--systems", "redis,file"])
        .env("PATH", "")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("apt-get install redis-server"), "{stderr}");
}
