//! One typed config per daemon, built in layers, each over the one before: `Config::default()`
//! (the only place a default is written), then a TOML file, then the environment (`TERN_<KEY>`),
//! then settings (`key=value`, from flags and `--set`); printed at start-up.
//!
//! Every layer is applied to a TOML table that starts as the serialized defaults, and the table is
//! deserialized again after each key, so an unknown key or a bad value is refused naming the key
//! and where it came from. A daemon's config flattens in the [`Serve`] block every daemon shares.

mod serve;
mod setting;

pub use serve::{check_listen, Serve, CLUSTER_SECRET_FILE};
pub use setting::{read_value, Setting};

use std::path::Path;

use anyhow::Context;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Prefix of the environment variables that set config keys.
pub const ENV_PREFIX: &str = "TERN_";

/// Builds `T` from its defaults, then the TOML file at `file` (a key there replaces the default's
/// whole value, tables included), then the environment `env` (see [`env_settings`]), then
/// `settings` in order. Unknown keys in the file and settings are errors.
pub fn load<T: Serialize + DeserializeOwned + Default>(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
    settings: &[Setting],
) -> anyhow::Result<T> {
    let mut table = defaults::<T>()?;
    if let Some(path) = file {
        let origin = format!("config {}", path.display());
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {origin}"))?;
        lay_document::<T>(&mut table, &text, &origin)?;
    }
    for setting in env_settings(env) {
        // `TERN_` variables name other things too (TERN_LOG_FORMAT, a client's TERN_METADATA
        // beside a metadata server): one that is no key of this daemon's is not for it.
        let mut with = table.clone();
        setting.apply(&mut with)?;
        match check::<T>(&with, || setting.to_string()) {
            Ok(()) => table = with,
            Err(e) if e.to_string().contains(&format!("unknown field `{}`", setting.first_key())) => {}
            Err(e) => return Err(e),
        }
    }
    for setting in settings {
        setting.apply(&mut table)?;
        check::<T>(&table, || setting.to_string())?;
    }
    Ok(T::deserialize(table)?)
}

/// A TOML document laid over `T::default()`, as [`load`] lays a file.
pub fn from_toml<T: Serialize + DeserializeOwned + Default>(text: &str) -> anyhow::Result<T> {
    let mut table = defaults::<T>()?;
    lay_document::<T>(&mut table, text, "config")?;
    Ok(T::deserialize(table)?)
}

/// The settings the environment makes: `TERN_<KEY>=VALUE` sets the key `<key>` (lower case;
/// `__` between the parts of a dotted key: `TERN_TENANTS__ETL__MAX_JOBS=4`), its value read as
/// `--set` reads one. In name order, so the outcome does not depend on the environment's order.
pub fn env_settings(env: impl IntoIterator<Item = (String, String)>) -> Vec<Setting> {
    let mut settings: Vec<(String, Setting)> = env
        .into_iter()
        .filter_map(|(name, value)| {
            let key = name.strip_prefix(ENV_PREFIX)?.to_lowercase().replace("__", ".");
            let setting = Setting::env(&name, &key, &value)?;
            Some((name, setting))
        })
        .collect();
    settings.sort_by(|a, b| a.0.cmp(&b.0));
    settings.into_iter().map(|(_, setting)| setting).collect()
}

fn defaults<T: Serialize + Default>() -> anyhow::Result<toml::Table> {
    toml::Table::try_from(T::default()).context("serializing the default configuration")
}

/// Puts each top-level key of the document `text` into `table`, checked one by one.
fn lay_document<T: DeserializeOwned>(table: &mut toml::Table, text: &str, origin: &str) -> anyhow::Result<()> {
    let keys: toml::Table = toml::from_str(text).with_context(|| format!("parsing {origin}"))?;
    for (key, value) in keys {
        table.insert(key.clone(), value);
        check::<T>(table, || format!("{origin}: key `{key}`"))?;
    }
    Ok(())
}

/// Deserializes the table as it stands, so an error is told against the layer just applied.
fn check<T: DeserializeOwned>(table: &toml::Table, origin: impl FnOnce() -> String) -> anyhow::Result<()> {
    match T::deserialize(table.clone()) {
        Ok(_) => Ok(()),
        // toml's messages end with "\nin `key`" for nested keys: kept, on one line.
        Err(e) => anyhow::bail!("{}: {}", origin(), e.to_string().trim().replace('\n', " ")),
    }
}

/// The configuration as TOML, one `key = value` per line: what `--print-config` prints and
/// start-up logs.
pub fn to_toml<T: Serialize>(config: &T) -> anyhow::Result<String> {
    Ok(toml::to_string(config).context("printing the configuration")?.trim_end().to_string())
}

/// Logs the effective configuration, so operators see what runs.
pub fn log_effective<T: Serialize>(daemon: &str, config: &T) {
    match to_toml(config) {
        Ok(text) => tracing::info!("{daemon} effective configuration:\n{text}"),
        Err(e) => tracing::warn!("{daemon}: {e:#}"),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::ByteSize;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, Serialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Example {
        #[serde(flatten)]
        serve: Serve,
        size: ByteSize,
        name: String,
        queues: BTreeMap<String, u32>,
    }

    impl Default for Example {
        fn default() -> Example {
            Example {
                serve: Serve::on_loopback(9000, 9001),
                size: ByteSize::mib(1),
                name: "x".into(),
                queues: BTreeMap::from([("default".into(), 1)]),
            }
        }
    }

    fn set(settings: &[&str]) -> anyhow::Result<Example> {
        let settings: Vec<Setting> = settings.iter().map(|s| s.parse().unwrap()).collect();
        load(None, [], &settings)
    }

    fn env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
        vars.iter().map(|(name, value)| (name.to_string(), value.to_string())).collect()
    }

    #[test]
    fn the_environment_lies_between_the_file_and_the_flags() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.toml");
        std::fs::write(&file, "size = \"2MiB\"\nname = \"from-file\"\n").unwrap();
        let vars = env(&[
            ("TERN_SIZE", "4MiB"),
            ("TERN_NAME", "from-env"),
            ("TERN_QUEUES__ETL", "3"),
            ("TERN_TLS_DIR", "/etc/tern/tls"),
            // Not keys of this config: other programs' (or other daemons') variables.
            ("TERN_LOG_FORMAT", "json"),
            ("TERN_METADATA", "10.0.0.1:9060"),
            ("HOME", "/root"),
        ]);
        let flags = [Setting::flag("--name", "name", "from-flag")];
        let config: Example = load(Some(&file), vars.clone(), &flags).unwrap();
        assert_eq!(config.size, ByteSize::mib(4), "the environment beats the file");
        assert_eq!(config.name, "from-flag", "a flag beats the environment");
        assert_eq!(config.queues, BTreeMap::from([("default".into(), 1), ("etl".into(), 3)]));
        assert_eq!(config.serve.tls_dir, Some("/etc/tern/tls".into()), "an optional key unset by default");
        // A bad value of a real key is refused, naming the variable.
        let err = load::<Example>(None, env(&[("TERN_SIZE", "huge")]), &[]).unwrap_err().to_string();
        assert!(err.starts_with("environment TERN_SIZE=huge: "), "{err}");
        let err = load::<Example>(None, env(&[("TERN_LISTEN", "nowhere")]), &[]).unwrap_err().to_string();
        assert!(err.contains("TERN_LISTEN=nowhere") && err.contains("invalid socket address"), "{err}");
    }

    #[test]
    fn loads_files_over_defaults_and_refuses_unknown_keys() {
        let dir = std::env::temp_dir().join(format!("tern-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.toml");
        std::fs::write(&good, "listen = \"127.0.0.1:1\"\nsize = \"2MiB\"\n[queues]\netl = 2\n").unwrap();
        let loaded: Example = load(Some(&good), [], &[]).unwrap();
        let serve = Serve { listen: "127.0.0.1:1".parse().unwrap(), ..Serve::on_loopback(9000, 9001) };
        let queues = BTreeMap::from([("etl".into(), 2)]);
        assert_eq!(loaded, Example { serve, size: ByteSize::mib(2), queues, ..Example::default() });
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, "lisen = \"x\"\n").unwrap();
        let err = format!("{:#}", load::<Example>(Some(&bad), [], &[]).unwrap_err());
        assert!(err.contains("unknown field") && err.contains("lisen") && err.contains("bad.toml"), "{err}");
        std::fs::write(&bad, "listen = \"nowhere\"\n").unwrap();
        let err = format!("{:#}", load::<Example>(Some(&bad), [], &[]).unwrap_err());
        assert!(err.contains("key `listen`") && err.contains("invalid socket address"), "{err}");
        assert_eq!(load::<Example>(None, [], &[]).unwrap(), Example::default());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn settings_overlay_keys_and_name_the_bad_ones() {
        let config = set(&["size=\"256MiB\"", "listen=127.0.0.1:7", "trusted_network=true", "queues.etl=2"]).unwrap();
        assert_eq!(config.size, ByteSize::mib(256));
        assert_eq!(config.serve.listen, "127.0.0.1:7".parse().unwrap());
        assert!(config.serve.trusted_network);
        assert_eq!(config.queues, BTreeMap::from([("default".into(), 1), ("etl".into(), 2)]));
        // Unquoted text that is not TOML is a string; a string key keeps a value that looks like a number.
        assert_eq!(
            set(&["size=64KiB", "name=2024"]).unwrap(),
            Example { size: ByteSize::kib(64), name: "2024".into(), ..Example::default() }
        );
        assert_eq!(set(&["tls_dir=/etc/tern/tls"]).unwrap().serve.tls_dir, Some("/etc/tern/tls".into()));
        // A flag's value is taken as it is; its errors name the flag.
        let flags =
            [Setting::flag("--name", "name", "true"), Setting::flag("--trusted-network", "trusted_network", true)];
        let config: Example = load(None, [], &flags).unwrap();
        assert_eq!((config.name.as_str(), config.serve.trusted_network), ("true", true));
        let err = load::<Example>(None, [], &[Setting::flag("--listen", "listen", "nowhere")]).unwrap_err().to_string();
        assert!(err.starts_with("--listen nowhere: invalid socket address"), "{err}");
        for (bad, expected) in [
            ("sise=1", "--set sise=1: unknown field `sise`"),
            ("size=huge", "--set size=huge: "),
            ("queues.etl=heavy", "queues.etl"),
            ("trusted_network=1", "--set trusted_network=1: invalid type"),
            ("listen.port=1", "`listen` is not a table"),
        ] {
            let err = set(&[bad]).unwrap_err().to_string();
            assert!(err.contains(expected), "{bad}: {err}");
        }
    }
}
