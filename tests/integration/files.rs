//! Files through a real cluster: round trips, namespace operations, and the errors users see.

use crate::common;

use bytes::Bytes;
use common::{random_bytes, Cluster};
use tern_client::ErrorKind;

const BLOCK: usize = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_of_every_edge_size_round_trip() {
    let cluster = Cluster::start(2, "256MiB").await;
    let client = cluster.client().await;
    for size in [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 50 << 20] {
        let data = random_bytes(size);
        let path = format!("/round-trip/{size}");
        // Odd-sized writes exercise the block buffering.
        let mut writer = client.create(&path, true).await.unwrap();
        for piece in data.chunks(100_003) {
            writer.write(piece).await.unwrap();
        }
        let info = writer.close().await.unwrap();
        assert_eq!(info.length, size as u64);
        assert!(info.sealed);
        assert_eq!(info.block_count, size.div_ceil(BLOCK) as u64);

        let reader = client.open(&path).await.unwrap();
        assert_eq!(reader.len(), size as u64);
        let back = reader.read_to_end().await.unwrap();
        assert!(back == data, "{path}: bytes differ after the round trip");
    }
    // Ranged reads across a block boundary.
    let reader = client.open("/round-trip/52428800").await.unwrap();
    let whole = client.open("/round-trip/52428800").await.unwrap().read_to_end().await.unwrap();
    let range = reader.read_at(BLOCK as u64 - 10, BLOCK + 20).await.unwrap();
    assert_eq!(&range[..], &whole[BLOCK - 10..2 * BLOCK + 10]);
    let err = reader.read_at(50 << 20, 1).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Invalid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_files_spread_over_servers_and_blocks_are_zero_copy_slices() {
    let cluster = Cluster::start(2, "256MiB").await;
    let client = cluster.client().await;
    let data = Bytes::from(random_bytes(8 * BLOCK + 123));
    client.put("/spread", data.clone()).await.unwrap();
    let (_, blocks) = client.stat_with_blocks("/spread", true).await.unwrap();
    assert_eq!(blocks.len(), 9);
    let servers: std::collections::HashSet<u64> = blocks.iter().map(|(b, _)| b.server_id).collect();
    assert_eq!(servers.len(), 2, "blocks of one file go to both servers: {blocks:?}");
    let back = client.open("/spread").await.unwrap().read_to_end().await.unwrap();
    assert!(back == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_put_get_cat_round_trip() {
    let cluster = Cluster::start(2, "256MiB").await;
    let local = cluster.dir.path().join("input");
    let data = random_bytes(50 << 20);
    std::fs::write(&local, &data).unwrap();
    let summary = cluster.tern_ok(&["fs", "put", local.to_str().unwrap(), "/cli/big", "--json"]);
    let summary: serde_json::Value = serde_json::from_str(summary.trim()).unwrap();
    assert_eq!(summary["bytes"], 50 << 20);

    let out = cluster.dir.path().join("output");
    cluster.tern_ok(&["fs", "get", "/cli/big", out.to_str().unwrap()]);
    assert!(std::fs::read(&out).unwrap() == data, "get returned different bytes");

    // Into a directory: the local name is kept.
    let small = cluster.dir.path().join("small.txt");
    std::fs::write(&small, b"hello tern\n").unwrap();
    cluster.tern_ok(&["fs", "put", small.to_str().unwrap(), "/cli/"]);
    assert_eq!(cluster.tern_ok(&["fs", "cat", "/cli/small.txt"]), "hello tern\n");
    // From stdin.
    let mut child = std::process::Command::new(common::TERN)
        .args(["fs", "put", "-", "/cli/stdin"])
        .env("TERN_METADATA", &cluster.metadata_addr)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(&data[..3 << 20]).unwrap();
    assert!(child.wait().unwrap().success());
    let back = cluster.client().await.open("/cli/stdin").await.unwrap().read_to_end().await.unwrap();
    assert!(back == data[..3 << 20]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_commands() {
    let cluster = Cluster::start(2, "128MiB").await;
    let client = cluster.client().await;
    cluster.tern_ok(&["fs", "mkdir", "-p", "/a/b/c"]);
    client.put("/a/b/one", Bytes::from_static(b"1")).await.unwrap();
    client.put("/a/b/two", Bytes::from(vec![7u8; BLOCK + 5])).await.unwrap();

    assert_eq!(cluster.tern_ok(&["fs", "ls", "/a/b"]), "c/\none\ntwo\n");
    let long = cluster.tern_ok(&["fs", "ls", "-l", "/a/b"]);
    assert!(long.lines().any(|l| l.starts_with("file") && l.ends_with("two") && l.contains("1.0MiB")), "{long}");
    let entries: Vec<serde_json::Value> =
        serde_json::from_str::<serde_json::Value>(&cluster.tern_ok(&["fs", "ls", "--json", "/a/b"]))
            .unwrap()
            .as_array()
            .unwrap()
            .clone();
    assert_eq!(entries.len(), 3);
    assert_eq!(entries[2]["length"], BLOCK as u64 + 5);

    let stat: serde_json::Value =
        serde_json::from_str(&cluster.tern_ok(&["fs", "stat", "--json", "/a/b/two"])).unwrap();
    assert_eq!(stat["kind"], "file");
    assert_eq!(stat["length"], BLOCK as u64 + 5);
    assert_eq!(stat["blocks"].as_array().unwrap().len(), 2);
    assert!(cluster.tern_ok(&["fs", "stat", "/a/b"]).contains("kind:     dir"));

    cluster.tern_ok(&["fs", "mv", "/a/b", "/moved"]);
    assert_eq!(cluster.client().await.open("/moved/one").await.unwrap().read_to_end().await.unwrap(), b"1");
    assert_eq!(client.stat("/a/b").await.unwrap_err().kind(), ErrorKind::NotFound);

    let refused = cluster.tern(&["fs", "rm", "/moved"]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("not empty"), "{refused:?}");
    cluster.tern_ok(&["fs", "rm", "/moved/one"]);
    cluster.tern_ok(&["fs", "rm", "-r", "/moved"]);
    assert_eq!(cluster.tern_ok(&["fs", "ls", "/a"]), "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_the_path_and_kind() {
    let cluster = Cluster::start(1, "64MiB").await;
    let client = cluster.client().await;
    client.put("/exists", Bytes::from_static(b"x")).await.unwrap();

    let err = client.create("/exists", false).await.err().unwrap();
    assert_eq!(err.kind(), ErrorKind::AlreadyExists);
    assert!(err.message().contains("/exists"), "{err}");
    let err = client.open("/missing").await.err().unwrap();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    assert!(err.message().contains("/missing"), "{err}");

    // A file being written is invisible to readers until sealed.
    let mut writer = client.create("/unsealed", false).await.unwrap();
    writer.write(b"partial").await.unwrap();
    assert_eq!(client.open("/unsealed").await.err().unwrap().kind(), ErrorKind::NotFound);
    writer.close().await.unwrap();
    assert_eq!(client.open("/unsealed").await.unwrap().read_to_end().await.unwrap(), b"partial");

    // The command line: one line on stderr naming the problem, non-zero exit.
    let out = cluster.tern(&["fs", "get", "/missing", cluster.dir.path().join("x").to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/missing") && stderr.contains("not-found"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    let local = cluster.dir.path().join("small");
    std::fs::write(&local, b"y").unwrap();
    let out = cluster.tern(&["fs", "put", local.to_str().unwrap(), "/exists"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("already-exists"));
    let out = cluster.tern(&["fs", "ls", "relative/path"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid"), "{out:?}");
    let out = std::process::Command::new(common::TERN).args(["status", "--metadata", "127.0.0.1:1"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("unavailable"), "{out:?}");
}
