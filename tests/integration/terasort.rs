//! Native TeraSort end to end: gensort layout, valsort checks, and a whole sort that validates.

use crate::common;

use std::process::Command;

use common::{Cluster, Nvme, TERN};

/// The fields of gensort record `n` that depend on its number alone (gensort 1.5, binary mode).
fn fixed_fields(n: u64) -> (Vec<u8>, [u8; 4], [u8; 4]) {
    let mut middle = vec![0x00, 0x11];
    middle.extend_from_slice(format!("{n:032X}").as_bytes());
    (middle, [0x88, 0x99, 0xAA, 0xBB], [0xCC, 0xDD, 0xEE, 0xFF])
}

#[test]
fn teragen_writes_the_gensort_layout_and_teravalidate_checks_order() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("input");
    let generated = Command::new(TERN)
        .args(["teragen", "--size", "100000", "--parts", "3", "--local", "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(generated.status.success(), "{}", String::from_utf8_lossy(&generated.stderr));
    let mut names: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().path()).collect();
    names.sort();
    assert_eq!(names.len(), 3);
    let data: Vec<u8> = names.iter().flat_map(|p| std::fs::read(p).unwrap()).collect();
    assert_eq!(data.len(), 100_000);
    for (n, record) in data.chunks_exact(100).enumerate() {
        let (middle, brk, tail) = fixed_fields(n as u64);
        assert_eq!(&record[10..44], &middle[..], "record {n}: bytes 10-43");
        assert_eq!(&record[44..48], &brk, "record {n}: bytes 44-47");
        assert_eq!(&record[96..100], &tail, "record {n}: bytes 96-99");
    }
    // Generated records are in random key order: valsort says so, and fails.
    let checked = Command::new(TERN).args(["teravalidate", "--local", out.to_str().unwrap()]).output().unwrap();
    assert!(!checked.status.success());
    let report = String::from_utf8_lossy(&checked.stdout);
    assert!(report.contains("Records: 1000"), "{report}");
    assert!(String::from_utf8_lossy(&checked.stderr).contains("out of order"));

    // The same parts sorted (by a plain in-test sort) validate, with the same checksum.
    let mut records: Vec<&[u8]> = data.chunks_exact(100).collect();
    records.sort_by(|a, b| a[..10].cmp(&b[..10]));
    let sorted_dir = dir.path().join("sorted");
    std::fs::create_dir(&sorted_dir).unwrap();
    std::fs::write(sorted_dir.join("part-00000"), records[..400].concat()).unwrap();
    std::fs::write(sorted_dir.join("part-00001"), records[400..].concat()).unwrap();
    let json = |path: &std::path::Path| -> serde_json::Value {
        let out =
            Command::new(TERN).args(["teravalidate", "--local", "--json", path.to_str().unwrap()]).output().unwrap();
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let (unsorted, sorted) = (json(&out), json(&sorted_dir));
    assert_eq!(sorted["sorted"], true);
    assert_eq!(unsorted["sorted"], false);
    assert_eq!(sorted["checksum"], unsorted["checksum"], "order does not change the checksum");
    assert_eq!(sorted["records"], 1000);
}

#[test]
fn a_64_mib_terasort_through_the_shuffle_service_validates() {
    let out = Command::new(TERN).args(["terasort", "--size", "64MiB", "--json"]).output().unwrap();
    assert!(out.status.success(), "terasort failed: {}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["records"], (64u64 << 20) / 100);
    assert_eq!(report["bytes"], (64u64 << 20) / 100 * 100);
    assert_eq!(report["sorted"], true);
    assert_eq!(report["input_checksum"], report["output_checksum"]);
    for phase in ["teragen", "map", "reduce", "validate"] {
        assert!(report["phases"][phase].as_f64().unwrap() > 0.0, "{phase}");
    }
    assert!(report["sort_mb_per_s"].as_f64().unwrap() > 0.0);
}

/// `tern terasort --json` against `metadata` with `extra` flags: its report, once it validated,
/// and what it said on stderr (each failed attempt and why).
fn sort_on(metadata: &str, size: &str, extra: &[&str]) -> (serde_json::Value, String) {
    let out = Command::new(TERN)
        .args(["terasort", "--size", size, "--metadata", metadata, "--json"])
        .args(extra)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "terasort {extra:?} failed: {said}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["sorted"], true, "{report}");
    assert_eq!(report["input_checksum"], report["output_checksum"], "{report}");
    (report, said)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sort_larger_than_the_clusters_dram_and_its_reduces_memory_spills_to_nvme_and_disk_and_validates() {
    // 48 MiB of DRAM in all for 128 MiB of input, shuffle and output: only NVMe can hold them.
    let cluster = Cluster::start_with_nvme(2, "24MiB", Nvme { size: "512MiB", engine: "auto" }).await;
    for class in ["any", "nvme"] {
        // The first one's reduces also sort beyond their memory: 64 MiB partitions in 16 MiB.
        let memory: &[&str] = if class == "any" { &["--reduce-memory", "16MiB"] } else { &[] };
        let (report, said) = tokio::task::block_in_place(|| {
            sort_on(&cluster.metadata_addr, "128MiB", &[&["--shuffle-class", class], memory].concat())
        });
        assert_eq!(report["shuffle_class"], class);
        let runs = report["sort_runs"].as_u64().unwrap();
        assert!(if memory.is_empty() { runs == 0 } else { runs >= 2 * 13 }, "{runs} sorted runs");
        // No map ran out of space and tried again: the shuffle went down to NVMe as it came.
        // What was refused, and why, if one did: the driver says so for each failed attempt.
        let failed: Vec<&str> = said.lines().filter(|line| line.contains("failed")).collect();
        assert_eq!(
            (report["task_retries"].as_u64(), report["maps_recomputed"].as_u64()),
            (Some(0), Some(0)),
            "{failed:#?}\n{}",
            cluster.logs()
        );
    }
    // A dram shuffle that cannot fit is refused, naming the tier.
    let out = Command::new(TERN)
        .args(["terasort", "--size", "128MiB", "--metadata", &cluster.metadata_addr, "--shuffle-class", "dram"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("dram tier full") && err.contains("out-of-space"), "{err}");
}
