//! Which GPUs an executor has: declared (`--gpus N`), named by a discovery script, or detected.
//!
//! Precedence ([`resolve`]): `--gpus` > discovery script > CUDA driver. A discovery script is Spark's
//! contract: an executable that prints one JSON object `{"name":"gpu","addresses":["0","1"]}` on
//! stdout and exits 0. It runs with a time limit and in its own process group, so a script that
//! hangs (or leaves children behind) is killed, not waited on forever.

use std::collections::HashSet;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Deserialize;

use crate::{GpuDevice, Inventory, Source};

/// How long a discovery script may run.
pub const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Most stdout or stderr kept from a discovery script; the rest is read and dropped.
const MAX_SCRIPT_OUTPUT: usize = 64 * 1024;
/// Most GPUs one executor may advertise.
pub const MAX_GPUS: usize = 1024;

/// GPUs "0".."count-1" of unknown name and memory, for `--gpus N`.
pub fn declared(count: u32) -> Inventory {
    let count = count as usize;
    if count == 0 {
        return Inventory {
            devices: Vec::new(),
            source: Source::Declared,
            note: Some("declared 0 GPUs (--gpus 0)".into()),
        };
    }
    let devices =
        (0..count).map(|i| GpuDevice { address: i.to_string(), name: String::new(), memory_bytes: 0 }).collect();
    Inventory { devices, source: Source::Declared, note: None }
}

/// The GPUs the CUDA driver sees (respecting `CUDA_VISIBLE_DEVICES`), or none with a note saying why:
/// no driver library, no device, built without the `cuda` feature. Never panics.
pub fn detect() -> Inventory {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::detect()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Inventory::none("built without the cuda feature: GPUs come only from --gpus or a discovery script")
    }
}

/// [`from_discovery_script_with_timeout`] with [`DISCOVERY_TIMEOUT`].
pub fn from_discovery_script(path: &Path) -> anyhow::Result<Inventory> {
    from_discovery_script_with_timeout(path, DISCOVERY_TIMEOUT)
}

/// Runs the discovery script at `path` and parses what it prints. Errors name the script and say
/// what went wrong: it could not start, it ran past `timeout`, it exited non-zero (with its
/// stderr), or its output is not `{"name":"gpu","addresses":[...]}`.
pub fn from_discovery_script_with_timeout(path: &Path, timeout: Duration) -> anyhow::Result<Inventory> {
    let shown = path.display();
    let mut child = Command::new(path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so that a timeout kills what it started too.
        .process_group(0)
        .spawn()
        .with_context(|| format!("discovery script {shown}: cannot run it"))?;
    let stdout = read_capped(child.stdout.take());
    let stderr = read_capped(child.stderr.take());
    let deadline = Instant::now() + timeout;
    let kill = |child: &mut std::process::Child| {
        // SAFETY: kill(2) on the process group we created for this child; no memory is involved.
        unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
        let _ = child.kill();
        let _ = child.wait();
    };
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                kill(&mut child);
                bail!("discovery script {shown} timed out after {timeout:?} and was killed");
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => {
                kill(&mut child);
                return Err(e).with_context(|| format!("discovery script {shown}: waiting for it"));
            }
        }
    };
    // Children it left behind may still hold the pipes open: wait for the output only until the
    // deadline, then kill the group.
    let wait_output =
        |rx: &mpsc::Receiver<Vec<u8>>| rx.recv_timeout(deadline.saturating_duration_since(Instant::now()));
    let (out, err) = match (wait_output(&stdout), wait_output(&stderr)) {
        (Ok(out), Ok(err)) => (out, err),
        _ => {
            kill(&mut child);
            bail!("discovery script {shown} exited but its output stayed open past {timeout:?} (a child process still running?)");
        }
    };
    if !status.success() {
        let err = String::from_utf8_lossy(&err);
        bail!("discovery script {shown} failed ({status}): {}", err.trim());
    }
    parse_discovery_output(path, &out)
}

/// Reads all of `pipe` on a thread, keeping the first [`MAX_SCRIPT_OUTPUT`] bytes; reading it all
/// keeps a chatty script from blocking on a full pipe.
fn read_capped(pipe: Option<impl Read + Send + 'static>) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        if let Some(mut pipe) = pipe {
            let mut buf = [0u8; 8192];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let room = MAX_SCRIPT_OUTPUT.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
        }
        let _ = tx.send(kept);
    });
    rx
}

/// Spark's `ResourceInformationJson`; other fields are ignored, as Spark ignores them.
#[derive(Deserialize)]
struct ResourceJson {
    name: String,
    addresses: Vec<String>,
}

/// Parses a discovery script's stdout into an [`Inventory`] with [`Source::Script`].
fn parse_discovery_output(path: &Path, stdout: &[u8]) -> anyhow::Result<Inventory> {
    let shown = path.display();
    let text = String::from_utf8_lossy(stdout);
    let text = text.trim();
    let resource: ResourceJson = serde_json::from_str(text).with_context(|| {
        let head: String = text.chars().take(200).collect();
        format!(r#"discovery script {shown} printed {head:?}, not Spark's {{"name":"gpu","addresses":[...]}}"#)
    })?;
    if resource.name != "gpu" {
        bail!(
            r#"discovery script {shown} reported resource {:?}; a GPU discovery script must print "name":"gpu""#,
            resource.name
        );
    }
    if resource.addresses.len() > MAX_GPUS {
        bail!("discovery script {shown} reported {} GPUs, more than the limit of {MAX_GPUS}", resource.addresses.len());
    }
    let mut seen = HashSet::new();
    for a in &resource.addresses {
        if a.trim().is_empty() || a.len() > 256 {
            bail!("discovery script {shown} reported a GPU address {a:?}: addresses must be 1 to 256 characters");
        }
        if !seen.insert(a.as_str()) {
            bail!("discovery script {shown} reported GPU address {a:?} twice");
        }
    }
    let source = Source::Script(path.to_path_buf());
    if resource.addresses.is_empty() {
        return Ok(Inventory {
            devices: Vec::new(),
            source,
            note: Some(format!("discovery script {shown} reported no GPUs")),
        });
    }
    let devices = resource
        .addresses
        .into_iter()
        .map(|address| GpuDevice { address, name: String::new(), memory_bytes: 0 })
        .collect();
    Ok(Inventory { devices, source, note: None })
}

/// An executor's GPUs by precedence: `--gpus N` if given, else the discovery script if given, else
/// whatever the CUDA driver finds. Only a failing discovery script is an error.
pub fn resolve(gpus: Option<u32>, discovery_script: Option<&Path>) -> anyhow::Result<Inventory> {
    match (gpus, discovery_script) {
        (Some(n), _) => Ok(declared(n)),
        (None, Some(script)) => from_discovery_script(script),
        (None, None) => Ok(detect()),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;

    use super::*;

    /// Writes an executable shell script; the file is closed before it is made executable, so no
    /// open write handle makes exec fail with ETXTBSY.
    fn script(dir: &tempfile::TempDir, name: &str, body: &str) -> PathBuf {
        let path = dir.path().join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[test]
    fn good_script_lists_its_addresses() {
        let dir = tempfile::tempdir().unwrap();
        let path = script(&dir, "gpus.sh", r#"echo '{"name": "gpu", "addresses": ["0", "1", "7"]}'"#);
        let inv = from_discovery_script(&path).unwrap();
        assert_eq!(inv.addresses(), ["0", "1", "7"]);
        assert_eq!(inv.source, Source::Script(path.clone()));
        assert_eq!(inv.note, None);
        assert!(inv.devices.iter().all(|d| d.name.is_empty() && d.memory_bytes == 0));

        let path = script(&dir, "none.sh", r#"echo '{"name":"gpu","addresses":[]}'"#);
        let inv = from_discovery_script(&path).unwrap();
        assert!(inv.devices.is_empty());
        assert!(inv.note.unwrap().contains("reported no GPUs"));
    }

    #[test]
    fn bad_json_is_an_error_naming_the_output() {
        let dir = tempfile::tempdir().unwrap();
        let path = script(&dir, "bad.sh", "echo 'gpus: 0,1'");
        let err = format!("{:#}", from_discovery_script(&path).unwrap_err());
        assert!(err.contains("bad.sh") && err.contains("gpus: 0,1") && err.contains(r#""name":"gpu""#), "{err}");

        let path = script(&dir, "noaddr.sh", r#"echo '{"name":"gpu"}'"#);
        let err = format!("{:#}", from_discovery_script(&path).unwrap_err());
        assert!(err.contains("addresses"), "{err}");
    }

    #[test]
    fn wrong_resource_name_or_bad_addresses_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = script(&dir, "fpga.sh", r#"echo '{"name":"fpga","addresses":["0"]}'"#);
        let err = format!("{:#}", from_discovery_script(&path).unwrap_err());
        assert!(err.contains(r#""fpga""#) && err.contains(r#""name":"gpu""#), "{err}");

        let path = script(&dir, "dup.sh", r#"echo '{"name":"gpu","addresses":["0","1","0"]}'"#);
        let err = format!("{:#}", from_discovery_script(&path).unwrap_err());
        assert!(err.contains(r#"address "0" twice"#), "{err}");

        let path = script(&dir, "empty.sh", r#"echo '{"name":"gpu","addresses":[""]}'"#);
        let err = format!("{:#}", from_discovery_script(&path).unwrap_err());
        assert!(err.contains("1 to 256 characters"), "{err}");
    }

    #[test]
    fn failing_or_missing_script_is_an_error_with_its_stderr() {
        let dir = tempfile::tempdir().unwrap();
        let path = script(&dir, "fail.sh", "echo 'nvidia-smi: not found' >&2; exit 3");
        let err = format!("{:#}", from_discovery_script(&path).unwrap_err());
        assert!(
            err.contains("fail.sh") && err.contains("exit status: 3") && err.contains("nvidia-smi: not found"),
            "{err}"
        );

        let err = format!("{:#}", from_discovery_script(&dir.path().join("absent.sh")).unwrap_err());
        assert!(err.contains("absent.sh") && err.contains("cannot run"), "{err}");
    }

    #[test]
    fn hanging_script_is_killed_at_the_timeout() {
        let dir = tempfile::tempdir().unwrap();
        // The sleep is a child of the shell: killing only the shell would leave it holding stdout.
        let path = script(&dir, "hang.sh", "sleep 30; echo '{}'");
        let start = Instant::now();
        let err = format!("{:#}", from_discovery_script_with_timeout(&path, Duration::from_millis(300)).unwrap_err());
        assert!(err.contains("hang.sh") && err.contains("timed out"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());

        // Exits at once but leaves a child holding stdout open.
        let path = script(&dir, "leak.sh", r#"echo '{"name":"gpu","addresses":["0"]}'; sleep 30 &"#);
        let start = Instant::now();
        let err = format!("{:#}", from_discovery_script_with_timeout(&path, Duration::from_millis(300)).unwrap_err());
        assert!(err.contains("output stayed open"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    }

    #[test]
    fn declared_and_precedence() {
        let inv = declared(3);
        assert_eq!(inv.addresses(), ["0", "1", "2"]);
        assert_eq!(inv.source, Source::Declared);
        let none = declared(0);
        assert!(none.devices.is_empty() && none.note.is_some());

        let dir = tempfile::tempdir().unwrap();
        let path = script(&dir, "two.sh", r#"echo '{"name":"gpu","addresses":["4","5"]}'"#);
        // --gpus wins over the script, the script over the driver.
        assert_eq!(resolve(Some(1), Some(&path)).unwrap().source, Source::Declared);
        assert_eq!(resolve(None, Some(&path)).unwrap().addresses(), ["4", "5"]);
        let detected = resolve(None, None).unwrap();
        assert!(matches!(detected.source, Source::Cuda | Source::None));
    }
}
