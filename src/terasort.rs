//! `tern teragen`, `tern teravalidate` and `tern terasort` (tern-terasort does the work; this
//! module starts the throwaway cluster `tern terasort` runs on when given none).

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use indicatif::MultiProgress;
use tern_client::{ClientOptions, StorageClass, TransportKind};
use tern_common::ByteSize;
use tern_local::cluster::EmbeddedCluster;
use tern_terasort::driver::{self, TerasortOptions};
use tern_terasort::in_memory;
use tern_terasort::tasks;
use tern_terasort::RECORD_LEN;

use crate::cli::MetadataAddr;

#[derive(Args)]
pub struct TeragenArgs {
    /// Bytes to generate (100-byte gensort records), e.g. 4GiB.
    #[arg(long)]
    size: ByteSize,
    /// Output directory: a store path, or a local one with --local.
    #[arg(long)]
    out: String,
    /// Parts to write, generated in parallel [default: one per 256 MiB, at least 2].
    #[arg(long)]
    parts: Option<usize>,
    /// Write to a local directory instead of the store.
    #[arg(long)]
    local: bool,
    #[command(flatten)]
    metadata: MetadataAddr,
}

#[derive(Args)]
pub struct TeravalidateArgs {
    /// Directory whose part-* files, in name order, are the sorted output.
    path: String,
    /// Read a local directory instead of the store.
    #[arg(long)]
    local: bool,
    /// Print one JSON object (records, checksum, duplicates, sorted).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    metadata: MetadataAddr,
}

#[derive(Args)]
pub struct TerasortArgs {
    /// Bytes to sort, e.g. 1GiB.
    #[arg(long, default_value = "1GiB")]
    size: ByteSize,
    /// Run against this cluster instead of starting an embedded one.
    #[arg(long)]
    metadata: Option<String>,
    /// Map tasks [default: one per 256 MiB of input, at least 2].
    #[arg(long)]
    maps: Option<usize>,
    /// Reduce tasks [default: one per 256 MiB, at least 2].
    #[arg(long)]
    reduces: Option<usize>,
    /// Copies of the input, the shuffle and the output (1 or 2), each on a different storage
    /// server: with 2, a storage server lost mid-job costs no recomputation; with 1, the maps
    /// whose output was lost are recomputed.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=tern_proto::MAX_REPLICAS as i64))]
    replicas: u32,
    /// Where the shuffle's segments live on their storage servers: dram (DRAM only), nvme
    /// (written behind to NVMe as their DRAM fills) or any (DRAM first, moved to NVMe when a
    /// server's DRAM runs short).
    #[arg(long, default_value = "any")]
    shuffle_class: StorageClass,
    /// Most memory each reduce's sort may hold, e.g. 256MiB: a larger partition is sorted in
    /// runs on local scratch disk ($TMPDIR) and merged into its output part [default: no bound,
    /// each partition sorted in memory].
    #[arg(long)]
    reduce_memory: Option<ByteSize>,
    /// Print one JSON object instead of progress and a table.
    #[arg(long)]
    json: bool,
    /// With --metadata: TLS material (`tern cert init`) for mutual TLS to the metadata server,
    /// needed for --transport tls and quic. An embedded cluster (no --metadata) ignores it.
    #[arg(long = "tls-dir", env = "TERN_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    /// With --metadata: transport of block data (auto, tcp, tls, quic or rdma), as for `tern fs`.
    #[arg(long, env = "TERN_TRANSPORT", default_value = "auto")]
    transport: TransportKind,
    #[command(flatten)]
    deadlines: crate::cli::Deadlines,
}

async fn client_unless_local(local: bool, metadata: &MetadataAddr) -> anyhow::Result<Option<tern_client::Client>> {
    Ok(if local { None } else { Some(metadata.connect().await?) })
}

pub async fn teragen(args: TeragenArgs) -> anyhow::Result<()> {
    let client = client_unless_local(args.local, &args.metadata).await?;
    let records = args.size.bytes() / RECORD_LEN as u64;
    let parts = args.parts.unwrap_or_else(|| tasks::default_tasks(args.size.bytes()));
    let out = tasks::location(&args.out, args.local);
    let summary = tasks::teragen(
        client.as_ref(),
        records,
        parts,
        &out,
        tern_client::CreateOptions::default(),
        &MultiProgress::new(),
    )
    .await?;
    outln!("Records: {}", summary.records);
    outln!("Checksum: {:x}", summary.checksum);
    Ok(())
}

pub async fn teravalidate(args: TeravalidateArgs) -> anyhow::Result<()> {
    let client = client_unless_local(args.local, &args.metadata).await?;
    let dir = tasks::location(&args.path, args.local);
    let progress = if args.json {
        MultiProgress::with_draw_target(indicatif::ProgressDrawTarget::hidden())
    } else {
        MultiProgress::new()
    };
    let summary = tasks::teravalidate(client.as_ref(), &dir, &progress).await?;
    if args.json {
        outln!(
            "{}",
            serde_json::json!({
                "records": summary.records,
                "checksum": format!("{:x}", summary.checksum),
                "duplicates": summary.duplicates,
                "sorted": summary.sorted(),
            })
        );
    } else {
        outln!("Records: {}", summary.records);
        outln!("Checksum: {:x}", summary.checksum);
        outln!("Duplicate keys: {}", summary.duplicates);
        if summary.sorted() {
            outln!("SUCCESS - all records are in order");
        }
    }
    anyhow::ensure!(summary.sorted(), "{} records are out of order", summary.unsorted);
    Ok(())
}

pub async fn terasort(args: TerasortArgs) -> anyhow::Result<()> {
    let mut options = TerasortOptions {
        size_bytes: args.size.bytes(),
        metadata: args.metadata.clone().unwrap_or_default(),
        // An embedded cluster is plain loopback, whatever the shell exported for other clusters.
        client: match args.metadata {
            Some(_) => args.deadlines.apply(ClientOptions {
                tls_dir: args.tls_dir.clone(),
                transport: args.transport,
                ..Default::default()
            }),
            None => args.deadlines.apply(ClientOptions::default()),
        },
        maps: args.maps.unwrap_or_else(|| tasks::default_tasks(args.size.bytes())),
        reduces: args.reduces.unwrap_or_else(|| tasks::default_tasks(args.size.bytes())),
        started: Instant::now(),
        progress: !args.json,
        replicas: args.replicas,
        shuffle_class: args.shuffle_class,
        reduce_memory: args.reduce_memory.map(|size| size.bytes()),
    };
    // Checked before a cluster is started for nothing.
    options.records()?;
    // Held to the end: dropping it stops the cluster.
    let embedded = match args.metadata {
        Some(_) => None,
        None => {
            let dram = driver::dram_per_server(options.size_bytes, options.replicas);
            // An nvme shuffle gets an NVMe tier of the same size; otherwise `tern up`'s own.
            let nvme = (options.shuffle_class == StorageClass::Nvme).then_some(dram.as_str());
            let cluster = EmbeddedCluster::start_with(
                &std::env::current_exe()?,
                2,
                &dram,
                "1MiB",
                nvme,
                &std::env::temp_dir(),
                &[],
            )
            .await?;
            options.metadata = cluster.metadata_addr.clone();
            Some(cluster)
        }
    };
    let report = driver::terasort(&options).await?;
    // The cluster's memory is given back before the in-memory sort takes its own.
    drop(embedded);
    let records = report.records;
    let limit = tokio::task::spawn_blocking(move || in_memory::sort(records)).await??;
    let of_limit = report.sort_mb_per_s / 1e3 / limit.gb_per_s;
    if args.json {
        let mut json = serde_json::to_value(&report)?;
        json["in_memory_sort"] = serde_json::to_value(&limit)?;
        json["of_in_memory_sort"] = of_limit.into();
        outln!("{json}");
    } else {
        let phases = &report.phases;
        outln!(
            "sorted {} records ({}) with {} maps and {} reduces",
            report.records,
            ByteSize(report.bytes).human(),
            report.maps,
            report.reduces
        );
        outln!("  teragen   {:>8.2} s", phases.teragen);
        outln!("  map       {:>8.2} s", phases.map);
        outln!("  reduce    {:>8.2} s", phases.reduce);
        outln!("  validate  {:>8.2} s", phases.validate);
        outln!("  total     {:>8.2} s", report.total_seconds);
        outln!(
            "replicas: {}  shuffle class: {}  sort runs: {}  maps recomputed: {}  task retries: {}",
            report.replicas,
            report.shuffle_class,
            report.sort_runs,
            report.maps_recomputed,
            report.task_retries
        );
        outln!(
            "sort rate: {:.0} MB/s ({:.2} GB/min), map and reduce phases",
            report.sort_mb_per_s,
            report.sort_mb_per_s * 60.0 / 1000.0
        );
        outln!("{}", limit.describe(report.records));
        outln!(
            "  Tern terasort's rate is {of_limit:.3} of it ({:.3} GB/s / {:.3} GB/s)",
            report.sort_mb_per_s / 1e3,
            limit.gb_per_s
        );
        outln!(
            "input checksum {}  output checksum {}  duplicates {}",
            report.input_checksum,
            report.output_checksum,
            report.duplicates
        );
        outln!("{}", if report.valid() { "output is VALID" } else { "output is INVALID" });
    }
    anyhow::ensure!(
        report.valid(),
        "terasort output is invalid (sorted: {}, checksums {} vs {})",
        report.sorted,
        report.input_checksum,
        report.output_checksum
    );
    Ok(())
}
