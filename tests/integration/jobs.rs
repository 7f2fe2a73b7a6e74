//! `tern scheduler` and the `tern job` commands as processes, with no executor: submit, status,
//! list, cancel, refusals. Running jobs on real executors is tested with `tern executor`.

use crate::common;

use std::time::Duration;

use serde_json::Value;

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

const JOB: &str = r#"
name = "demo"
queue = "batch"
[[shuffles]]
name = "data"
partitions = 2
[[stages]]
name = "map"
command = ["sh", "-c", "true"]
tasks = 3
output = "data"
[[stages]]
name = "reduce"
operator = "terasort-reduce-gpu"
tasks = 2
after = ["map"]
input = "data"
output = "/out"
needs = { cpus = 0.5, memory = "64MiB", gpus = 0.25 }
gpu_optional = true
"#;

#[tokio::test]
async fn job_commands_submit_show_list_and_cancel() {
    let cluster = common::Cluster::start(1, "64MiB").await;
    let (port, admin) = (common::free_port(), common::free_port());
    let addr = format!("127.0.0.1:{port}");
    let _scheduler = common::spawn_logged(
        cluster.dir.path(),
        "scheduler",
        &[
            "scheduler",
            "--listen",
            &addr,
            "--admin",
            &format!("127.0.0.1:{admin}"),
            "--metadata",
            &cluster.metadata_addr,
            "--set",
            "queues.batch=2",
            "--set",
            &cluster.secret_setting(),
        ],
    );
    // The job's queue is tenant batch's: its client submits and watches it, with the credential
    // an operator issues it.
    let batch = cluster.dir.path().join("batch.credential");
    let secret = cluster.dir.path().join("cluster.secret");
    let (batch, secret) = (batch.to_str().unwrap(), secret.to_str().unwrap());
    cluster.tern_ok(&[
        "cert",
        "credential",
        "--secret",
        secret,
        "--role",
        "client",
        "--tenant",
        "batch",
        "--out",
        batch,
    ]);
    let tern = |args: &[&str]| {
        let mut all = vec!["job", "--scheduler", &addr, "--as", batch];
        all.extend_from_slice(args);
        cluster.tern(&all)
    };
    let tern_ok = |args: &[&str]| {
        let out = tern(args);
        assert!(out.status.success(), "tern job {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    cluster
        .wait_for("the scheduler to answer", Duration::from_secs(30), || async {
            tern(&["list"]).status.success().then_some(())
        })
        .await;

    let file = cluster.dir.path().join("job.toml");
    std::fs::write(&file, JOB).unwrap();
    let out = tern(&["submit", file.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let job_id = json(&String::from_utf8_lossy(&out.stdout))["job_id"].as_str().unwrap().to_string();

    let status = json(&tern_ok(&["status", &job_id, "--json"]));
    assert_eq!(status["state"], "running");
    assert_eq!(status["queue"], "batch");
    assert!(status["tern_job_id"].as_str().is_some_and(|t| !t.is_empty()));
    let stages = status["stages"].as_array().unwrap();
    assert_eq!((stages[0]["name"].as_str(), stages[0]["queued"].as_u64()), (Some("map"), Some(3)));
    assert_eq!((stages[1]["state"].as_str(), stages[1]["waiting"].as_u64()), (Some("waiting"), Some(2)));
    assert!(stages[0]["output_shuffle_id"].as_str().unwrap().parse::<u64>().unwrap() > 0, "ids are strings");
    let text = tern_ok(&["status", &job_id]);
    assert!(text.contains("reduce") && text.contains("waiting"), "{text}");

    // A bad file is refused before it reaches the scheduler, naming the stage and field.
    let bad = cluster.dir.path().join("bad.toml");
    std::fs::write(&bad, JOB.replace("after = [\"map\"]", "after = [\"mapp\"]")).unwrap();
    let out = tern(&["submit", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("stage \"reduce\"") && err.contains("\"mapp\""), "{err}");

    let listed = json(&tern_ok(&["list", "--active", "--json"]));
    assert_eq!(listed.as_array().unwrap().len(), 1);
    let cancelled = json(&tern_ok(&["cancel", &job_id, "--json"]));
    assert_eq!(cancelled["state"], "cancelled");
    let listed = json(&tern_ok(&["list", "--active", "--json"]));
    assert!(listed.as_array().unwrap().is_empty());
    let out = tern(&["status", "no-such-job"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("not-found"));

    // The terasort job is built and accepted.
    let id = tern_ok(&["terasort", "--size", "1MiB", "--tasks", "2", "--out", "/ts"]);
    let status = json(&tern_ok(&["status", id.trim(), "--json"]));
    let names: Vec<&str> = status["stages"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["teragen", "map", "reduce", "validate"]);
}
