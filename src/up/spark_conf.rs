//! The Spark configuration directory `tern up` writes (DIR/spark/spark-defaults.conf), as managed
//! Spark platforms (EMR, Dataproc) ship one: with `SPARK_CONF_DIR` pointing there, a bare
//! `pyspark` or `spark-submit` runs on this cluster with Tern's shuffle, and on Tern's scheduler
//! when `tern up` runs one. Spark 3.5 makes its shuffle manager before it asks a cluster manager,
//! so the master URL alone cannot switch Tern's shuffle on; the defaults file does both.
//!
//! The file is rewritten at every start (it names this run's ports and paths); Spark reads it only
//! where `SPARK_CONF_DIR` says, so nobody else's Spark changes.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// Where spark-shuffle/build.sh leaves the jar, relative to the cargo target directory.
const BUILT_JAR: &str = "tern-spark/tern-spark.jar";

/// What the Spark configuration says.
#[derive(Debug)]
pub struct SparkConf {
    /// The scheduler's master URL, when `tern up` runs a scheduler.
    pub master: Option<String>,
    /// The metadata server, HOST:PORT.
    pub metadata: String,
    /// The cluster's TLS directory, when the control plane is TLS (absolute).
    pub tls_dir: Option<PathBuf>,
    /// The plugin jar for the class paths (absolute), when known.
    pub jar: Option<PathBuf>,
}

/// The plugin jar: `given` (which must exist), else the one build.sh leaves in the cargo target
/// directory holding `tern` (target/<profile>/tern -> target/tern-spark/tern-spark.jar) if it is
/// there, else none.
pub fn plugin_jar(given: Option<&Path>, tern: &Path) -> anyhow::Result<Option<PathBuf>> {
    if let Some(jar) = given {
        if !jar.is_file() {
            bail!("--spark-jar {}: no such file (spark-shuffle/build.sh builds it)", jar.display());
        }
        return Ok(Some(std::path::absolute(jar).context("the plugin jar's path")?));
    }
    let built = tern.parent().and_then(Path::parent).map(|target| target.join(BUILT_JAR));
    Ok(built.filter(|jar| jar.is_file()))
}

impl SparkConf {
    /// spark-defaults.conf's text.
    pub fn defaults(&self) -> anyhow::Result<String> {
        let mut keys: Vec<(&str, String)> = Vec::new();
        if let Some(master) = &self.master {
            keys.push(("spark.master", master.clone()));
        }
        keys.extend(tern_common::spark::shuffle_settings().map(|(key, class)| (key, class.to_string())));
        keys.push(("spark.tern.metadata", self.metadata.clone()));
        if let Some(dir) = &self.tls_dir {
            keys.push(("spark.tern.tlsDir", text(dir)?));
        }
        if let Some(jar) = &self.jar {
            keys.push(("spark.driver.extraClassPath", text(jar)?));
            keys.push(("spark.executor.extraClassPath", text(jar)?));
        }
        let mut out = String::from(
            "# Written by `tern up` at each start: Spark on this Tern cluster (export SPARK_CONF_DIR=this directory).\n",
        );
        if self.jar.is_none() {
            out.push_str("# The plugin jar was not found: add it to spark.driver.extraClassPath and spark.executor.extraClassPath.\n");
        }
        for (key, value) in keys {
            // java.util.Properties syntax, which Spark reads this file with: a backslash escapes.
            let _ = writeln!(out, "{key:<36} {}", value.replace('\\', "\\\\"));
        }
        Ok(out)
    }

    /// Writes `dir`/spark-defaults.conf (whole or not at all); returns `dir`, absolute.
    pub fn write(&self, dir: &Path) -> anyhow::Result<PathBuf> {
        let dir = std::path::absolute(dir).context("the Spark configuration directory's path")?;
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let file = dir.join("spark-defaults.conf");
        let tmp = dir.join("spark-defaults.conf.tmp");
        std::fs::write(&tmp, self.defaults()?).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &file).with_context(|| format!("renaming {} to {}", tmp.display(), file.display()))?;
        Ok(dir)
    }

    /// The banner's lines about Spark.
    pub fn banner(&self, dir: &Path) -> String {
        let on = if self.master.is_some() { "on Tern's scheduler with Tern's shuffle" } else { "with Tern's shuffle" };
        let mut out = format!("Spark {on} (pyspark, spark-submit with no --master):\n");
        let _ = writeln!(out, "  export SPARK_CONF_DIR={}", dir.display());
        if self.jar.is_none() {
            let _ = writeln!(
                out,
                "  (no plugin jar found: build it with spark-shuffle/build.sh and start again, or pass --spark-jar)"
            );
        }
        out
    }
}

/// A path as UTF-8 text; a newline would end the property early.
fn text(path: &Path) -> anyhow::Result<String> {
    match path.to_str() {
        Some(s) if !s.contains(['\n', '\r']) => Ok(s.to_string()),
        _ => bail!("{}: a path Spark's configuration cannot hold (not UTF-8, or a line break)", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spark_defaults_name_the_master_the_shuffle_and_the_jar() {
        let conf = SparkConf {
            master: Some(tern_scheduler_api::spark_master_url("127.0.0.1:9062")),
            metadata: "127.0.0.1:9060".into(),
            tls_dir: Some("/d/tls".into()),
            jar: Some("/t/tern-spark.jar".into()),
        };
        let text = conf.defaults().unwrap();
        let value = |key: &str| {
            text.lines().find_map(|l| l.strip_prefix(key).filter(|v| v.starts_with(' ')).map(str::trim)).unwrap_or("")
        };
        assert_eq!(value("spark.master"), tern_scheduler_api::spark_master_url("127.0.0.1:9062"));
        assert_eq!(value("spark.shuffle.manager"), tern_common::spark::SHUFFLE_MANAGER_CLASS);
        assert_eq!(value("spark.shuffle.sort.io.plugin.class"), tern_common::spark::SHUFFLE_IO_CLASS);
        assert_eq!(value("spark.tern.metadata"), "127.0.0.1:9060");
        assert_eq!(value("spark.tern.tlsDir"), "/d/tls");
        assert_eq!(value("spark.driver.extraClassPath"), "/t/tern-spark.jar");
        assert_eq!(value("spark.executor.extraClassPath"), "/t/tern-spark.jar");
        // No scheduler, no TLS, no jar: Spark's own master, plain control plane, and a note.
        let bare = SparkConf { master: None, tls_dir: None, jar: None, ..conf };
        let text = bare.defaults().unwrap();
        let keys: Vec<&str> =
            text.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split_whitespace().next()).collect();
        assert_eq!(
            keys,
            ["spark.shuffle.manager", "spark.shuffle.sort.io.plugin.class", "spark.tern.metadata"],
            "{text}"
        );
        assert!(text.contains("plugin jar was not found"), "{text}");
        let bad = SparkConf { jar: Some("/a\nb.jar".into()), ..bare };
        assert!(bad.defaults().unwrap_err().to_string().contains("line break"));
    }

    #[test]
    fn the_jar_is_the_given_one_or_the_one_built_beside_the_binary() {
        let dir = tempfile::tempdir().unwrap();
        let tern = dir.path().join("debug/tern");
        assert_eq!(plugin_jar(None, &tern).unwrap(), None, "nothing built");
        std::fs::create_dir_all(dir.path().join("tern-spark")).unwrap();
        std::fs::write(dir.path().join(BUILT_JAR), "").unwrap();
        assert_eq!(plugin_jar(None, &tern).unwrap(), Some(dir.path().join(BUILT_JAR)));
        let e = plugin_jar(Some(&dir.path().join("nope.jar")), &tern).unwrap_err().to_string();
        assert!(e.contains("--spark-jar") && e.contains("nope.jar"), "{e}");
    }
}
