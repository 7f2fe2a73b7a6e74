//! `DIR/daemons.json`: what `tern up` knows of its daemons while it runs, for whoever asks
//! after its output scrolled away (a person, a script, a test; `tern status` shows the cluster
//! as the metadata server sees it, which cannot say why a daemon is down): each daemon's state
//! (running, restarting, down, stopped), process id, restarts, last exit and why it is not
//! running. Rewritten whole (a temp file renamed over it) at start and at every event, so a
//! reader never sees half of one; removed when `tern up` stops the cluster.
//!
//! ```json
//! {"tern_up_pid": 4242, "metadata": "127.0.0.1:9060", "daemons": [
//!   {"name": "storage-1", "state": "down", "pid": null, "restarts": 5,
//!    "last_exit": "signal: 9 (SIGKILL)", "why": "it exited unexpectedly (...) after 5 restarts within 60s",
//!    "log": "tern-data/logs/storage-1.log"}]}
//! ```

use std::path::{Path, PathBuf};

use anyhow::Context;
use tern_local::DaemonReport;

/// The file's name in `tern up`'s directory.
pub const FILE: &str = "daemons.json";

pub struct DaemonsFile {
    path: PathBuf,
    metadata: String,
    /// Whether a failed write was reported already: said once, not at every event.
    warned: bool,
}

impl DaemonsFile {
    /// The file in `dir`, for the cluster whose metadata server is at `metadata`.
    pub fn new(dir: &Path, metadata: &str) -> DaemonsFile {
        DaemonsFile { path: dir.join(FILE), metadata: metadata.to_string(), warned: false }
    }

    /// Writes `daemons`' states; a failure is said once on stderr and costs only the file.
    pub fn write(&mut self, daemons: &[DaemonReport]) {
        if let Err(e) = self.try_write(daemons) {
            if !std::mem::replace(&mut self.warned, true) {
                eprintln!("tern up: cannot write {}: {e:#}", self.path.display());
            }
        }
    }

    fn try_write(&self, daemons: &[DaemonReport]) -> anyhow::Result<()> {
        let daemons: Vec<serde_json::Value> = daemons
            .iter()
            .map(|d| {
                serde_json::json!({
                    "name": d.name,
                    "state": d.state.name(),
                    "pid": d.pid,
                    "restarts": d.restarts,
                    "last_exit": d.last_exit,
                    "why": d.why,
                    "log": d.log,
                })
            })
            .collect();
        let report = serde_json::json!({
            "tern_up_pid": std::process::id(),
            "metadata": self.metadata,
            "daemons": daemons,
        });
        let temp = self.path.with_extension("json.tmp");
        std::fs::write(&temp, format!("{report:#}\n")).with_context(|| format!("writing {}", temp.display()))?;
        std::fs::rename(&temp, &self.path).with_context(|| format!("renaming {} into place", temp.display()))
    }

    /// Removes the file: nothing runs any more.
    pub fn remove(&self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
