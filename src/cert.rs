//! `tern cert`: the cluster's TLS material (`init`: a CA and a node certificate signed by it, for
//! `--tls-dir`), its cluster secret, and the credentials made from the secret (`secret`,
//! `credential`; see `tern_proto::identity`).

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand};
use tern_proto::identity::{self, ClusterSecret, Identity, Role, DEFAULT_TENANT};

/// Where credentials go under a `tern up` or `tern cert` directory.
pub const CREDENTIALS_DIR: &str = "credentials";

#[derive(Args)]
pub struct CertArgs {
    #[command(subcommand)]
    command: CertCommand,
}

#[derive(Subcommand)]
enum CertCommand {
    /// Make a cluster CA (ca.pem, ca.key) and a node certificate (node.pem, node.key) signed by
    /// it, the cluster secret (cluster.secret) and an operator's and the default tenant's
    /// credentials (credentials/admin, credentials/default). Copy ca.pem, node.pem, node.key and
    /// cluster.secret to every daemon's node, and start daemons with --tls-dir DIR.
    Init(InitArgs),
    /// Make a cluster secret (DIR/cluster.secret) for a cluster without TLS, and the operator's and
    /// default tenant's credentials from it (DIR/credentials/); kept if there already.
    Secret {
        /// Directory to write to (created if missing).
        #[arg(long)]
        dir: PathBuf,
    },
    /// Issue a credential from the cluster secret: for a tenant's applications (`--role client
    /// --tenant NAME`), or an operator (`--role admin`). Printed, or written to --out (mode 0600).
    Credential(CredentialArgs),
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

#[derive(Args)]
struct CredentialArgs {
    /// The cluster secret (`tern up`'s DIR/cluster.secret, or cluster.secret in a TLS directory).
    #[arg(long)]
    secret: PathBuf,
    /// client (a tenant's applications), executor (an executor of the pool) or admin (an
    /// operator). The other daemons' roles (server, metadata, scheduler) are made by those
    /// daemons from the secret, never handed out.
    #[arg(long, value_parser = parse_handed_out_role)]
    role: Role,
    /// The tenant of a client credential.
    #[arg(long, default_value = DEFAULT_TENANT)]
    tenant: String,
    /// Write the credential to this file (created new, mode 0600) instead of printing it.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn parse_handed_out_role(name: &str) -> Result<Role, String> {
    match Role::parse(name).map_err(|e| e.0)? {
        role @ (Role::Client | Role::Executor | Role::Admin) => Ok(role),
        role => Err(format!(
            "{role} credentials are made by the daemons from the cluster secret; issue client, executor or admin"
        )),
    }
}

pub fn run(args: CertArgs) -> anyhow::Result<()> {
    match args.command {
        CertCommand::Init(args) => {
            let options = tern_transport::tls::InitOptions { hosts: args.hosts, days: args.days, force: args.force };
            let names = tern_transport::tls::init(&args.dir, &options)?;
            ensure_credentials(&args.dir)?;
            let dir = args.dir.display();
            outln!("Made a cluster CA, a node certificate and a cluster secret in {dir} (valid {} days).", args.days);
            outln!("The node certificate is valid for: {}", names.join(", "));
            outln!("Keys (ca.key, node.key, cluster.secret) are readable by their owner only; keep ca.key off the nodes if you like:");
            outln!("daemons need ca.pem, node.pem, node.key and cluster.secret; clients need ca.pem, node.pem and node.key,");
            outln!("and act as an operator or a tenant with a credential ({dir}/{CREDENTIALS_DIR}/admin, `tern cert credential`).");
            outln!();
            outln!("  tern metadata-server --tls-dir {dir} ...");
            outln!("  tern storage-server --tls-dir {dir} ...   # also serves QUIC");
            outln!("  tern fs --tls-dir {dir} --transport quic ls /");
            outln!("  tern admin --tls-dir {dir} --as {dir}/{CREDENTIALS_DIR}/admin cordon HOST:PORT");
            Ok(())
        }
        CertCommand::Secret { dir } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let secret = ensure_credentials(&dir)?;
            outln!(
                "The cluster secret is {} (daemons: cluster_secret_file); credentials are in {}.",
                secret.display(),
                dir.join(CREDENTIALS_DIR).display()
            );
            Ok(())
        }
        CertCommand::Credential(args) => {
            let secret = ClusterSecret::load(&args.secret).map_err(|e| anyhow::anyhow!("{e}"))?;
            let tenant = if args.role == Role::Client { args.tenant.as_str() } else { "" };
            identity::validate_tenant(&Identity::new(args.role, tenant, "").tenant)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let credential = secret.credential(&Identity::new(args.role, tenant, ""));
            match args.out {
                Some(out) => {
                    identity::write_credential(&out, &credential)
                        .with_context(|| format!("writing {}", out.display()))?;
                    outln!("Wrote a {} credential to {} (use it with --as {0} or TERN_AS).", args.role, out.display());
                }
                None => outln!("{credential}"),
            }
            Ok(())
        }
    }
}

/// The cluster secret (`DIR/cluster.secret`, which the daemons read) and the credentials made
/// from it for the shell (`DIR/credentials/admin`, `DIR/credentials/default`) and for executors
/// (`DIR/credentials/executor`, which hold no secret), each made once and kept; a credential of
/// an earlier secret is made anew. Returns the secret's path.
pub fn ensure_credentials(dir: &Path) -> anyhow::Result<PathBuf> {
    let path = dir.join(tern_common::config::CLUSTER_SECRET_FILE);
    if !path.exists() {
        ClusterSecret::generate().write_new(&path).with_context(|| format!("writing {}", path.display()))?;
    }
    let secret = ClusterSecret::load(&path).map_err(|e| anyhow::anyhow!("{e}"))?;
    let credentials = dir.join(CREDENTIALS_DIR);
    std::fs::create_dir_all(&credentials).with_context(|| format!("creating {}", credentials.display()))?;
    let shell = [
        ("admin", Identity::new(Role::Admin, "", "")),
        (DEFAULT_TENANT, Identity::new(Role::Client, "", "")),
        ("executor", Identity::new(Role::Executor, "", "")),
    ];
    for (name, identity) in shell {
        let file = credentials.join(name);
        let current = identity::load_credential(&file).is_ok_and(|text| secret.verify(&text).is_ok());
        if !current {
            let _ = std::fs::remove_file(&file);
            identity::write_credential(&file, &secret.credential(&identity))
                .with_context(|| format!("writing {}", file.display()))?;
        }
    }
    Ok(path)
}
