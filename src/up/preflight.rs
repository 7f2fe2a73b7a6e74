//! What `tern up` checks before it writes anything in its directory, each failing with one line
//! that names the flag to change: the DRAM tiers fit in the memory this machine (and the cgroup
//! `tern up` runs in) can give; the NVMe tiers match the ones an earlier run left in `DIR/nvme`
//! (so no tier's blocks become unreadable, and no storage server is refused its file after the
//! cluster's logs were started); and the new NVMe files fit on their disk. (Free ports are
//! `tern_local::PortLayout::check_free`'s.)
//!
//! The decisions are pure functions of what was read ([`Memory`], [`NvmeDisk`]), tested below.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use tern_common::ByteSize;

use super::NvmeSize;

/// Most an `auto` NVMe tier takes per storage server.
const AUTO_NVME_MAX: u64 = 2 << 30;
/// Least an `auto` NVMe tier is worth having.
const AUTO_NVME_MIN: u64 = 64 << 20;
/// Memory left beside the DRAM tiers, for the daemons' own heaps, the metadata server and
/// whatever else runs: this share of what there is ...
const MEMORY_HEADROOM_SHARE: u64 = 8;
/// ... and at least this.
const MEMORY_HEADROOM_MIN: u64 = 256 << 20;

/// The memory the DRAM tiers could have now: the least of the machine's and each enclosing
/// cgroup's room, and which one that is (for the refusal).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Memory {
    pub room: u64,
    /// What bounds it, e.g. "this machine has 21.9GiB available".
    pub bound_by: String,
}

/// Refuses DRAM tiers (`each` for each of `servers`) that would not fit in `memory` less a
/// headroom: storage servers fault their whole arena in at start, so a machine without the
/// memory would otherwise swap or be killed by the OOM killer, silently, for many seconds.
pub(super) fn check_dram(each: u64, servers: u16, memory: &Memory) -> anyhow::Result<()> {
    let total = each.saturating_mul(u64::from(servers));
    let headroom = (memory.room / MEMORY_HEADROOM_SHARE).max(MEMORY_HEADROOM_MIN);
    let usable = memory.room.saturating_sub(headroom);
    if total <= usable {
        return Ok(());
    }
    // The most each may have, in whole MiB.
    let most = (usable / u64::from(servers.max(1))) >> 20 << 20;
    let fix = if most == 0 {
        "pass fewer --storage-servers or free some memory".to_string()
    } else {
        format!("pass --dram {} or less", ByteSize(most))
    };
    bail!(
        "--dram {} for each of {servers} storage server{} is {} in all, but {}, and {} of it stays for everything \
         else: {fix}",
        ByteSize(each),
        if servers == 1 { "" } else { "s" },
        ByteSize(total).human(),
        memory.bound_by,
        ByteSize(headroom).human(),
    )
}

/// The memory room of this machine and of the cgroups enclosing this process (v2, and v1's
/// memory controller), read now; `None` where /proc/meminfo cannot be read (not Linux).
pub(super) fn memory() -> Option<Memory> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let available = meminfo_field(&meminfo, "MemAvailable:")?;
    let mut memory =
        Memory { room: available, bound_by: format!("this machine has {} available", ByteSize(available).human()) };
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    for (dir, v2) in cgroup_dirs(&cgroups) {
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
        let room = if v2 {
            cgroup_room(&read("memory.max"), &read("memory.current"), &read("memory.stat"), "inactive_file")
        } else {
            cgroup_room(
                &read("memory.limit_in_bytes"),
                &read("memory.usage_in_bytes"),
                &read("memory.stat"),
                "total_inactive_file",
            )
        };
        if let Some((room, limit)) = room.filter(|&(room, _)| room < memory.room) {
            memory = Memory {
                room,
                bound_by: format!(
                    "the cgroup {}, limited to {}, has {} unused",
                    dir.display(),
                    ByteSize(limit).human(),
                    ByteSize(room).human()
                ),
            };
        }
    }
    Some(memory)
}

/// A `/proc/meminfo` field in bytes.
fn meminfo_field(meminfo: &str, field: &str) -> Option<u64> {
    let kib = meminfo.lines().find_map(|line| line.strip_prefix(field))?;
    kib.trim().trim_end_matches("kB").trim().parse::<u64>().ok().map(|kib| kib * 1024)
}

/// The memory cgroup directories enclosing this process, innermost first, from
/// `/proc/self/cgroup`: each with whether it is v2 (unified) rather than v1's memory controller.
/// Every enclosing one counts: a limit on a parent bounds its children too.
fn cgroup_dirs(proc_self_cgroup: &str) -> Vec<(PathBuf, bool)> {
    let mut dirs = Vec::new();
    for line in proc_self_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        let (root, v2) = match controllers {
            "" => ("/sys/fs/cgroup", true),
            c if c.split(',').any(|c| c == "memory") => ("/sys/fs/cgroup/memory", false),
            _ => continue,
        };
        let mut path = Path::new(path);
        loop {
            let relative = path.strip_prefix("/").unwrap_or(path);
            let dir =
                if relative.as_os_str().is_empty() { PathBuf::from(root) } else { Path::new(root).join(relative) };
            dirs.push((dir, v2));
            match path.parent() {
                Some(parent) => path = parent,
                None => break,
            }
        }
    }
    dirs
}

/// A cgroup's unused memory and its limit, from its limit file ("max", or v1's huge number, when
/// unlimited: `None`), its usage and its stat file. Inactive page cache is counted as free, as
/// the kubelet's working set does: the kernel reclaims it before it would OOM-kill.
fn cgroup_room(limit: &str, usage: &str, stat: &str, inactive_key: &str) -> Option<(u64, u64)> {
    let limit = limit.trim().parse::<u64>().ok().filter(|&limit| limit < 1 << 60)?;
    let usage = usage.trim().parse::<u64>().unwrap_or(0);
    let inactive = stat
        .lines()
        .find_map(|line| line.strip_prefix(inactive_key)?.strip_prefix(' ')?.trim().parse::<u64>().ok())
        .unwrap_or(0);
    Some((limit.saturating_sub(usage.saturating_sub(inactive)), limit))
}

/// What `DIR/nvme` holds and the disk under it, as read before the plan is made.
#[derive(Debug, Clone, Default)]
pub(super) struct NvmeDisk {
    /// The directory (for messages).
    pub dir: PathBuf,
    /// The size of each non-empty `storage-I.nvme`, by I. An empty one holds nothing (a storage
    /// server refused to size it): it is treated as absent.
    pub existing: BTreeMap<u16, u64>,
    /// Bytes free to unprivileged users on its filesystem.
    pub free: u64,
    /// Whether that filesystem is tmpfs (no O_DIRECT).
    pub tmpfs: bool,
}

impl NvmeDisk {
    /// Reads `nvme_dir` (which need not exist yet) and the filesystem under it, or under `parent`.
    pub(super) fn read(nvme_dir: &Path, parent: &Path) -> anyhow::Result<NvmeDisk> {
        let mut existing = BTreeMap::new();
        if let Ok(entries) = std::fs::read_dir(nvme_dir) {
            for entry in entries {
                let entry = entry.with_context(|| format!("reading {}", nvme_dir.display()))?;
                let name = entry.file_name();
                let index = name.to_str().and_then(|n| n.strip_prefix("storage-")?.strip_suffix(".nvme")?.parse().ok());
                let size = entry.metadata().map(|m| m.len()).unwrap_or(0);
                if let Some(index) = index.filter(|_| size > 0) {
                    existing.insert(index, size);
                }
            }
        }
        let on = if nvme_dir.exists() { nvme_dir } else { parent };
        let (free, tmpfs) = free_space(on)?;
        Ok(NvmeDisk { dir: nvme_dir.to_path_buf(), existing, free, tmpfs })
    }

    fn file(&self, i: u16) -> PathBuf {
        self.dir.join(format!("storage-{i}.nvme"))
    }
}

/// Each storage server's NVMe tier size in bytes (`None`: no tiers), and a note to print when
/// `auto` found no room for one.
pub(super) type NvmePlan = (Option<Vec<u64>>, Option<String>);

/// The NVMe tiers `servers` storage servers get, given what an earlier run left on `disk`:
/// - files there are kept with their size (their blocks survive restarts; another size or block
///   size would have the storage server refuse the file's index), so a `--nvme-size` that
///   differs, `off`, or fewer storage servers than there are files is refused;
/// - more storage servers than files adapts: the new ones get new files of the existing ones'
///   size (`auto`) or the size asked for;
/// - `auto` on a new directory: a quarter of the disk's free space over the servers, at most
///   [`AUTO_NVME_MAX`] each, none on tmpfs or under [`AUTO_NVME_MIN`];
/// - new files must fit in the disk's free space, and not be on tmpfs.
pub(super) fn plan_nvme(wanted: NvmeSize, servers: u16, block_size: u64, disk: &NvmeDisk) -> anyhow::Result<NvmePlan> {
    let dir = disk.dir.display();
    let count = disk.existing.len();
    let files = |indexes: &mut dyn Iterator<Item = u16>| {
        indexes.map(|i| disk.file(i).display().to_string()).collect::<Vec<_>>().join(", ")
    };
    if let Some(&last) = disk.existing.keys().next_back() {
        if last >= servers {
            let beyond = files(&mut disk.existing.keys().copied().filter(|&i| i >= servers));
            bail!(
                "{dir} holds the NVMe tiers of {} storage servers, and --storage-servers {servers} would leave the \
                 blocks in {beyond} unreadable: pass --storage-servers {} (or delete those files to drop their data)",
                last + 1,
                last + 1
            );
        }
    }
    let new: Vec<u16> = (0..servers).filter(|i| !disk.existing.contains_key(i)).collect();
    let sizes = match wanted {
        NvmeSize::Off if count > 0 => bail!(
            "{dir} holds the NVMe tiers of {count} storage server{}, and --nvme-size off would leave their blocks \
             unreadable: leave out --nvme-size (auto keeps them), or delete {dir} to drop their data",
            if count == 1 { "" } else { "s" }
        ),
        NvmeSize::Off => return Ok((None, None)),
        NvmeSize::Size(size) => {
            let size = size.bytes();
            if let Some((&i, &had)) = disk.existing.iter().find(|&(_, &had)| had != size) {
                bail!(
                    "{} is an NVMe tier of {}, not the {} --nvme-size asks for: pass --nvme-size auto to keep the \
                     tiers as they are (or delete {dir} to start them empty)",
                    disk.file(i).display(),
                    ByteSize(had),
                    ByteSize(size)
                );
            }
            vec![size; usize::from(servers)]
        }
        NvmeSize::Auto => match disk.existing.values().max() {
            // New servers' tiers match the largest of the others'.
            Some(&like) => (0..servers).map(|i| disk.existing.get(&i).copied().unwrap_or(like)).collect(),
            None => {
                let size = (disk.free / 4 / u64::from(servers)).min(AUTO_NVME_MAX) / block_size * block_size;
                if disk.tmpfs || size < AUTO_NVME_MIN {
                    let why =
                        if disk.tmpfs { "it is tmpfs, which has no O_DIRECT" } else { "it has too little free space" };
                    let note = format!("no NVMe tier: {dir} is on a disk where {why}; shuffles stay in DRAM");
                    return Ok((None, Some(note)));
                }
                vec![size; usize::from(servers)]
            }
        },
    };
    if !new.is_empty() {
        if disk.tmpfs {
            bail!(
                "{dir} is on tmpfs, which has no O_DIRECT for NVMe tiers: put --dir on a disk, or pass --nvme-size off"
            );
        }
        let needed: u64 = new.iter().map(|&i| sizes[usize::from(i)]).sum();
        if needed > disk.free {
            bail!(
                "the NVMe tier files of {} new storage server{} need {} on the disk holding {dir}, which has {} free: \
                 pass a smaller --nvme-size, or --nvme-size off",
                new.len(),
                if new.len() == 1 { "" } else { "s" },
                ByteSize(needed).human(),
                ByteSize(disk.free).human()
            );
        }
    }
    Ok((Some(sizes), None))
}

/// Bytes free to unprivileged users on the filesystem holding `dir`, and whether it is tmpfs.
#[allow(unsafe_code)] // statfs(2) through libc: the standard library has no call for free space
fn free_space(dir: &Path) -> anyhow::Result<(u64, bool)> {
    use std::os::unix::ffi::OsStrExt;
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).context("a directory name holding a NUL")?;
    let mut stat = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `path` is a NUL-terminated string and `stat` points to memory for one statfs, which
    // the call fills on success (checked before it is read).
    let rc = unsafe { libc::statfs(path.as_ptr(), stat.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("statfs {}", dir.display()));
    }
    // SAFETY: statfs succeeded, so it filled the struct.
    let stat = unsafe { stat.assume_init() };
    #[allow(clippy::unnecessary_cast)] // the field types differ between targets
    Ok((stat.f_bavail as u64 * stat.f_bsize as u64, stat.f_type as i64 == TMPFS_MAGIC))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn machine(room: u64) -> Memory {
        Memory { room, bound_by: format!("this machine has {} available", ByteSize(room).human()) }
    }

    #[test]
    fn dram_tiers_must_fit_in_the_memory_there_is_less_a_headroom() {
        check_dram(GIB, 2, &machine(24 * GIB)).unwrap();
        check_dram(64 * MIB, 2, &machine(GIB)).unwrap();
        let e = check_dram(64 * GIB, 1, &machine(24 * GIB)).unwrap_err().to_string();
        assert!(!e.contains('\n'), "one line: {e}");
        // 24 GiB less an eighth is 21 GiB.
        assert!(
            e.contains("--dram 64GiB for each of 1 storage server is 64GiB") && e.contains("pass --dram 21GiB or less"),
            "{e}"
        );
        let e = check_dram(GIB, 4, &machine(GIB)).unwrap_err().to_string();
        assert!(e.contains("4GiB in all") && e.contains("pass --dram 192MiB or less"), "{e}");
        let e = check_dram(GIB, 1, &machine(100 * MIB)).unwrap_err().to_string();
        assert!(e.contains("pass fewer --storage-servers"), "{e}");
    }

    #[test]
    fn cgroup_limits_count_inactive_page_cache_as_free() {
        let stat = "anon 100\ninactive_file 1000\nactive_file 5\n";
        assert_eq!(cgroup_room("4096\n", "3000\n", stat, "inactive_file"), Some((2096, 4096)));
        assert_eq!(cgroup_room("max\n", "3000\n", stat, "inactive_file"), None);
        // v1 says "no limit" with a number near 2^63.
        assert_eq!(cgroup_room("9223372036854771712\n", "1\n", "", "total_inactive_file"), None);
        let dirs = cgroup_dirs("0::/user.slice/tern.scope\n");
        let dirs: Vec<String> = dirs.iter().map(|(d, _)| d.display().to_string()).collect();
        assert_eq!(dirs, ["/sys/fs/cgroup/user.slice/tern.scope", "/sys/fs/cgroup/user.slice", "/sys/fs/cgroup"]);
        let v1 = cgroup_dirs("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n");
        assert_eq!(v1[0], (PathBuf::from("/sys/fs/cgroup/memory/docker/abc"), false));
        assert_eq!(v1.len(), 3);
    }

    #[test]
    fn this_machines_memory_is_read() {
        let memory = memory().expect("tests run on Linux");
        assert!(memory.room > 0, "{memory:?}");
    }

    fn disk(existing: &[(u16, u64)], free: u64) -> NvmeDisk {
        NvmeDisk { dir: PathBuf::from("/d/nvme"), existing: existing.iter().copied().collect(), free, tmpfs: false }
    }

    #[test]
    fn auto_on_a_new_directory_takes_a_quarter_of_the_free_space_within_bounds() {
        assert_eq!(plan_nvme(NvmeSize::Auto, 2, MIB, &disk(&[], 100 * GIB)).unwrap(), (Some(vec![2 * GIB; 2]), None));
        assert_eq!(plan_nvme(NvmeSize::Auto, 2, MIB, &disk(&[], 2 * GIB)).unwrap().0, Some(vec![256 * MIB; 2]));
        let (tiers, note) = plan_nvme(NvmeSize::Auto, 2, MIB, &disk(&[], 100 * MIB)).unwrap();
        assert!(tiers.is_none() && note.unwrap().contains("too little free space"));
        let tmpfs = NvmeDisk { tmpfs: true, ..disk(&[], 100 * GIB) };
        assert!(plan_nvme(NvmeSize::Auto, 2, MIB, &tmpfs).unwrap().1.unwrap().contains("tmpfs"));
        assert_eq!(plan_nvme(NvmeSize::Off, 2, MIB, &disk(&[], 100 * GIB)).unwrap(), (None, None));
    }

    #[test]
    fn existing_tiers_keep_their_size_and_new_servers_get_the_same() {
        let one = disk(&[(0, 512 * MIB)], 10 * GIB);
        assert_eq!(plan_nvme(NvmeSize::Auto, 1, MIB, &one).unwrap().0, Some(vec![512 * MIB]));
        assert_eq!(plan_nvme(NvmeSize::Auto, 3, MIB, &one).unwrap().0, Some(vec![512 * MIB; 3]));
        let size = NvmeSize::Size(ByteSize(512 * MIB));
        assert_eq!(plan_nvme(size, 2, MIB, &one).unwrap().0, Some(vec![512 * MIB; 2]));
        // No room for the new ones' files.
        let e = plan_nvme(NvmeSize::Auto, 3, MIB, &disk(&[(0, 512 * MIB)], 600 * MIB)).unwrap_err().to_string();
        assert!(e.contains("2 new storage servers need 1GiB") && e.contains("--nvme-size"), "{e}");
    }

    #[test]
    fn fewer_servers_another_size_or_off_than_the_files_there_are_refused_naming_the_flag() {
        let two = disk(&[(0, 512 * MIB), (1, 512 * MIB)], 10 * GIB);
        let e = plan_nvme(NvmeSize::Auto, 1, MIB, &two).unwrap_err().to_string();
        assert!(e.contains("pass --storage-servers 2") && e.contains("/d/nvme/storage-1.nvme"), "{e}");
        let e = plan_nvme(NvmeSize::Size(ByteSize(GIB)), 2, MIB, &two).unwrap_err().to_string();
        assert!(
            e.contains("storage-0.nvme is an NVMe tier of 512MiB, not the 1GiB") && e.contains("--nvme-size auto"),
            "{e}"
        );
        let e = plan_nvme(NvmeSize::Off, 2, MIB, &two).unwrap_err().to_string();
        assert!(e.contains("--nvme-size off would leave") && e.contains("leave out --nvme-size"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }

    #[test]
    fn a_new_file_with_a_given_size_must_fit_and_not_be_on_tmpfs() {
        let e = plan_nvme(NvmeSize::Size(ByteSize(8 * GIB)), 2, MIB, &disk(&[], 10 * GIB)).unwrap_err().to_string();
        assert!(e.contains("need 16GiB") && e.contains("10GiB free"), "{e}");
        let tmpfs = NvmeDisk { tmpfs: true, ..disk(&[], 100 * GIB) };
        let e = plan_nvme(NvmeSize::Size(ByteSize(GIB)), 2, MIB, &tmpfs).unwrap_err().to_string();
        assert!(e.contains("tmpfs") && e.contains("--nvme-size off"), "{e}");
    }

    #[test]
    fn the_directory_is_read_with_empty_files_left_out() {
        let temp = tempfile::tempdir().unwrap();
        let nvme = temp.path().join("nvme");
        // Not there yet: nothing, and the parent's disk.
        assert!(NvmeDisk::read(&nvme, temp.path()).unwrap().existing.is_empty());
        std::fs::create_dir(&nvme).unwrap();
        std::fs::write(nvme.join("storage-0.nvme"), vec![0u8; 4096]).unwrap();
        std::fs::write(nvme.join("storage-0.nvme.index"), b"x").unwrap();
        std::fs::write(nvme.join("storage-1.nvme"), b"").unwrap();
        let read = NvmeDisk::read(&nvme, temp.path()).unwrap();
        assert_eq!(read.existing, BTreeMap::from([(0, 4096)]));
    }
}
