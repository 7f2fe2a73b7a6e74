//! Tern as `tern bench io` measures it: an embedded cluster of one storage server, reached
//! through `tern_client` with the options of each Tern system (transport, storage class).

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use tern_client::{BlockLocation, Client, ClientOptions, ErrorKind};
use tern_local::cluster::EmbeddedCluster;
use tern_proto::v1::metadata_client::MetadataClient;
use tern_proto::v1::{AllocateBlocksRequest, CreateRequest};

use super::{Cell, IoOptions, Op, System, TERN_BLOCK_SIZE};
use crate::harness::{go, join_all, payload, Budget, Recorder, Samples};

/// How long a write cell waits for freed Tern blocks to come back before giving up.
const ALLOCATE_PATIENCE: Duration = Duration::from_secs(30);

/// Tern reached through `tern_client` with `options`; the embedded cluster lives as long as this.
pub(super) struct TernTarget {
    cluster: EmbeddedCluster,
    options: ClientOptions,
    /// The storage class of the files it writes and reads.
    class: tern_client::StorageClass,
    admin: Client,
    metadata: MetadataClient<tonic::transport::Channel>,
    /// The read set: path of a sealed file of `items` x `size` bytes.
    reads: Option<(String, u64)>,
    cells: u64,
}

impl TernTarget {
    /// One storage server with a DRAM tier of `--dram`; for `tern-nvme` also an NVMe tier as
    /// large in a file beside the `file` systems' (on the disk of `--dir`).
    pub(super) async fn start(system: System, io: &IoOptions) -> anyhow::Result<TernTarget> {
        let dram = format!("{}MiB", io.dram_bytes.div_ceil(1 << 20));
        let block_size = format!("{}MiB", TERN_BLOCK_SIZE >> 20);
        let nvme = (system == System::TernNvme).then(|| dram.clone());
        let cluster =
            EmbeddedCluster::start_with(&io.tern, 1, &dram, &block_size, nvme.as_deref(), &io.dir, &[]).await?;
        let mut options = ClientOptions::default();
        let mut class = tern_client::StorageClass::Dram;
        match system {
            System::TernQuic | System::TernTls => {
                let quic = system == System::TernQuic;
                options.transport =
                    if quic { tern_client::TransportKind::Quic } else { tern_client::TransportKind::Tls };
                options.tls_dir = Some(cluster.tls_dir());
            }
            System::TernNvme => {
                class = tern_client::StorageClass::Nvme;
                options.transport = tern_client::TransportKind::Tcp;
            }
            System::TernLocal => options.transport = tern_client::TransportKind::Local,
            System::TernRdma => {
                // The embedded servers serve RDMA on loopback (rdma = auto) where a device is;
                // a figure labelled tern-rdma must not be TCP's, so RDMA is checked first.
                let addr = cluster.storage_addr(0);
                if let Err(e) = tern_transport::rdma_or::rdma_connect(&addr).await {
                    anyhow::bail!("tern-rdma: the embedded storage server {addr} does not answer over RDMA: {e}");
                }
                options.transport = tern_client::TransportKind::Rdma;
            }
            _ => options.transport = tern_client::TransportKind::Tcp,
        }
        // The embedded cluster's control plane is plain on loopback, QUIC or not.
        let metadata_url = format!("http://{}", cluster.metadata_addr);
        let admin = Client::connect_with(&metadata_url, options.clone()).await?;
        let metadata = MetadataClient::connect(metadata_url).await?;
        let block_size = admin.block_size().await?;
        ensure!(
            u64::from(block_size) >= TERN_BLOCK_SIZE,
            "the embedded cluster has {block_size}-byte blocks, less than the {TERN_BLOCK_SIZE} bytes measured"
        );
        Ok(TernTarget { cluster, options, class, admin, metadata, reads: None, cells: 0 })
    }

    /// A client of its own per worker, with one connection to the storage server, so each worker
    /// has its own connection as each Redis worker does.
    async fn worker_client(&self) -> anyhow::Result<Client> {
        let options = ClientOptions { connections_per_server: 1, ..self.options.clone() };
        Ok(Client::connect_with(&format!("http://{}", self.cluster.metadata_addr), options).await?)
    }

    pub(super) async fn prepare_reads(&mut self, size: u64, items: u64) -> anyhow::Result<()> {
        let path = format!("/bench-io/read-{size}");
        let mut writer = self.admin.create_with_class(&path, true, self.class).await?;
        for item in 0..items {
            writer.write_bytes(payload(size, item)).await?;
        }
        writer.close().await?;
        self.reads = Some((path, items));
        Ok(())
    }

    pub(super) async fn finish_reads(&mut self) -> anyhow::Result<()> {
        if let Some((path, _)) = self.reads.take() {
            self.admin.delete(&path, false).await?;
        }
        Ok(())
    }

    pub(super) async fn measure(&mut self, cell: Cell, budget: Budget) -> anyhow::Result<Samples> {
        self.cells += 1;
        let mut clients = Vec::with_capacity(cell.concurrency as usize);
        for _ in 0..cell.concurrency {
            clients.push(self.worker_client().await?);
        }
        match cell.op {
            Op::Write => {
                let per_block = TERN_BLOCK_SIZE / cell.size;
                let blocks_per_worker = budget.ops_in_all().div_ceil(per_block);
                let path = format!("/bench-io/write-{}", self.cells);
                let file_id = self
                    .metadata
                    .create(CreateRequest {
                        path: path.clone(),
                        parents: true,
                        sealed: false,
                        storage_class: self.class.to_string(),
                        replicas: 1,
                        ..Default::default()
                    })
                    .await?
                    .into_inner()
                    .file_id;
                let blocks = self.allocate(file_id, blocks_per_worker * u64::from(cell.concurrency)).await?;
                let budget = budget.start();
                let mut tasks = Vec::new();
                for (worker, client) in clients.into_iter().enumerate() {
                    let start = worker * blocks_per_worker as usize;
                    let mine = blocks[start..start + blocks_per_worker as usize].to_vec();
                    tasks.push(tokio::spawn(tern_writer(client, mine, cell.size, budget)));
                }
                let recorders = join_all(tasks).await;
                // Unsealed: deleting frees every block, written or not.
                self.admin.delete(&path, false).await?;
                Samples::merge(recorders?)
            }
            Op::Read => {
                let (path, items) = self.reads.clone().context("no Tern read set prepared")?;
                let mut readers = Vec::new();
                for client in clients {
                    readers.push(client.open(&path).await?);
                }
                let budget = budget.start();
                let mut tasks = Vec::new();
                for (worker, reader) in readers.into_iter().enumerate() {
                    let concurrency = u64::from(cell.concurrency);
                    tasks.push(tokio::spawn(async move {
                        let mut recorder = Recorder::new(budget);
                        let mut item = worker as u64;
                        while go(&recorder).await {
                            let started = Instant::now();
                            let data = reader.read_at((item % items) * cell.size, cell.size as usize).await?;
                            ensure!(data.len() as u64 == cell.size, "read returned {} bytes", data.len());
                            recorder.record(started);
                            item += concurrency;
                        }
                        Ok(recorder)
                    }));
                }
                Samples::merge(join_all(tasks).await?)
            }
        }
    }

    /// Allocates `count` blocks in batches before timing, waiting (bounded) for blocks freed by
    /// the previous cell to come back.
    async fn allocate(&mut self, file_id: u64, count: u64) -> anyhow::Result<Vec<BlockLocation>> {
        let deadline = Instant::now() + ALLOCATE_PATIENCE;
        let mut blocks = Vec::with_capacity(count as usize);
        while (blocks.len() as u64) < count {
            let batch = (count - blocks.len() as u64).min(u64::from(tern_proto::MAX_ALLOCATE_BLOCKS)) as u32;
            let request = AllocateBlocksRequest { file_id, count: batch, client_host: "127.0.0.1".into() };
            match self.metadata.allocate_blocks(request).await {
                Ok(reply) => blocks.extend(reply.into_inner().blocks),
                Err(status) => {
                    let error = tern_client::Error::from(status);
                    if !matches!(error.kind(), ErrorKind::Unavailable | ErrorKind::OutOfSpace)
                        || Instant::now() > deadline
                    {
                        bail!("allocating {count} blocks of {TERN_BLOCK_SIZE} bytes: {error}");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        Ok(blocks)
    }
}

/// Appends `size`-byte writes to each of `blocks` in turn until the budget ends.
async fn tern_writer(
    client: Client,
    blocks: Vec<BlockLocation>,
    size: u64,
    budget: Budget,
) -> anyhow::Result<Recorder> {
    let data = payload(size, 7);
    let mut recorder = Recorder::new(budget);
    let (mut block, mut offset) = (0usize, 0u64);
    while go(&recorder).await {
        if offset + size > TERN_BLOCK_SIZE {
            block += 1;
            offset = 0;
        }
        let Some(location) = blocks.get(block) else { break };
        let started = Instant::now();
        // The files are outside /jobs: the volume principal's, no token needed.
        client.write_block("", location, offset as u32, data.clone()).await?;
        recorder.record(started);
        offset += size;
    }
    Ok(recorder)
}
