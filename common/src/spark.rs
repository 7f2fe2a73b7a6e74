//! The Java classes and jars of Tern's Spark plugin (spark-shuffle) that Rust names: in Spark
//! configuration (`tern up`'s spark-defaults, the benches' spark-submits) and in the JVMs the
//! executor starts. Stated once, per Spark line where the lines differ (spark-shuffle/build.sh
//! builds a jar per line from one source tree; ARCHITECTURE.md, "Spark lines"); a test holds each
//! class to its source file in the jar's tree.

use std::path::Path;

/// Tern's shuffle manager (`spark.shuffle.manager`) on Spark 3.5 to 4.2.
pub const SHUFFLE_MANAGER_CLASS: &str = "io.tern.spark.TernShuffleManager";
/// Tern's shuffle manager on Spark 4.3 and later, which take only a `BlockingShuffleManager`.
pub const BLOCKING_SHUFFLE_MANAGER_CLASS: &str = "io.tern.spark.TernBlockingShuffleManager";
/// Tern's shuffle I/O plugin (`spark.shuffle.sort.io.plugin.class`).
pub const SHUFFLE_IO_CLASS: &str = "io.tern.spark.TernShuffleDataIO";
/// The main class of a parked (warm) Spark executor JVM.
pub const WARM_EXECUTOR_CLASS: &str = "io.tern.spark.WarmExecutor";

/// A Spark minor line the plugin serves: which jar, and which shuffle manager class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SparkLine {
    V3_5,
    V4_0,
    V4_1,
    V4_2,
    V4_3,
}

impl SparkLine {
    /// Every line served, oldest first.
    pub const ALL: [SparkLine; 5] = [Self::V3_5, Self::V4_0, Self::V4_1, Self::V4_2, Self::V4_3];

    /// The line of a Spark version ("4.3.0", "3.5.3-SNAPSHOT"), if the plugin serves it.
    pub fn of_version(version: &str) -> Option<SparkLine> {
        let mut parts = version.split(['.', '-']);
        let major: u32 = parts.next()?.parse().ok()?;
        let minor: u32 = parts.next()?.parse().ok()?;
        Some(match (major, minor) {
            (3, 5) => Self::V3_5,
            (4, 0) => Self::V4_0,
            (4, 1) => Self::V4_1,
            (4, 2) => Self::V4_2,
            (4, 3) => Self::V4_3,
            _ => return None,
        })
    }

    /// The plugin jar for this line, as spark-shuffle/build.sh names it (Spark 3.5: Scala 2.12;
    /// 4.x: Scala 2.13, one jar for 4.0 to 4.3).
    pub fn jar(self) -> &'static str {
        match self {
            Self::V3_5 => "tern-spark-3.5.jar",
            Self::V4_0 | Self::V4_1 | Self::V4_2 | Self::V4_3 => "tern-spark-4.jar",
        }
    }

    /// `spark.shuffle.manager` for this line.
    pub fn shuffle_manager_class(self) -> &'static str {
        if self >= Self::V4_3 {
            BLOCKING_SHUFFLE_MANAGER_CLASS
        } else {
            SHUFFLE_MANAGER_CLASS
        }
    }

    /// The Spark settings that make an application of this line shuffle through Tern (`key=value`).
    pub fn shuffle_settings(self) -> [(&'static str, &'static str); 2] {
        [
            ("spark.shuffle.manager", self.shuffle_manager_class()),
            ("spark.shuffle.sort.io.plugin.class", SHUFFLE_IO_CLASS),
        ]
    }
}

/// What the plugin serves, for messages.
pub const SERVED: &str = "Spark 3.5 and 4.0 to 4.3";

/// The Spark found without being told where: `$SPARK_HOME`, else python3's pyspark package (None:
/// neither).
pub fn default_home() -> Option<std::path::PathBuf> {
    if let Some(home) = std::env::var_os("SPARK_HOME") {
        return Some(home.into());
    }
    let out = std::process::Command::new("python3")
        .args(["-c", "import os, pyspark; print(os.path.dirname(pyspark.__file__))"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().into())
}

/// The version of the Spark installed at `home` (a SPARK_HOME, or the pyspark package), read from
/// the name of its spark-core jar (`jars/spark-core_2.13-4.3.0.jar`): no JVM to start.
pub fn spark_version(home: &Path) -> Option<String> {
    std::fs::read_dir(home.join("jars")).ok()?.flatten().find_map(|entry| {
        let name = entry.file_name().into_string().ok()?;
        let rest = name.strip_prefix("spark-core_")?.strip_suffix(".jar")?;
        let (_scala, version) = rest.split_once('-')?;
        Some(version.to_string())
    })
}

/// The line of the Spark at `home`, or an error saying what was found.
pub fn spark_line(home: &Path) -> anyhow::Result<(SparkLine, String)> {
    let Some(version) = spark_version(home) else {
        anyhow::bail!("{}: no Spark there (no jars/spark-core_*.jar)", home.display());
    };
    match SparkLine::of_version(&version) {
        Some(line) => Ok((line, version)),
        None => anyhow::bail!("{}: Spark {version}; Tern's plugin serves {SERVED}", home.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_class_named_has_its_source_in_the_plugin() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../spark-shuffle/src");
        for class in [SHUFFLE_MANAGER_CLASS, BLOCKING_SHUFFLE_MANAGER_CLASS, SHUFFLE_IO_CLASS, WARM_EXECUTOR_CLASS] {
            let file = format!("{}.java", class.replace('.', "/"));
            let roots = ["main", "spark3.5", "spark4"];
            assert!(
                roots.iter().any(|root| src.join(root).join("java").join(&file).exists()),
                "{class} is named in Rust but no spark-shuffle/src/*/java/{file} exists"
            );
        }
    }

    #[test]
    fn versions_map_to_the_jar_and_manager_of_their_line() {
        assert_eq!(SparkLine::of_version("3.5.3"), Some(SparkLine::V3_5));
        assert_eq!(SparkLine::of_version("4.3.0"), Some(SparkLine::V4_3));
        assert_eq!(SparkLine::of_version("4.1.4-SNAPSHOT"), Some(SparkLine::V4_1));
        for unserved in ["3.4.1", "4.4.0", "5.0.0", "four", ""] {
            assert_eq!(SparkLine::of_version(unserved), None, "{unserved}");
        }
        assert_eq!(SparkLine::V3_5.jar(), "tern-spark-3.5.jar");
        assert_eq!(SparkLine::V4_0.jar(), "tern-spark-4.jar");
        assert_eq!(SparkLine::V4_2.shuffle_manager_class(), SHUFFLE_MANAGER_CLASS);
        assert_eq!(SparkLine::V4_3.shuffle_manager_class(), BLOCKING_SHUFFLE_MANAGER_CLASS);
        assert_eq!(SparkLine::V3_5.shuffle_settings()[1], ("spark.shuffle.sort.io.plugin.class", SHUFFLE_IO_CLASS));
    }

    #[test]
    fn the_version_is_read_from_the_spark_core_jar() {
        let home = tempfile::tempdir().unwrap();
        assert!(spark_line(home.path()).is_err());
        std::fs::create_dir(home.path().join("jars")).unwrap();
        std::fs::write(home.path().join("jars/scala-library-2.13.18.jar"), b"").unwrap();
        std::fs::write(home.path().join("jars/spark-core_2.13-4.3.0.jar"), b"").unwrap();
        assert_eq!(spark_version(home.path()).as_deref(), Some("4.3.0"));
        assert_eq!(spark_line(home.path()).unwrap(), (SparkLine::V4_3, "4.3.0".to_string()));
    }
}
