//! `spark-executor`: one Spark executor (`CoarseGrainedExecutorBackend`) of a Spark application
//! whose driver runs Tern's cluster manager (`io.tern.spark.TernClusterManager`). The driver
//! submits an elastic stage of these per resource profile and scales them; each task is one
//! executor JVM, its Spark executor id `executor_id_base` plus the task's index (indexes are never
//! reused, as Spark wants; the driver gives each profile's stage its own base).
//!
//! Parameters (strings, set by the driver): `driver_url`, `app_id`, `cores`, `classpath` (the
//! JVM's `-cp`), optional `resource_profile_id` (default 0), optional `executor_id_base` (default
//! 0), `heap_bytes` (`-Xmx`), `java`
//! (default `$JAVA_HOME/bin/java`, else `java`), `java_options` (one option a line: the
//! application's `spark.executor.extraJavaOptions` and the `--add-opens` Spark needs on Java 17).
//!
//! The process runs as a `command` does (its memory watched against the task's grant: heap plus
//! overhead, killed past it). GPUs the scheduler granted go to the executor in its resources
//! file (`--resourcesFile`, so it offers exactly those addresses to tasks) and in
//! `CUDA_VISIBLE_DEVICES` (set by [`super::task_env`]). The JVM runs in a directory of its own,
//! removed when the task ends: its working directory, where Spark's executor fetches the
//! application's jars and files (as a standalone worker's executor runs in its work directory).

use std::path::PathBuf;

use tern_proto::sched as pb;

use super::{command, param, Report, Services};

/// Java options given in `java_options`, at most.
const MAX_JAVA_OPTIONS: usize = 256;

pub async fn run(task: &pb::Assignment, services: &Services) -> Report {
    let launch = match Launch::new(task, services) {
        Ok(launch) => launch,
        Err(e) => return Report::failed(format!("spark-executor: {e:#}")),
    };
    let env: Vec<(String, String)> =
        task.operator.as_ref().map(|o| o.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect()).unwrap_or_default();
    let report = command::run_program(task, services, &launch.java, &launch.args, &env, Some(&launch.dir)).await;
    let _ = std::fs::remove_dir_all(&launch.dir);
    report
}

/// The executor's command line, and its directory (its working directory, holding its resources
/// file).
#[derive(Debug)]
struct Launch {
    java: String,
    args: Vec<String>,
    dir: PathBuf,
}

impl Launch {
    fn new(task: &pb::Assignment, services: &Services) -> anyhow::Result<Launch> {
        let text = |name: &str| -> anyhow::Result<String> {
            let value: Option<String> = param(task, name)?;
            value.filter(|v| !v.is_empty()).ok_or_else(|| anyhow::anyhow!("parameter {name} is missing"))
        };
        let driver_url = text("driver_url")?;
        let app_id = text("app_id")?;
        let classpath = text("classpath")?;
        let cores: u32 = param(task, "cores")?.ok_or_else(|| anyhow::anyhow!("parameter cores is missing"))?;
        if cores == 0 {
            anyhow::bail!("cores = 0: an executor needs at least one core");
        }
        let profile: u32 = param(task, "resource_profile_id")?.unwrap_or(0);
        let base: u64 = param(task, "executor_id_base")?.unwrap_or(0);
        let executor_id = base
            .checked_add(u64::from(task.task_index))
            .ok_or_else(|| anyhow::anyhow!("executor_id_base = {base} plus task index overflows"))?;
        let heap: Option<u64> = param(task, "heap_bytes")?;
        let java = match param::<String>(task, "java")? {
            Some(java) if !java.is_empty() => java,
            _ => std::env::var("JAVA_HOME").map_or_else(|_| "java".to_string(), |home| format!("{home}/bin/java")),
        };
        let options: Vec<String> = task
            .operator
            .as_ref()
            .and_then(|o| o.params.get("java_options"))
            .map(|o| o.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect())
            .unwrap_or_default();
        if options.len() > MAX_JAVA_OPTIONS {
            anyhow::bail!("java_options has {} options; at most {MAX_JAVA_OPTIONS}", options.len());
        }
        let mut args = vec!["-cp".to_string(), classpath];
        if let Some(heap) = heap {
            // In MiB: the JVM takes no plain byte count above 2^31 on every version.
            args.push(format!("-Xmx{}m", (heap >> 20).max(64)));
        }
        args.extend(options);
        args.extend(
            [
                "org.apache.spark.executor.CoarseGrainedExecutorBackend",
                "--driver-url",
                &driver_url,
                "--executor-id",
                &executor_id.to_string(),
                "--hostname",
                services.host(),
                "--cores",
                &cores.to_string(),
                "--app-id",
                &app_id,
                "--resourceProfileId",
                &profile.to_string(),
            ]
            .map(String::from),
        );
        let dir =
            std::env::temp_dir().join(format!("tern-spark-{}-{}-{}", task.job_id, task.task_index, std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
        if !task.gpus.is_empty() {
            let file = dir.join("resources.json");
            if let Err(e) = std::fs::write(&file, resources_json(&task.gpus)) {
                let _ = std::fs::remove_dir_all(&dir);
                anyhow::bail!("writing {}: {e}", file.display());
            }
            args.extend(["--resourcesFile".to_string(), file.display().to_string()]);
        }
        Ok(Launch { java, args, dir })
    }
}

/// Spark's resources file: the executor's "gpu" addresses.
fn resources_json(gpus: &[pb::GpuGrant]) -> String {
    let addresses: Vec<String> = gpus.iter().map(|g| format!("{:?}", g.address)).collect();
    format!(
        r#"[{{"id":{{"componentName":"spark.executor","resourceName":"gpu"}},"addresses":[{}]}}]"#,
        addresses.join(",")
    )
}

#[cfg(test)]
mod tests {
    use tern_client::ClientOptions;

    use super::*;

    fn task(params: &[(&str, &str)], gpus: &[&str]) -> pb::Assignment {
        pb::Assignment {
            job_id: "app-1".into(),
            task_index: 7,
            operator: Some(pb::Operator {
                name: "spark-executor".into(),
                params: params.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
                ..Default::default()
            }),
            gpus: gpus.iter().map(|a| pb::GpuGrant { address: a.to_string(), gpu_milli: 1000 }).collect(),
            ..Default::default()
        }
    }

    const PARAMS: [(&str, &str); 7] = [
        ("driver_url", "spark://CoarseGrainedScheduler@10.0.0.1:4040"),
        ("app_id", "app-42"),
        ("classpath", "/spark/jars/*"),
        ("cores", "2"),
        ("heap_bytes", "1073741824"),
        ("java", "/jdk/bin/java"),
        ("java_options", "-Dx=1\n--add-opens=java.base/java.nio=ALL-UNNAMED\n"),
    ];

    #[test]
    fn the_command_line_carries_the_executors_identity_resources_and_options() {
        let services = Services::new("m:1".into(), ClientOptions::default()).with_host("h3");
        let launch = Launch::new(&task(&PARAMS, &["0", "3"]), &services).unwrap();
        assert_eq!(launch.java, "/jdk/bin/java");
        let line = launch.args.join(" ");
        assert!(
            line.starts_with(
                "-cp /spark/jars/* -Xmx1024m -Dx=1 --add-opens=java.base/java.nio=ALL-UNNAMED \
                 org.apache.spark.executor.CoarseGrainedExecutorBackend --driver-url \
                 spark://CoarseGrainedScheduler@10.0.0.1:4040 --executor-id 7 --hostname h3 --cores 2 \
                 --app-id app-42 --resourceProfileId 0 --resourcesFile "
            ),
            "{line}"
        );
        let file = std::fs::read_to_string(launch.dir.join("resources.json")).unwrap();
        assert_eq!(file, r#"[{"id":{"componentName":"spark.executor","resourceName":"gpu"},"addresses":["0","3"]}]"#);
        std::fs::remove_dir_all(&launch.dir).unwrap();
        // Without GPUs: a working directory all the same, and no resources file.
        let mut other = task(&PARAMS, &[]);
        other.task_index = 8;
        let launch = Launch::new(&other, &services).unwrap();
        assert!(launch.dir.is_dir() && !launch.dir.join("resources.json").exists(), "{launch:?}");
        assert!(!launch.args.contains(&"--resourcesFile".to_string()), "{launch:?}");
        std::fs::remove_dir_all(&launch.dir).unwrap();
        // Another resource profile's stage: its executor ids start at its base.
        let mut profile = PARAMS.to_vec();
        profile.extend([("resource_profile_id", "2"), ("executor_id_base", "2000000")]);
        let launch = Launch::new(&task(&profile, &[]), &services).unwrap();
        let line = launch.args.join(" ");
        assert!(line.contains("--executor-id 2000007 ") && line.contains("--resourceProfileId 2"), "{line}");
        std::fs::remove_dir_all(&launch.dir).unwrap();
    }

    #[test]
    fn missing_or_bad_parameters_are_named() {
        let services = Services::new("m:1".into(), ClientOptions::default());
        let without: Vec<_> = PARAMS.iter().copied().filter(|(k, _)| *k != "driver_url").collect();
        let e = Launch::new(&task(&without, &[]), &services).unwrap_err();
        assert!(e.to_string().contains("driver_url is missing"), "{e}");
        let mut zero = PARAMS.to_vec();
        zero[3] = ("cores", "0");
        let e = Launch::new(&task(&zero, &[]), &services).unwrap_err();
        assert!(e.to_string().contains("cores = 0"), "{e}");
    }
}
