//! `tern scheduler`: a TOML config overridden by flags.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

#[derive(Args)]
pub struct SchedulerArgs {
    /// TOML config file (keys as in the README); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// gRPC listen address for jobs and executors [default: 127.0.0.1:9062].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Prometheus metrics endpoint [default: 127.0.0.1:9063].
    #[arg(long)]
    admin: Option<SocketAddr>,
    /// Metadata server the jobs' shuffles live on [default: 127.0.0.1:9060].
    #[arg(long)]
    metadata: Option<String>,
    /// Queue weight, NAME=WEIGHT; repeat for several queues [default: default=1].
    #[arg(long = "queue", value_name = "NAME=WEIGHT")]
    queues: Vec<String>,
    /// How often executors heartbeat [default: 1000].
    #[arg(long)]
    heartbeat_interval_ms: Option<u64>,
    /// An executor silent this long is lost and its tasks run elsewhere [default: 5000].
    #[arg(long)]
    executor_timeout_ms: Option<u64>,
    /// TLS material (`tern cert init`): serve gRPC over mutual TLS, and use it towards the
    /// metadata server [default: none].
    #[arg(long)]
    tls_dir: Option<PathBuf>,
    /// Allow plain gRPC beyond loopback without TLS [default: false].
    #[arg(long)]
    trusted_network: bool,
}

pub async fn run(args: SchedulerArgs) -> anyhow::Result<()> {
    let mut config: tern_scheduler::Config = tern_common::config::load(args.config.as_deref())?;
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    if let Some(admin) = args.admin {
        config.admin_listen = admin;
    }
    if let Some(metadata) = args.metadata {
        config.metadata = metadata;
    }
    for queue in &args.queues {
        let (name, weight) =
            queue.split_once('=').with_context(|| format!("--queue {queue:?}: expected NAME=WEIGHT"))?;
        let weight: u32 = weight.parse().with_context(|| format!("--queue {queue:?}: weight is not a number"))?;
        config.queues.insert(name.to_string(), weight);
    }
    if let Some(ms) = args.heartbeat_interval_ms {
        config.heartbeat_interval_ms = ms;
    }
    if let Some(ms) = args.executor_timeout_ms {
        config.executor_timeout_ms = ms;
    }
    if args.tls_dir.is_some() {
        config.tls_dir = args.tls_dir;
    }
    config.trusted_network |= args.trusted_network;
    tern_scheduler::server::run(config).await
}
