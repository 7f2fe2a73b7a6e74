//! Failures through a real cluster: lost servers, lapsed jobs, hostile frames.

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::{random_bytes, Cluster};
use tern_client::ErrorKind;
use tern_proto::frame::{self, Frame, Header, HEADER_LEN};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_storage_server_means_data_lost_for_its_files_only_and_they_say_so() {
    let mut cluster = Cluster::start(2, "128MiB").await;
    let client = cluster.client().await;
    let mut files = Vec::new();
    for i in 0..8 {
        let path = format!("/f{i}");
        let data = random_bytes(1000 + i);
        client.put(&path, Bytes::from(data.clone())).await.unwrap();
        let (_, blocks) = client.stat_with_blocks(&path, true).await.unwrap();
        files.push((path, data, blocks[0].0.address.clone()));
    }
    let victim = cluster.storage_addrs[0].clone();
    assert!(files.iter().any(|f| f.2 == victim) && files.iter().any(|f| f.2 != victim), "files on both servers");
    cluster.kill_storage(0);
    cluster
        .wait_for("the metadata server to declare the server dead", Duration::from_secs(10), || async {
            let status = client.status().await.ok()?;
            status.servers.iter().any(|s| s.address == victim && !s.alive).then_some(())
        })
        .await;
    for (path, data, server) in &files {
        let result = match client.open(path).await {
            Ok(reader) => reader.read_to_end().await,
            Err(e) => Err(e),
        };
        if *server == victim {
            let err = result.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::DataLost, "{path}: {err}");
            assert!(err.message().contains(path.as_str()), "the error names the file: {err}");
        } else {
            assert!(result.unwrap() == *data, "{path} on the live server still reads");
        }
    }
    // Lost is visible: `fs ls -l` marks exactly the victim's files `lost`, `fs stat` and the JSON
    // say how many blocks, `status` counts the files, and `fs rm` removes them.
    let lost: Vec<&str> = files.iter().filter(|f| f.2 == victim).map(|f| f.0.as_str()).collect();
    let listing = cluster.tern_ok(&["fs", "ls", "-l", "/"]);
    for (path, _, server) in &files {
        let line = listing.lines().find(|l| l.ends_with(&format!(" {}", &path[1..]))).unwrap_or_default();
        assert_eq!(line.starts_with("lost "), *server == victim, "{path} in:\n{listing}");
    }
    let stat: serde_json::Value = serde_json::from_str(&cluster.tern_ok(&["fs", "stat", "--json", lost[0]])).unwrap();
    assert_eq!(stat["lost_blocks"], 1, "{stat}");
    assert!(cluster.tern_ok(&["fs", "stat", lost[0]]).contains("lost:     1 of 1 block:"));
    let status: serde_json::Value = serde_json::from_str(&cluster.tern_ok(&["status", "--json"])).unwrap();
    assert_eq!(status["lost_files"], lost.len(), "{status}");
    for path in &lost {
        cluster.tern_ok(&["fs", "rm", path]);
    }
    let status: serde_json::Value = serde_json::from_str(&cluster.tern_ok(&["status", "--json"])).unwrap();
    assert_eq!(status["lost_files"], 0, "{status}");
    // New writes go to the live server.
    client.put("/after", Bytes::from_static(b"still works")).await.unwrap();
    assert_eq!(client.open("/after").await.unwrap().read_to_end().await.unwrap(), b"still works");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_in_flight_when_a_server_dies_fail_cleanly() {
    let mut cluster = Cluster::start(2, "128MiB").await;
    // A short read-ahead, so most blocks are still to be fetched when the server dies.
    let options = tern_client::ClientOptions { read_ahead_blocks: 2, ..Default::default() };
    let client = tern_client::Client::connect_with(&cluster.metadata_addr, options).await.unwrap();
    client.put("/big", Bytes::from(random_bytes(16 << 20))).await.unwrap();
    let mut reader = client.open("/big").await.unwrap();
    reader.next_chunk().await.unwrap();
    cluster.kill_storage(1);
    let mut result = Ok(Some(Bytes::new()));
    while let Ok(Some(_)) = result {
        result = reader.next_chunk().await;
    }
    let err = result.unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::DataLost | ErrorKind::Unavailable), "{err}");
    assert!(err.message().contains("/big"), "{err}");
}

fn used_blocks(status: &serde_json::Value) -> u64 {
    status["servers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["tiers"].as_array().unwrap())
        .map(|t| t["used_blocks"].as_u64().unwrap())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_job_gives_its_space_back() {
    let cluster = Cluster::start(2, "128MiB").await;
    let client = cluster.client().await;
    let job = client.start_job(Some("lapsing"), Duration::from_millis(1500)).await.unwrap();
    assert_eq!(job.root(), "/jobs/lapsing");
    for i in 0..4 {
        client.put(&format!("{}/part-{i}", job.root()), Bytes::from(random_bytes(4 << 20))).await.unwrap();
    }
    let status = || serde_json::from_str::<serde_json::Value>(&cluster.tern_ok(&["status", "--json"])).unwrap();
    cluster
        .wait_for("storage servers to report the job's 16 blocks", Duration::from_secs(10), || async {
            (used_blocks(&status()) == 16).then_some(())
        })
        .await;
    let jobs = status()["jobs"].clone();
    assert_eq!(jobs[0]["job_id"], "lapsing");
    assert_eq!(jobs[0]["files"], 4);
    // The client "crashes": nobody renews, the lease lapses, the data goes.
    job.abandon();
    cluster
        .wait_for("the lapsed job's blocks to be freed", Duration::from_secs(15), || async {
            let now = status();
            (used_blocks(&now) == 0 && now["jobs"].as_array().unwrap().is_empty()).then_some(())
        })
        .await;
    assert_eq!(client.stat("/jobs/lapsing").await.unwrap_err().kind(), ErrorKind::NotFound);
    let err = client.create("/jobs/lapsing/late", false).await.err().unwrap();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert!(cluster.tern_ok(&["status"]).contains("0/"), "the table shows the space back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ending_or_dropping_a_job_frees_its_files() {
    let cluster = Cluster::start(1, "64MiB").await;
    let client = cluster.client().await;
    let job = client.start_job(None, Duration::from_secs(30)).await.unwrap();
    let path = format!("{}/data", job.root());
    client.put(&path, Bytes::from(random_bytes(3 << 20))).await.unwrap();
    let ended = job.end().await.unwrap();
    assert_eq!((ended.files_deleted, ended.blocks_freed), (1, 3));
    assert_eq!(client.open(&path).await.err().unwrap().kind(), ErrorKind::NotFound);

    let job = client.start_job(Some("dropped"), Duration::from_secs(30)).await.unwrap();
    client.put("/jobs/dropped/x", Bytes::from_static(b"x")).await.unwrap();
    drop(job);
    cluster
        .wait_for("the dropped job to end", Duration::from_secs(5), || async {
            client.status().await.ok()?.jobs.is_empty().then_some(())
        })
        .await;
}

/// Sends raw bytes to a storage server and reads the one reply frame.
async fn raw_exchange(addr: &str, bytes: &[u8], close_after: bool) -> Frame {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(bytes).await.unwrap();
    if close_after {
        stream.shutdown().await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(5), frame::read_frame(&mut stream, frame::MAX_PAYLOAD_BYTES))
        .await
        .expect("the server answers")
        .expect("a well-formed error frame")
        .expect("a frame, not a bare close")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_frames_get_error_frames_and_the_server_keeps_serving() {
    let cluster = Cluster::start(1, "64MiB").await;
    let client = cluster.client().await;
    let addr = cluster.storage_addrs[0].clone();

    let reply = raw_exchange(&addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\r\n\r\n\r\n\r\n", false).await;
    let (kind, message) = reply.into_result().unwrap_err();
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("magic"), "{message}");

    // A header promising 1000 bytes, then only 10 and the end of the stream.
    let write = Frame::write(7, 1, 0, Bytes::from(vec![1u8; 1000]));
    let mut truncated = write.header.encode().to_vec();
    truncated.extend_from_slice(&[1u8; 10]);
    let (kind, message) = raw_exchange(&addr, &truncated, true).await.into_result().unwrap_err();
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("truncated"), "{message}");
    // Half a header.
    let (_, message) = raw_exchange(&addr, &truncated[..HEADER_LEN / 2], true).await.into_result().unwrap_err();
    assert!(message.contains("truncated"), "{message}");

    // A payload far beyond the block size is refused before it is read.
    let mut huge: Header = write.header;
    huge.payload_len = 60 << 20;
    let (kind, message) = raw_exchange(&addr, &huge.encode(), false).await.into_result().unwrap_err();
    assert_eq!(kind, ErrorKind::Invalid);
    assert!(message.contains("exceeds"), "{message}");

    // Well-formed requests for what is not there: errors on a connection that stays usable.
    let mut stream = TcpStream::connect(&addr).await.unwrap();
    for request in [Frame::read(1, 999_999, 0, 10), Frame::ping(2)] {
        frame::write_frame(&mut stream, &request).await.unwrap();
    }
    let missing = frame::read_frame(&mut stream, 1 << 20).await.unwrap().unwrap();
    assert_eq!(missing.header.request_id, 1);
    let (kind, message) = missing.into_result().unwrap_err();
    // Without a grant for it, the block is refused before it is looked up.
    assert_eq!(kind, ErrorKind::PermissionDenied);
    assert!(message.contains("999999"), "{message}");
    let pong = frame::read_frame(&mut stream, 1 << 20).await.unwrap().unwrap();
    assert_eq!((pong.header.request_id, pong.header.status), (2, 0));

    // And the next client is served as if nothing happened.
    client.put("/fine", Bytes::from(random_bytes(2 << 20))).await.unwrap();
    assert_eq!(client.open("/fine").await.unwrap().read_to_end().await.unwrap().len(), 2 << 20);
}
