//! The lock that keeps two metadata servers from sharing one state directory.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// An exclusive `flock` on `<dir>/LOCK`, held while this value lives (the kernel drops it when
/// the file closes, also when the process dies, so a crash never leaves a stale lock).
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

impl DirLock {
    /// Creates `dir` if missing and locks it, or says which directory is in use.
    #[allow(unsafe_code)] // flock(2): std has no advisory lock
    pub fn acquire(dir: &Path) -> anyhow::Result<DirLock> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating metadata directory {}", dir.display()))?;
        let path: PathBuf = dir.join("LOCK");
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
                bail!(
                    "metadata directory {} is in use by another metadata server (it holds {}); \
                     stop that server or choose another dir",
                    dir.display(),
                    path.display()
                );
            }
            return Err(err).with_context(|| format!("locking {}", path.display()));
        }
        // The holder's pid, for operators wondering who holds the lock.
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
        let first = DirLock::acquire(&dir).unwrap();
        let err = format!("{:#}", DirLock::acquire(&dir).unwrap_err());
        assert!(err.contains("in use by another metadata server"), "{err}");
        drop(first);
        DirLock::acquire(&dir).unwrap();
    }
}
