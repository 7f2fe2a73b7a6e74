//! The Java classes of Tern's Spark plugin (spark-shuffle's jar) that Rust names: in Spark
//! configuration (`tern up`'s spark-defaults, the benches' spark-submits) and in the JVMs the
//! executor starts. Stated once; a test holds each to its source file in the jar's tree.

/// Tern's shuffle manager (`spark.shuffle.manager`).
pub const SHUFFLE_MANAGER_CLASS: &str = "io.tern.spark.TernShuffleManager";
/// Tern's shuffle I/O plugin (`spark.shuffle.sort.io.plugin.class`).
pub const SHUFFLE_IO_CLASS: &str = "io.tern.spark.TernShuffleDataIO";
/// The main class of a parked (warm) Spark executor JVM.
pub const WARM_EXECUTOR_CLASS: &str = "io.tern.spark.WarmExecutor";

/// The Spark settings that make an application shuffle through Tern (`key=value`).
pub fn shuffle_settings() -> [(&'static str, &'static str); 2] {
    [("spark.shuffle.manager", SHUFFLE_MANAGER_CLASS), ("spark.shuffle.sort.io.plugin.class", SHUFFLE_IO_CLASS)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_class_named_has_its_source_in_the_plugin() {
        let java = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../spark-shuffle/src/main/java");
        for class in [SHUFFLE_MANAGER_CLASS, SHUFFLE_IO_CLASS, WARM_EXECUTOR_CLASS] {
            let source = java.join(format!("{}.java", class.replace('.', "/")));
            assert!(source.exists(), "{class} is named in Rust but {} does not exist", source.display());
        }
    }
}
