//! Readiness checks a cluster's daemons answer, for [`crate::wait_ready`]: the metadata server
//! answers a status call, a storage server is registered and alive there.

use std::net::SocketAddr;

use anyhow::anyhow;
use tern_client::{Client, ClientOptions};

use crate::process::Daemon;
use crate::ready::{wait_ready, Deadline};

/// The metadata server at `url` answers a status call: a client of it, to probe again with.
pub async fn metadata_answers(url: &str, options: &ClientOptions) -> anyhow::Result<Client> {
    let client = Client::connect_with(url, options.clone()).await?;
    client.status().await?;
    Ok(client)
}

/// The metadata server lists the storage server at `addr` as alive.
pub async fn storage_registered(client: &Client, addr: SocketAddr) -> anyhow::Result<()> {
    let status = client.status().await?;
    let addr = addr.to_string();
    // A metadata server that kept its state across restarts may also list an earlier, dead
    // registration from the same address.
    // Ready once its inventory is reconciled: until then it takes no placements.
    let listed: Vec<&str> = status
        .servers
        .iter()
        .filter(|server| server.address == addr && server.alive)
        .map(|s| s.state.as_str())
        .collect();
    match (listed.iter().any(|&state| state != "registering"), listed.is_empty()) {
        (true, _) => Ok(()),
        (false, false) => Err(anyhow!("registered, its inventory not yet reconciled")),
        (false, true) => Err(anyhow!("not registered, or not alive")),
    }
}

/// Waits until the metadata server at `url` answers (`daemons[metadata]` is blamed if it does
/// not) and lists each storage server alive (each given as the daemon to blame and its address),
/// failing at once if any of `daemons` exits. Returns a client of the metadata server.
pub async fn cluster_ready(
    daemons: &mut [Daemon],
    metadata: usize,
    url: &str,
    options: &ClientOptions,
    storage: &[(usize, SocketAddr)],
    deadline: &Deadline,
) -> anyhow::Result<Client> {
    let what = format!("the metadata server at {url} to answer");
    let client = wait_ready(daemons, metadata, deadline, &what, || metadata_answers(url, options)).await?;
    for &(daemon, addr) in storage {
        let what = format!("the storage server at {addr} to register with the metadata server");
        wait_ready(daemons, daemon, deadline, &what, || storage_registered(&client, addr)).await?;
    }
    Ok(client)
}
