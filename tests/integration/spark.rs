//! Tern's Spark shuffle plugin on real Spark: spark-shuffle/tests/spark_suite.py runs RDD, JVM
//! and SQL shuffles (AQE coalescing and skew splitting forced) on Spark's built-in shuffle and on
//! Tern and fails on any difference; then a TeraSort validated as `tern teravalidate` does; Spark's
//! shuffle cleanup and the application's end leaving no bytes in Tern; a storage server killed
//! between a shuffle's map and reduce stages, recovered by one map-stage retry that reruns exactly
//! the lost maps; and a second driver with dynamic allocation (executors released between two
//! reads of one shuffle) that is SIGKILLed, its data freed when its job lease lapses.
//!
//! Needs python3 and a JDK (javac, jar); installs pyspark==3.5.3 with pip if it is missing.

use crate::common;

use std::path::Path;
use std::process::Command;

use common::{Cluster, TERN};

fn ensure_pyspark() {
    let has = |version: &str| {
        Command::new("python3")
            .args(["-c", &format!("import pyspark, sys; sys.exit(pyspark.__version__ != '{version}')")])
            .status()
            .is_ok_and(|s| s.success())
    };
    if has("3.5.3") {
        return;
    }
    let status = Command::new("python3")
        .args(["-m", "pip", "install", "--user", "--quiet", "pyspark==3.5.3", "py4j==0.10.9.7"])
        .status()
        .expect("running pip");
    assert!(status.success() && has("3.5.3"), "installing pyspark==3.5.3 failed");
}

fn build_plugin(root: &Path) -> String {
    let out = Command::new(root.join("spark-shuffle/build.sh")).output().expect("running spark-shuffle/build.sh");
    assert!(out.status.success(), "spark-shuffle/build.sh failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().lines().last().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spark_jobs_on_tern_match_the_builtin_shuffle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ensure_pyspark();
    let jar = build_plugin(root);
    let cluster = Cluster::start(3, "512MiB").await;
    let work = tempfile::tempdir().unwrap();
    let suite = root.join("spark-shuffle/tests/spark_suite.py");
    let out = tokio::process::Command::new("python3")
        .arg(&suite)
        .env("TERN_METADATA", &cluster.metadata_addr)
        .env("TERN_SPARK_JAR", &jar)
        .env("TERN_BIN", TERN)
        .env("TERN_KILL_PID", cluster.storage_pid(0).to_string())
        .env("TERN_WORK", work.path())
        .output()
        .await
        .expect("running the Spark suite");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "the Spark suite failed:\n{stdout}\n--- stderr (tail) ---\n{}\n{}",
        tail(&String::from_utf8_lossy(&out.stderr), 200),
        tail(&cluster.logs(), 60)
    );
    assert!(stdout.contains("all Spark cases agree"), "{stdout}");
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
