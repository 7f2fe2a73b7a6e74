//! Job files: what users write (TOML or JSON), turned into the wire's [`pb::JobSpec`] and
//! validated. Both `tern job submit` and the scheduler's SubmitJob run [`validate`], so a bad job
//! is refused with the same message whichever way it came.
//!
//! ```toml
//! name = "sort"
//! queue = "analytics"
//! priority = 1
//!
//! [[shuffles]]
//! name = "data"
//! partitions = 8
//!
//! [[stages]]
//! name = "map"
//! operator = "command"
//! command = ["sh", "-c", "my-mapper"]
//! tasks = 8
//! output = "data"
//! needs = { cpus = 1, memory = "512MiB" }
//!
//! [[stages]]
//! name = "reduce"
//! operator = "terasort-reduce-gpu"
//! tasks = 8
//! after = ["map"]
//! input = "data"
//! output = "/out/sorted"
//! needs = { cpus = 0.5, memory = "1GiB", gpus = 0.25 }
//! gpu_optional = true
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use tern_common::ByteSize;
use tern_proto::sched as pb;

use crate::Operator;

/// Milli-units per whole CPU or GPU.
pub const MILLI: u64 = 1000;
/// The queue of jobs that name none.
pub const DEFAULT_QUEUE: &str = "default";

/// Bounds on one job; the scheduler's config may lower the per-stage task limit.
#[derive(Debug, Clone, Copy)]
pub struct SpecLimits {
    pub max_stages: usize,
    pub max_shuffles: usize,
    pub max_tasks_per_stage: u32,
    pub max_tasks_per_job: u64,
    pub max_attempts: u32,
    pub max_partitions: u32,
}

impl Default for SpecLimits {
    fn default() -> Self {
        SpecLimits {
            max_stages: 64,
            max_shuffles: 64,
            max_tasks_per_stage: 100_000,
            max_tasks_per_job: 1_000_000,
            max_attempts: 100,
            max_partitions: 1_000_000,
        }
    }
}

/// A job file as written.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct JobFile {
    pub name: String,
    /// The tenant's queue ("tenant" is accepted as another name for it).
    #[serde(default, alias = "tenant")]
    pub queue: String,
    #[serde(default)]
    pub priority: i32,
    #[serde(default)]
    pub shuffles: Vec<ShuffleFile>,
    pub stages: Vec<StageFile>,
    /// Copies of shuffle segments and of built-ins' output files: 1 or 2 (absent: 1).
    #[serde(default)]
    pub copies: u32,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ShuffleFile {
    pub name: String,
    pub partitions: u32,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StageFile {
    pub name: String,
    /// A built-in operator or "command"; "command" when omitted and `command` is given.
    #[serde(default)]
    pub operator: Option<String>,
    /// Parameters of a built-in operator.
    #[serde(default)]
    pub params: BTreeMap<String, ParamValue>,
    /// "command": the program and its arguments.
    #[serde(default)]
    pub command: Vec<String>,
    /// "command": extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub tasks: u32,
    #[serde(default)]
    pub needs: NeedsFile,
    #[serde(default)]
    pub after: Vec<String>,
    #[serde(default)]
    pub gang: bool,
    #[serde(default)]
    pub min_available: u32,
    #[serde(default)]
    pub min_success: u32,
    #[serde(default)]
    pub max_attempts: u32,
    #[serde(default)]
    pub backoff_ms: u64,
    #[serde(default)]
    pub max_memory: Option<ByteSize>,
    /// A shuffle of the job by name, or a path (starting with `/` or `.`).
    #[serde(default)]
    pub input: Option<String>,
    #[serde(default)]
    pub output: Option<String>,
    #[serde(default)]
    pub gpu_optional: bool,
    #[serde(default)]
    pub locality: Vec<String>,
}

/// Per-task needs; CPUs and GPUs may be fractional down to 0.001.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct NeedsFile {
    pub cpus: f64,
    pub memory: ByteSize,
    pub gpus: f64,
}

impl Default for NeedsFile {
    fn default() -> Self {
        NeedsFile { cpus: 1.0, memory: ByteSize::mib(256), gpus: 0.0 }
    }
}

/// A parameter value: written as a string, number or boolean, passed on as a string.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(untagged)]
pub enum ParamValue {
    Bool(bool),
    Int(i64),
    Float(f64),
    Text(String),
}

impl std::fmt::Display for ParamValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParamValue::Bool(b) => write!(f, "{b}"),
            ParamValue::Int(i) => write!(f, "{i}"),
            ParamValue::Float(x) => write!(f, "{x}"),
            ParamValue::Text(s) => f.write_str(s),
        }
    }
}

/// Reads a job file: JSON when it ends in `.json` or starts with `{`, TOML otherwise.
pub fn load(path: &Path) -> anyhow::Result<pb::JobSpec> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading job file {}", path.display()))?;
    let json = path.extension().is_some_and(|e| e == "json");
    parse(&text, json).with_context(|| format!("job file {}", path.display()))
}

/// Parses a job file's text (`json` forces JSON; text starting with `{` is JSON too) and
/// validates it with the default limits.
pub fn parse(text: &str, json: bool) -> anyhow::Result<pb::JobSpec> {
    let file: JobFile = if json || text.trim_start().starts_with('{') {
        serde_json::from_str(text).context("parsing JSON")?
    } else {
        toml::from_str(text).context("parsing TOML")?
    };
    let spec = file.to_proto()?;
    validate(&spec, &SpecLimits::default())?;
    Ok(spec)
}

/// `x` whole units in milli-units, refusing negatives, NaN and anything finer than 0.001.
fn to_milli(field: &str, x: f64) -> anyhow::Result<u64> {
    if !x.is_finite() || x < 0.0 {
        bail!("{field} = {x}: must be a number >= 0");
    }
    if x > 1_000_000.0 {
        bail!("{field} = {x}: more than 1,000,000");
    }
    let milli = (x * MILLI as f64).round();
    if (milli - x * MILLI as f64).abs() > 1e-6 {
        bail!("{field} = {x}: finer than 0.001 (milli-units are the smallest share)");
    }
    Ok(milli as u64)
}

fn data_ref(text: &str, shuffles: &HashSet<&str>, field: &str) -> anyhow::Result<pb::DataRef> {
    use pb::data_ref::Kind;
    if text.starts_with('/') || text.starts_with('.') {
        return Ok(pb::DataRef { kind: Some(Kind::Path(text.into())) });
    }
    if !shuffles.contains(text) {
        bail!("{field} = {text:?}: no shuffle of that name (declare it under [[shuffles]], or write a path starting with / or .)");
    }
    Ok(pb::DataRef { kind: Some(Kind::Shuffle(text.into())) })
}

impl JobFile {
    /// The wire form; checks only what the wire cannot say (fractions, input/output names).
    pub fn to_proto(&self) -> anyhow::Result<pb::JobSpec> {
        let shuffle_names: HashSet<&str> = self.shuffles.iter().map(|s| s.name.as_str()).collect();
        let mut stages = Vec::with_capacity(self.stages.len());
        for stage in &self.stages {
            let at = format!("stage {:?}", stage.name);
            let operator = match (&stage.operator, stage.command.is_empty()) {
                (Some(name), _) => name.clone(),
                (None, false) => Operator::Command.name().to_string(),
                (None, true) => bail!("{at}: operator is missing (a built-in name, or command = [...])"),
            };
            let needs = pb::Resources {
                cpu_milli: to_milli(&format!("{at}: needs.cpus"), stage.needs.cpus)?,
                memory_bytes: stage.needs.memory.bytes(),
                gpu_milli: to_milli(&format!("{at}: needs.gpus"), stage.needs.gpus)?,
            };
            let input =
                stage.input.as_deref().map(|t| data_ref(t, &shuffle_names, &format!("{at}: input"))).transpose()?;
            let output =
                stage.output.as_deref().map(|t| data_ref(t, &shuffle_names, &format!("{at}: output"))).transpose()?;
            stages.push(pb::StageSpec {
                name: stage.name.clone(),
                operator: Some(pb::Operator {
                    name: operator,
                    params: stage.params.iter().map(|(k, v)| (k.clone(), v.to_string())).collect(),
                    argv: stage.command.clone(),
                    env: stage.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                }),
                tasks: stage.tasks,
                needs: Some(needs),
                after: stage.after.clone(),
                gang: stage.gang,
                min_available: stage.min_available,
                min_success: stage.min_success,
                max_attempts: stage.max_attempts,
                backoff_ms: stage.backoff_ms,
                max_memory_bytes: stage.max_memory.map(|m| m.bytes()).unwrap_or(0),
                input,
                output,
                gpu_optional: stage.gpu_optional,
                locality: stage.locality.clone(),
                elastic: false,
                lease_ms: 0,
            });
        }
        Ok(pb::JobSpec {
            name: self.name.clone(),
            queue: self.queue.clone(),
            priority: self.priority,
            shuffles: self
                .shuffles
                .iter()
                .map(|s| pb::ShuffleSpec { name: s.name.clone(), partitions: s.partitions })
                .collect(),
            stages,
            copies: self.copies,
        })
    }
}

/// `[A-Za-z0-9._-]`, 1 to `max` bytes.
pub fn check_name(field: &str, name: &str, max: usize) -> anyhow::Result<()> {
    if name.is_empty() {
        bail!("{field} is empty");
    }
    if name.len() > max {
        bail!("{field} {name:?} is longer than {max} bytes");
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        bail!("{field} {name:?} has {c:?}: only letters, digits, '.', '_' and '-' are allowed");
    }
    Ok(())
}

/// Which of a job's stages each stage must wait for, by index; also what validation proved.
#[derive(Debug, Clone)]
pub struct Dag {
    /// `after[s]`: indexes of the stages stage `s` comes directly after.
    pub after: Vec<Vec<usize>>,
    /// Stage indexes in an order where every stage follows those it comes after.
    pub order: Vec<usize>,
    /// `producer[s]`: the stage that writes stage `s`'s input, which `s` comes after: its input
    /// shuffle's writer, or the one earlier stage whose output path is `s`'s input path. The
    /// scheduler runs that stage's tasks again when `s` finds their output lost; `None` where no
    /// single stage wrote it.
    pub producer: Vec<Option<usize>>,
}

/// Every check of a job, each error naming the stage and field. Returns the stage DAG.
pub fn validate(spec: &pb::JobSpec, limits: &SpecLimits) -> anyhow::Result<Dag> {
    check_name("job name", &spec.name, 128)?;
    if !spec.queue.is_empty() {
        check_name("queue", &spec.queue, 64)?;
    }
    if spec.stages.is_empty() {
        bail!("job {:?} has no stages", spec.name);
    }
    if spec.copies > 2 {
        bail!("job {:?}: copies = {} must be 1 or 2", spec.name, spec.copies);
    }
    if spec.stages.len() > limits.max_stages {
        bail!("job {:?} has {} stages; at most {} are allowed", spec.name, spec.stages.len(), limits.max_stages);
    }
    if spec.shuffles.len() > limits.max_shuffles {
        bail!("job {:?} has {} shuffles; at most {} are allowed", spec.name, spec.shuffles.len(), limits.max_shuffles);
    }
    let mut shuffles: HashMap<&str, Option<usize>> = HashMap::new();
    for shuffle in &spec.shuffles {
        check_name("shuffle name", &shuffle.name, 64)?;
        if shuffle.partitions == 0 || shuffle.partitions > limits.max_partitions {
            bail!(
                "shuffle {:?}: partitions = {} must be 1 to {}",
                shuffle.name,
                shuffle.partitions,
                limits.max_partitions
            );
        }
        if shuffles.insert(&shuffle.name, None).is_some() {
            bail!("shuffle {:?} is declared twice", shuffle.name);
        }
    }
    let mut index: HashMap<&str, usize> = HashMap::new();
    for (i, stage) in spec.stages.iter().enumerate() {
        check_name("stage name", &stage.name, 64)?;
        if index.insert(&stage.name, i).is_some() {
            bail!("stage {:?} is declared twice", stage.name);
        }
    }
    let mut total_tasks = 0u64;
    let mut after = vec![Vec::new(); spec.stages.len()];
    for (i, stage) in spec.stages.iter().enumerate() {
        let at = format!("stage {:?}", stage.name);
        if stage.elastic {
            // Elastic stages live side by side (a Spark application's resource profiles), each
            // ended by its owner: nothing orders them and nothing flows between them.
            if spec.stages.iter().any(|s| !s.elastic) || !spec.shuffles.is_empty() || !stage.after.is_empty() {
                bail!("{at}: a job with an elastic stage has only elastic stages, with no `after` and no shuffles");
            }
            if stage.lease_ms > 86_400_000 {
                bail!("{at}: lease_ms = {} is more than a day", stage.lease_ms);
            }
            if stage.input.is_some() || stage.output.is_some() || stage.min_success != 0 {
                bail!("{at}: an elastic stage has no input, output or min_success (its owner ends it)");
            }
        } else if stage.lease_ms != 0 {
            bail!("{at}: lease_ms is for elastic stages");
        } else if stage.tasks == 0 {
            bail!("{at}: tasks = 0; a stage runs at least one task");
        }
        if stage.tasks > limits.max_tasks_per_stage {
            bail!("{at}: tasks = {} is more than the limit of {}", stage.tasks, limits.max_tasks_per_stage);
        }
        total_tasks += u64::from(stage.tasks);
        let op = stage.operator.as_ref().with_context(|| format!("{at}: operator is missing"))?;
        let operator: Operator = op.name.parse().with_context(|| at.clone())?;
        if operator == Operator::Command && op.argv.is_empty() {
            bail!("{at}: operator \"command\" needs command = [program, args...]");
        }
        if operator != Operator::Command && (!op.argv.is_empty() || (!operator.takes_env() && !op.env.is_empty())) {
            bail!("{at}: command and env belong to operator \"command\", not {:?}", op.name);
        }
        let needs = stage.needs.unwrap_or_default();
        if needs.cpu_milli == 0 {
            bail!("{at}: needs.cpus = 0; a task needs at least 0.001 CPUs");
        }
        if needs.gpu_milli > MILLI && needs.gpu_milli % MILLI != 0 {
            bail!(
                "{at}: needs.gpus = {}: above one GPU, tasks take whole GPUs (a fraction must be below 1)",
                needs.gpu_milli as f64 / MILLI as f64
            );
        }
        if needs.memory_bytes == 0 {
            bail!("{at}: needs.memory = 0; give the task's memory");
        }
        if stage.max_memory_bytes != 0 && stage.max_memory_bytes < needs.memory_bytes {
            bail!(
                "{at}: max_memory ({} bytes) is below needs.memory ({} bytes)",
                stage.max_memory_bytes,
                needs.memory_bytes
            );
        }
        if stage.gpu_optional && needs.gpu_milli == 0 {
            bail!("{at}: gpu_optional is set but needs.gpus = 0");
        }
        if stage.min_available > stage.tasks {
            bail!("{at}: min_available = {} is more than tasks = {}", stage.min_available, stage.tasks);
        }
        if stage.min_available > 0 && !stage.gang {
            bail!("{at}: min_available is set but gang = false");
        }
        if stage.min_success > stage.tasks {
            bail!("{at}: min_success = {} is more than tasks = {}", stage.min_success, stage.tasks);
        }
        if stage.max_attempts > limits.max_attempts {
            bail!("{at}: max_attempts = {} is more than {}", stage.max_attempts, limits.max_attempts);
        }
        if stage.backoff_ms > 3_600_000 {
            bail!("{at}: backoff_ms = {} is more than an hour", stage.backoff_ms);
        }
        if stage.locality.len() > stage.tasks as usize || stage.locality.iter().any(|h| h.is_empty() || h.len() > 255) {
            bail!("{at}: locality must hold 1 to 255-byte host names, at most one per task");
        }
        let mut seen = HashSet::new();
        for name in &stage.after {
            let Some(&j) = index.get(name.as_str()) else {
                bail!("{at}: after names {name:?}, which is no stage of this job");
            };
            if j == i {
                bail!("{at}: after names the stage itself");
            }
            if seen.insert(j) {
                after[i].push(j);
            }
        }
        for (field, data) in [("input", &stage.input), ("output", &stage.output)] {
            use pb::data_ref::Kind;
            match data.as_ref().and_then(|d| d.kind.as_ref()) {
                Some(Kind::Shuffle(name)) => {
                    let Some(writer) = shuffles.get_mut(name.as_str()) else {
                        bail!("{at}: {field} names shuffle {name:?}, which the job does not declare");
                    };
                    if field == "output" {
                        if let Some(other) = *writer {
                            bail!(
                                "{at}: output shuffle {name:?} is already written by stage {:?}; one stage writes a shuffle",
                                spec.stages[other].name
                            );
                        }
                        *writer = Some(i);
                    }
                }
                Some(Kind::Path(path)) if path.is_empty() => bail!("{at}: {field} path is empty"),
                _ => {}
            }
        }
    }
    if total_tasks > limits.max_tasks_per_job {
        bail!("job {:?} has {total_tasks} tasks; at most {} are allowed", spec.name, limits.max_tasks_per_job);
    }
    let order = topological_order(spec, &after)?;
    // A stage reading a shuffle must come (transitively) after the stage writing it.
    let reach = reachability(&after, &order);
    for (i, stage) in spec.stages.iter().enumerate() {
        if let Some(pb::data_ref::Kind::Shuffle(name)) = stage.input.as_ref().and_then(|d| d.kind.as_ref()) {
            match shuffles[name.as_str()] {
                None => bail!("stage {:?}: input shuffle {name:?} is written by no stage", stage.name),
                Some(w) if w == i => bail!("stage {:?}: reads and writes shuffle {name:?}", stage.name),
                Some(w) if !reach[i].contains(&w) => bail!(
                    "stage {:?}: reads shuffle {name:?} written by stage {:?} but does not come after it (add after = [{:?}])",
                    stage.name,
                    spec.stages[w].name,
                    spec.stages[w].name
                ),
                Some(_) => {}
            }
        }
    }
    for (name, writer) in &shuffles {
        if writer.is_none() {
            bail!("shuffle {name:?} is declared but no stage writes it");
        }
    }
    let producer = (0..spec.stages.len()).map(|i| producer_of(spec, i, &reach[i])).collect();
    Ok(Dag { after, order, producer })
}

/// Kahn's algorithm; a cycle is reported with the stages on it.
fn topological_order(spec: &pb::JobSpec, after: &[Vec<usize>]) -> anyhow::Result<Vec<usize>> {
    let n = after.len();
    let mut indegree: Vec<usize> = after.iter().map(Vec::len).collect();
    let mut next: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, deps) in after.iter().enumerate() {
        for &d in deps {
            next[d].push(i);
        }
    }
    let mut ready: Vec<usize> = (0..n).filter(|&i| indegree[i] == 0).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(i) = ready.pop() {
        order.push(i);
        for &j in &next[i] {
            indegree[j] -= 1;
            if indegree[j] == 0 {
                ready.push(j);
            }
        }
    }
    if order.len() < n {
        let on_cycle: Vec<&str> = (0..n).filter(|&i| indegree[i] > 0).map(|i| spec.stages[i].name.as_str()).collect();
        bail!("stages {on_cycle:?} form a cycle through their after lists");
    }
    Ok(order)
}

/// `reach[i]`: every stage `i` comes after, directly or not.
/// The one stage that writes stage `i`'s input and that `i` comes after (`earlier`), if any.
fn producer_of(spec: &pb::JobSpec, i: usize, earlier: &HashSet<usize>) -> Option<usize> {
    let input = spec.stages[i].input.as_ref()?.kind.as_ref()?;
    let mut writers = earlier
        .iter()
        .copied()
        .filter(|&w| spec.stages[w].output.as_ref().and_then(|d| d.kind.as_ref()) == Some(input));
    let first = writers.next()?;
    // Two earlier stages writing the same path: which one's output is lost is unknown.
    writers.next().is_none().then_some(first)
}

fn reachability(after: &[Vec<usize>], order: &[usize]) -> Vec<HashSet<usize>> {
    let mut reach = vec![HashSet::new(); after.len()];
    for &i in order {
        let mut set = HashSet::new();
        for &d in &after[i] {
            set.insert(d);
            set.extend(reach[d].iter().copied());
        }
        reach[i] = set;
    }
    reach
}

/// What `tern job terasort` builds.
#[derive(Debug, Clone)]
pub struct TerasortJob {
    /// Bytes to generate and sort (100-byte gensort records).
    pub size_bytes: u64,
    /// Tasks per stage (maps, partitions, reduces).
    pub tasks: u32,
    /// Reduce on the GPU (`terasort-reduce-gpu`, a quarter GPU per task, CPU path if none).
    pub gpu: bool,
    /// Store directory: teragen writes `<out>/input/part-*`, reduces write `<out>/output/part-*`.
    pub out: String,
    /// A last stage runs `validate` (argv; e.g. `tern teravalidate <out>/output`) as a command.
    pub validate: Option<Vec<String>>,
    /// Copies of the shuffle and of the input and output parts (1 or 2).
    pub copies: u32,
}

/// teragen → terasort-map → terasort-reduce (→ validate): the job `tern terasort` runs in one
/// process, as scheduler stages. Teragen task i writes records [i*N/T, (i+1)*N/T) to
/// `<out>/input/part-<i>`; map task i reads that part and writes the "data" shuffle (T
/// partitions, uniform key ranges); reduce task i sorts partition i into `<out>/output/part-<i>`.
pub fn terasort_job(job: &TerasortJob) -> anyhow::Result<pb::JobSpec> {
    const RECORD: u64 = 100;
    if job.size_bytes < RECORD {
        bail!("size {} is less than one 100-byte record", ByteSize(job.size_bytes));
    }
    if job.tasks == 0 {
        bail!("tasks must be at least 1");
    }
    let records = job.size_bytes / RECORD;
    let out = job.out.trim_end_matches('/');
    if !out.starts_with('/') {
        bail!("out {out:?} must be an absolute store path");
    }
    let part_bytes = job.size_bytes / u64::from(job.tasks) + 1;
    // A map holds a part's batches; a reduce sorts its partition in memory (data + index).
    let memory = |factor: u64| ByteSize(part_bytes.saturating_mul(factor) + (64 << 20));
    let stage = |name: &str, operator: Operator, factor: u64| StageFile {
        name: name.into(),
        operator: Some(operator.name().into()),
        params: BTreeMap::new(),
        command: Vec::new(),
        env: BTreeMap::new(),
        tasks: job.tasks,
        needs: NeedsFile { cpus: 1.0, memory: memory(factor), gpus: 0.0 },
        after: Vec::new(),
        gang: false,
        min_available: 0,
        min_success: 0,
        max_attempts: 0,
        backoff_ms: 0,
        max_memory: Some(memory(factor * 4)),
        input: None,
        output: None,
        gpu_optional: false,
        locality: Vec::new(),
    };
    let mut teragen = stage("teragen", Operator::Teragen, 1);
    teragen.params.insert("records".into(), ParamValue::Int(records as i64));
    teragen.output = Some(format!("{out}/input"));
    let mut map = stage("map", Operator::TerasortMap, 1);
    map.after = vec!["teragen".into()];
    map.input = Some(format!("{out}/input"));
    map.output = Some("data".into());
    map.params.insert("parts".into(), ParamValue::Int(i64::from(job.tasks)));
    let mut reduce = stage("reduce", if job.gpu { Operator::TerasortReduceGpu } else { Operator::TerasortReduce }, 3);
    reduce.after = vec!["map".into()];
    reduce.input = Some("data".into());
    reduce.output = Some(format!("{out}/output"));
    if job.gpu {
        reduce.needs.gpus = 0.25;
        reduce.gpu_optional = true;
    }
    let mut stages = vec![teragen, map, reduce];
    if let Some(argv) = &job.validate {
        let mut validate = stage("validate", Operator::Command, 1);
        validate.tasks = 1;
        validate.command = argv.clone();
        validate.after = vec!["reduce".into()];
        validate.input = Some(format!("{out}/output"));
        // teravalidate reads one part per core at once: its resident set grows with the cores
        // (270-490 MB on 16 of them, 4 GiB sorted), so an OOM retry may double it up to 4 GiB.
        validate.needs.memory = ByteSize::mib(512);
        validate.max_memory = Some(ByteSize::gib(4));
        stages.push(validate);
    }
    let file = JobFile {
        name: "terasort".into(),
        queue: String::new(),
        priority: 0,
        shuffles: vec![ShuffleFile { name: "data".into(), partitions: job.tasks }],
        stages,
        copies: job.copies,
    };
    let spec = file.to_proto()?;
    validate(&spec, &SpecLimits::default())?;
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SORT: &str = r#"
name = "sort"
queue = "analytics"
priority = 2

[[shuffles]]
name = "data"
partitions = 4

[[stages]]
name = "map"
command = ["sh", "-c", "true"]
tasks = 4
output = "data"
needs = { cpus = 0.5, memory = "64MiB" }

[[stages]]
name = "reduce"
operator = "terasort-reduce-gpu"
tasks = 4
after = ["map"]
input = "data"
output = "/out/sorted"
needs = { cpus = 1, memory = "1GiB", gpus = 0.25 }
gpu_optional = true
max_memory = "4GiB"
"#;

    fn err(text: &str) -> String {
        format!("{:#}", parse(text, false).unwrap_err())
    }

    #[test]
    fn parses_toml_and_json_alike() {
        let spec = parse(SORT, false).unwrap();
        assert_eq!(spec.queue, "analytics");
        assert_eq!(spec.stages[0].operator.as_ref().unwrap().name, "command");
        assert_eq!(spec.stages[0].needs.unwrap().cpu_milli, 500);
        assert_eq!(spec.stages[1].needs.unwrap().gpu_milli, 250);
        assert_eq!(spec.stages[1].max_memory_bytes, 4 << 30);
        assert_eq!(spec.stages[1].output.as_ref().unwrap().kind, Some(pb::data_ref::Kind::Path("/out/sorted".into())));
        let file: JobFile = toml::from_str(SORT).unwrap();
        let json = serde_json::to_string(&file).unwrap();
        assert_eq!(parse(&json, true).unwrap(), spec);
    }

    #[test]
    fn refuses_bad_jobs_naming_the_field() {
        let cases = [
            (SORT.replace("after = [\"map\"]", "after = [\"mapp\"]"), "after names \"mapp\""),
            (SORT.replace("tasks = 4\nafter", "tasks = 0\nafter"), "tasks = 0"),
            (SORT.replace("gpus = 0.25", "gpus = 1.5"), "whole GPUs"),
            (SORT.replace("gpus = 0.25", "gpus = 0.0005"), "finer than 0.001"),
            (SORT.replace("input = \"data\"", "input = \"dta\""), "no shuffle of that name"),
            (SORT.replace("operator = \"terasort-reduce-gpu\"", "operator = \"sortt\""), "unknown"),
            (SORT.replace("after = [\"map\"]\n", ""), "does not come after it"),
            (SORT.replace("max_memory = \"4GiB\"", "max_memory = \"1MiB\""), "max_memory"),
            (SORT.replace("priority = 2", "priority = 2\nbogus = 1"), "unknown field"),
            (SORT.replace("priority = 2", "priority = 2\ncopies = 3"), "copies = 3 must be 1 or 2"),
            (SORT.replace("name = \"sort\"", "name = \"a b\""), "job name"),
            (SORT.replace("partitions = 4", "partitions = 0"), "partitions = 0"),
        ];
        for (text, want) in cases {
            let e = err(&text);
            assert!(e.contains(want), "wanted {want:?} in: {e}");
        }
    }

    #[test]
    fn refuses_cycles_and_duplicates() {
        let cyclic = r#"
name = "c"
[[stages]]
name = "a"
operator = "noop"
tasks = 1
after = ["b"]
[[stages]]
name = "b"
operator = "noop"
tasks = 1
after = ["a"]
"#;
        assert!(err(cyclic).contains("form a cycle"), "{}", err(cyclic));
        let dup = cyclic.replace("name = \"b\"", "name = \"a\"");
        assert!(err(&dup).contains("declared twice"));
        let gang =
            "name = \"g\"\n[[stages]]\nname = \"a\"\noperator = \"noop\"\ntasks = 2\nmin_available = 3\ngang = true\n";
        assert!(err(gang).contains("min_available = 3"));
    }

    #[test]
    fn terasort_job_chains_its_stages() {
        let job = TerasortJob {
            size_bytes: 1 << 30,
            tasks: 4,
            gpu: true,
            out: "/ts/".into(),
            validate: Some(vec!["tern".into(), "teravalidate".into(), "/ts/output".into()]),
            copies: 1,
        };
        let spec = terasort_job(&job).unwrap();
        let names: Vec<&str> = spec.stages.iter().map(|s| s.operator.as_ref().unwrap().name.as_str()).collect();
        assert_eq!(names, ["teragen", "terasort-map", "terasort-reduce-gpu", "command"]);
        assert_eq!(spec.stages[0].operator.as_ref().unwrap().params["records"], ((1u64 << 30) / 100).to_string());
        assert_eq!(spec.stages[2].needs.unwrap().gpu_milli, 250);
        assert!(spec.stages[2].gpu_optional);
        assert_eq!(spec.shuffles[0].partitions, 4);
        let dag = validate(&spec, &SpecLimits::default()).unwrap();
        assert_eq!(dag.order, vec![0, 1, 2, 3]);
        // Lineage: the map reads teragen's path, the reduce the map's shuffle.
        assert_eq!(dag.producer[..3], [None, Some(0), Some(1)]);
        assert!(terasort_job(&TerasortJob { out: "rel".into(), ..job.clone() }).is_err());
    }

    #[test]
    fn dag_orders_stages() {
        let spec = parse(SORT, false).unwrap();
        let dag = validate(&spec, &SpecLimits::default()).unwrap();
        assert_eq!(dag.order, vec![0, 1]);
        assert_eq!(dag.after[1], vec![0]);
    }
}
