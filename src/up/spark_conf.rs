//! The Spark configuration directory `tern up` writes (DIR/spark/spark-defaults.conf), as managed
//! Spark platforms (EMR, Dataproc) ship one: with `SPARK_CONF_DIR` pointing there, a bare
//! `pyspark` or `spark-submit` runs on this cluster with Tern's shuffle, and on Tern's scheduler
//! when `tern up` runs one. Spark 3.5 makes its shuffle manager before it asks a cluster manager,
//! so the master URL alone cannot switch Tern's shuffle on; the defaults file does both.
//!
//! The file is rewritten at every start (it names this run's ports and paths); Spark reads it only
//! where `SPARK_CONF_DIR` says, so nobody else's Spark changes. It suits one Spark line (the jar,
//! Scala 2.12 or 2.13, and Spark 4.3's own shuffle manager class): the Spark `--spark-home` names,
//! else `$SPARK_HOME`'s, else python3's pyspark package's; Spark 3.5's when none is found.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use tern_common::spark::SparkLine;

/// Where spark-shuffle/build.sh leaves the jars, relative to the cargo target directory.
const BUILT_JARS: &str = "tern-spark";

/// The Spark the configuration is written for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SparkFound {
    pub line: SparkLine,
    /// Its version, and where it is installed.
    pub version: String,
    pub home: PathBuf,
}

/// The Spark to write the configuration for: `given` (`--spark-home`, which must be a Spark the
/// plugin serves), else `$SPARK_HOME`, else python3's pyspark package; None when none is found
/// (a found one the plugin does not serve is said on stderr and passed over).
pub fn find_spark(given: Option<&Path>) -> anyhow::Result<Option<SparkFound>> {
    if let Some(home) = given {
        let (line, version) = tern_common::spark::spark_line(home).context("--spark-home")?;
        return Ok(Some(SparkFound { line, version, home: std::path::absolute(home)? }));
    }
    let Some(home) = tern_common::spark::default_home() else { return Ok(None) };
    match tern_common::spark::spark_line(&home) {
        Ok((line, version)) => Ok(Some(SparkFound { line, version, home })),
        Err(e) => {
            eprintln!("tern up: not writing Spark settings for the Spark found: {e:#} (pass --spark-home)");
            Ok(None)
        }
    }
}

/// What the Spark configuration says.
#[derive(Debug)]
pub struct SparkConf {
    /// The scheduler's master URL, when `tern up` runs a scheduler.
    pub master: Option<String>,
    /// The metadata server, HOST:PORT.
    pub metadata: String,
    /// The cluster's TLS directory, when the control plane is TLS (absolute).
    pub tls_dir: Option<PathBuf>,
    /// The Spark it is written for (None: none found; written for Spark 3.5).
    pub spark: Option<SparkFound>,
    /// The plugin jar for the class paths (absolute), when known.
    pub jar: Option<PathBuf>,
}

/// The plugin jar: `given` (which must exist), else the one build.sh leaves for `line` in the cargo
/// target directory holding `tern` (target/<profile>/tern -> target/tern-spark/tern-spark-4.jar)
/// if it is there, else none.
pub fn plugin_jar(given: Option<&Path>, tern: &Path, line: SparkLine) -> anyhow::Result<Option<PathBuf>> {
    if let Some(jar) = given {
        if !jar.is_file() {
            bail!("--spark-jar {}: no such file (spark-shuffle/build.sh builds it)", jar.display());
        }
        return Ok(Some(std::path::absolute(jar).context("the plugin jar's path")?));
    }
    let built = tern.parent().and_then(Path::parent).map(|target| target.join(BUILT_JARS).join(line.jar()));
    Ok(built.filter(|jar| jar.is_file()))
}

impl SparkConf {
    /// spark-defaults.conf's text.
    pub fn defaults(&self) -> anyhow::Result<String> {
        let mut keys: Vec<(&str, String)> = Vec::new();
        if let Some(master) = &self.master {
            keys.push(("spark.master", master.clone()));
        }
        keys.extend(self.line().shuffle_settings().map(|(key, class)| (key, class.to_string())));
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
        match &self.spark {
            Some(spark) => {
                let _ = writeln!(
                    out,
                    "# For Spark {} at {} (another line: tern up --spark-home).",
                    spark.version,
                    text(&spark.home)?
                );
            }
            None => out.push_str("# For Spark 3.5: no Spark was found (for another line: tern up --spark-home).\n"),
        }
        if self.jar.is_none() {
            out.push_str("# The plugin jar was not found: add it to spark.driver.extraClassPath and spark.executor.extraClassPath.\n");
        }
        for (key, value) in keys {
            // java.util.Properties syntax, which Spark reads this file with: a backslash escapes.
            let _ = writeln!(out, "{key:<36} {}", value.replace('\\', "\\\\"));
        }
        Ok(out)
    }

    /// The Spark line the file suits.
    fn line(&self) -> SparkLine {
        self.spark.as_ref().map_or(SparkLine::V3_5, |spark| spark.line)
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
        let version = self.spark.as_ref().map_or("3.5", |spark| spark.version.as_str());
        let mut out = format!("Spark {version} {on} (pyspark, spark-submit with no --master):\n");
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
            spark: None,
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
        assert!(text.contains("# For Spark 3.5: no Spark was found"), "{text}");
        let bad = SparkConf { jar: Some("/a\nb.jar".into()), ..bare };
        assert!(bad.defaults().unwrap_err().to_string().contains("line break"));
    }

    #[test]
    fn spark_defaults_suit_the_spark_line_found() {
        let spark = |line, version: &str| Some(SparkFound { line, version: version.into(), home: "/opt/spark".into() });
        let conf =
            |spark| SparkConf { master: None, metadata: "127.0.0.1:9060".into(), tls_dir: None, spark, jar: None };
        for (line, version, manager) in [
            (SparkLine::V3_5, "3.5.3", tern_common::spark::SHUFFLE_MANAGER_CLASS),
            (SparkLine::V4_2, "4.2.1", tern_common::spark::SHUFFLE_MANAGER_CLASS),
            (SparkLine::V4_3, "4.3.0", tern_common::spark::BLOCKING_SHUFFLE_MANAGER_CLASS),
        ] {
            let text = conf(spark(line, version)).defaults().unwrap();
            let value = text.lines().find_map(|l| l.strip_prefix("spark.shuffle.manager ")).map(str::trim);
            assert_eq!(value, Some(manager), "{text}");
            assert!(text.contains(&format!("# For Spark {version} at /opt/spark")), "{text}");
        }
    }

    #[test]
    fn the_spark_named_must_be_one_the_plugin_serves() {
        let home = tempfile::tempdir().unwrap();
        std::fs::create_dir(home.path().join("jars")).unwrap();
        let core = home.path().join("jars/spark-core_2.12-3.4.1.jar");
        std::fs::write(&core, "").unwrap();
        let e = format!("{:#}", find_spark(Some(home.path())).unwrap_err());
        assert!(e.contains("--spark-home") && e.contains("Spark 3.4.1") && e.contains("serves"), "{e}");
        std::fs::rename(&core, home.path().join("jars/spark-core_2.13-4.1.4.jar")).unwrap();
        let found = find_spark(Some(home.path())).unwrap().unwrap();
        assert_eq!((found.line, found.version.as_str()), (SparkLine::V4_1, "4.1.4"));
    }

    #[test]
    fn the_jar_is_the_given_one_or_the_one_built_beside_the_binary_for_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let tern = dir.path().join("debug/tern");
        assert_eq!(plugin_jar(None, &tern, SparkLine::V4_3).unwrap(), None, "nothing built");
        std::fs::create_dir_all(dir.path().join(BUILT_JARS)).unwrap();
        for jar in ["tern-spark-3.5.jar", "tern-spark-4.jar"] {
            std::fs::write(dir.path().join(BUILT_JARS).join(jar), "").unwrap();
        }
        for (line, jar) in [(SparkLine::V3_5, "tern-spark-3.5.jar"), (SparkLine::V4_3, "tern-spark-4.jar")] {
            assert_eq!(plugin_jar(None, &tern, line).unwrap(), Some(dir.path().join(BUILT_JARS).join(jar)));
        }
        let e = plugin_jar(Some(&dir.path().join("nope.jar")), &tern, SparkLine::V3_5).unwrap_err().to_string();
        assert!(e.contains("--spark-jar") && e.contains("nope.jar"), "{e}");
    }
}
