//! One typed config per daemon: defaults, then a TOML file, then flags; printed at start-up.

use std::path::Path;

use anyhow::Context;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Loads `T` from a TOML file (unknown keys are errors), or its defaults when there is no file.
pub fn load<T: DeserializeOwned + Default>(path: Option<&Path>) -> anyhow::Result<T> {
    let Some(path) = path else {
        return Ok(T::default());
    };
    let text = std::fs::read_to_string(path).with_context(|| format!("reading config {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("parsing config {}", path.display()))
}

/// Logs the effective configuration, one `key = value` per line, so operators see what runs.
pub fn log_effective<T: Serialize>(daemon: &str, config: &T) {
    match toml::to_string(config) {
        Ok(text) => tracing::info!("{daemon} effective configuration:\n{}", text.trim_end()),
        Err(e) => tracing::warn!("{daemon}: cannot print configuration: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Default, Deserialize, Serialize, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Example {
        listen: String,
        size: crate::ByteSize,
    }

    #[test]
    fn loads_files_and_refuses_unknown_keys() {
        let dir = std::env::temp_dir().join(format!("tern-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.toml");
        std::fs::write(&good, "listen = \"127.0.0.1:1\"\nsize = \"2MiB\"\n").unwrap();
        let loaded: Example = load(Some(&good)).unwrap();
        assert_eq!(loaded, Example { listen: "127.0.0.1:1".into(), size: crate::ByteSize::mib(2) });
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, "lisen = \"x\"\n").unwrap();
        let err = format!("{:#}", load::<Example>(Some(&bad)).unwrap_err());
        assert!(err.contains("unknown field"), "{err}");
        assert_eq!(load::<Example>(None).unwrap(), Example::default());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
