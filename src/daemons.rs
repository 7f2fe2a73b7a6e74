//! `tern metadata-server`, `tern storage-server` and `tern scheduler`: each daemon's config is its
//! defaults, then a TOML file (`--config`), then the environment (`TERN_<KEY>`), then settings:
//! the few flags that stand for one key each (addresses, and what a user needs to start one
//! without a file), then `--set KEY=VALUE`. Every other key is set in the file, the environment
//! or with `--set`, so no key is copied into a flag. `--print-config` shows the outcome.

use std::path::PathBuf;

use clap::Args;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tern_common::config::Setting;

/// The flags every daemon takes: its config file, `--set`, and the keys of the block every
/// daemon's config shares (`tern_common::config::Serve`).
#[derive(Args)]
pub struct DaemonArgs {
    /// TOML config file (keys as in the README's tables); flags and --set override it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Sets one config key, after the file and the other flags; repeatable. The key is dotted for
    /// tables (queues.etl=2); the value is TOML, or text taken as a string (dram=4GiB).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<Setting>,
    /// Address of the daemon's service (key `listen`).
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// Address of /metrics and /health (key `admin_listen`).
    #[arg(long, value_name = "ADDR")]
    admin: Option<String>,
    /// TLS material made by `tern cert init` (key `tls_dir`).
    #[arg(long, value_name = "DIR")]
    tls_dir: Option<String>,
    /// The network is private: allow plain listeners beyond loopback (key `trusted_network`).
    #[arg(long)]
    trusted_network: bool,
    /// Print the effective configuration (defaults, file, environment and flags applied) as
    /// TOML, and exit without starting.
    #[arg(long)]
    print_config: bool,
}

impl DaemonArgs {
    /// The daemon's config: defaults, the file, the environment, `own` (the daemon's flags:
    /// flag, key, value), the shared flags, then `--set`. `None` when it was only to be printed
    /// (`--print-config`), which is done.
    fn load<T: Serialize + DeserializeOwned + Default>(
        &self,
        own: &[(&str, &str, &Option<String>)],
    ) -> anyhow::Result<Option<T>> {
        let shared = [
            ("--listen", "listen", &self.listen),
            ("--admin", "admin_listen", &self.admin),
            ("--tls-dir", "tls_dir", &self.tls_dir),
        ];
        let mut settings: Vec<Setting> = own
            .iter()
            .chain(&shared)
            .filter_map(|(flag, key, value)| value.as_deref().map(|value| Setting::flag(flag, key, value)))
            .collect();
        if self.trusted_network {
            settings.push(Setting::flag("--trusted-network", "trusted_network", true));
        }
        settings.extend(self.set.iter().cloned());
        // Variables that are not UTF-8 name no key.
        let env =
            std::env::vars_os().filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)));
        let config: T = tern_common::config::load(self.config.as_deref(), env, &settings)?;
        if self.print_config {
            outln!("{}", tern_common::config::to_toml(&config)?);
            return Ok(None);
        }
        Ok(Some(config))
    }
}

#[derive(Args)]
pub struct MetadataArgs {
    #[command(flatten)]
    daemon: DaemonArgs,
    /// State directory (key `dir`).
    #[arg(long, value_name = "DIR")]
    dir: Option<String>,
    /// Cluster block size, a power of two from 4KiB to 64MiB (key `block_size`).
    #[arg(long, value_name = "SIZE")]
    block_size: Option<String>,
}

pub async fn run_metadata(args: MetadataArgs) -> anyhow::Result<()> {
    let config: Option<tern_metadata::Config> =
        args.daemon.load(&[("--dir", "dir", &args.dir), ("--block-size", "block_size", &args.block_size)])?;
    match config {
        Some(config) => tern_metadata::run(config).await,
        None => Ok(()),
    }
}

#[derive(Args)]
pub struct StorageArgs {
    #[command(flatten)]
    daemon: DaemonArgs,
    /// Metadata server address, or its replicas' `a,b,c` (key `metadata`).
    #[arg(long, value_name = "ADDR[,ADDR...]")]
    metadata: Option<String>,
    /// Address clients use to reach this server (key `advertise`).
    #[arg(long, value_name = "ADDR")]
    advertise: Option<String>,
    /// QUIC (UDP) listen address, with --tls-dir (key `quic_listen`).
    #[arg(long, value_name = "ADDR")]
    quic_listen: Option<String>,
    /// Size of the DRAM tier, e.g. 4GiB (key `dram`).
    #[arg(long, value_name = "SIZE")]
    dram: Option<String>,
    /// NVMe tier: a file (created and preallocated if missing) or block device, opened with
    /// O_DIRECT (key `nvme`).
    #[arg(long, value_name = "PATH")]
    nvme: Option<String>,
    /// Bytes of the NVMe file or device to use, e.g. 100GiB; required for a new file (key `nvme_size`).
    #[arg(long, value_name = "SIZE")]
    nvme_size: Option<String>,
    /// NVMe io engine: uring, psync, or auto (key `io_engine`).
    #[arg(long, value_name = "ENGINE")]
    io_engine: Option<String>,
}

pub async fn run_storage(args: StorageArgs) -> anyhow::Result<()> {
    let config: Option<tern_storage::Config> = args.daemon.load(&[
        ("--metadata", "metadata", &args.metadata),
        ("--advertise", "advertise", &args.advertise),
        ("--quic-listen", "quic_listen", &args.quic_listen),
        ("--dram", "dram", &args.dram),
        ("--nvme", "nvme", &args.nvme),
        ("--nvme-size", "nvme_size", &args.nvme_size),
        ("--io-engine", "io_engine", &args.io_engine),
    ])?;
    match config {
        Some(config) => tern_storage::run(config).await,
        None => Ok(()),
    }
}

#[derive(Args)]
pub struct SchedulerArgs {
    #[command(flatten)]
    daemon: DaemonArgs,
    /// Metadata server the jobs' shuffles live on, or its replicas' `a,b,c` (key `metadata`).
    #[arg(long, value_name = "ADDR[,ADDR...]")]
    metadata: Option<String>,
}

pub async fn run_scheduler(args: SchedulerArgs) -> anyhow::Result<()> {
    let config: Option<tern_scheduler::Config> = args.daemon.load(&[("--metadata", "metadata", &args.metadata)])?;
    match config {
        Some(config) => tern_scheduler::server::run(config).await,
        None => Ok(()),
    }
}

/// README's tables of configuration keys hold each key's default as `Config::default()` has it,
/// and list every key, so the two cannot drift apart.
#[cfg(test)]
mod readme_tables {
    use serde::Serialize;
    use tern_common::config::read_value;

    const README: &str = include_str!("../README.md");

    /// The rows (key cell, default cell) of the table under "### `tern <daemon>`" in the
    /// Configuration section.
    fn rows(daemon: &str) -> Vec<(String, String)> {
        let section = README.split("\n## Configuration\n").nth(1).expect("README has a Configuration section");
        let section = section.split("\n## ").next().unwrap();
        let heading = format!("### `tern {daemon}`\n");
        let table = section.split(&heading).nth(1).unwrap_or_else(|| panic!("README has no {heading}"));
        let table = table.split("\n### ").next().unwrap();
        table
            .lines()
            .skip_while(|line| !line.starts_with("| key |"))
            .skip(2)
            .take_while(|line| line.starts_with('|'))
            .map(|line| {
                // Cells are split at " | "; an escaped `\|` inside one has no spaces around it.
                let cells: Vec<&str> = line.split(" | ").collect();
                (cells[0].trim_start_matches("| ").trim_matches('`').to_string(), cells[1].to_string())
            })
            .collect()
    }

    /// The first code span of a cell: `1MiB` of "`1MiB`", `0` of "`0` (unlimited)"; none for
    /// words ("none", "the bound address"), which document an unset optional key.
    fn code(cell: &str) -> Option<&str> {
        cell.strip_prefix('`').and_then(|rest| rest.split('`').next())
    }

    /// Checks `daemon`'s table against `T::default()`; `nested` gives the defaults of the values
    /// of map keys documented as "[map.<name>] key".
    fn check<T: Serialize + Default>(daemon: &str, nested: &[(&str, toml::Table)]) {
        let defaults = toml::Table::try_from(T::default()).unwrap();
        let rows = rows(daemon);
        assert!(!rows.is_empty(), "README's `tern {daemon}` table has no rows");
        let mut documented = Vec::new();
        for (key, cell) in &rows {
            let (table, name) = match key.strip_prefix('[').and_then(|k| k.split_once(".<name>] ")) {
                Some((map, name)) => {
                    let nested = nested.iter().find(|(m, _)| *m == map);
                    let (_, table) = nested.unwrap_or_else(|| panic!("README documents {key} of {daemon}"));
                    documented.push(map.to_string());
                    (table, name)
                }
                None => {
                    documented.push(key.clone());
                    (&defaults, key.as_str())
                }
            };
            let default = table.get(name);
            match code(cell) {
                Some(text) => {
                    let want = default.unwrap_or_else(|| panic!("README: {daemon} has no key {key}"));
                    assert_eq!(&read_value(text, Some(want)), want, "README: {daemon}'s {key} defaults to {cell}");
                }
                None => assert!(default.is_none(), "README: {daemon}'s {key} is {cell}, but defaults to {default:?}"),
            }
        }
        for key in defaults.keys() {
            assert!(documented.contains(key), "README's `tern {daemon}` table does not list `{key}`");
        }
    }

    /// The clients' default addresses, as the README's prose states them.
    #[test]
    fn readme_states_the_default_addresses() {
        let metadata =
            format!("`TERN_METADATA` when the flag is absent, or `{}`", tern_common::ports::default_metadata());
        let scheduler = format!("(`TERN_SCHEDULER`, default `{}`)", tern_common::ports::default_scheduler());
        for sentence in [metadata, scheduler] {
            assert!(README.contains(&sentence), "README does not say {sentence:?}");
        }
    }

    #[test]
    fn readme_tables_hold_the_defaults() {
        let tenant = toml::Table::try_from(tern_metadata::TenantQuota::default()).unwrap();
        check::<tern_metadata::Config>("metadata-server", &[("tenants", tenant)]);
        check::<tern_storage::Config>("storage-server", &[]);
        check::<tern_scheduler::Config>("scheduler", &[]);
    }
}
