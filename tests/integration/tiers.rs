//! Storage classes and the NVMe tier through a real cluster, once per io engine: filling DRAM
//! sends the next `any` file to NVMe, `nvme` goes straight there, and filling everything gives
//! OutOfSpace while earlier files stay readable.

use crate::common;

use bytes::Bytes;
use common::{random_bytes, Cluster, Nvme};
use tern_client::{Client, ErrorKind, StorageClass, Tier};

const MIB: usize = 1 << 20;

async fn tiers_of(client: &Client, path: &str) -> Vec<Tier> {
    let (info, blocks) = client.stat_with_blocks(path, true).await.unwrap();
    assert!(blocks.iter().all(|(_, alive)| *alive));
    let _ = info;
    blocks.iter().map(|(b, _)| Tier::of_block(b.block_id)).collect()
}

async fn put(client: &Client, path: &str, data: &[u8], class: StorageClass) -> tern_client::Result<()> {
    client.put_with_class(path, Bytes::copy_from_slice(data), class).await
}

async fn dram_then_nvme_then_out_of_space(engine: &str) {
    // 4 DRAM blocks and 8 NVMe blocks of 1 MiB. Files of 2.5 MiB take 3 blocks each (a writer
    // asks for 2, then 1 at close), so no allocation asks for more than the file needs.
    let cluster = Cluster::start_with_nvme(1, "4MiB", Nvme { size: "8MiB", engine }).await;
    let client = cluster.client().await;
    let status = client.status().await.unwrap();
    let nvme = status.servers[0].tiers.iter().find(|t| t.tier == "nvme").expect("an nvme tier");
    assert_eq!((nvme.engine.as_str(), nvme.capacity_blocks), (engine, 8), "{nvme:?}");
    let text = cluster.tern_ok(&["status"]);
    assert!(text.contains("nvme") && text.contains(engine), "{text}");

    let size = 5 * MIB / 2;
    let files: Vec<(String, Vec<u8>)> = (0..4).map(|i| (format!("/t/{i}"), random_bytes(size + i))).collect();
    put(&client, &files[0].0, &files[0].1, StorageClass::Any).await.unwrap();
    assert_eq!(tiers_of(&client, &files[0].0).await, [Tier::Dram; 3]);
    // DRAM has one block left: the next `any` file spills to NVMe.
    put(&client, &files[1].0, &files[1].1, StorageClass::Any).await.unwrap();
    assert_eq!(tiers_of(&client, &files[1].0).await, [Tier::Dram, Tier::Nvme, Tier::Nvme]);
    // `nvme` goes straight there.
    put(&client, &files[2].0, &files[2].1, StorageClass::Nvme).await.unwrap();
    assert_eq!(tiers_of(&client, &files[2].0).await, [Tier::Nvme; 3]);
    let stat = cluster.tern_ok(&["fs", "stat", &files[2].0]);
    assert!(stat.contains("class:    nvme") && stat.contains(" nvme "), "{stat}");
    // DRAM is full: a `dram` file is refused.
    let err = put(&client, "/t/dram", b"0123456789", StorageClass::Dram).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfSpace, "{err}");
    assert!(err.to_string().contains("class dram"), "{err}");
    // Three NVMe blocks left: one more file, then nothing.
    put(&client, &files[3].0, &files[3].1, StorageClass::Any).await.unwrap();
    assert_eq!(tiers_of(&client, &files[3].0).await, [Tier::Nvme; 3]);
    let err = put(&client, "/t/more", b"x", StorageClass::Any).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfSpace, "{err}");
    assert!(err.to_string().contains("0 dram and 0 nvme"), "{err}");
    // The cluster still serves every earlier file, whole and in ranges across tiers.
    for (path, data) in &files {
        let back = client.open(path).await.unwrap().read_to_end().await.unwrap();
        assert!(back == *data, "{path} came back different ({engine})");
        let reader = client.open(path).await.unwrap();
        let range = reader.read_at(MIB as u64 - 7, MIB + 13).await.unwrap();
        assert_eq!(range[..], data[MIB - 7..2 * MIB + 6], "{path} ({engine})");
    }
    let json = cluster.tern_ok(&["status", "--json"]);
    assert!(json.contains(&format!("\"engine\":\"{engine}\"")), "{json}");
    // Deleting gives NVMe space back once the server has freed it.
    client.delete(&files[2].0, false).await.unwrap();
    cluster
        .wait_for("the freed NVMe blocks to be reusable", std::time::Duration::from_secs(10), || async {
            put(&client, "/t/again", &files[2].1, StorageClass::Nvme).await.ok()
        })
        .await;
    let back = client.open("/t/again").await.unwrap().read_to_end().await.unwrap();
    assert!(back == files[2].1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_with_uring() {
    dram_then_nvme_then_out_of_space("uring").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_with_psync() {
    dram_then_nvme_then_out_of_space("psync").await;
}
