//! The command line: one subcommand per role or action.

use clap::{Args, Parser, Subcommand};

use std::path::PathBuf;

use tern_client::{ClientOptions, TransportKind};

use crate::{admin, bench, cert, daemons, executor, fs, job, status, terasort, up};

#[derive(Parser)]
#[command(name = "tern", version, about = "Tern: a serverless shuffle and intermediate-data store")]
pub struct Cli {
    /// Log lines as text (coloured only on a terminal) or json (one object per line).
    #[arg(long, env = "TERN_LOG_FORMAT", default_value = "text", global = true, value_name = "FORMAT")]
    pub log_format: tern_common::LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run a whole cluster on this machine in the foreground: a metadata server and N storage servers.
    Up(up::UpArgs),
    /// Run the metadata server (namespace, jobs, block placement).
    MetadataServer(daemons::MetadataArgs),
    /// Run a storage server (DRAM tier, block service).
    StorageServer(daemons::StorageArgs),
    /// Run the task scheduler (jobs of stages; executors pull tasks from it).
    Scheduler(daemons::SchedulerArgs),
    /// Jobs on the scheduler: submit FILE, terasort, status, list, cancel.
    Job(job::JobArgs),
    /// Files: put, get, cat, ls, stat, rm, mkdir, mv.
    Fs(fs::FsArgs),
    /// Storage servers with each tier's capacity and use, and jobs.
    Status(status::StatusArgs),
    /// Benchmarks that measure Tern beside a peer in the same run.
    Bench(bench::BenchArgs),
    /// Sort gensort records through the shuffle service (an embedded cluster unless --metadata).
    Terasort(terasort::TerasortArgs),
    /// Generate gensort-compatible records into the store or a local directory.
    Teragen(terasort::TeragenArgs),
    /// Check sorted records as valsort does: order, count, checksum, duplicates.
    Teravalidate(terasort::TeravalidateArgs),
    /// TLS material: `cert init` makes a cluster CA and a node certificate.
    Cert(cert::CertArgs),
    /// Run an executor: offers CPUs, memory and GPUs to the scheduler and runs the tasks it hands out.
    Executor(executor::ExecutorArgs),
    /// Operators: storage servers (show, cordon, uncordon, drain), jobs (list, end), shuffles.
    Admin(admin::AdminArgs),
    /// Print a shell completion script: `tern completions bash > /etc/bash_completion.d/tern`.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
}

impl Command {
    /// Daemons log at info by default; client commands only warn, so their output stays clean.
    pub fn is_daemon(&self) -> bool {
        matches!(
            self,
            Command::Up(_)
                | Command::MetadataServer(_)
                | Command::StorageServer(_)
                | Command::Scheduler(_)
                | Command::Executor(_)
        )
    }
}

/// Where client commands find the cluster, and how they talk to it.
#[derive(Args, Clone)]
pub struct MetadataAddr {
    /// Metadata server address: host:port, https://host:port (TLS) or http://host:port (plain).
    /// A bare host:port uses TLS when --tls-dir is given.
    #[arg(long = "metadata", env = "TERN_METADATA", default_value_t = tern_common::ports::default_metadata(), global = true)]
    pub addr: String,
    /// TLS material (`tern cert init`, or DIR/tls of `tern up`): mutual TLS to the metadata
    /// server, and needed for --transport tls and quic.
    #[arg(long = "tls-dir", env = "TERN_TLS_DIR", global = true)]
    pub tls_dir: Option<PathBuf>,
    /// Transport of block data to storage servers: auto (the same-host socket to a server on
    /// this host; else plain TCP to servers on loopback, TLS over TCP to others when --tls-dir is
    /// given, else plain TCP, and RDMA where this host and the server have it and no --tls-dir is
    /// given), local (the same-host socket only: a server elsewhere is an error), tcp, tls or quic
    /// (both need --tls-dir), or rdma (RDMA to each server serving it, plain TCP to others, said
    /// once per server).
    #[arg(long, env = "TERN_TRANSPORT", default_value = "auto", global = true)]
    pub transport: TransportKind,
    /// Act with the credential in this file: an operator's (`DIR/credentials/admin` of `tern up`)
    /// for `tern admin`, or a tenant's (`DIR/credentials/<tenant>`). Without it, a client of the
    /// default tenant.
    #[arg(long = "as", env = "TERN_AS", global = true, value_name = "FILE", value_parser = read_credential)]
    pub credential: Option<Credential>,
    #[command(flatten)]
    pub deadlines: Deadlines,
}

/// A credential read from its file (`--as`).
#[derive(Clone, Debug)]
pub struct Credential(String);

impl Credential {
    pub fn text(&self) -> &str {
        &self.0
    }
}

pub fn read_credential(path: &str) -> Result<Credential, String> {
    tern_proto::identity::load_credential(std::path::Path::new(path)).map(Credential).map_err(|e| e.0)
}

/// The client's deadlines, in milliseconds; defaults are `tern_client`'s (one definition each).
#[derive(Args, Clone, Debug)]
pub struct Deadlines {
    /// Deadline for opening a connection, handshake included, to the metadata server or a
    /// storage server.
    #[arg(long, env = "TERN_CONNECT_TIMEOUT_MS", global = true, value_name = "MS",
          default_value_t = tern_client::DEFAULT_CONNECT_TIMEOUT.as_millis() as u64)]
    pub connect_timeout_ms: u64,
    /// Deadline for an RDMA connect to a storage server, after which the client uses TCP for it
    /// (part of --connect-timeout-ms). Raise it on an emulated CPU, where connects take seconds.
    #[arg(long, env = "TERN_RDMA_CONNECT_TIMEOUT_MS", global = true, value_name = "MS",
          default_value_t = tern_client::DEFAULT_RDMA_CONNECT_TIMEOUT.as_millis() as u64)]
    pub rdma_connect_timeout_ms: u64,
    /// Deadline for each metadata (control-plane) call.
    #[arg(long, env = "TERN_RPC_TIMEOUT_MS", global = true, value_name = "MS",
          default_value_t = tern_client::DEFAULT_RPC_TIMEOUT.as_millis() as u64)]
    pub rpc_timeout_ms: u64,
    /// Deadline for each request to a storage server (Auth, block read or write, shuffle push
    /// or fetch); a connection that misses one is given up.
    #[arg(long, env = "TERN_BLOCK_TIMEOUT_MS", global = true, value_name = "MS",
          default_value_t = tern_client::DEFAULT_BLOCK_REQUEST_TIMEOUT.as_millis() as u64)]
    pub block_timeout_ms: u64,
}

impl Deadlines {
    /// `options` with these deadlines.
    pub fn apply(&self, options: ClientOptions) -> ClientOptions {
        use std::time::Duration;
        ClientOptions {
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
            rdma_connect_timeout: Duration::from_millis(self.rdma_connect_timeout_ms),
            request_timeout: Duration::from_millis(self.rpc_timeout_ms),
            block_request_timeout: Duration::from_millis(self.block_timeout_ms),
            ..options
        }
    }
}

impl MetadataAddr {
    pub fn options(&self) -> ClientOptions {
        let defaults = ClientOptions::default();
        self.deadlines.apply(ClientOptions {
            transport: self.transport,
            tls_dir: self.tls_dir.clone(),
            // `--as` first; then a task's own (TERN_CREDENTIAL, which its executor sets).
            credential: self.credential.as_ref().map(|credential| credential.0.clone()).or(defaults.credential.clone()),
            ..defaults
        })
    }

    pub async fn connect(&self) -> anyhow::Result<tern_client::Client> {
        let _ = CONNECTED.set(self.addr.clone());
        Ok(tern_client::Client::connect_with(&self.addr, self.options()).await?)
    }
}

/// The metadata address this run connected to, for [`explain`].
static CONNECTED: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// `error`, saying what answered at the metadata address when the connection died before a call
/// got an answer ("operation was canceled"). The client names a storage server's block port from
/// h2's protocol error, but on a loaded machine the connection can die before that error reaches
/// the call: then the port is asked directly whether it answers with Tern's block frames.
pub async fn explain(error: anyhow::Error) -> anyhow::Error {
    if let Some(refusal) = refusal_for_users(&format!("{error:#}")) {
        return anyhow::anyhow!(refusal);
    }
    let Some(addr) = CONNECTED.get() else { return error };
    if !format!("{error:#}").contains("operation was canceled") || !answers_with_block_frames(addr).await {
        return error;
    }
    anyhow::anyhow!(
        "this port is not a Tern metadata server or scheduler (is it a storage server's block port?): it answers \
         with Tern block frames ({error:#})"
    )
}

/// An authorization refusal (`permission denied: <rpc> by <caller>: <what it lacked>`, as the
/// metadata server words it for operators and logs) said as the user's own command: who they
/// act as, what they lack, and what to do, without the RPC's name.
fn refusal_for_users(error: &str) -> Option<String> {
    let (_, rest) = error.split_once("permission denied: ")?;
    let (_rpc, rest) = rest.split_once(" by ")?;
    let (caller, lacked) = rest.split_once(": ")?;
    let todo = if lacked.contains("belongs to tenant") || lacked.contains("'s queue") {
        "act as a client of that tenant (--as its credential: `tern cert credential --role client --tenant NAME`) or as an operator"
    } else if lacked.contains("operator") {
        "run it as an operator: --as DIR/credentials/admin (`tern up` writes it; TERN_AS works too)"
    } else if lacked.contains("token of job") || lacked.contains("token it presented") {
        "only the job's own processes (holding its token, TERN_JOB_TOKEN) or an operator (--as DIR/credentials/admin) may"
    } else if lacked.contains("storage server") {
        "only storage servers, which hold the cluster secret, may"
    } else if lacked.contains("executor credential") {
        "run it as an executor of the pool: --credential-file DIR/credentials/executor (`tern up` writes it)"
    } else {
        "ask the cluster's operator for a credential that may (--as FILE)"
    };
    Some(format!("permission denied: you act as {caller}, and {lacked}; {todo}"))
}

/// Whether `addr` answers an HTTP/2 client's first bytes with a Tern block frame (within a second).
async fn answers_with_block_frames(addr: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = addr.trim().trim_start_matches("http://").trim_start_matches("https://").trim_end_matches('/');
    let probe = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        // The HTTP/2 preface, and zeros so that a whole block-frame header has arrived.
        stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.ok()?;
        stream.write_all(&[0; 64]).await.ok()?;
        let mut magic = [0; 2];
        stream.read_exact(&mut magic).await.ok()?;
        Some(magic == tern_proto::frame::MAGIC)
    };
    matches!(tokio::time::timeout(std::time::Duration::from_secs(1), probe).await, Ok(Some(true)))
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Up(args) => up::run(args).await,
        Command::MetadataServer(args) => daemons::run_metadata(args).await,
        Command::StorageServer(args) => daemons::run_storage(args).await,
        Command::Scheduler(args) => daemons::run_scheduler(args).await,
        Command::Job(args) => job::run(args).await,
        Command::Fs(args) => fs::run(args).await,
        Command::Status(args) => status::run(args).await,
        Command::Bench(args) => bench::run(args).await,
        Command::Terasort(args) => terasort::terasort(args).await,
        Command::Teragen(args) => terasort::teragen(args).await,
        Command::Teravalidate(args) => terasort::teravalidate(args).await,
        Command::Cert(args) => cert::run(args),
        Command::Executor(args) => executor::run(args).await,
        Command::Admin(args) => admin::run(args).await,
        Command::Completions { shell } => {
            let mut command = <Cli as clap::CommandFactory>::command();
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut command, "tern", &mut script);
            std::io::Write::write_all(&mut std::io::stdout().lock(), &script)?;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Every subcommand, argument and flag says what it is in `--help` (global flags once, where
    /// they are defined).
    #[test]
    fn every_command_and_argument_has_help() {
        let mut missing = Vec::new();
        walk(&super::Cli::command(), "tern", &mut missing);
        assert!(missing.is_empty(), "{} without help:\n{}", missing.len(), missing.join("\n"));
    }

    fn walk(command: &clap::Command, path: &str, missing: &mut Vec<String>) {
        let said = |text: Option<&clap::builder::StyledStr>| text.is_some_and(|t| !t.to_string().trim().is_empty());
        if path != "tern" && !said(command.get_about()) {
            missing.push(format!("{path} (the command)"));
        }
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            if arg.is_hide_set() || arg.is_global_set() && path.contains(' ') || matches!(id, "help" | "version") {
                continue;
            }
            if !said(arg.get_help()) {
                missing.push(format!("{path} {id}"));
            }
        }
        for sub in command.get_subcommands().filter(|sub| sub.get_name() != "help") {
            walk(sub, &format!("{path} {}", sub.get_name()), missing);
        }
    }

    /// README's command tables name every flag each command takes: a row starting with the
    /// command (`| \`tern fs put ...`, or a row listing it beside others with `\|`) holds each of
    /// its long flags in its first cell. Global flags (`--metadata`, `--tls-dir`, ...) are left to
    /// the sections on connecting and security.
    #[test]
    fn readme_names_every_flag() {
        let readme = include_str!("../README.md");
        let rows: Vec<&str> = readme.lines().filter(|line| line.starts_with("| `tern ")).collect();
        let mut missing = Vec::new();
        flags_in_readme(&super::Cli::command(), "tern", &rows, &mut missing);
        assert!(missing.is_empty(), "{} flags not in README's tables:\n{}", missing.len(), missing.join("\n"));
    }

    fn flags_in_readme(command: &clap::Command, path: &str, rows: &[&str], missing: &mut Vec<String>) {
        let leaf = command.get_name();
        let parent = path.rsplit_once(' ').map_or("", |(parent, _)| parent);
        // The rows for this command: those naming it after its parent, alone or in a `\|` list.
        let mine: Vec<&str> = rows
            .iter()
            .copied()
            .filter(|row| {
                let cell = row.split(" | ").next().unwrap_or_default();
                cell.contains(&format!("`{path}")) || (cell.contains(&format!("`{parent} ")) && cell.contains(leaf))
            })
            .collect();
        if command.get_subcommands().next().is_none() && path != "tern" {
            for arg in command.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                if arg.is_hide_set() || arg.is_global_set() || matches!(long, "help" | "version") {
                    continue;
                }
                let flag = format!("--{long}");
                if !mine.iter().any(|row| row.split(" | ").next().unwrap_or_default().contains(&flag)) {
                    missing.push(format!("{path} {flag}{}", if mine.is_empty() { " (no row)" } else { "" }));
                }
            }
        }
        for sub in command.get_subcommands().filter(|sub| sub.get_name() != "help") {
            flags_in_readme(sub, &format!("{path} {}", sub.get_name()), rows, missing);
        }
    }
}
