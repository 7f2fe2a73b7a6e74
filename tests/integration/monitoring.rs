//! The Grafana dashboard and Prometheus alert rules under `deploy/monitoring/` against running
//! daemons: a metadata server, a storage server, a scheduler and an executor are started as
//! real processes, put to work (a file round trip, a job on the executor), and every daemon's
//! `/metrics` is scraped. The test fails naming each metric the dashboard or the rules use that
//! no daemon exports. Executors serve no `/metrics`; the scheduler reports on them.
//!
//! Metric names are taken from PromQL by a small tokenizer ([`promql_metrics`]): identifiers
//! that are not functions (followed by `(`) or aggregations (`sum by (...)`), keywords, label names (in `{...}`, and in the lists
//! of `by`, `without`, `on`, `ignoring`, `group_left`, `group_right`), strings or durations. A
//! name ending in `_bucket`, `_sum` or `_count` matches only a histogram (or summary) of the
//! stem; `_total` only a counter.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::{free_port, spawn_logged, TERN};
use tern_client::ClientOptions;
use tern_local::{Daemon, Deadline, Host};

/// Series Prometheus or kube-state-metrics make, not a Tern daemon: the rules may use them.
const NOT_FROM_TERN: [(&str, &str); 2] =
    [("up", "Prometheus, per scrape target"), ("kube_pod_status_ready", "kube-state-metrics")];

const STARTUP: Duration = Duration::from_secs(60);

fn deploy_monitoring() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/monitoring")
}

#[tokio::test]
async fn every_metric_the_dashboard_and_alerts_use_is_exported() {
    let dashboard = std::fs::read_to_string(deploy_monitoring().join("grafana-dashboard.json")).unwrap();
    let alerts = std::fs::read_to_string(deploy_monitoring().join("alerts.yaml")).unwrap();
    let mut used: BTreeMap<String, BTreeSet<&str>> = BTreeMap::new();
    for query in dashboard_queries(&dashboard) {
        for name in promql_metrics(&query) {
            used.entry(name).or_default().insert("grafana-dashboard.json");
        }
    }
    for expr in rule_exprs(&alerts) {
        for name in promql_metrics(&expr) {
            used.entry(name).or_default().insert("alerts.yaml");
        }
    }
    assert!(used.len() >= 30, "only {} metric names found in the dashboard and rules: {used:?}", used.len());

    let cluster = Daemons::start().await;
    cluster.put_to_work().await;
    // Gauges of the scheduler's queues are refreshed by its ticker: scrape until nothing is
    // missing, or until the deadline says what still is.
    let deadline = Deadline::after(Duration::from_secs(15));
    let scraped = tern_local::poll_until(&deadline, || async {
        let exported = cluster.scrape_all().await;
        let missing: Vec<String> = used
            .iter()
            .filter(|(name, _)| !exported.has(name) && !NOT_FROM_TERN.iter().any(|(n, _)| n == name))
            .map(|(name, files)| format!("{name} (used in {})", files.iter().copied().collect::<Vec<_>>().join(", ")))
            .collect();
        if missing.is_empty() {
            Ok(exported)
        } else {
            Err((exported, missing))
        }
    })
    .await;
    let (exported, missing) = scraped.map_or_else(|failed| failed, |exported| (exported, Vec::new()));
    for (name, source) in NOT_FROM_TERN {
        if used.contains_key(name) {
            println!("not checked: {name} comes from {source}");
        }
    }
    println!("{} metric names used, {} exported by the daemons", used.len(), exported.names.len());
    assert!(
        missing.is_empty(),
        "metrics used by deploy/monitoring that no daemon exports:\n  {}",
        missing.join("\n  ")
    );
}

/// The daemons, each with its admin endpoint, started from a temp dir.
struct Daemons {
    dir: tempfile::TempDir,
    metadata: String,
    scheduler: String,
    storage: SocketAddr,
    /// Role and admin address of each daemon that serves /metrics.
    admin: Vec<(&'static str, SocketAddr)>,
    /// Held so that dropping the struct stops them.
    _daemons: Vec<Daemon>,
}

impl Daemons {
    async fn start() -> Daemons {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let host = Host::local();
        let [metadata, metadata_admin, storage, storage_admin, scheduler, scheduler_admin] =
            [(); 6].map(|()| host.addr(free_port()));
        let path = |name: &str| dir.path().join(name).to_string_lossy().into_owned();
        let secret = crate::common::cluster_secret(dir.path());
        let mut daemons = vec![
            spawn_logged(
                dir.path(),
                "metadata",
                &[
                    "metadata-server",
                    "--listen",
                    &metadata.to_string(),
                    "--admin",
                    &metadata_admin.to_string(),
                    "--dir",
                    &path("metadata"),
                    "--set",
                    &secret,
                ],
            ),
            spawn_logged(
                dir.path(),
                "storage",
                &[
                    "storage-server",
                    "--metadata",
                    &metadata.to_string(),
                    "--listen",
                    &storage.to_string(),
                    "--admin",
                    &storage_admin.to_string(),
                    "--dram",
                    "64MiB",
                    // An NVMe tier too, so its gauges and the io engine's exist.
                    "--nvme",
                    &path("storage.nvme"),
                    "--nvme-size",
                    "16MiB",
                    "--set",
                    &secret,
                ],
            ),
        ];
        let options = ClientOptions::default();
        let deadline = Deadline::after(STARTUP);
        if let Err(e) =
            tern_local::cluster_ready(&mut daemons, 0, &metadata.to_string(), &options, &[(1, storage)], &deadline)
                .await
        {
            panic!("{e:#}");
        }
        daemons.push(spawn_logged(
            dir.path(),
            "scheduler",
            &[
                "scheduler",
                "--listen",
                &scheduler.to_string(),
                "--admin",
                &scheduler_admin.to_string(),
                "--metadata",
                &metadata.to_string(),
                "--set",
                &secret,
            ],
        ));
        daemons.push(spawn_logged(
            dir.path(),
            "executor",
            &[
                "executor",
                "--scheduler",
                &scheduler.to_string(),
                "--cpus",
                "1",
                "--memory",
                "256MiB",
                "--gpus",
                "0",
                "--credential-file",
                &dir.path().join("credentials/executor").to_string_lossy(),
            ],
        ));
        Daemons {
            dir,
            metadata: metadata.to_string(),
            scheduler: scheduler.to_string(),
            storage,
            admin: vec![
                ("metadata server", metadata_admin),
                ("storage server", storage_admin),
                ("scheduler", scheduler_admin),
            ],
            _daemons: daemons,
        }
    }

    /// Traffic for every daemon, so label families have members: a file there and back, a
    /// missing file asked for (an error), and a job of two tasks run by the executor.
    async fn put_to_work(&self) {
        let local = self.dir.path().join("file");
        std::fs::write(&local, crate::common::random_bytes(300_000)).unwrap();
        let local = local.to_string_lossy().into_owned();
        self.tern(&["fs", "put", &local, "/monitoring/file"]);
        self.tern(&["fs", "get", "/monitoring/file", &format!("{local}.copy")]);
        let missing = self.command(&["fs", "stat", "/monitoring/no-such-file"]).output().unwrap();
        assert!(!missing.status.success(), "stat of a missing file succeeded");
        let job = self.dir.path().join("job.toml");
        std::fs::write(
            &job,
            "name = \"monitoring\"\n[[stages]]\nname = \"noop\"\noperator = \"noop\"\ntasks = 2\n\
             needs = { cpus = 0.5, memory = \"16MiB\" }\n",
        )
        .unwrap();
        self.tern(&["job", "submit", "--wait", &job.to_string_lossy()]);
        // A frame a storage server cannot decode: refused, counted as a malformed request.
        let mut stream = TcpStream::connect_timeout(&self.storage, Duration::from_secs(10)).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        stream.write_all(&[0xff; 64]).unwrap();
        let mut reply = Vec::new();
        let _ = stream.take(1 << 20).read_to_end(&mut reply);
        assert!(!reply.is_empty(), "the storage server answered nothing to a malformed frame");
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(TERN);
        command
            .args(args)
            .env("TERN_METADATA", &self.metadata)
            .env("TERN_SCHEDULER", &self.scheduler)
            .env_remove("TERN_TLS_DIR")
            .env_remove("TERN_TRANSPORT")
            .stdin(Stdio::null());
        command
    }

    fn tern(&self, args: &[&str]) {
        let out = self.command(args).output().unwrap();
        assert!(
            out.status.success(),
            "tern {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.logs()
        );
    }

    /// The names every daemon's `/metrics` makes queryable.
    async fn scrape_all(&self) -> Exported {
        let mut exported = Exported::default();
        for (role, admin) in &self.admin {
            let text = self.scrape(*admin).await;
            let before = exported.names.len();
            exported.add(&text);
            assert!(exported.names.len() > before + 5, "{role} at {admin} exported almost nothing:\n{text}");
        }
        exported
    }

    /// `/metrics` of the daemon whose admin endpoint is `addr`, waiting for it to answer.
    async fn scrape(&self, addr: SocketAddr) -> String {
        let deadline = Deadline::after(STARTUP);
        let scraped = tern_local::poll_until(&deadline, || async move {
            tokio::task::spawn_blocking(move || http_get(addr, "/metrics")).await.map_err(anyhow::Error::from)?
        })
        .await;
        scraped.unwrap_or_else(|e| panic!("GET http://{addr}/metrics: {e:#}\n{}", self.logs()))
    }

    fn logs(&self) -> String {
        let mut names: Vec<PathBuf> = std::fs::read_dir(self.dir.path())
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        names.sort();
        names
            .iter()
            .map(|p| format!("--- {} ---\n{}", p.display(), std::fs::read_to_string(p).unwrap_or_default()))
            .collect()
    }
}

/// A plain HTTP/1.0 GET with deadlines: the body of a 200 answer.
pub(crate) fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let timeout = Duration::from_secs(10);
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut reply = Vec::new();
    stream.take(64 << 20).read_to_end(&mut reply)?;
    let reply = String::from_utf8(reply)?;
    let (head, body) = reply.split_once("\r\n\r\n").ok_or_else(|| anyhow::anyhow!("no header end in {reply:?}"))?;
    anyhow::ensure!(head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"), "answered {head:?}");
    Ok(body.to_string())
}

/// The names a scrape makes queryable: each sample's name, and for each `# TYPE` the names
/// its type gives (a counter `x` is queried as `x_total`; a histogram as `x_bucket`, `x_sum`,
/// `x_count`), so a family with no member yet still counts.
#[derive(Default)]
struct Exported {
    names: BTreeSet<String>,
}

impl Exported {
    fn add(&mut self, text: &str) {
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut words = rest.split_whitespace();
                let (Some(name), Some(kind)) = (words.next(), words.next()) else { continue };
                let suffixes: &[&str] = match kind {
                    "counter" => &["_total"],
                    "histogram" | "gaugehistogram" => &["_bucket", "_sum", "_count"],
                    "summary" => &["_sum", "_count"],
                    "info" => &["_info"],
                    _ => &[""],
                };
                for suffix in suffixes {
                    self.names.insert(format!("{name}{suffix}"));
                }
            } else if !line.starts_with('#') && !line.trim().is_empty() {
                let end = line.find(['{', ' ']).unwrap_or(line.len());
                self.names.insert(line[..end].to_string());
            }
        }
    }

    fn has(&self, name: &str) -> bool {
        self.names.contains(name)
    }
}

/// Every PromQL query of a Grafana dashboard: panels' `expr`, and the metric selector of
/// template variables' `label_values(SELECTOR, LABEL)`.
fn dashboard_queries(json: &str) -> Vec<String> {
    fn walk(value: &serde_json::Value, out: &mut Vec<String>) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, value) in map {
                    match (key.as_str(), value) {
                        ("expr", serde_json::Value::String(expr)) => out.push(expr.clone()),
                        ("definition", serde_json::Value::String(query)) => {
                            let inner = query.strip_prefix("label_values(").and_then(|q| q.rsplit_once(','));
                            out.push(inner.map_or(query.as_str(), |(selector, _label)| selector).to_string());
                        }
                        _ => walk(value, out),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let value: serde_json::Value = serde_json::from_str(json).expect("grafana-dashboard.json is not JSON");
    let mut out = Vec::new();
    walk(&value, &mut out);
    out
}

/// The `expr` of every rule in a Prometheus rules file: one line (`expr: ...`, quotes
/// removed) or a block scalar (`expr: |` and the more-indented lines after it). Checked against
/// the number of rules, so an expression this reader missed fails the test.
fn rule_exprs(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let indent = |line: &str| line.len() - line.trim_start().len();
    let mut exprs = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        i += 1;
        let Some(value) = line.trim_start().strip_prefix("expr:") else { continue };
        let value = value.trim();
        if value.starts_with('|') || value.starts_with('>') {
            let mut block = Vec::new();
            while i < lines.len() && (lines[i].trim().is_empty() || indent(lines[i]) > indent(line)) {
                block.push(lines[i].trim());
                i += 1;
            }
            exprs.push(block.join("\n"));
        } else {
            let unquoted = value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .or_else(|| value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
                .unwrap_or(value);
            exprs.push(unquoted.to_string());
        }
    }
    let rules = lines
        .iter()
        .filter(|l| l.trim_start().starts_with("- alert:") || l.trim_start().starts_with("- record:"))
        .count();
    assert_eq!(exprs.len(), rules, "found {} exprs for {rules} rules", exprs.len());
    assert!(exprs.iter().all(|e| !e.trim().is_empty()), "an empty expr in {exprs:?}");
    exprs
}

/// Words of PromQL that are never metric names.
const KEYWORDS: [&str; 14] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
    "atan2",
    "inf",
    "nan",
];

/// Metric names in a PromQL expression (see the module's docs).
fn promql_metrics(expr: &str) -> Vec<String> {
    let chars: Vec<char> = expr.chars().collect();
    let is_start = |c: char| c.is_ascii_alphabetic() || c == '_' || c == ':';
    let is_part = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    // Index of the character closing the bracket opened at `open`, strings skipped.
    let close = |open: usize, left: char, right: char| -> usize {
        let mut depth = 0;
        let mut j = open;
        while j < chars.len() {
            match chars[j] {
                '"' | '\'' | '`' => j = skip_string(&chars, j),
                c if c == left => depth += 1,
                c if c == right => {
                    depth -= 1;
                    if depth == 0 {
                        return j;
                    }
                }
                _ => {}
            }
            j += 1;
        }
        chars.len()
    };
    let mut names = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(&chars, i) + 1;
        } else if c == '{' {
            i = close(i, '{', '}') + 1; // label matchers
        } else if c == '[' {
            i = close(i, '[', ']') + 1; // ranges and subqueries' durations
        } else if c.is_ascii_digit() || (c == '.' && chars.get(i + 1).is_some_and(|d| d.is_ascii_digit())) {
            while i < chars.len() && (is_part(chars[i]) || chars[i] == '.') {
                i += 1; // numbers and durations (5m, 1e3, 0x1f)
            }
        } else if c == '$' {
            i += 1;
            while i < chars.len() && is_part(chars[i]) {
                i += 1; // a Grafana variable
            }
        } else if is_start(c) {
            let start = i;
            while i < chars.len() && is_part(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let lowered = word.to_ascii_lowercase();
            if KEYWORDS.contains(&lowered.as_str()) {
                if ["by", "without", "on", "ignoring", "group_left", "group_right"].contains(&lowered.as_str())
                    && chars.get(next) == Some(&'(')
                {
                    i = close(next, '(', ')') + 1; // a list of label names
                }
            } else if chars.get(next) == Some(&'(') {
                // A function or an aggregation: `rate(`, `sum (`.
            } else if ["by", "without"].contains(&word_at(&chars, next).to_ascii_lowercase().as_str()) {
                // An aggregation with its grouping first: `sum by (le) (...)`.
            } else {
                names.push(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

/// The identifier starting at `at` (empty if none does).
fn word_at(chars: &[char], at: usize) -> String {
    chars[at.min(chars.len())..].iter().take_while(|c| c.is_ascii_alphanumeric() || **c == '_').collect()
}

/// Index of the quote closing the string that opens at `open` (backslash escapes, except in
/// raw backtick strings).
fn skip_string(chars: &[char], open: usize) -> usize {
    let quote = chars[open];
    let mut j = open + 1;
    while j < chars.len() && chars[j] != quote {
        if chars[j] == '\\' && quote != '`' {
            j += 1;
        }
        j += 1;
    }
    j
}

#[test]
fn promql_tokenizer_finds_metrics_only() {
    let found = |e: &str| promql_metrics(e);
    assert_eq!(
        found(
            r#"histogram_quantile(0.99, sum by (le, method) (rate(tern_metadata_request_duration_seconds_bucket{job=~"$job", method!="a(b)"}[$__rate_interval])))"#
        ),
        ["tern_metadata_request_duration_seconds_bucket"]
    );
    assert_eq!(
        found("sum(rate(a_total[5m] offset 1h)) by (instance) / on (instance) group_left (x) b > bool 0.5 unless c"),
        ["a_total", "b", "c"]
    );
    assert_eq!(
        found("tern_storage_tier_used_bytes / (tern_storage_tier_capacity_bytes > 0) > 0.9"),
        ["tern_storage_tier_used_bytes", "tern_storage_tier_capacity_bytes"]
    );
    assert_eq!(found(r#"up{job=~".*tern.*"} == 0 and ON(job) rate (x[1m:30s]) > 1e3"#), ["up", "x"]);
    assert_eq!(found("time() - process_start_time_seconds"), ["process_start_time_seconds"]);
    assert_eq!(found("max without (instance) (m) + count by(x)(n)"), ["m", "n"]);

    let mut exported = Exported::default();
    exported.add(
        "# TYPE h histogram\nh_bucket{le=\"1\"} 0\n# TYPE c counter\n# TYPE g gauge\ng 1\n# TYPE d_seconds histogram\n",
    );
    for name in ["h_bucket", "h_sum", "h_count", "c_total", "g", "d_seconds_bucket", "d_seconds_count"] {
        assert!(exported.has(name), "{name}");
    }
    for name in ["c_bucket", "g_total", "g_count", "h_total", "c"] {
        assert!(!exported.has(name), "{name}");
    }

    let rules = "groups:\n  - name: x\n    rules:\n      - alert: A\n        expr: up == 0\n      - alert: B\n        \
                 expr: |\n          sum(a)\n            / sum(b)\n        for: 1m\n      - record: r\n        expr: \"c > 1\"\n";
    assert_eq!(rule_exprs(rules), ["up == 0", "sum(a)\n/ sum(b)", "c > 1"]);
}
