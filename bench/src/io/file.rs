//! Plain files as `tern bench io` measures them (`file`, `file-direct`): `pwrite` / `pread` in a
//! temp dir under `--dir`, one thread per worker, buffered or O_DIRECT; after the buffered reads,
//! how much of the read file sat in the page cache.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context};

use super::{human_size, Cell, Op, System, WRITE_SET_BYTES};
use crate::harness::{go_blocking, payload, AlignedVec, Budget, Recorder, Samples};

/// Files in a temp dir on the disk the user named, written and read with pwrite / pread from
/// one thread per worker.
pub(super) struct FileTarget {
    dir: tempfile::TempDir,
    /// O_DIRECT: every op reaches the disk, none the page cache.
    direct: bool,
    /// The read set: (path, size, items).
    reads: Option<(PathBuf, u64, u64)>,
}

impl FileTarget {
    pub(super) fn start(dir: &Path, direct: bool) -> anyhow::Result<FileTarget> {
        let dir = tempfile::Builder::new()
            .prefix("tern-bench-io-")
            .tempdir_in(dir)
            .with_context(|| format!("making a temp dir in {}", dir.display()))?;
        Ok(FileTarget { dir, direct, reads: None })
    }

    /// How its ops reach the disk, and where.
    pub(super) fn describe(&self, system: System) -> String {
        format!(
            "{}: {} pwrite/pread in {}",
            system,
            if self.direct { "O_DIRECT" } else { "buffered" },
            self.dir.path().display()
        )
    }

    pub(super) fn prepare_reads(&mut self, size: u64, items: u64) -> anyhow::Result<()> {
        let path = self.dir.path().join(format!("read-{size}"));
        let file = std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        for item in 0..items {
            file.write_all_at(&payload(size, item), item * size)?;
        }
        file.sync_all()?;
        self.reads = Some((path, size, items));
        Ok(())
    }

    /// Deletes the read set; for buffered reads, says how much of it sat in the page cache after
    /// the reads (O_DIRECT reads bypass the cache: nothing to say).
    pub(super) fn finish_reads(&mut self, size: u64) -> anyhow::Result<Option<String>> {
        let (path, _, items) = self.reads.take().context("no file read set prepared")?;
        let resident = (!self.direct).then(|| resident_fraction(&path).unwrap_or(f64::NAN));
        std::fs::remove_file(&path)?;
        Ok(resident.map(|resident| {
            format!(
                "file: {} reads cycled over a {} file, {:.0}% of it in the page cache after reading: \
                 reads {} the page cache",
                human_size(size),
                human_size(size * items),
                resident * 100.0,
                if resident >= 0.99 { "hit" } else { "partly missed" }
            )
        }))
    }

    pub(super) async fn measure(&mut self, cell: Cell, budget: Budget) -> anyhow::Result<Samples> {
        let (path, items) = match cell.op {
            Op::Read => {
                let (path, size, items) = self.reads.clone().context("no file read set prepared")?;
                ensure!(size == cell.size, "the file read set holds {size}-byte items, not {}", cell.size);
                (path, items)
            }
            Op::Write => (PathBuf::new(), 0),
        };
        let write_items = (WRITE_SET_BYTES / u64::from(cell.concurrency) / cell.size).max(1);
        let budget = budget.start();
        let mut threads = Vec::new();
        for worker in 0..cell.concurrency as u64 {
            let file = match cell.op {
                Op::Read => self.open(&path, false)?,
                Op::Write => self.open(&self.dir.path().join(format!("write-{worker}")), true)?,
            };
            let (size, op, concurrency) = (cell.size, cell.op, u64::from(cell.concurrency));
            threads.push(std::thread::spawn(move || -> anyhow::Result<Recorder> {
                // Aligned for O_DIRECT (sizes are multiples of 4 KiB).
                let mut data = AlignedVec::new(size as usize);
                data.as_mut().copy_from_slice(&payload(size, 7));
                let data = data;
                let mut buf = AlignedVec::new(size as usize);
                let buf = buf.as_mut();
                let mut recorder = Recorder::new(budget);
                let mut item = worker;
                while go_blocking(&recorder) {
                    let started = Instant::now();
                    match op {
                        Op::Write => file.write_all_at(data.as_ref(), (item % write_items) * size)?,
                        Op::Read => file.read_exact_at(buf, (item % items) * size)?,
                    }
                    recorder.record(started);
                    item += if op == Op::Read { concurrency } else { 1 };
                }
                Ok(recorder)
            }));
        }
        let recorders = tokio::task::spawn_blocking(move || {
            threads
                .into_iter()
                .map(|t| t.join().map_err(|_| anyhow::anyhow!("a file worker panicked"))?)
                .collect::<anyhow::Result<Vec<_>>>()
        })
        .await??;
        if cell.op == Op::Write {
            for worker in 0..cell.concurrency {
                std::fs::remove_file(self.dir.path().join(format!("write-{worker}")))?;
            }
        }
        Samples::merge(recorders)
    }
}

impl FileTarget {
    /// Opens `path` for the measured ops, with O_DIRECT if this target is direct.
    fn open(&self, path: &Path, create: bool) -> anyhow::Result<std::fs::File> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut options = std::fs::OpenOptions::new();
        options.read(true).write(create).create(create).truncate(create);
        if self.direct {
            options.custom_flags(libc::O_DIRECT);
        }
        options.open(path).with_context(|| {
            format!(
                "opening {}{}",
                path.display(),
                if self.direct { " with O_DIRECT (tmpfs may refuse it)" } else { "" }
            )
        })
    }
}

/// The fraction of `path`'s pages resident in the page cache (mincore of a read-only mapping).
#[allow(unsafe_code)] // mmap(2) and mincore(2): std has neither
fn resident_fraction(path: &Path) -> anyhow::Result<f64> {
    let file = std::fs::File::open(path)?;
    let len = file.metadata()?.len() as usize;
    if len == 0 {
        return Ok(1.0);
    }
    // SAFETY: a private read-only mapping of a file we opened, unmapped below; only mincore
    // looks at it, no byte of it is read.
    unsafe {
        use std::os::fd::AsRawFd;
        let map = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0);
        if map == libc::MAP_FAILED {
            bail!("mmap of {}: {}", path.display(), std::io::Error::last_os_error());
        }
        let page = libc::sysconf(libc::_SC_PAGESIZE) as usize;
        let mut pages = vec![0u8; len.div_ceil(page)];
        let rc = libc::mincore(map, len, pages.as_mut_ptr());
        let error = std::io::Error::last_os_error();
        libc::munmap(map, len);
        if rc != 0 {
            bail!("mincore of {}: {error}", path.display());
        }
        Ok(pages.iter().filter(|p| *p & 1 == 1).count() as f64 / pages.len() as f64)
    }
}
