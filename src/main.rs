//! `tern`: every Tern role in one binary. Each subcommand lives in its own module; this file
//! only parses the command line and reports errors.

// First: the `outln!` macro every command prints with.
#[macro_use]
mod out;

mod admin;
mod bench;
mod cert;
mod cli;
mod daemons;
mod executor;
mod fs;
mod job;
mod show;
mod status;
mod terasort;
mod up;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    tern_common::init_logging(if cli.command.is_daemon() { "info" } else { "warn" }, cli.log_format);
    // RDMA for every transport user in this process (a no-op in builds without the `rdma` feature).
    tern_rdma::install();
    // The daemons and executors this process starts (`tern up`) inherit the format. Set before
    // any other thread exists.
    std::env::set_var("TERN_LOG_FORMAT", cli.log_format.to_string());
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("tern: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli::run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // The reader of stdout went away (`tern fs cat F | head`): nothing is left to tell.
        Err(e) if out::is_broken_pipe(&e) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let e = runtime.block_on(cli::explain(e));
            eprintln!("tern: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
