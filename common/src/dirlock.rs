//! The lock that keeps two processes from sharing one state directory: a metadata server's
//! `--dir`, and `tern up`'s whole `--dir` (taken before it touches any file in it).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// The lock file's name inside the locked directory.
pub const LOCK_FILE: &str = "LOCK";

/// An exclusive `flock` on `<dir>/LOCK`, held while this value lives (the kernel drops it when
/// the file closes, also when the process dies, so a crash never leaves a stale lock). The file
/// holds the holder's pid, for whoever wonders who holds it; it is opened close-on-exec, so child
/// processes never inherit the lock.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

impl DirLock {
    /// Creates `dir` if missing and locks it for `holder` (e.g. "metadata server", named in the
    /// refusal), or says which directory is in use and by which process.
    #[allow(unsafe_code)] // flock(2): std has no advisory lock
    pub fn acquire(dir: &Path, holder: &str) -> anyhow::Result<DirLock> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating directory {}", dir.display()))?;
        let path: PathBuf = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening lock file {}", path.display()))?;
        // SAFETY: flock only reads the descriptor, which `file` keeps open for this call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::WouldBlock {
                // The holder wrote its pid once it had the lock (absent in the moment between).
                let pid = std::fs::read_to_string(&path).ok().and_then(|text| text.trim().parse::<u32>().ok());
                let who = pid.map_or_else(String::new, |pid| format!(", pid {pid}"));
                bail!(
                    "directory {} is in use by another {holder} (it holds {}{who}); stop that one or choose another \
                     directory",
                    dir.display(),
                    path.display()
                );
            }
            return Err(err).with_context(|| format!("locking {}", path.display()));
        }
        file.set_len(0).and_then(|()| writeln!(file, "{}", std::process::id())).ok();
        Ok(DirLock { _file: file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_holder_is_refused_until_the_first_lets_go() {
        let temp = tempfile::tempdir().unwrap();
        let dir = temp.path().join("meta");
        let first = DirLock::acquire(&dir, "metadata server").unwrap();
        let err = format!("{:#}", DirLock::acquire(&dir, "metadata server").unwrap_err());
        assert!(err.contains("in use by another metadata server"), "{err}");
        assert!(err.contains(&format!("pid {}", std::process::id())), "the refusal names the holder: {err}");
        drop(first);
        DirLock::acquire(&dir, "metadata server").unwrap();
    }
}
