//! The client half of `scripts/rdma-test.sh`, run inside the soft-RoCE guest against a real
//! `tern metadata-server` and `tern storage-server`s: every check goes over `--transport rdma`,
//! and a fallback to TCP is a failure (the script greps this program's log for it).
//!
//! `rdma_check METADATA BLOCK_SIZE before ADDR=ADMIN...` (each storage server's block address and
//! admin endpoint): round trips of files of 0, 1, block-1, block, block+1 bytes (their reads of
//! blocks on servers serving RDMA one-sided RDMA READs through the servers' memory windows), a
//! shuffle written by 3 maps into 4 partitions and read back by map ranges (every page from a
//! server serving RDMA READ one-sided: its batches lie back to back in one extent), a read and a
//! Lease of another job's file refused, READs through a window after its Release and after its
//! lease ran out failing; leaves /jobs/keep/* for the next phase.
//!
//! What goes one-sided is counted exactly, whatever order the servers started in and wherever
//! the planner put each block and segment: the check asks the metadata server which server holds
//! each one, and compares the client's READs with the lends each server counted
//! (`tern_storage_lends_total`, from its admin endpoint), which also say why anything was not lent.
//! `rdma_check METADATA BLOCK_SIZE after`: run once a storage server was killed: every file
//! still reads back or fails as Unavailable/DataLost naming the server (never wrong bytes, never
//! a hang past the deadline), and a new file round-trips on the survivor.

use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use tern_client::{Client, ClientOptions, ErrorKind, ShuffleOptions, TransportKind};
use tern_proto::frame::{self, Frame, RemoteLease, LEASE_TTL};
use tern_proto::token::JobToken;
use tern_transport::rdma_provider::Window;

/// The storage server the script starts with `rdma=off`.
const NO_RDMA_SERVER: &str = "10.77.0.1:9074";
/// Job keep's token, from the first phase to the second.
const TOKEN_FILE: &str = "/tmp/rdma_check.token";

fn pattern(len: usize, seed: u64) -> Bytes {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

fn check(ok: bool, what: &str) -> anyhow::Result<()> {
    if ok {
        println!("rdma_check: ok: {what}");
        Ok(())
    } else {
        anyhow::bail!("{what}")
    }
}

async fn client(metadata: &str) -> anyhow::Result<Client> {
    // Deadlines for an emulated CPU: under TCG an RDMA connect (queue pairs and their buffers
    // registered) takes seconds beside three servers, and a slow connect is not a missing device.
    let options = ClientOptions {
        transport: TransportKind::Rdma,
        connect_timeout: Duration::from_secs(30),
        rdma_connect_timeout: Duration::from_secs(10),
        block_request_timeout: Duration::from_secs(20),
        ..ClientOptions::default()
    };
    Ok(Client::connect_with(metadata, options).await?)
}

/// The storage servers: block address and admin endpoint (`ADDR=ADMIN`).
struct Servers(Vec<(String, String)>);

impl Servers {
    fn parse(args: &[String]) -> anyhow::Result<Servers> {
        let servers = args
            .iter()
            .map(|arg| {
                let (addr, admin) = arg.split_once('=').with_context(|| format!("{arg:?}: expected ADDR=ADMIN"))?;
                Ok((addr.to_string(), admin.to_string()))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        anyhow::ensure!(!servers.is_empty(), "name each storage server as ADDR=ADMIN");
        Ok(Servers(servers))
    }

    /// Every server's lends so far, by (server, what, outcome).
    async fn lends(&self) -> anyhow::Result<Lends> {
        let mut all = Lends::default();
        for (addr, admin) in &self.0 {
            let text = http_get(admin, "/metrics").await.with_context(|| format!("metrics of {addr} from {admin}"))?;
            for line in text.lines().filter(|l| l.starts_with("tern_storage_lends_total{")) {
                let label = |name: &str| {
                    let at = line.find(&format!("{name}=\"")).map(|i| i + name.len() + 2)?;
                    Some(line[at..].split('"').next()?.to_string())
                };
                let (Some(what), Some(outcome)) = (label("what"), label("outcome")) else { continue };
                let value: f64 = line.rsplit(' ').next().unwrap_or("").parse().with_context(|| line.to_string())?;
                all.0.insert((addr.clone(), what, outcome), value as u64);
            }
        }
        Ok(all)
    }
}

/// Lend counters of the servers, by (server, what, outcome).
#[derive(Default, Debug)]
struct Lends(std::collections::BTreeMap<(String, String, String), u64>);

impl Lends {
    /// What changed since `earlier`, for `what` ("page" or "block"): (server, outcome) -> count.
    fn since(&self, earlier: &Lends, what: &str) -> Vec<(String, String, u64)> {
        self.0
            .iter()
            .filter(|((_, w, _), _)| w == what)
            .filter_map(|((server, w, outcome), &now)| {
                let then = earlier.0.get(&(server.clone(), w.clone(), outcome.clone())).copied().unwrap_or(0);
                (now > then).then(|| (server.clone(), outcome.clone(), now - then))
            })
            .collect()
    }
}

/// The body of `GET path` from an admin endpoint (HTTP/1.0, so the server closes when done).
async fn http_get(addr: &str, path: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        anyhow::Ok(response)
    };
    let response = tokio::time::timeout(Duration::from_secs(20), exchange).await.context("timed out")??;
    let (head, body) = response.split_once("\r\n\r\n").context("no end of the response's head")?;
    anyhow::ensure!(head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200"), "{head}");
    Ok(body.to_string())
}

/// Checks the lends of one step: every lend refused for a reason other than the data's layout
/// (a window limit, a bind refused or late, a connection that lends nothing) is a failure, and
/// the client's one-sided READs are exactly the lends of the servers serving RDMA.
fn check_lends(step: &str, what: &str, changed: &[(String, String, u64)], reads: u64) -> anyhow::Result<u64> {
    let mut lent = 0;
    for (server, outcome, n) in changed {
        match outcome.as_str() {
            "lent" => lent += n,
            // Bytes that are not one view of DRAM are carried by design (the unit tests cover why).
            "gathered" | "nvme" | "empty" => {}
            "transport" if server == NO_RDMA_SERVER => {}
            _ => anyhow::bail!("{step}: storage server {server} did not lend {n} {what}s: {outcome}"),
        }
    }
    check(reads == lent, &format!("{step}: {reads} one-sided READs, {lent} {what}s lent by the servers"))?;
    Ok(lent)
}

async fn before(metadata: &str, block: usize, servers: &Servers) -> anyhow::Result<()> {
    let owner = client(metadata).await?;
    let _job = owner.start_job(Some("keep"), Duration::from_secs(600)).await?;
    let (lends_before, reads_before) = (servers.lends().await?, tern_rdma::one_sided::counters().reads);
    let mut on_rdma = 0;
    for (i, len) in [0, 1, block - 1, block, block + 1, 3 * block + 7].into_iter().enumerate() {
        let data = pattern(len, i as u64 + 1);
        let path = format!("/jobs/keep/f{len}");
        owner.put(&path, data.clone()).await?;
        let back = owner.open(&path).await?.read_to_end().await?;
        check(back == data, &format!("round trip of {len} bytes"))?;
        let (_, blocks) = owner.stat_with_blocks(&path, true).await?;
        on_rdma += blocks.iter().filter(|(b, _)| b.address != NO_RDMA_SERVER).count() as u64;
    }
    let reads = tern_rdma::one_sided::counters().reads - reads_before;
    let changed = servers.lends().await?.since(&lends_before, "block");
    let lent = check_lends("the round trips", "block", &changed, reads)?;
    check(
        lent >= on_rdma && (on_rdma == 0 || reads > 0),
        &format!("each of the {on_rdma} blocks on servers serving RDMA was READ one-sided ({reads} READs)"),
    )?;

    // A shuffle: 3 maps into 4 partitions, read back whole and by ranges of maps. Each partition
    // takes under 4 KiB, so its segment's batches lie back to back in its first extent (a piece of
    // a slot) and every page is one view of the arena, lent whole.
    let shuffle = owner.register_shuffle("keep", 4, ShuffleOptions::default()).await?;
    let piece = |map: u32, partition: u32| {
        pattern(200 + 250 * partition as usize + 100 * map as usize, 100 + u64::from(map * 10 + partition))
    };
    for map in 0..3 {
        let mut writer = shuffle.writer(map, 0);
        for partition in 0..4 {
            writer.write(partition, &piece(map, partition)).await?;
        }
        check(writer.commit().await?.committed, &format!("map {map} committed"))?;
    }
    let segments = shuffle.segments(0..4).await?;
    let holder = |partition: u32| segments.iter().find(|s| s.partition == partition).map(|s| s.address.clone());
    for partition in 0..4 {
        let held_by = holder(partition).context("a partition without a segment")?;
        println!("rdma_check: shuffle partition {partition} is held by storage server {held_by}");
    }
    for (partitions, maps) in [(0..4, 0..3), (1..3, 1..3), (3..4, 0..1), (0..4, 2..3)] {
        let (lends_before, reads_before) = (servers.lends().await?, tern_rdma::one_sided::counters().reads);
        let batches = shuffle.reader(partitions.clone(), maps.clone()).await?.read_to_end().await?;
        let mut got: Vec<(u32, u32, Vec<u8>)> = Vec::new();
        for b in batches {
            match got.iter_mut().find(|(p, m, _)| *p == b.partition && *m == b.map) {
                Some((_, _, bytes)) => bytes.extend_from_slice(&b.data),
                None => got.push((b.partition, b.map, b.data.to_vec())),
            }
        }
        got.sort();
        let mut want: Vec<(u32, u32, Vec<u8>)> = Vec::new();
        for p in partitions.clone() {
            for m in maps.clone() {
                want.push((p, m, piece(m, p).to_vec()));
            }
        }
        want.sort();
        let step = format!("shuffle read of partitions {partitions:?} x maps {maps:?}");
        check(got == want, &step)?;
        // One page per partition (each fits a page): READ one-sided exactly where its holder
        // serves RDMA, so start order and placement cannot change the count, only its expectation.
        let expected = partitions.clone().filter(|&p| holder(p).is_some_and(|a| a != NO_RDMA_SERVER)).count() as u64;
        let reads = tern_rdma::one_sided::counters().reads - reads_before;
        let changed = servers.lends().await?.since(&lends_before, "page");
        let lent = check_lends(&step, "page", &changed, reads)?;
        check(lent == expected, &format!("{step}: {expected} pages on servers serving RDMA, {lent} lent"))?;
    }

    // Another job's client may not read keep's file.
    let stranger = client(metadata).await?;
    let _other = stranger.start_job(Some("other"), Duration::from_secs(60)).await?;
    let refused = match stranger.open(&format!("/jobs/keep/f{block}")).await {
        Ok(reader) => reader.read_to_end().await.err(),
        Err(e) => Some(e),
    };
    let refused_right = refused.as_ref().is_some_and(|e| e.kind() == ErrorKind::PermissionDenied);
    check(refused_right, &format!("cross-job read refused by the client (got {refused:?})"))?;
    // The control plane does not tell the stranger where keep's blocks are ...
    let refused = stranger.stat_with_blocks(&format!("/jobs/keep/f{block}"), true).await.err();
    let refused_right = refused.as_ref().is_some_and(|e| e.kind() == ErrorKind::PermissionDenied);
    check(refused_right, &format!("cross-job stat refused by the metadata server (got {refused:?})"))?;
    // ... and should it learn them anyway (here from keep's owner), the storage server refuses it
    // too, over RDMA: the stranger's own token bound, then a Read of keep's block with keep's grant.
    // A block of keep's on a server that serves RDMA (not the one started with rdma=off).
    let mut target = None;
    for len in [1, block - 1, block, block + 1, 3 * block + 7] {
        let (_, blocks) = owner.stat_with_blocks(&format!("/jobs/keep/f{len}"), true).await?;
        target = blocks.into_iter().map(|(b, _)| b).find(|b| b.address != NO_RDMA_SERVER);
        if target.is_some() {
            break;
        }
    }
    let target = target.context("none of keep's blocks is on a server serving RDMA")?;
    let grant: [u8; 16] = target.grant.as_slice().try_into().context("a 16-byte grant")?;
    let token = JobToken::from_text(&stranger.job_token("other").context("the stranger's token")?)?;
    let connect = tern_transport::rdma_or::rdma_connect(&target.address);
    let mut raw = tokio::time::timeout(Duration::from_secs(20), connect).await.context("RDMA connect timed out")??;
    frame::write_frame(&mut raw.writer, &Frame::auth(1, 1, Bytes::from(token.encode()))).await?;
    let bound = frame::read_frame(&mut raw.reader, frame::MAX_PAYLOAD_BYTES).await?.context("no Auth reply")?;
    check(bound.into_result().is_ok(), "the stranger's own token binds over RDMA")?;
    frame::write_frame(&mut raw.writer, &Frame::read(2, target.block_id, 0, 16).authorized(1, grant)).await?;
    let reply = frame::read_frame(&mut raw.reader, frame::MAX_PAYLOAD_BYTES).await?.context("no Read reply")?;
    let denied = reply.into_result().err();
    check(
        denied.as_ref().is_some_and(|(kind, _)| *kind == ErrorKind::PermissionDenied),
        &format!("cross-job read refused by the storage server over RDMA (got {denied:?})"),
    )?;
    // Nor lend it: a Lease is authorized as a Read.
    frame::write_frame(&mut raw.writer, &Frame::lease(3, target.block_id).authorized(1, grant)).await?;
    let reply = frame::read_frame(&mut raw.reader, frame::MAX_PAYLOAD_BYTES).await?.context("no Lease reply")?;
    let denied = reply.into_result().err();
    check(
        denied.as_ref().is_some_and(|(kind, _)| *kind == ErrorKind::PermissionDenied),
        &format!("cross-job Lease refused by the storage server over RDMA (got {denied:?})"),
    )?;
    drop(raw);

    // keep's own lease of the block: READ one-sided, the same bytes as a Read; then no READ
    // through the window once it is released, or once its lease ran out.
    let keep_token = Bytes::from(JobToken::from_text(&owner.job_token("keep").context("keep's token")?)?.encode());
    let (address, block_id) = (target.address.as_str(), target.block_id);
    let (mut raw, lease) = lease_raw(address, &keep_token, block_id, grant).await?;
    let one_sided = raw.one_sided.clone().context("an RDMA stream without one-sided operations")?;
    let window = Window { addr: lease.addr, rkey: lease.rkey };
    let read = tokio::time::timeout(Duration::from_secs(20), one_sided.read(window, lease.len as usize)).await??;
    frame::write_frame(&mut raw.writer, &Frame::read(3, block_id, 0, lease.len).authorized(1, grant)).await?;
    let reply = frame::read_frame(&mut raw.reader, frame::MAX_PAYLOAD_BYTES).await?.context("no Read reply")?;
    let two_sided = reply.into_result().map_err(|(kind, why)| anyhow::anyhow!("Read: {kind:?}: {why}"))?.payload;
    check(
        read == two_sided && crc32c::crc32c(&read) == lease.crc,
        &format!("a {}-byte block READ one-sided equals its Read and its lease's crc", lease.len),
    )?;
    frame::write_frame(&mut raw.writer, &Frame::release(4, &[lease.id]).authorized(1, grant)).await?;
    let reply = frame::read_frame(&mut raw.reader, frame::MAX_PAYLOAD_BYTES).await?.context("no Release reply")?;
    let ended = reply.into_result().map_err(|(kind, why)| anyhow::anyhow!("Release: {kind:?}: {why}"))?.header.length;
    check(ended == 1, &format!("Release invalidated the window (ended {ended})"))?;
    let stale = tokio::time::timeout(Duration::from_secs(20), one_sided.read(window, lease.len as usize)).await?;
    check(
        key_refused(&stale),
        &format!("a READ through the released window fails (got {:?})", stale.map(|b| b.len())),
    )?;
    drop(raw);
    let (raw, lease) = lease_raw(address, &keep_token, block_id, grant).await?;
    let one_sided = raw.one_sided.clone().context("an RDMA stream without one-sided operations")?;
    let window = Window { addr: lease.addr, rkey: lease.rkey };
    tokio::time::sleep(LEASE_TTL + Duration::from_secs(1)).await;
    let stale = tokio::time::timeout(Duration::from_secs(20), one_sided.read(window, lease.len as usize)).await?;
    check(
        key_refused(&stale),
        &format!("a READ through an expired lease's window fails (got {:?})", stale.map(|b| b.len())),
    )?;
    drop(raw);
    // The job is left to its lease; its token lets the next phase read its files again.
    std::fs::write(TOKEN_FILE, _job.token())?;
    _job.abandon();
    Ok(())
}

/// Whether a READ failed because the server refused its key: its completion says "remote access
/// error", or the connection ended under it. The access violation puts the server's queue pair
/// in error, and rdma_cm's disconnect can reach this client before the READ's own completion
/// (seen once in CI); either way no byte came back, and the connection was alive until the READ.
fn key_refused(read: &std::io::Result<Bytes>) -> bool {
    read.as_ref().err().is_some_and(|e| {
        let e = e.to_string();
        e.contains("remote access error") || e.contains("the RDMA peer disconnected")
    })
}

/// A new RDMA connection to `address` with `token` bound to slot 1, and a Lease of `block_id`
/// under `grant` on it.
async fn lease_raw(
    address: &str,
    token: &Bytes,
    block_id: u64,
    grant: [u8; 16],
) -> anyhow::Result<(tern_transport::Stream, RemoteLease)> {
    let connect = tern_transport::rdma_or::rdma_connect(address);
    let mut raw = tokio::time::timeout(Duration::from_secs(20), connect).await.context("RDMA connect timed out")??;
    frame::write_frame(&mut raw.writer, &Frame::auth(1, 1, token.clone())).await?;
    let bound = frame::read_frame(&mut raw.reader, frame::MAX_PAYLOAD_BYTES).await?.context("no Auth reply")?;
    bound.into_result().map_err(|(kind, why)| anyhow::anyhow!("Auth: {kind:?}: {why}"))?;
    frame::write_frame(&mut raw.writer, &Frame::lease(2, block_id).authorized(1, grant)).await?;
    let reply = frame::read_frame(&mut raw.reader, frame::MAX_PAYLOAD_BYTES).await?.context("no Lease reply")?;
    let reply = reply.into_result().map_err(|(kind, why)| anyhow::anyhow!("Lease: {kind:?}: {why}"))?;
    Ok((raw, RemoteLease::decode(&reply.payload)?))
}

async fn after(metadata: &str, block: usize) -> anyhow::Result<()> {
    let owner = client(metadata).await?;
    owner.add_job_token(std::fs::read_to_string(TOKEN_FILE)?.trim())?;
    let _job = owner.start_job(Some("later"), Duration::from_secs(120)).await?;
    let (mut lost, mut intact) = (0, 0);
    for (i, len) in [1, block - 1, block, block + 1, 3 * block + 7].into_iter().enumerate() {
        let want = pattern(len, i as u64 + 2);
        println!("rdma_check: reading the {len}-byte file after the kill");
        let started = Instant::now();
        let read = match owner.open(&format!("/jobs/keep/f{len}")).await {
            Ok(reader) => reader.read_to_end().await,
            Err(e) => Err(e),
        };
        let took = started.elapsed();
        check(took < Duration::from_secs(60), &format!("read of {len} bytes answered in {took:?}"))?;
        match read {
            Ok(bytes) => {
                check(bytes == want, &format!("{len}-byte file intact after the kill"))?;
                intact += 1;
            }
            // The killed server held it, or its job's grant is gone with the job: any clear
            // refusal is right; wrong bytes or a hang are not.
            Err(e) => {
                println!("rdma_check: {len}-byte file after the kill: {:?} ({e})", e.kind());
                lost += 1;
            }
        }
    }
    println!("rdma_check: after the kill: {intact} files intact, {lost} refused");
    // Until the metadata server declares the killed server dead (5 s of missed heartbeats), a
    // new block may still be placed there and its write refused; the client reports the server
    // unreachable and placement avoids it, so a retry lands on the survivors.
    let data = pattern(2 * block + 3, 99);
    for attempt in 1..=4 {
        let path = format!("/jobs/later/new{attempt}");
        match owner.put(&path, data.clone()).await {
            Ok(()) => {
                let back = owner.open(&path).await?.read_to_end().await?;
                return check(back == data, &format!("a new file round-trips on the survivors (attempt {attempt})"));
            }
            Err(e) if e.kind() == ErrorKind::Unavailable && attempt < 4 => {
                println!("rdma_check: new file, attempt {attempt}: {e}; retrying");
                tokio::time::sleep(Duration::from_secs(3)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
    unreachable!("the last attempt returns")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter("info").init();
    let args: Vec<String> = std::env::args().collect();
    let [_, metadata, block, phase, servers @ ..] = &args[..] else {
        anyhow::bail!("usage: rdma_check METADATA BLOCK_SIZE_BYTES before|after [ADDR=ADMIN ...]");
    };
    let block: usize = block.parse()?;
    tern_rdma::install();
    match tern_transport::rdma_devices() {
        Ok(devices) => println!("rdma_check: RDMA devices {devices:?}"),
        Err(why) => anyhow::bail!("{why}: this check needs an RDMA device (soft-RoCE in the guest)"),
    }
    match phase.as_str() {
        "before" => before(metadata, block, &Servers::parse(servers)?).await,
        "after" => after(metadata, block).await,
        other => anyhow::bail!("unknown phase {other:?} (expected before or after)"),
    }
}
