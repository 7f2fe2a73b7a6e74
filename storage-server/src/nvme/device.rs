//! Opening the NVMe tier's file or block device: O_DIRECT, its size, and its direct-I/O alignment.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use anyhow::{bail, Context};
use tern_common::ByteSize;

/// Used when the kernel cannot say (no STATX_DIOALIGN before Linux 6.1).
pub const FALLBACK_ALIGN: u64 = 4096;

/// An open NVMe device or file.
pub struct Device {
    pub file: File,
    /// Bytes of it the tier may use.
    pub size: u64,
    /// Direct-I/O alignment of offsets, lengths and buffer addresses.
    pub align: u64,
}

/// Opens `path` with O_DIRECT. A regular file is created if missing and preallocated
/// (fallocate) to `size`; `size` may be omitted for a file that already has one, and for a block
/// device (whose whole size is then used).
pub fn open(path: &Path, size: Option<ByteSize>) -> anyhow::Result<Device> {
    let existing = std::fs::metadata(path).ok();
    let is_block = existing.as_ref().is_some_and(|m| m.file_type().is_block_device());
    if existing.as_ref().is_some_and(|m| !m.is_file() && !is_block) {
        bail!("nvme: {} is neither a regular file nor a block device", path.display());
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(!is_block)
        .truncate(false)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::EINVAL) {
                anyhow::anyhow!(
                    "nvme: the filesystem holding {} refuses O_DIRECT (tmpfs, e.g. /dev/shm, does); put the NVMe \
                     file on a disk filesystem or give a block device",
                    path.display()
                )
            } else {
                anyhow::Error::new(e).context(format!("nvme: opening {} with O_DIRECT", path.display()))
            }
        })?;
    let align = dio_align(&file);
    let size = if is_block {
        let device_size = (&file).seek(SeekFrom::End(0)).context("nvme: reading the block device's size")?;
        match size {
            Some(size) if size.bytes() > device_size => {
                bail!("nvme-size {size} is larger than the block device {} ({})", path.display(), ByteSize(device_size))
            }
            Some(size) => size.bytes(),
            None => device_size,
        }
    } else {
        let current = file.metadata()?.len();
        let size = match size {
            Some(size) => size.bytes(),
            None if current > 0 => current,
            None => bail!(
                "nvme-size is required: {} is a new (or empty) file, and its size sets the NVMe tier's capacity",
                path.display()
            ),
        };
        if size > current {
            preallocate(&file, size)
                .with_context(|| format!("nvme: preallocating {} of {} (fallocate)", ByteSize(size), path.display()))?;
            // The file's size and its name are durable before any block in it is acknowledged.
            file.sync_all().with_context(|| format!("nvme: syncing {}", path.display()))?;
            let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
            File::open(dir)
                .and_then(|d| d.sync_all())
                .with_context(|| format!("nvme: syncing the directory of {}", path.display()))?;
        }
        size
    };
    if size < align {
        bail!("nvme: {} holds {} bytes, less than one {align}-byte unit", path.display(), size);
    }
    Ok(Device { file, size, align })
}

fn preallocate(file: &File, size: u64) -> std::io::Result<()> {
    let len = libc::off_t::try_from(size).map_err(|_| std::io::Error::other("size too large"))?;
    // SAFETY: plain syscall on an open descriptor.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The larger of the memory and offset alignments statx reports for direct I/O, or
/// [`FALLBACK_ALIGN`] when it reports none.
fn dio_align(file: &File) -> u64 {
    // SAFETY: an all-zero statx is a valid value of this plain C struct.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx fills the struct; the empty path with AT_EMPTY_PATH names the fd.
    let rc =
        unsafe { libc::statx(file.as_raw_fd(), c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx) };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return FALLBACK_ALIGN;
    }
    let align = u64::from(stx.stx_dio_mem_align.max(stx.stx_dio_offset_align));
    if align == 0 || !align.is_power_of_two() {
        return FALLBACK_ALIGN;
    }
    align
}
