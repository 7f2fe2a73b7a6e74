//! The file operations that durable state goes through: the metadata server's write-ahead log and
//! snapshots, and the storage server's NVMe block index. One trait, [`Fs`], with the operations
//! they use and no more; [`RealFs`] is the filesystem (each call is the `std::fs` call, behind one
//! dynamic dispatch), and with the `crash-sim` feature [`sim::SimFs`] keeps, per file and per
//! directory, what a sync has made durable, so a test can cut the power at any point and start
//! again from what a disk would still hold. A missing fsync then fails a test; with SIGKILL, which
//! keeps the page cache, it never would.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

#[cfg(any(test, feature = "crash-sim"))]
pub mod sim;

/// How [`Fs::open`] treats a missing or existing file. Every mode opens for reading and writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Open {
    /// The file must exist.
    Existing,
    /// Created empty if missing; an existing one is kept as it is.
    Create,
    /// Created empty; an existing one is an error (`AlreadyExists`).
    CreateNew,
    /// Created if missing, cut to zero bytes if not.
    Truncate,
}

/// An open file. Positions are explicit (no cursor), so one handle serves any thread.
pub trait FsFile: Send + Sync {
    /// Writes all of `bytes` at `offset`, growing the file as needed.
    fn write_at(&self, bytes: &[u8], offset: u64) -> io::Result<()>;
    /// Fills `buf` from `offset`; short of bytes is `UnexpectedEof`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// The file's size in bytes.
    fn size(&self) -> io::Result<u64>;
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// fdatasync: the contents and size are durable (not the name: see [`Fs::sync_dir`]).
    fn sync_data(&self) -> io::Result<()>;
    /// fsync: as [`FsFile::sync_data`], and the rest of the inode's metadata.
    fn sync_all(&self) -> io::Result<()>;
}

/// The filesystem operations of durable state. Creating, renaming or removing a name is durable
/// only once its directory is synced ([`Fs::sync_dir`]); a file's bytes only once the file is.
pub trait Fs: Send + Sync {
    fn open(&self, path: &Path, mode: Open) -> io::Result<Box<dyn FsFile>>;
    /// The whole file (`NotFound` if it does not exist).
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    fn exists(&self, path: &Path) -> io::Result<bool>;
    /// The names in `dir`, in no particular order.
    fn list(&self, dir: &Path) -> io::Result<Vec<OsString>>;
    /// Renames within one directory, replacing `to` if it exists.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// fsync of the directory: the names created, renamed and removed in it are durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
}

/// The real filesystem.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealFs;

impl RealFs {
    /// As the `Arc<dyn Fs>` that the durable modules take.
    pub fn shared() -> Arc<dyn Fs> {
        Arc::new(RealFs)
    }
}

impl FsFile for File {
    fn write_at(&self, bytes: &[u8], offset: u64) -> io::Result<()> {
        FileExt::write_all_at(self, bytes, offset)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        File::set_len(self, len)
    }

    fn sync_data(&self) -> io::Result<()> {
        File::sync_data(self)
    }

    fn sync_all(&self) -> io::Result<()> {
        File::sync_all(self)
    }
}

impl Fs for RealFs {
    fn open(&self, path: &Path, mode: Open) -> io::Result<Box<dyn FsFile>> {
        let mut options = OpenOptions::new();
        options.read(true).write(true);
        match mode {
            Open::Existing => &mut options,
            Open::Create => options.create(true).truncate(false),
            Open::CreateNew => options.create_new(true),
            Open::Truncate => options.create(true).truncate(true),
        };
        Ok(Box::new(options.open(path)?))
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        fs::read(path)
    }

    fn exists(&self, path: &Path) -> io::Result<bool> {
        path.try_exists()
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<OsString>> {
        fs::read_dir(dir)?.map(|entry| Ok(entry?.file_name())).collect()
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}

/// The directory holding `path` (`.` for a bare name), for [`Fs::sync_dir`].
pub fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_real_filesystem_does_what_the_trait_says() {
        let temp = tempfile::tempdir().unwrap();
        let fs = RealFs;
        let path = temp.path().join("a");
        let file = fs.open(&path, Open::CreateNew).unwrap();
        assert_eq!(fs.open(&path, Open::CreateNew).err().unwrap().kind(), io::ErrorKind::AlreadyExists);
        file.write_at(b"hello", 0).unwrap();
        file.write_at(b"!", 7).unwrap();
        file.sync_data().unwrap();
        assert_eq!(fs.read(&path).unwrap(), b"hello\0\0!");
        let mut two = [0; 2];
        file.read_at(&mut two, 1).unwrap();
        assert_eq!(&two, b"el");
        file.set_len(2).unwrap();
        assert_eq!(file.size().unwrap(), 2);
        fs.rename(&path, &temp.path().join("b")).unwrap();
        fs.sync_dir(temp.path()).unwrap();
        assert_eq!(fs.list(temp.path()).unwrap(), vec![OsString::from("b")]);
        assert!(!fs.exists(&path).unwrap());
        assert_eq!(fs.open(&temp.path().join("b"), Open::Truncate).unwrap().size().unwrap(), 0);
        fs.remove(&temp.path().join("b")).unwrap();
        assert_eq!(fs.open(&path, Open::Existing).err().unwrap().kind(), io::ErrorKind::NotFound);
        assert_eq!(parent_dir(Path::new("x")), Path::new("."));
        assert_eq!(parent_dir(Path::new("/d/x")), Path::new("/d"));
    }
}
