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
//! An executor without GPUs is, when the Tern executor has one, a parked JVM handed the
//! executor's arguments ([`super::spark_warm`]) instead of a JVM started for it.

use tern_proto::sched as pb;

use std::path::PathBuf;

use super::spark_warm::{self, Shape, Taken, WarmJvms};
use super::{command, param, Report, Services};

/// Java options given in `java_options`, at most.
const MAX_JAVA_OPTIONS: usize = 256;
/// The executor JVM's main class.
const MAIN_CLASS: &str = "org.apache.spark.executor.CoarseGrainedExecutorBackend";

pub async fn run(task: &pb::Assignment, services: &Services) -> Report {
    let launch = match Launch::new(task, services) {
        Ok(launch) => launch,
        Err(e) => return Report::failed(format!("spark-executor: {e:#}")),
    };
    if !task.gpus.is_empty() {
        // Its CUDA_VISIBLE_DEVICES is set when its process starts: always a cold start.
        return run_cold(task, services, &launch, false).await;
    }
    let warm = services.warm_spark();
    // However the executor ends (its JVM exits, or Spark releases it and the task is cancelled,
    // dropping this future), its slot is free again: a JVM of its kind waits for the next one.
    let _park = ParkWhenDone { warm, shape: &launch.shape };
    match warm.take(&launch.shape) {
        Some(taken) => run_warm(task, services, &launch, taken).await,
        None => run_cold(task, services, &launch, warm.wants_class_log(&launch.shape)).await,
    }
}

/// Parks a JVM of `shape` when dropped.
struct ParkWhenDone<'a> {
    warm: &'a WarmJvms,
    shape: &'a Shape,
}

impl Drop for ParkWhenDone<'_> {
    fn drop(&mut self) {
        self.warm.park(self.shape);
    }
}

/// An executor's own directory, removed when dropped (the task ended or was cancelled); a cold
/// executor that logged its classes teaches them to [`WarmJvms`] first.
struct ExecutorDir<'a> {
    dir: PathBuf,
    learn: Option<(&'a WarmJvms, &'a Shape)>,
}

impl ExecutorDir<'_> {
    fn class_log(&self) -> PathBuf {
        self.dir.join("classes.log")
    }
}

impl Drop for ExecutorDir<'_> {
    fn drop(&mut self) {
        if let Some((warm, shape)) = self.learn {
            warm.learn(shape, &self.class_log());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts the executor's JVM, in a directory of its own (with its resources file), logging
/// the classes it loads when `learn` (for [`spark_warm`]).
async fn run_cold(task: &pb::Assignment, services: &Services, launch: &Launch, learn: bool) -> Report {
    let dir = ExecutorDir {
        dir: std::env::temp_dir().join(format!(
            "tern-spark-{}-{}-{}",
            task.job_id,
            task.task_index,
            std::process::id()
        )),
        learn: learn.then_some((services.warm_spark(), &launch.shape)),
    };
    let mut args = launch.shape.jvm_options.clone();
    if learn {
        args.push(spark_warm::class_log_option(&dir.class_log()));
    }
    args.extend(launch.properties.iter().cloned());
    args.push(MAIN_CLASS.to_string());
    args.extend(launch.args.iter().cloned());
    let prepared = std::fs::create_dir_all(&dir.dir).and_then(|()| {
        if task.gpus.is_empty() {
            return Ok(());
        }
        let file = dir.dir.join("resources.json");
        std::fs::write(&file, resources_json(&task.gpus))?;
        args.extend(["--resourcesFile".to_string(), file.display().to_string()]);
        Ok(())
    });
    if let Err(e) = prepared {
        return Report::failed(format!("spark-executor: preparing {}: {e}", dir.dir.display()));
    }
    command::run_program(task, services, &launch.shape.java, &args, &launch.shape.env, Some(&dir.dir)).await
}

/// Makes a parked JVM this task's executor; a JVM that cannot take the hand-off is given up and
/// the executor starts cold.
async fn run_warm(task: &pb::Assignment, services: &Services, launch: &Launch, mut taken: Taken) -> Report {
    let dir = ExecutorDir { dir: taken.dir.clone(), learn: None };
    if let Err(e) = spark_warm::hand_off(&mut taken, &launch.properties, &launch.args).await {
        tracing::warn!(error = %e, "a parked Spark executor JVM did not take its hand-off; starting one cold");
        drop((taken, dir));
        return run_cold(task, services, launch, false).await;
    }
    command::watch(task, &launch.shape.java, taken.started).await
}

/// The executor's JVM: how it is started ([`Shape`]), the application's startup settings (its
/// `-Dspark.*` options, which a parked JVM takes at the hand-off) and its arguments.
#[derive(Debug)]
struct Launch {
    shape: Shape,
    properties: Vec<String>,
    args: Vec<String>,
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
        let mut jvm_options = vec!["-cp".to_string(), classpath];
        if let Some(heap) = heap {
            // In MiB: the JVM takes no plain byte count above 2^31 on every version.
            jvm_options.push(format!("-Xmx{}m", (heap >> 20).max(64)));
        }
        let (properties, rest): (Vec<String>, Vec<String>) =
            options.into_iter().partition(|o| o.starts_with("-Dspark."));
        jvm_options.extend(rest);
        let mut env: Vec<(String, String)> = task
            .operator
            .as_ref()
            .map(|o| o.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        env.sort();
        let args = [
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
        .map(String::from)
        .to_vec();
        Ok(Launch { shape: Shape { java, jvm_options, env }, properties, args })
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
        ("java_options", "-Dx=1\n--add-opens=java.base/java.nio=ALL-UNNAMED\n-Dspark.driver.port=4040\n"),
    ];

    #[test]
    fn the_command_line_carries_the_executors_identity_and_options_and_the_apps_settings_apart() {
        let services = Services::new("m:1".into(), ClientOptions::default()).with_host("h3");
        let launch = Launch::new(&task(&PARAMS, &["0", "3"]), &services).unwrap();
        assert_eq!(launch.shape.java, "/jdk/bin/java");
        assert_eq!(
            launch.shape.jvm_options.join(" "),
            "-cp /spark/jars/* -Xmx1024m -Dx=1 --add-opens=java.base/java.nio=ALL-UNNAMED"
        );
        // The application's own settings are not part of how its JVM starts: a parked JVM takes them.
        assert_eq!(launch.properties, ["-Dspark.driver.port=4040"]);
        assert_eq!(
            launch.args.join(" "),
            "--driver-url spark://CoarseGrainedScheduler@10.0.0.1:4040 --executor-id 7 --hostname h3 --cores 2 \
             --app-id app-42 --resourceProfileId 0"
        );
        assert_eq!(
            resources_json(&task(&PARAMS, &["0", "3"]).gpus),
            r#"[{"id":{"componentName":"spark.executor","resourceName":"gpu"},"addresses":["0","3"]}]"#
        );
        // Another resource profile's stage: its executor ids start at its base.
        let mut profile = PARAMS.to_vec();
        profile.extend([("resource_profile_id", "2"), ("executor_id_base", "2000000")]);
        let launch = Launch::new(&task(&profile, &[]), &services).unwrap();
        let line = launch.args.join(" ");
        assert!(line.contains("--executor-id 2000007 ") && line.contains("--resourceProfileId 2"), "{line}");
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
