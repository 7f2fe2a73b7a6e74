//! `tern cert init`: a cluster CA and a node certificate signed by it, for `--tls-dir`.

use std::path::PathBuf;

use clap::{Args, Subcommand};

#[derive(Args)]
pub struct CertArgs {
    #[command(subcommand)]
    command: CertCommand,
}

#[derive(Subcommand)]
enum CertCommand {
    /// Make a cluster CA (ca.pem, ca.key) and a node certificate (node.pem, node.key) signed by
    /// it. Copy the directory to every node and client, and start daemons with --tls-dir DIR.
    Init(InitArgs),
}

#[derive(Args)]
struct InitArgs {
    /// Directory to write the material to (created if missing).
    #[arg(long)]
    dir: PathBuf,
    /// Another DNS name or IP address the node certificate is valid for (repeatable); localhost,
    /// 127.0.0.1, ::1 and this machine's hostname are always in it.
    #[arg(long = "host")]
    hosts: Vec<String>,
    /// Days the certificates stay valid.
    #[arg(long, default_value_t = tern_transport::tls::DEFAULT_DAYS)]
    days: u32,
    /// Replace a CA already in DIR (every node then needs the new material).
    #[arg(long)]
    force: bool,
}

pub fn run(args: CertArgs) -> anyhow::Result<()> {
    match args.command {
        CertCommand::Init(args) => {
            let options = tern_transport::tls::InitOptions { hosts: args.hosts, days: args.days, force: args.force };
            let names = tern_transport::tls::init(&args.dir, &options)?;
            let dir = args.dir.display();
            outln!("Made a cluster CA and a node certificate in {dir} (valid {} days).", args.days);
            outln!("The node certificate is valid for: {}", names.join(", "));
            outln!("Keys (ca.key, node.key) are readable by their owner only; keep ca.key off the nodes if you like:");
            outln!("daemons and clients need ca.pem, node.pem and node.key.");
            outln!();
            outln!("  tern metadata-server --tls-dir {dir} ...");
            outln!("  tern storage-server --tls-dir {dir} ...   # also serves QUIC");
            outln!("  tern fs --tls-dir {dir} --transport quic ls /");
            Ok(())
        }
    }
}
