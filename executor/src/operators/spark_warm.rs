//! Warm Spark executor JVMs: JVMs a Tern executor starts before any application asks for them,
//! so that a Spark application's executor is a hand-off to a running JVM rather than a JVM start.
//!
//! A Spark executor's start is seconds of JVM start-up and class loading and initialization
//! (about 4,000 classes) before it registers with its driver; a parked JVM
//! (`io.tern.spark.WarmExecutor`, in the plugin jar) has done that already, and becomes the
//! executor when a `spark-executor` task hands it the application's arguments on stdin.
//!
//! What it loads is learned, not shipped: the first executor of a [`Shape`] on this Tern
//! executor starts cold with `-Xlog:class+load` into its directory, and when it ends the classes
//! it loaded up to its first task ([`FIRST_TASK_CLASS`]; later classes are the application's)
//! become the shape's class list. From then on, whenever a `spark-executor` task of that shape
//! ends, the executor parks a JVM of that shape (its slot is free again), up to
//! [`WarmJvms::limit`] parked JVMs in all (the most recent shapes win). A JVM parked longer
//! than [`PARKED_AT_MOST`] is stopped.
//!
//! A JVM can only be handed off to an executor whose JVM would have been started the same way:
//! the same java, class path, heap and JVM options, and the same environment (the shape). The
//! application's `-Dspark.*` startup settings (its driver's port among them) travel in the
//! hand-off as system properties instead; executors with GPUs start cold (their
//! `CUDA_VISIBLE_DEVICES` is per task, set at the process's start), as does every executor when
//! the limit is 0. A parked JVM is outside any task's grant: it holds about 190 MiB resident (with
//! a 900 MiB heap), which the executor's operator budgets for.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use super::command::Started;

/// The class a Spark executor loads when it starts its first task: the class list ends there.
pub const FIRST_TASK_CLASS: &str = "org.apache.spark.executor.Executor$TaskRunner";
/// Classes in a learned list, at most.
const MAX_CLASSES: usize = 20_000;
/// Bytes of a class-loading log read, at most.
const MAX_LOG_BYTES: u64 = 16 << 20;
/// A parked JVM nobody took for this long is stopped (it holds memory).
pub const PARKED_AT_MOST: Duration = Duration::from_secs(600);
/// Parked JVMs a Tern executor keeps, at most (the `--warm-spark-executors` bound).
pub const MAX_LIMIT: usize = 64;
/// Exit status of a parked JVM where a class failed to initialize (`WarmExecutor.POISONED`).
const POISONED: i32 = 3;

/// How an executor JVM is started, apart from the application's own settings: JVMs of one shape
/// are interchangeable until the hand-off.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Shape {
    pub java: String,
    /// The JVM's options: class path, heap, `--add-opens` and other options, in order.
    pub jvm_options: Vec<String>,
    /// The process's environment beyond the executor's own, sorted.
    pub env: Vec<(String, String)>,
}

/// A parked JVM.
struct Parked {
    id: u64,
    shape: Arc<Shape>,
    started: Started,
    dir: PathBuf,
}

/// A JVM taken for a task: it runs in `dir` and becomes the executor once handed its line.
pub(super) struct Taken {
    pub(super) started: Started,
    pub(super) dir: PathBuf,
}

#[derive(Default)]
struct State {
    parked: Vec<Parked>,
    /// Learned class lists, by shape.
    class_lists: HashMap<Arc<Shape>, PathBuf>,
    /// Shapes whose parked JVMs failed: not parked again (said once, in the log).
    refused: HashMap<Arc<Shape>, String>,
    next_id: u64,
}

/// One Tern executor's parked JVMs.
pub struct WarmJvms {
    limit: usize,
    /// Where class lists and parked JVMs' directories live.
    dir: PathBuf,
    state: Arc<Mutex<State>>,
}

impl WarmJvms {
    /// Keeps up to `limit` parked JVMs (0 = none: every executor starts cold).
    pub fn new(limit: usize) -> WarmJvms {
        static POOLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = POOLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tern-warm-{}-{n}", std::process::id()));
        WarmJvms { limit: limit.min(MAX_LIMIT), dir, state: Default::default() }
    }

    /// Whether executors of `shape` should start cold with a class-loading log (to learn its
    /// class list).
    pub fn wants_class_log(&self, shape: &Shape) -> bool {
        let state = self.state.lock();
        self.limit > 0 && !state.class_lists.contains_key(shape) && !state.refused.contains_key(shape)
    }

    /// A parked JVM of `shape`, if one is alive. One that died while parked is dropped and its
    /// shape refused from then on.
    pub(super) fn take(&self, shape: &Shape) -> Option<Taken> {
        let mut state = self.state.lock();
        while let Some(at) = state.parked.iter().position(|p| *p.shape == *shape) {
            let mut parked = state.parked.swap_remove(at);
            match parked.started.child.try_wait() {
                Ok(None) => {
                    // Its warm-up output is nobody's task's.
                    parked.started.take_output();
                    return Some(Taken { started: parked.started, dir: parked.dir });
                }
                Ok(Some(status)) => {
                    let (_, stderr) = parked.started.take_output();
                    let why = format!("{status}: {}", String::from_utf8_lossy(&stderr).trim());
                    let _ = std::fs::remove_dir_all(&parked.dir);
                    refuse(&mut state, &parked.shape, why, status.code() == Some(POISONED));
                }
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&parked.dir);
                    refuse(&mut state, &parked.shape, e.to_string(), false);
                }
            }
        }
        None
    }

    /// Learns `shape`'s class list from a cold executor's class-loading log `log` (once).
    pub fn learn(&self, shape: &Shape, log: &Path) {
        if self.limit == 0 || self.state.lock().class_lists.contains_key(shape) {
            return;
        }
        let classes = match read_class_log(log) {
            Ok(classes) if !classes.is_empty() => classes,
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(log = %log.display(), error = %e, "reading a Spark executor's class-loading log");
                return;
            }
        };
        let mut state = self.state.lock();
        let file = self.dir.join(format!("classes-{}.txt", state.next_id));
        state.next_id += 1;
        let written = std::fs::create_dir_all(&self.dir).and_then(|()| std::fs::write(&file, classes.join("\n")));
        match written {
            Ok(()) => {
                tracing::info!(classes = classes.len(), file = %file.display(), "learned a Spark executor's class list");
                state.class_lists.insert(Arc::new(shape.clone()), file);
            }
            Err(e) => tracing::warn!(file = %file.display(), error = %e, "writing a Spark executor class list"),
        }
    }

    /// Parks one more JVM of `shape` (when its class list is known and it is not refused),
    /// stopping the oldest parked JVM of another shape when at the limit. Called when an executor
    /// of `shape` ended: its slot is free again.
    pub fn park(&self, shape: &Shape) {
        if self.limit == 0 {
            return;
        }
        let mut state = self.state.lock();
        let Some((shape, list)) = state.class_lists.get_key_value(shape).map(|(s, l)| (s.clone(), l.clone())) else {
            return;
        };
        if state.refused.contains_key(&shape) {
            return;
        }
        if state.parked.iter().filter(|p| p.shape == shape).count() >= self.limit {
            return;
        }
        if state.parked.len() >= self.limit {
            // The oldest (ids grow) goes; dropping it kills it.
            if let Some(oldest) = state.parked.iter().enumerate().min_by_key(|(_, p)| p.id).map(|(i, _)| i) {
                let gone = state.parked.swap_remove(oldest);
                let _ = std::fs::remove_dir_all(&gone.dir);
            }
        }
        let id = state.next_id;
        state.next_id += 1;
        let dir = self.dir.join(format!("jvm-{id}"));
        let spawned = std::fs::create_dir_all(&dir).and_then(|()| {
            let mut command = Command::new(&shape.java);
            command
                .current_dir(&dir)
                .args(&shape.jvm_options)
                .arg(tern_common::spark::WARM_EXECUTOR_CLASS)
                .arg(&list)
                .envs(shape.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .stdin(Stdio::piped());
            Started::spawn(command)
        });
        match spawned {
            Ok(started) => {
                tracing::debug!(pid = started.pid, "parked a Spark executor JVM");
                state.parked.push(Parked { id, shape, started, dir });
                // Stopped after PARKED_AT_MOST if still parked (a weak handle: a dropped pool
                // has stopped it already).
                let weak = Arc::downgrade(&self.state);
                tokio::spawn(async move {
                    tokio::time::sleep(PARKED_AT_MOST).await;
                    if let Some(state) = weak.upgrade() {
                        let mut state = state.lock();
                        if let Some(at) = state.parked.iter().position(|p| p.id == id) {
                            let gone = state.parked.swap_remove(at);
                            let _ = std::fs::remove_dir_all(&gone.dir);
                        }
                    }
                });
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                refuse(&mut state, &shape, format!("cannot start {}: {e}", shape.java), false);
            }
        }
    }

    /// JVMs parked now.
    #[cfg(test)]
    fn parked(&self) -> usize {
        self.state.lock().parked.len()
    }
}

impl Drop for WarmJvms {
    fn drop(&mut self) {
        // Parked JVMs die with their handles (kill on drop); their files go too.
        self.state.lock().parked.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Parks no more JVMs of `shape`; `poisoned` when one exited because a static initializer failed.
fn refuse(state: &mut State, shape: &Arc<Shape>, why: String, poisoned: bool) {
    tracing::warn!(
        java = %shape.java, why = %why, poisoned,
        "a parked Spark executor JVM failed; executors of this kind start cold from now on"
    );
    state.refused.insert(shape.clone(), why);
}

/// Writes the hand-off line (NUL-separated `-Dkey=value` properties, then the executor's
/// arguments) to a taken JVM's stdin and closes it.
pub(super) async fn hand_off(taken: &mut Taken, properties: &[String], args: &[String]) -> std::io::Result<()> {
    let mut stdin =
        taken.started.child.stdin.take().ok_or_else(|| std::io::Error::other("the parked JVM has no stdin"))?;
    stdin.write_all(hand_off_line(properties, args)?.as_bytes()).await?;
    stdin.flush().await
}

fn hand_off_line(properties: &[String], args: &[String]) -> std::io::Result<String> {
    let fields: Vec<&String> = properties.iter().chain(args).collect();
    if let Some(bad) = fields.iter().find(|f| f.contains(['\0', '\n'])) {
        return Err(std::io::Error::other(format!("{bad:?} holds a NUL or a newline; it cannot be handed off")));
    }
    let mut line = fields.iter().map(|f| f.as_str()).collect::<Vec<_>>().join("\0");
    line.push('\n');
    Ok(line)
}

/// The JVM option that logs class loading to `log` (plain lines: "NAME source: WHERE").
pub fn class_log_option(log: &Path) -> String {
    format!("-Xlog:class+load=info:file={}:none", log.display())
}

/// Classes from a `-Xlog:class+load` log up to [`FIRST_TASK_CLASS`], in loading order, without
/// the JVM's generated classes (lambdas, proxies, hidden classes), which cannot be named.
fn read_class_log(log: &Path) -> std::io::Result<Vec<String>> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(log)?.take(MAX_LOG_BYTES).read_to_string(&mut text)?;
    Ok(parse_class_log(&text))
}

fn parse_class_log(text: &str) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    let mut classes = Vec::new();
    for line in text.lines() {
        let Some((name, source)) = line.trim().split_once(" source: ") else { continue };
        if name == FIRST_TASK_CLASS || classes.len() >= MAX_CLASSES {
            break;
        }
        let generated = name.contains("$$Lambda")
            || name.contains("/0x")
            || name.contains("$Proxy")
            || source.starts_with("__")
            || name.contains(char::is_whitespace);
        if !generated && seen.insert(name) {
            classes.push(name.to_string());
        }
    }
    classes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_class_list_stops_at_the_first_task_and_skips_generated_classes() {
        let log = "java.lang.Object source: shared objects file\n\
                   org.apache.spark.SparkConf source: jar:file:/spark/jars/spark-core.jar!/\n\
                   org.apache.spark.SparkConf$$Lambda$12/0x0000000800c0b2a8 source: org.apache.spark.SparkConf\n\
                   jdk.internal.reflect.GeneratedMethodAccessor1 source: __JVM_DefineClass__\n\
                   com.sun.proxy.$Proxy3 source: __dynamic_proxy__\n\
                   org.apache.spark.SparkConf source: jar:file:/spark/jars/spark-core.jar!/\n\
                   garbage without a source\n\
                   org.apache.spark.executor.Executor source: jar:file:/spark/jars/spark-core.jar!/\n\
                   org.apache.spark.executor.Executor$TaskRunner source: jar:file:/spark/jars/spark-core.jar!/\n\
                   com.example.UserUdf source: file:/app/udf.jar\n";
        assert_eq!(
            parse_class_log(log),
            ["java.lang.Object", "org.apache.spark.SparkConf", "org.apache.spark.executor.Executor"]
        );
    }

    #[test]
    fn the_hand_off_is_one_line_of_nul_separated_fields() {
        let line = hand_off_line(&["-Dspark.driver.port=4040".into()], &["--cores".into(), "2".into()]).unwrap();
        assert_eq!(line, "-Dspark.driver.port=4040\0--cores\x002\n");
        let e = hand_off_line(&[], &["a\nb".into()]).unwrap_err();
        assert!(e.to_string().contains("newline"), "{e}");
    }

    #[tokio::test]
    async fn a_shape_parks_only_once_learned_and_a_jvm_that_dies_parked_refuses_its_shape() {
        let pool = WarmJvms::new(2);
        // `sh -c 'exit 5' WarmExecutor LIST`: a "JVM" that dies at once.
        let shape = Shape {
            java: "sh".into(),
            jvm_options: vec!["-c".into(), "exit 5".into()],
            env: vec![("SPARK_HOME".into(), "/spark".into())],
        };
        assert!(pool.wants_class_log(&shape));
        pool.park(&shape);
        assert_eq!(pool.parked(), 0, "nothing to load yet: nothing parked");
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("classes.log");
        std::fs::write(&log, "org.apache.spark.SparkConf source: jar:file:/x.jar!/\n").unwrap();
        pool.learn(&shape, &log);
        assert!(!pool.wants_class_log(&shape));
        pool.park(&shape);
        pool.park(&shape);
        pool.park(&shape);
        assert_eq!(pool.parked(), 2, "at most the limit");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(pool.take(&shape).is_none(), "both died parked");
        assert_eq!(pool.parked(), 0);
        pool.park(&shape);
        assert_eq!(pool.parked(), 0, "a refused shape is not parked again");
        assert!(!pool.wants_class_log(&shape));
    }

    #[tokio::test]
    async fn a_live_parked_jvm_is_taken_and_handed_its_line() {
        let pool = WarmJvms::new(1);
        // Reads the hand-off line into a file in its directory, as WarmExecutor reads it.
        let shape = Shape {
            java: "sh".into(),
            jvm_options: vec!["-c".into(), "echo warming; cat > handed.txt".into()],
            env: Vec::new(),
        };
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("classes.log");
        std::fs::write(&log, "a.B source: jrt:/java.base\n").unwrap();
        pool.learn(&shape, &log);
        pool.park(&shape);
        let other = Shape { java: "java".into(), ..shape.clone() };
        assert!(pool.take(&other).is_none(), "another shape's JVM is not handed out");
        let mut taken = pool.take(&shape).expect("a parked JVM");
        assert_eq!(pool.parked(), 0);
        hand_off(&mut taken, &["-Dspark.x=1".into()], &["--cores".into(), "1".into()]).await.unwrap();
        let status = taken.started.child.wait().await.unwrap();
        assert!(status.success());
        let handed = std::fs::read_to_string(taken.dir.join("handed.txt")).unwrap();
        assert_eq!(handed, "-Dspark.x=1\0--cores\x001\n");
    }
}
