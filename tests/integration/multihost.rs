//! Tern across hosts: each daemon and the client on a network-namespace host of its own
//! ([`common::multihost`]), TLS between them, faults as a real network has them. These need root
//! to make namespaces (CI has it) and fail, saying so, without it.

use std::time::Duration;

use tern_client::TransportKind;

use crate::common::multihost::{Layout, MultiHost};

/// How long a terasort of the sizes here may take on a loaded 2-core machine.
const SORT_TIMEOUT: Duration = Duration::from_secs(240);

fn two_storage_servers() -> Layout<'static> {
    Layout { storage_servers: 2, dram: "2GiB", metadata_sets: &[] }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_1_gib_terasort_from_a_client_host_validates_over_tls_across_hosts() {
    let cluster = MultiHost::start(two_storage_servers()).await;
    let mut sort = cluster.spawn_terasort("1GiB", TransportKind::Auto, &[]);
    let (report, _) = cluster.validated(&mut sort, SORT_TIMEOUT).await;
    assert_eq!(report["records"], (1u64 << 30) / 100, "{report}");
    assert_eq!((report["task_retries"].as_u64(), report["maps_recomputed"].as_u64()), (Some(0), Some(0)));
    // Both storage servers took part: the shuffle crossed hosts.
    let status = cluster.on_client(async || {
        let client = tern_client::Client::connect_with(&cluster.metadata_url, cluster.options(TransportKind::Auto))
            .await
            .unwrap();
        client.status().await.unwrap()
    });
    assert_eq!(status.servers.len(), 2, "{status:?}");
    let mut listed: Vec<&str> = status.servers.iter().filter(|s| s.alive).map(|s| s.address.as_str()).collect();
    listed.sort();
    assert_eq!(listed, cluster.storage_addrs, "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terasort_over_quic_across_hosts_validates() {
    let cluster = MultiHost::start(two_storage_servers()).await;
    let mut sort = cluster.spawn_terasort("256MiB", TransportKind::Quic, &[]);
    let (report, _) = cluster.validated(&mut sort, SORT_TIMEOUT).await;
    assert_eq!(report["records"], (256u64 << 20) / 100, "{report}");
}
