//! One `key=value` overlay on a config: a dotted key into its tables, and a value read as TOML.

use std::fmt;
use std::str::FromStr;

use anyhow::bail;

/// A config key set from the command line (`--set key=value`, or a flag that stands for one
/// key) or the environment (`TERN_KEY=value`).
///
/// The key is dotted for tables (`queues.etl`, `tenants.etl.max_jobs`). A `--set` value is read
/// by [`read_value`]; a flag's value is taken as it is.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    /// Where the setting came from, for errors: `--set KEY=VALUE` or `--flag VALUE`.
    origin: String,
    key: Vec<String>,
    value: Value,
}

#[derive(Debug, Clone, PartialEq)]
enum Value {
    /// `--set`'s text, read once the key's current value is known.
    Text(String),
    /// A flag's value.
    Exact(toml::Value),
}

impl Setting {
    /// A flag that stands for one key: `--listen ADDR` is the key `listen` set to the string ADDR.
    pub fn flag(flag: &str, key: &str, value: impl Into<toml::Value>) -> Setting {
        let value = value.into();
        let origin = match &value {
            toml::Value::Boolean(true) => flag.to_string(),
            toml::Value::String(text) => format!("{flag} {text}"),
            other => format!("{flag} {other}"),
        };
        Setting { origin, key: key.split('.').map(String::from).collect(), value: Value::Exact(value) }
    }

    /// An environment variable `name` that stands for `key` (dotted), its value read as `--set`
    /// reads one; `None` when the key has an empty part.
    pub fn env(name: &str, key: &str, value: &str) -> Option<Setting> {
        let key: Vec<String> = key.split('.').map(String::from).collect();
        if key.iter().any(String::is_empty) {
            return None;
        }
        Some(Setting { origin: format!("environment {name}={value}"), key, value: Value::Text(value.to_string()) })
    }

    /// The first part of the key: the top-level key it sets.
    pub fn first_key(&self) -> &str {
        &self.key[0]
    }

    /// Puts the value at the key, creating the tables on its way that are missing.
    pub(super) fn apply(&self, table: &mut toml::Table) -> anyhow::Result<()> {
        let (last, parents) = self.key.split_last().expect("a setting has a key");
        let mut table = table;
        for (depth, part) in parents.iter().enumerate() {
            let entry = table.entry(part.clone()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
            let toml::Value::Table(inner) = entry else {
                bail!("{self}: `{}` is not a table", self.key[..=depth].join("."));
            };
            table = inner;
        }
        let value = match &self.value {
            Value::Text(raw) => read_value(raw, table.get(last)),
            Value::Exact(value) => value.clone(),
        };
        table.insert(last.clone(), value);
        Ok(())
    }
}

impl FromStr for Setting {
    type Err = String;

    /// `key=value`, as `--set` takes it.
    fn from_str(text: &str) -> Result<Setting, String> {
        let Some((key, raw)) = text.split_once('=') else {
            return Err(format!("{text:?}: expected KEY=VALUE (e.g. dram=4GiB)"));
        };
        let key: Vec<String> = key.trim().split('.').map(String::from).collect();
        if key.iter().any(|part| part.is_empty()) {
            return Err(format!("{text:?}: the key has an empty part (expected KEY or TABLE.KEY)"));
        }
        Ok(Setting { origin: format!("--set {text}"), key, value: Value::Text(raw.trim().to_string()) })
    }
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.origin)
    }
}

/// Reads `--set`'s value text for a key whose value is now `current`: as a TOML value (`64`,
/// `true`, `"256MiB"`, `{ default = 1 }`), else as a string, so a shell's stripped quotes do not
/// matter (`dram=256MiB`, `listen=0.0.0.0:9060`); and as a string for a key whose value is a
/// string (`dir=2024`). Public for the test that holds README's tables of defaults to each
/// `Config::default()`.
pub fn read_value(raw: &str, current: Option<&toml::Value>) -> toml::Value {
    let parsed = toml::from_str::<toml::Table>(&format!("value = {raw}"))
        .ok()
        .filter(|table| table.len() == 1)
        .and_then(|mut table| table.remove("value"));
    match (parsed, current) {
        (Some(value), Some(toml::Value::String(_))) if !value.is_str() => toml::Value::String(raw.to_string()),
        (Some(value), _) => value,
        (None, _) => toml::Value::String(raw.to_string()),
    }
}
