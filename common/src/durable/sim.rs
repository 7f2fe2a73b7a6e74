//! A filesystem in memory that loses, at a simulated power cut, what no sync made durable.
//!
//! Each file keeps its contents as the page cache would (what reads see) and its contents as of
//! its last `sync_data`/`sync_all` (what the disk holds), with the writes since. Each directory
//! keeps its names, the names as of its last [`Fs::sync_dir`], and the creates, renames and
//! removes since. [`SimFs::crash`] returns the filesystem a power cut would leave: synced bytes
//! under synced names only; a file created in a directory never synced is gone, a rename or remove
//! not followed by a sync of its directory is undone. [`SimFs::crash_with`] lets chosen unsynced
//! changes reach the disk as well, as a real disk may: a prefix of each file's unsynced writes
//! (the last one cut at a sector boundary, a torn write) and some of the unsynced directory
//! changes, in any order. A sector ([`SECTOR_BYTES`]) is written whole or not at all, as disks
//! promise; what lies within one is never torn.
//!
//! [`SimFs::record`] keeps the state after every mutating call, so a test can crash at each of
//! them ([`SimFs::points`]) and check what each crash leaves. `sync_data` and `sync_all` do the
//! same here (both make the size durable, as fdatasync does when the size changed). Paths are taken
//! as given: no symlinks, no `..`; a directory exists once a path in it is used.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{OsStr, OsString};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{parent_dir, Fs, FsFile, Open};
use crate::SplitMix64;

/// The unit a disk writes whole at a power cut: a torn write is cut at a multiple of it.
pub const SECTOR_BYTES: u64 = 512;

/// Which unsynced changes reach the disk anyway at a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keep {
    /// Of each file's writes since its last sync, this many bytes reach the disk, in the order
    /// they were written; the write the budget ends in is cut at the last sector boundary before
    /// the budget's end (a torn write). 0 keeps none;
    /// `u64::MAX` keeps them all, as a process crash that keeps the page cache does.
    pub unsynced_bytes: u64,
    pub unsynced_names: Names,
}

/// Which directory changes made since a directory's last sync reach the disk anyway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Names {
    None,
    All,
    /// Removes only: the worst case for a rename that must reach the disk before a remove.
    RemovesOnly,
    /// Each change kept or not, by a coin from this seed.
    Seeded(u64),
}

impl Keep {
    /// What a disk must keep: synced bytes under synced names.
    pub const SYNCED: Keep = Keep { unsynced_bytes: 0, unsynced_names: Names::None };

    /// Crash modes a durability test should survive at every point: only what was synced, torn
    /// tails of several lengths, the whole page cache, and directory changes kept in several
    /// orders.
    pub fn battery() -> Vec<Keep> {
        let mut modes = vec![Keep::SYNCED];
        for unsynced_bytes in [1, 100, 600, 3000, u64::MAX] {
            modes.push(Keep { unsynced_bytes, unsynced_names: Names::None });
        }
        for unsynced_names in [Names::All, Names::RemovesOnly, Names::Seeded(1), Names::Seeded(2), Names::Seeded(3)] {
            modes.push(Keep { unsynced_bytes: 0, unsynced_names });
            modes.push(Keep { unsynced_bytes: 600, unsynced_names });
        }
        modes
    }
}

#[derive(Debug, Clone)]
enum Change {
    Write(u64, Vec<u8>),
    SetLen(u64),
}

#[derive(Debug, Clone, Default)]
struct Inode {
    /// What reads see.
    data: Vec<u8>,
    /// What the disk holds: `data` as of the last sync.
    durable: Vec<u8>,
    /// The changes since, in order.
    unsynced: Vec<Change>,
}

#[derive(Debug, Clone)]
enum NameChange {
    Create(OsString, u64),
    Rename { from: OsString, to: OsString, ino: u64 },
    Remove(OsString, u64),
}

impl NameChange {
    fn apply(&self, names: &mut BTreeMap<OsString, u64>) {
        match self {
            NameChange::Create(name, ino) => {
                names.insert(name.clone(), *ino);
            }
            NameChange::Rename { from, to, ino } => {
                if names.get(from) == Some(ino) {
                    names.remove(from);
                }
                names.insert(to.clone(), *ino);
            }
            NameChange::Remove(name, ino) => {
                if names.get(name) == Some(ino) {
                    names.remove(name);
                }
            }
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Dir {
    names: BTreeMap<OsString, u64>,
    durable: BTreeMap<OsString, u64>,
    unsynced: Vec<NameChange>,
}

#[derive(Debug, Clone, Default)]
struct State {
    inodes: BTreeMap<u64, Inode>,
    dirs: BTreeMap<PathBuf, Dir>,
    next_ino: u64,
    /// Mutating calls so far.
    ops: u64,
}

fn apply(data: &mut Vec<u8>, change: &Change, budget: usize) {
    match change {
        Change::Write(offset, bytes) => {
            let offset = *offset as usize;
            let bytes = &bytes[..bytes.len().min(budget)];
            if data.len() < offset + bytes.len() {
                data.resize(offset + bytes.len(), 0);
            }
            data[offset..offset + bytes.len()].copy_from_slice(bytes);
        }
        Change::SetLen(len) => data.resize(*len as usize, 0),
    }
}

impl State {
    /// What a power cut leaves, keeping `keep`'s unsynced changes too.
    fn crash(&self, keep: Keep) -> State {
        let mut coin = SplitMix64(match keep.unsynced_names {
            Names::Seeded(seed) => seed,
            _ => 0,
        });
        let mut dirs = BTreeMap::new();
        let mut live = BTreeSet::new();
        for (path, dir) in &self.dirs {
            let mut names = dir.durable.clone();
            for change in &dir.unsynced {
                let kept = match keep.unsynced_names {
                    Names::None => false,
                    Names::All => true,
                    Names::RemovesOnly => matches!(change, NameChange::Remove(..)),
                    Names::Seeded(_) => coin.below(2) == 1,
                };
                if kept {
                    change.apply(&mut names);
                }
            }
            live.extend(names.values().copied());
            dirs.insert(path.clone(), Dir { durable: names.clone(), names, unsynced: Vec::new() });
        }
        let mut inodes = BTreeMap::new();
        for ino in live {
            let inode = &self.inodes[&ino];
            let mut data = inode.durable.clone();
            let mut budget = keep.unsynced_bytes;
            for change in &inode.unsynced {
                if budget == 0 {
                    break;
                }
                let (take, torn) = match change {
                    Change::Write(_, bytes) if bytes.len() as u64 <= budget => (bytes.len() as u64, false),
                    // Torn: the whole sectors below the budget's end.
                    Change::Write(offset, _) => {
                        (((offset + budget) / SECTOR_BYTES * SECTOR_BYTES).saturating_sub(*offset), true)
                    }
                    Change::SetLen(_) => (0, false),
                };
                if take > 0 || matches!(change, Change::SetLen(_)) {
                    apply(&mut data, change, take as usize);
                }
                // Nothing after a torn write reaches the disk.
                budget = if torn { 0 } else { budget - take };
            }
            inodes.insert(ino, Inode { durable: data.clone(), data, unsynced: Vec::new() });
        }
        State { inodes, dirs, next_ino: self.next_ino, ops: 0 }
    }

    fn lookup(&self, path: &Path) -> Option<u64> {
        let (dir, name) = split(path).ok()?;
        self.dirs.get(dir)?.names.get(name).copied()
    }
}

fn split(path: &Path) -> io::Result<(&Path, &OsStr)> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{} names no file", path.display())))?;
    Ok((parent_dir(path), name))
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("{}: no such file (simulated)", path.display()))
}

#[derive(Debug, Default)]
struct Inner {
    state: State,
    /// With [`SimFs::record`]: the state after each mutating call since.
    history: Option<Vec<State>>,
}

impl Inner {
    /// Counts a mutating call and records the state it left.
    fn done(&mut self) {
        self.state.ops += 1;
        if let Some(history) = &mut self.history {
            history.push(self.state.clone());
        }
    }
}

/// The simulated filesystem; clones share it.
#[derive(Debug, Clone, Default)]
pub struct SimFs {
    inner: Arc<Mutex<Inner>>,
}

/// The state after one mutating call, recorded by [`SimFs::record`].
#[derive(Debug, Clone)]
pub struct Point {
    /// Mutating calls made by then (as [`SimFs::ops`] said).
    pub ops: u64,
    state: State,
}

impl Point {
    /// What a power cut at this point leaves.
    pub fn crash_with(&self, keep: Keep) -> SimFs {
        SimFs::from(self.state.crash(keep))
    }
}

impl SimFs {
    pub fn new() -> SimFs {
        SimFs::default()
    }

    fn from(state: State) -> SimFs {
        SimFs { inner: Arc::new(Mutex::new(Inner { state, history: None })) }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// As the `Arc<dyn Fs>` that the durable modules take, sharing this filesystem.
    pub fn shared(&self) -> Arc<dyn Fs> {
        Arc::new(self.clone())
    }

    /// Mutating calls so far: writes, size changes, syncs, creates, renames, removes.
    pub fn ops(&self) -> u64 {
        self.lock().state.ops
    }

    /// From now on, keeps the state after every mutating call (and the state now), for
    /// [`SimFs::points`].
    pub fn record(&self) {
        let mut inner = self.lock();
        inner.history = Some(vec![inner.state.clone()]);
    }

    /// The states recorded since [`SimFs::record`], the first one the state when it was called.
    pub fn points(&self) -> Vec<Point> {
        let inner = self.lock();
        let history = inner.history.as_deref().unwrap_or_default();
        history.iter().map(|state| Point { ops: state.ops, state: state.clone() }).collect()
    }

    /// What a power cut now leaves: synced bytes under synced names.
    pub fn crash(&self) -> SimFs {
        self.crash_with(Keep::SYNCED)
    }

    /// What a power cut now leaves, `keep`'s unsynced changes included.
    pub fn crash_with(&self, keep: Keep) -> SimFs {
        SimFs::from(self.lock().state.crash(keep))
    }

    fn create(inner: &mut Inner, path: &Path) -> io::Result<u64> {
        let (dir, name) = split(path)?;
        let state = &mut inner.state;
        state.next_ino += 1;
        let ino = state.next_ino;
        state.inodes.insert(ino, Inode::default());
        let dir = state.dirs.entry(dir.to_path_buf()).or_default();
        dir.names.insert(name.to_owned(), ino);
        dir.unsynced.push(NameChange::Create(name.to_owned(), ino));
        inner.done();
        Ok(ino)
    }
}

struct SimFile {
    fs: SimFs,
    ino: u64,
}

impl SimFile {
    fn change(&self, change: Change) {
        let mut inner = self.fs.lock();
        let inode = inner.state.inodes.get_mut(&self.ino).expect("an open file's inode stays");
        apply(&mut inode.data, &change, usize::MAX);
        inode.unsynced.push(change);
        inner.done();
    }

    fn sync(&self) {
        let mut inner = self.fs.lock();
        let inode = inner.state.inodes.get_mut(&self.ino).expect("an open file's inode stays");
        inode.durable = inode.data.clone();
        inode.unsynced.clear();
        inner.done();
    }
}

impl FsFile for SimFile {
    fn write_at(&self, bytes: &[u8], offset: u64) -> io::Result<()> {
        self.change(Change::Write(offset, bytes.to_vec()));
        Ok(())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let inner = self.fs.lock();
        let data = &inner.state.inodes[&self.ino].data;
        let offset = offset as usize;
        if data.len() < offset + buf.len() {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end (simulated)"));
        }
        buf.copy_from_slice(&data[offset..offset + buf.len()]);
        Ok(())
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.fs.lock().state.inodes[&self.ino].data.len() as u64)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.change(Change::SetLen(len));
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        self.sync();
        Ok(())
    }

    fn sync_all(&self) -> io::Result<()> {
        self.sync();
        Ok(())
    }
}

impl Fs for SimFs {
    fn open(&self, path: &Path, mode: Open) -> io::Result<Box<dyn FsFile>> {
        let found = self.lock().state.lookup(path);
        let ino = match (found, mode) {
            (Some(_), Open::CreateNew) => {
                return Err(io::Error::new(io::ErrorKind::AlreadyExists, format!("{} exists", path.display())))
            }
            (Some(ino), Open::Truncate) => {
                let file = SimFile { fs: self.clone(), ino };
                file.change(Change::SetLen(0));
                return Ok(Box::new(file));
            }
            (Some(ino), _) => ino,
            (None, Open::Existing) => return Err(not_found(path)),
            (None, _) => SimFs::create(&mut self.lock(), path)?,
        };
        Ok(Box::new(SimFile { fs: self.clone(), ino }))
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        let inner = self.lock();
        let ino = inner.state.lookup(path).ok_or_else(|| not_found(path))?;
        Ok(inner.state.inodes[&ino].data.clone())
    }

    fn exists(&self, path: &Path) -> io::Result<bool> {
        Ok(self.lock().state.lookup(path).is_some())
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<OsString>> {
        let inner = self.lock();
        Ok(inner.state.dirs.get(dir).map(|dir| dir.names.keys().cloned().collect()).unwrap_or_default())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let ((dir, from_name), (to_dir, to_name)) = (split(from)?, split(to)?);
        if dir != to_dir {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "the simulation renames within a directory only"));
        }
        let mut inner = self.lock();
        let dir = inner.state.dirs.get_mut(dir).ok_or_else(|| not_found(from))?;
        let ino = dir.names.remove(from_name).ok_or_else(|| not_found(from))?;
        dir.names.insert(to_name.to_owned(), ino);
        dir.unsynced.push(NameChange::Rename { from: from_name.to_owned(), to: to_name.to_owned(), ino });
        inner.done();
        Ok(())
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        let (dir, name) = split(path)?;
        let mut inner = self.lock();
        let dir = inner.state.dirs.get_mut(dir).ok_or_else(|| not_found(path))?;
        let ino = dir.names.remove(name).ok_or_else(|| not_found(path))?;
        dir.unsynced.push(NameChange::Remove(name.to_owned(), ino));
        inner.done();
        Ok(())
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        let mut inner = self.lock();
        let dir = inner.state.dirs.entry(path.to_path_buf()).or_default();
        dir.durable = dir.names.clone();
        dir.unsynced.clear();
        inner.done();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(fs: &SimFs, path: &str, bytes: &[u8]) -> Box<dyn FsFile> {
        let file = fs.open(Path::new(path), Open::Create).unwrap();
        let at = file.size().unwrap();
        file.write_at(bytes, at).unwrap();
        file
    }

    fn read(fs: &SimFs, path: &str) -> Option<Vec<u8>> {
        match fs.read(Path::new(path)) {
            Ok(bytes) => Some(bytes),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn bytes_survive_a_crash_only_once_synced() {
        let fs = SimFs::new();
        let file = write(&fs, "/d/f", b"one");
        fs.sync_dir(Path::new("/d")).unwrap();
        // Written, not synced: the name survives (its directory was synced), the bytes do not.
        assert_eq!(fs.read(Path::new("/d/f")).unwrap(), b"one");
        assert_eq!(read(&fs.crash(), "/d/f"), Some(Vec::new()));
        file.sync_data().unwrap();
        file.write_at(b"two", 3).unwrap();
        assert_eq!(read(&fs.crash(), "/d/f"), Some(b"one".to_vec()));
        file.sync_all().unwrap();
        assert_eq!(read(&fs.crash(), "/d/f"), Some(b"onetwo".to_vec()));
        // A size change is a change like a write.
        file.set_len(1).unwrap();
        assert_eq!(read(&fs.crash(), "/d/f"), Some(b"onetwo".to_vec()));
        file.sync_data().unwrap();
        assert_eq!(read(&fs.crash(), "/d/f"), Some(b"o".to_vec()));
        // A crash's result is a filesystem of its own, all of it durable.
        let crashed = fs.crash();
        write(&crashed, "/d/f", b"x");
        assert_eq!(read(&fs, "/d/f"), Some(b"o".to_vec()));
        assert_eq!(read(&crashed.crash(), "/d/f"), Some(b"o".to_vec()));
    }

    #[test]
    fn names_survive_a_crash_only_once_their_directory_is_synced() {
        let fs = SimFs::new();
        let file = write(&fs, "/d/f", b"data");
        file.sync_all().unwrap();
        // Created and synced, but not its directory: gone.
        assert_eq!(read(&fs.crash(), "/d/f"), None);
        fs.sync_dir(Path::new("/d")).unwrap();
        assert_eq!(read(&fs.crash(), "/d/f"), Some(b"data".to_vec()));
        // Another directory's sync does nothing for it.
        write(&fs, "/d/g", b"g").sync_all().unwrap();
        fs.sync_dir(Path::new("/e")).unwrap();
        assert_eq!(read(&fs.crash(), "/d/g"), None);

        // Renamed over another file without a directory sync: the old state, both names.
        let new = write(&fs, "/d/f.tmp", b"new");
        new.sync_all().unwrap();
        fs.sync_dir(Path::new("/d")).unwrap();
        fs.rename(Path::new("/d/f.tmp"), Path::new("/d/f")).unwrap();
        assert_eq!(read(&fs, "/d/f"), Some(b"new".to_vec()));
        let crashed = fs.crash();
        assert_eq!(read(&crashed, "/d/f"), Some(b"data".to_vec()));
        assert_eq!(read(&crashed, "/d/f.tmp"), Some(b"new".to_vec()));
        // A remove is undone the same way.
        fs.remove(Path::new("/d/g")).unwrap();
        fs.sync_dir(Path::new("/d")).unwrap();
        fs.remove(Path::new("/d/f")).unwrap();
        let crashed = fs.crash();
        assert_eq!(read(&crashed, "/d/f"), Some(b"new".to_vec()));
        assert_eq!((read(&crashed, "/d/f.tmp"), read(&crashed, "/d/g")), (None, None));
        fs.sync_dir(Path::new("/d")).unwrap();
        assert!(fs.crash().list(Path::new("/d")).unwrap().is_empty());
        // A file created without a directory sync is gone even where the rename it got is synced
        // later, unless that sync comes: then it is there under its new name.
        let tmp = write(&fs, "/d/t", b"t");
        tmp.sync_all().unwrap();
        fs.rename(Path::new("/d/t"), Path::new("/d/u")).unwrap();
        assert_eq!(fs.crash().list(Path::new("/d")).unwrap(), Vec::<OsString>::new());
        fs.sync_dir(Path::new("/d")).unwrap();
        assert_eq!(fs.crash().list(Path::new("/d")).unwrap(), vec![OsString::from("u")]);
    }

    #[test]
    fn chosen_unsynced_changes_can_reach_the_disk_too() {
        let fs = SimFs::new();
        let file = write(&fs, "/d/f", &[b'a'; 500]);
        file.write_at(&[b'b'; 1100], 500).unwrap();
        let all = Keep { unsynced_bytes: u64::MAX, unsynced_names: Names::All };
        assert_eq!(read(&fs.crash_with(all), "/d/f").unwrap().len(), 1600);
        // The first write, and of the second the sectors below 500 + 700 bytes: torn at 1024.
        let torn = Keep { unsynced_bytes: 1200, unsynced_names: Names::All };
        let kept = read(&fs.crash_with(torn), "/d/f").unwrap();
        assert_eq!((kept.len(), kept[499], kept[500], kept[1023]), (1024, b'a', b'b', b'b'));
        // Within a sector, nothing is torn.
        let torn = Keep { unsynced_bytes: 510, unsynced_names: Names::All };
        assert_eq!(read(&fs.crash_with(torn), "/d/f"), Some(vec![b'a'; 500]));
        // Names only: the file is there, empty.
        let names = Keep { unsynced_bytes: 0, unsynced_names: Names::All };
        assert_eq!(read(&fs.crash_with(names), "/d/f"), Some(Vec::new()));
        // Removes only: a rename is undone while the remove after it stays.
        file.sync_all().unwrap();
        write(&fs, "/d/old", b"old").sync_all().unwrap();
        fs.sync_dir(Path::new("/d")).unwrap();
        fs.rename(Path::new("/d/f"), Path::new("/d/g")).unwrap();
        fs.remove(Path::new("/d/old")).unwrap();
        let removes = Keep { unsynced_bytes: 0, unsynced_names: Names::RemovesOnly };
        let crashed = fs.crash_with(removes);
        assert_eq!(crashed.list(Path::new("/d")).unwrap(), vec![OsString::from("f")]);
        // Seeded choices repeat.
        let seeded = Keep { unsynced_bytes: 0, unsynced_names: Names::Seeded(7) };
        assert_eq!(
            fs.crash_with(seeded).list(Path::new("/d")).unwrap(),
            fs.crash_with(seeded).list(Path::new("/d")).unwrap()
        );
    }

    #[test]
    fn every_mutating_call_is_a_crash_point() {
        let fs = SimFs::new();
        let file = write(&fs, "/d/f", b"a");
        fs.record();
        file.write_at(b"b", 1).unwrap();
        file.sync_data().unwrap();
        fs.sync_dir(Path::new("/d")).unwrap();
        let points = fs.points();
        assert_eq!(points.iter().map(|p| p.ops).collect::<Vec<_>>(), vec![2, 3, 4, 5]);
        let after = |i: usize| read(&points[i].crash_with(Keep::SYNCED), "/d/f");
        assert_eq!((after(0), after(1), after(2), after(3)), (None, None, None, Some(b"ab".to_vec())));
        // Unsynced, the name is kept by a crash that keeps names: then the bytes show.
        let names = Keep { unsynced_bytes: 0, unsynced_names: Names::All };
        assert_eq!(read(&points[2].crash_with(names), "/d/f"), Some(b"ab".to_vec()));
        assert_eq!(fs.ops(), 5);
    }
}
