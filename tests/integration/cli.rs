//! The command line's edges, each a bug once: a failed put leaves no file and its retry succeeds
//! at once, a killed writer's file is reaped while a live writer's is kept, output into a closed
//! pipe ends quietly, `tern up` checks its ports first, unresolvable hosts, admin ports and
//! storage ports are named, errors say what failed once, ids in JSON are strings, and shell
//! completions exist.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use tern_client::ErrorKind;

use crate::common::{random_bytes, Cluster, TERN};

const BLOCK: usize = 1 << 20;

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test]
async fn a_put_of_a_missing_local_file_leaves_nothing() {
    let cluster = Cluster::start(1, "16MiB").await;
    let out = cluster.tern(&["fs", "put", "/no/such/file", "/data/x"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("opening /no/such/file"), "{}", stderr(&out));
    let client = cluster.client().await;
    let err = client.stat("/data/x").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "an orphan was left: {err}");
    assert_eq!(cluster.tern_ok(&["fs", "ls", "/"]), "", "nothing at all is created");
}

/// A put that fails after its file was created gives the file up at once (README: a failed put
/// leaves nothing behind): a file larger than the cluster fails out of space, and at once the
/// path is free and the blocks are back, so a retry succeeds; the library's `put` does the same.
/// A directory is refused before anything is created.
#[tokio::test]
async fn a_failed_put_leaves_nothing_and_its_retry_succeeds_at_once() {
    let cluster = Cluster::start(1, "16MiB").await;
    let client = cluster.client().await;
    let local = tempfile::tempdir().unwrap();
    let out = cluster.tern(&["fs", "put", local.path().to_str().unwrap(), "/data/dir"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("is a directory; put uploads one file"), "{}", stderr(&out));

    let big = local.path().join("big");
    std::fs::write(&big, random_bytes(24 * BLOCK)).unwrap();
    let out = cluster.tern(&["fs", "put", big.to_str().unwrap(), "/data/f"]);
    assert!(!out.status.success(), "24 MiB fit in a 16 MiB cluster?");
    let gone = client.stat("/data/f").await.unwrap_err();
    assert_eq!(gone.kind(), ErrorKind::NotFound, "the failed put left its file: {gone}");
    // The cluster is full until the server carries out the frees (a heartbeat): the retry's
    // allocation waits for that, not for the 60 s writer lease.
    let small = local.path().join("small");
    let data = random_bytes(4 * BLOCK);
    std::fs::write(&small, &data).unwrap();
    cluster.tern_ok(&["fs", "put", small.to_str().unwrap(), "/data/f"]);
    assert_eq!(client.open("/data/f").await.unwrap().read_to_end().await.unwrap(), data);

    let err = client.put("/data/g", bytes::Bytes::from(random_bytes(24 * BLOCK))).await.unwrap_err();
    assert_eq!(client.stat("/data/g").await.unwrap_err().kind(), ErrorKind::NotFound, "after {err}");
    client.put("/data/g", bytes::Bytes::from(data.clone())).await.unwrap();
    cluster
        .wait_for("the failed puts' blocks to be given back", Duration::from_secs(10), || async {
            let status = client.status().await.ok()?;
            (status.servers.iter().map(|s| s.allocated_blocks).sum::<u64>() == 8).then_some(())
        })
        .await;
}

/// A writer lease of 2 s (renewed every 667 ms, with room for a loaded machine): `tern fs put -` fed through a pipe holds its file unsealed while it
/// waits for more input. Alive, it renews the lease and keeps the file; SIGKILLed, it cannot
/// delete the file itself, and the metadata server reaps it.
#[tokio::test]
async fn a_killed_writer_is_reaped_and_a_live_one_is_not() {
    let cluster = Cluster::start_with_metadata_config(1, "16MiB", "writer_lease_ms = 2000").await;
    let client = cluster.client().await;
    let mut put = Command::new(TERN)
        .args(["fs", "put", "-", "/data/slow"])
        .env("TERN_METADATA", &cluster.metadata_addr)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = put.stdin.take().unwrap();
    // Past one chunk of `put` (8 MiB), so blocks are allocated and written before the kill.
    stdin.write_all(&random_bytes(9 * BLOCK)).unwrap();
    let unsealed = cluster
        .wait_for("the writer's blocks", Duration::from_secs(20), || async {
            let (info, blocks) = client.stat_with_blocks("/data/slow", true).await.ok()?;
            (!info.sealed && !blocks.is_empty()).then_some(blocks.len())
        })
        .await;
    // Two leases: a live writer keeps its file by renewing.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (info, _) = client.stat_with_blocks("/data/slow", true).await.expect("a live writer's file was reaped");
    assert!(!info.sealed);

    put.kill().unwrap();
    put.wait().unwrap();
    cluster
        .wait_for("the dead writer's file to be reaped", Duration::from_secs(15), || async {
            let gone = client.stat("/data/slow").await.is_err_and(|e| e.kind() == ErrorKind::NotFound);
            gone.then_some(())
        })
        .await;
    cluster
        .wait_for("its blocks to be freed", Duration::from_secs(10), || async {
            let status = client.status().await.ok()?;
            (status.servers.iter().map(|s| s.allocated_blocks).sum::<u64>() == 0).then_some(())
        })
        .await;
    assert!(unsealed > 0);
}

#[tokio::test]
async fn output_into_a_closed_pipe_ends_quietly() {
    let cluster = Cluster::start(1, "16MiB").await;
    let client = cluster.client().await;
    for i in 0..50 {
        client.create_empty(&format!("/many/file-with-a-long-name-{i:04}"), true).await.unwrap();
    }
    client.put("/big", bytes::Bytes::from(random_bytes(2 * BLOCK))).await.unwrap();
    for args in [
        vec!["status"],
        vec!["status", "--json"],
        vec!["admin", "servers", "--json"],
        vec!["fs", "ls", "-l", "/many"],
        vec!["fs", "ls", "--json", "/many"],
        vec!["fs", "cat", "/big"],
    ] {
        let mut child = Command::new(TERN)
            .args(&args)
            .env("TERN_METADATA", &cluster.metadata_addr)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The reader goes away before the command has its answer (it must reach the cluster first).
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "tern {args:?} into a closed pipe: {} {}", out.status, stderr(&out));
        assert!(!stderr(&out).contains("panicked"), "tern {args:?}: {}", stderr(&out));
    }
}

#[tokio::test]
async fn up_on_a_busy_port_fails_before_saying_it_is_up() {
    let dir = tempfile::tempdir().unwrap();
    let ports = tern_local::PortLayout::free(2).unwrap();
    // Something else holds storage server 1's admin port.
    let _held = std::net::TcpListener::bind(("127.0.0.1", ports.storage_admin(1))).unwrap();
    let out = Command::new(TERN)
        .args(["up", "--storage-servers", "2", "--dram", "16MiB", "--port", &ports.metadata().to_string(), "--dir"])
        .arg(dir.path())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert!(!out.status.success(), "tern up started on a busy port: {stdout}");
    assert!(!stdout.contains("Tern is up"), "{stdout}");
    assert!(stderr.contains(&format!("port {}", ports.storage_admin(1))) && stderr.contains("not free"), "{stderr}");
}

#[tokio::test]
async fn unresolvable_hosts_admin_ports_and_storage_ports_are_named() {
    let cluster = Cluster::start(1, "16MiB").await;
    let out = cluster.tern(&["status", "--metadata", "nonexistent.invalid:9060"]);
    assert!(stderr(&out).contains("cannot resolve host nonexistent.invalid"), "{}", stderr(&out));
    let out = cluster.tern(&["status", "--metadata", "nonexistent.invalid"]);
    assert!(stderr(&out).contains("not host:port"), "{}", stderr(&out));
    let admin = cluster.metadata_admin_addr();
    let out = cluster.tern(&["fs", "ls", "--metadata", &admin, "/"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("this port is not a Tern metadata server (is it the admin port?)"),
        "{}",
        stderr(&out)
    );
    let out = cluster.tern(&["fs", "ls", "--metadata", &cluster.storage_addrs[0], "/"]);
    assert!(!out.status.success());
    let said = stderr(&out);
    assert!(said.contains("(is it a storage server's block port?)"), "{said}");
}

/// Errors say what failed once, naming the server or file: a refused connection is not "tcp
/// connect error: tcp connect error", a job file that is missing is not "cannot reach the
/// scheduler", a refused configuration comes without the dump of the rest, and counts agree
/// with their nouns.
#[tokio::test]
async fn errors_name_what_failed_once() {
    let cluster = Cluster::start(1, "16MiB").await;
    let closed = format!("127.0.0.1:{}", tern_local::free_port_range(1).unwrap());
    let out = cluster.tern(&["fs", "ls", "--metadata", &closed, "/"]);
    let said = stderr(&out);
    assert!(said.contains(&format!("cannot reach the metadata server at {closed}: tcp connect error: ")), "{said}");
    assert!(!said.contains("tcp connect error: tcp connect error") && !said.contains("transport error"), "{said}");
    let out = cluster.tern(&["job", "submit", "--scheduler", &closed, "/no/such/job.toml"]);
    let said = stderr(&out);
    assert!(said.contains("reading job file /no/such/job.toml"), "{said}");
    assert!(!said.contains("scheduler"), "the scheduler was asked before the file was read: {said}");
    let status = cluster.tern_ok(&["status"]);
    assert!(status.contains(", 1 storage server (1 alive), 0 files, 0 directories, 0 jobs"), "{status}");
    // A refused configuration is one line, not the end of a dump of the rest.
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path().to_str().unwrap();
    let out = cluster.tern(&["metadata-server", "--dir", dir, "--listen", &closed, "--set", "block_size=3MiB"]);
    assert!(!out.status.success());
    assert_eq!(
        stderr(&out).trim(),
        "tern: invalid metadata server configuration: block_size = 3MiB is not a power of two from 4KiB to 64MiB"
    );
}

#[tokio::test]
async fn ids_in_json_are_strings() {
    let cluster = Cluster::start(1, "16MiB").await;
    cluster.client().await.put("/f", bytes::Bytes::from(random_bytes(BLOCK + 1))).await.unwrap();
    let stat: Value = serde_json::from_str(&cluster.tern_ok(&["fs", "stat", "--json", "/f"])).unwrap();
    assert!(stat["file_id"].is_string(), "{stat}");
    for block in stat["blocks"].as_array().unwrap() {
        assert!(block["block_id"].is_string() && block["server_id"].is_string(), "{block}");
        assert!(block["length"].is_u64(), "counts stay numbers: {block}");
    }
    let status: Value = serde_json::from_str(&cluster.tern_ok(&["status", "--json"])).unwrap();
    assert!(status["servers"][0]["server_id"].is_string(), "{status}");
    let listed: Value = serde_json::from_str(&cluster.tern_ok(&["fs", "ls", "--json", "/"])).unwrap();
    assert!(listed.as_array().is_some_and(|a| a.len() == 1), "a list is one array: {listed}");
}

#[test]
fn shell_completions_are_printed() {
    for (shell, mark) in [("bash", "complete -F _tern"), ("zsh", "#compdef tern"), ("fish", "complete -c tern")] {
        let out = Command::new(TERN).args(["completions", shell]).output().unwrap();
        assert!(out.status.success(), "{shell}: {}", stderr(&out));
        let script = String::from_utf8_lossy(&out.stdout);
        assert!(script.contains(mark) && script.contains("admin"), "{shell}: no {mark:?} in the script");
    }
    let out = Command::new(TERN).args(["completions", "tcsh"]).output().unwrap();
    assert!(!out.status.success());
}
