//! The CUDA path (feature `cuda`): probing the driver and NVRTC libraries, listing devices, and the
//! engine behind [`crate::GpuSorter`].
//!
//! cudarc's dynamic loading panics when a library is missing, so every entry point here checks the
//! libraries first and also runs under `catch_unwind`: a machine without a driver (or with an old
//! one missing a symbol) gets an error, never a crashed executor.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{
    result as cu, sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtrMut, DriverError, LaunchConfig,
    PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc;
use tern_terasort::{KEY_LEN, RECORD_LEN};

use crate::sort::{GpuError, SortStats};
use crate::{GpuDevice, Inventory, Source};

/// The kernels, compiled at run time (see the file for the algorithm).
const KERNEL_SOURCE: &str = include_str!("sort.cu");
/// Must match RADIX, TILE and SCAN_THREADS in sort.cu.
const RADIX: u32 = 256;
const TILE: u32 = 2048;
const SCAN_THREADS: u32 = 1024;
/// Key bytes, one radix pass each.
const PASSES: u32 = KEY_LEN as u32;
// sort.cu holds a key as 8 + 2 bytes and moves records as 4-byte words.
const _: () = assert!(KEY_LEN == 10 && RECORD_LEN.is_multiple_of(4), "sort.cu's key split and word copy");
/// Threads per block of the grid-stride kernels, and a cap on their grids.
const STRIDE_THREADS: u32 = 256;
const MAX_STRIDE_BLOCKS: u32 = 1 << 16;

/// Whether the CUDA driver library can be loaded; `Err` says why not.
pub(crate) fn driver_present() -> Result<(), String> {
    // SAFETY: only tries to dlopen the library under its usual names.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err("no CUDA driver library (libcuda.so) could be loaded".into())
    }
}

/// Whether the NVRTC library (which compiles the sort kernel) can be loaded; `Err` says why not.
pub(crate) fn nvrtc_present() -> Result<(), String> {
    // SAFETY: as for driver_present.
    if unsafe { nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err("no NVRTC library (libnvrtc.so) could be loaded; the GPU sort compiles its kernel with it".into())
    }
}

fn panic_message(p: Box<dyn Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

pub(crate) fn detect() -> Inventory {
    match catch_unwind(detect_devices) {
        Ok(inv) => inv,
        Err(p) => Inventory::none(format!("querying the CUDA driver failed: {}", panic_message(p))),
    }
}

fn detect_devices() -> Inventory {
    if let Err(why) = driver_present() {
        return Inventory::none(why);
    }
    if let Err(e) = cu::init() {
        return Inventory::none(format!("the CUDA driver did not initialise: {e:?}"));
    }
    let count = match cu::device::get_count() {
        Ok(n) => n,
        Err(e) => return Inventory::none(format!("the CUDA driver could not count devices: {e:?}")),
    };
    if count <= 0 {
        return Inventory::none("the CUDA driver found no device");
    }
    let mut devices = Vec::with_capacity(count as usize);
    for ordinal in 0..count {
        let described = cu::device::get(ordinal).and_then(|dev| {
            // SAFETY: `dev` is a device handle the driver just returned.
            Ok((cu::device::get_name(dev)?, unsafe { cu::device::total_mem(dev)? }))
        });
        match described {
            Ok((name, mem)) => devices.push(GpuDevice { address: ordinal.to_string(), name, memory_bytes: mem as u64 }),
            Err(e) => return Inventory::none(format!("the CUDA driver could not describe device {ordinal}: {e:?}")),
        }
    }
    // Devices without NVRTC can still be handed to `command` tasks, but the built-in GPU sort
    // cannot compile its kernel: say so once, here.
    let note = nvrtc_present().err().map(|why| format!("{why}: GPU sort tasks will run on the CPU path"));
    Inventory { devices, source: Source::Cuda, note }
}

fn driver_err(what: &str) -> impl Fn(DriverError) -> GpuError + '_ {
    move |e| {
        if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            GpuError::OutOfMemory(format!("{what}: {e:?}"))
        } else {
            GpuError::Cuda(format!("{what}: {e:?}"))
        }
    }
}

/// Compiles the sort kernels to PTX; an `Err` is [`GpuError::NoGpu`] when NVRTC is missing.
pub(crate) fn compile_kernels() -> Result<nvrtc::Ptx, GpuError> {
    nvrtc_present().map_err(GpuError::NoGpu)?;
    let compiled = catch_unwind(|| {
        let opts = nvrtc::CompileOptions {
            name: Some("tern_sort.cu".into()),
            // The record layout is tern-terasort's, handed to the kernels rather than copied.
            options: vec![format!("-DRECORD_LEN={RECORD_LEN}")],
            ..Default::default()
        };
        nvrtc::compile_ptx_with_opts(KERNEL_SOURCE, opts)
    });
    match compiled {
        Ok(Ok(ptx)) => Ok(ptx),
        Ok(Err(e)) => Err(GpuError::Cuda(format!("compiling the sort kernels with NVRTC: {e}"))),
        Err(p) => Err(GpuError::NoGpu(format!("NVRTC failed: {}", panic_message(p)))),
    }
}

/// Pinned buffers a device keeps for reuse once dropped: pinning pages costs more than copying
/// them, so a partition should not pay for it again; two covers the tasks that share a GPU.
const PINNED_POOL: usize = 2;

/// Page-locked host memory of one device's context, `len` bytes of it in use; see
/// [`crate::PinnedBuffer`].
pub(crate) struct PinnedBuffer {
    /// Always `Some` until dropped, when it goes back to `pool`.
    slice: Option<PinnedHostSlice<u8>>,
    /// The slice's memory, taken once (asking the slice for it waits on its event every time).
    ptr: *mut u8,
    len: usize,
    pool: Arc<Mutex<Vec<PinnedHostSlice<u8>>>>,
}

// SAFETY: `ptr` is the memory `slice` owns, reached only through `&self` / `&mut self`, so the
// buffer can move between threads as the slice itself can (cudarc declares it Send and Sync).
unsafe impl Send for PinnedBuffer {}
// SAFETY: as for Send just above: the buffer is reached only through `&self` / `&mut self`.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` holds at least `len` initialised bytes (zeroed when pinned), alive as long
        // as `self`; no copy to or from the device is in flight outside `Engine::sort_pinned`,
        // which holds `&mut self` until its stream is synchronized.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `bytes`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let Some(slice) = self.slice.take() else { return };
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.push(slice);
        if pool.len() > PINNED_POOL {
            // Keep the largest; the smallest is unpinned here, in its own context.
            pool.sort_by_key(|s| std::cmp::Reverse(s.len()));
            let smallest = pool.pop().expect("more than PINNED_POOL");
            drop(pool);
            let _ = smallest.context().bind_to_thread();
            drop(smallest);
        }
    }
}

/// The sort kernels loaded on one device, and its pool of pinned buffers.
pub(crate) struct Engine {
    device: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    extract_keys: CudaFunction,
    radix_histogram: CudaFunction,
    exclusive_scan: CudaFunction,
    radix_scatter: CudaFunction,
    gather_records: CudaFunction,
    pinned_pool: Arc<Mutex<Vec<PinnedHostSlice<u8>>>>,
}

impl Engine {
    pub(crate) fn open(address: &str) -> Result<Engine, GpuError> {
        match catch_unwind(|| Engine::open_inner(address)) {
            Ok(r) => r,
            Err(p) => Err(GpuError::NoGpu(format!("the CUDA driver failed: {}", panic_message(p)))),
        }
    }

    fn open_inner(address: &str) -> Result<Engine, GpuError> {
        let ordinal: usize = address.trim().parse().map_err(|_| {
            GpuError::NoGpu(format!("GPU address {address:?} is not a CUDA device ordinal (0, 1, ...)"))
        })?;
        driver_present().map_err(GpuError::NoGpu)?;
        cu::init().map_err(|e| GpuError::NoGpu(format!("the CUDA driver did not initialise: {e:?}")))?;
        let count = cu::device::get_count()
            .map_err(|e| GpuError::NoGpu(format!("the CUDA driver could not count devices: {e:?}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(GpuError::NoGpu(format!(
                "GPU {ordinal} does not exist: the CUDA driver sees {count} device(s)"
            )));
        }
        let ptx = compile_kernels()?;
        let ctx = CudaContext::new(ordinal).map_err(driver_err("creating a CUDA context"))?;
        let device = format!("{} (GPU {ordinal})", ctx.name().map_err(driver_err("reading the device name"))?);
        let module = ctx.load_module(ptx).map_err(driver_err("loading the sort kernels"))?;
        let f = |name: &str| module.load_function(name).map_err(driver_err("loading a sort kernel"));
        Ok(Engine {
            device,
            stream: ctx.new_stream().map_err(driver_err("creating a stream"))?,
            extract_keys: f("extract_keys")?,
            radix_histogram: f("radix_histogram")?,
            exclusive_scan: f("exclusive_scan")?,
            radix_scatter: f("radix_scatter")?,
            gather_records: f("gather_records")?,
            ctx,
            pinned_pool: Arc::default(),
        })
    }

    pub(crate) fn device(&self) -> &str {
        &self.device
    }

    /// A pinned buffer of `len` bytes: the smallest pooled one that is large enough, or a new one.
    pub(crate) fn pinned_buffer(&self, len: usize) -> Result<PinnedBuffer, GpuError> {
        let pooled = {
            let mut pool = self.pinned_pool.lock().unwrap_or_else(|e| e.into_inner());
            let fits = pool.iter().enumerate().filter(|(_, s)| s.len() >= len).min_by_key(|(_, s)| s.len());
            fits.map(|(i, _)| i).map(|i| pool.swap_remove(i))
        };
        let mut slice = match pooled {
            Some(slice) => slice,
            None => {
                let pinned = catch_unwind(AssertUnwindSafe(|| {
                    // SAFETY: zeroed below before anything reads it. Plain pinned memory, not
                    // write-combined: the host reads the sorted records back from it.
                    unsafe { self.ctx.alloc_pinned_with_flags::<u8>(len.max(1), 0) }
                }));
                let mut slice = match pinned {
                    Ok(r) => r.map_err(driver_err("pinning host memory"))?,
                    Err(p) => return Err(GpuError::Cuda(format!("pinning host memory: {}", panic_message(p)))),
                };
                let ptr = slice.as_mut_ptr().map_err(driver_err("pinning host memory"))?;
                // SAFETY: the slice owns `slice.len()` bytes at `ptr`; nothing else uses them yet.
                unsafe { std::ptr::write_bytes(ptr, 0, slice.len()) };
                slice
            }
        };
        let ptr = slice.as_mut_ptr().map_err(driver_err("waiting for a pinned buffer"))?;
        Ok(PinnedBuffer { slice: Some(slice), ptr, len, pool: self.pinned_pool.clone() })
    }

    /// Sorts the whole records in `buf` in place (the caller checked the length); see `sort.cu`
    /// for the algorithm.
    pub(crate) fn sort_pinned(&mut self, buf: &mut PinnedBuffer) -> Result<SortStats, GpuError> {
        match catch_unwind(AssertUnwindSafe(|| self.sort_inner(buf))) {
            Ok(r) => r,
            Err(p) => Err(GpuError::Cuda(format!("the GPU sort failed: {}", panic_message(p)))),
        }
    }

    fn sort_inner(&mut self, buf: &mut PinnedBuffer) -> Result<SortStats, GpuError> {
        let bytes = buf.len;
        let n = bytes / RECORD_LEN;
        let mut stats =
            SortStats { records: n as u64, bytes: bytes as u64, device: self.device.clone(), ..SortStats::default() };
        if n == 0 {
            return Ok(stats);
        }
        let n32 = u32::try_from(n)
            .map_err(|_| GpuError::Input(format!("{n} records is more than one GPU sort can index (2^32 - 1)")))?;
        let tiles = n32.div_ceil(TILE);
        let hist_len = tiles as usize * RADIX as usize;
        // Input, output, two sets of (hi u64, lo u16, idx u32) entries, the histogram.
        let need = 2 * bytes + 2 * n * (8 + 2 + 4) + hist_len * 4;
        let (free, _total) = self.ctx.mem_get_info().map_err(driver_err("reading free GPU memory"))?;
        if need > free {
            return Err(GpuError::OutOfMemory(format!(
                "sorting {bytes} bytes needs {need} bytes of GPU memory; {free} are free on {}",
                self.device
            )));
        }
        let s = self.stream.clone();
        let err = driver_err;
        // The records go to the device straight from the pinned buffer and come back into it; the
        // host touches it only after each copy's stream is synchronized.
        let staging = buf.bytes_mut();

        let t = Instant::now();
        // SAFETY: device memory is written by the copy before any kernel reads it.
        let mut d_in: CudaSlice<u8> = unsafe { s.alloc(bytes) }.map_err(err("allocating GPU memory"))?;
        {
            let (dst, _record) = d_in.device_ptr_mut(&s);
            // SAFETY: `dst` holds `bytes` bytes; `staging` stays alive and untouched until the
            // stream is synchronized just below.
            unsafe { cu::memcpy_htod_async(dst, staging, s.cu_stream()) }.map_err(err("copying records to the GPU"))?;
        }
        s.synchronize().map_err(err("copying records to the GPU"))?;
        stats.h2d_seconds = t.elapsed().as_secs_f64();

        // Sort the keys, then permute the records.
        let t = Instant::now();
        let mut hi: [CudaSlice<u64>; 2] = [
            // SAFETY: device scratch memory, written by a kernel before it is read.
            unsafe { s.alloc(n) }.map_err(err("allocating GPU memory"))?,
            // SAFETY: device scratch memory, written by a kernel before it is read.
            unsafe { s.alloc(n) }.map_err(err("allocating GPU memory"))?,
        ];
        let mut lo: [CudaSlice<u16>; 2] = [
            // SAFETY: device scratch memory, written by a kernel before it is read.
            unsafe { s.alloc(n) }.map_err(err("allocating GPU memory"))?,
            // SAFETY: device scratch memory, written by a kernel before it is read.
            unsafe { s.alloc(n) }.map_err(err("allocating GPU memory"))?,
        ];
        let mut idx: [CudaSlice<u32>; 2] = [
            // SAFETY: device scratch memory, written by a kernel before it is read.
            unsafe { s.alloc(n) }.map_err(err("allocating GPU memory"))?,
            // SAFETY: device scratch memory, written by a kernel before it is read.
            unsafe { s.alloc(n) }.map_err(err("allocating GPU memory"))?,
        ];
        // SAFETY: device scratch memory, written by a kernel before it is read.
        let mut hist: CudaSlice<u32> = unsafe { s.alloc(hist_len) }.map_err(err("allocating GPU memory"))?;
        // SAFETY: device scratch memory, written by a kernel before it is read.
        let mut d_out: CudaSlice<u8> = unsafe { s.alloc(bytes) }.map_err(err("allocating GPU memory"))?;
        let stride = |items: u64| LaunchConfig {
            grid_dim: (items.div_ceil(STRIDE_THREADS as u64).clamp(1, MAX_STRIDE_BLOCKS as u64) as u32, 1, 1),
            block_dim: (STRIDE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let per_tile = LaunchConfig { grid_dim: (tiles, 1, 1), block_dim: (RADIX, 1, 1), shared_mem_bytes: 0 };
        let scan = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (SCAN_THREADS, 1, 1), shared_mem_bytes: 0 };
        let hist_len32 = hist_len as u32;
        {
            let [hi0, _] = &mut hi;
            let [lo0, _] = &mut lo;
            let [idx0, _] = &mut idx;
            // SAFETY: argument types and count match `extract_keys` in sort.cu; buffers hold n entries.
            unsafe {
                s.launch_builder(&self.extract_keys)
                    .arg(&d_in)
                    .arg(&n32)
                    .arg(hi0)
                    .arg(lo0)
                    .arg(idx0)
                    .launch(stride(n as u64))
            }
            .map_err(err("launching extract_keys"))?;
        }
        for pass in 0..PASSES {
            // Even passes read set 0 and write set 1, odd passes the reverse; ten passes end in set 0.
            let (src, dst) = if pass % 2 == 0 { (0, 1) } else { (1, 0) };
            let (hi_src, hi_dst) = pair(&mut hi, src, dst);
            let (lo_src, lo_dst) = pair(&mut lo, src, dst);
            let (idx_src, idx_dst) = pair(&mut idx, src, dst);
            // SAFETY: argument types, counts and launch shapes match sort.cu's contract.
            unsafe {
                s.launch_builder(&self.radix_histogram)
                    .arg(&*hi_src)
                    .arg(&*lo_src)
                    .arg(&n32)
                    .arg(&pass)
                    .arg(&tiles)
                    .arg(&mut hist)
                    .launch(per_tile)
            }
            .map_err(err("launching radix_histogram"))?;
            // SAFETY: `exclusive_scan` takes the histogram and its length, as passed.
            unsafe { s.launch_builder(&self.exclusive_scan).arg(&mut hist).arg(&hist_len32).launch(scan) }
                .map_err(err("launching exclusive_scan"))?;
            // SAFETY: `radix_scatter`'s arguments match its signature in sort.cu; every slice holds `n` items.
            unsafe {
                s.launch_builder(&self.radix_scatter)
                    .arg(&*hi_src)
                    .arg(&*lo_src)
                    .arg(&*idx_src)
                    .arg(&n32)
                    .arg(&pass)
                    .arg(&tiles)
                    .arg(&hist)
                    .arg(hi_dst)
                    .arg(lo_dst)
                    .arg(idx_dst)
                    .launch(per_tile)
            }
            .map_err(err("launching radix_scatter"))?;
        }
        const _: () = assert!(PASSES.is_multiple_of(2), "the sorted entries must end in set 0");
        // SAFETY: argument types match `gather_records`; d_in and d_out hold n records, idx[0] n entries.
        unsafe {
            s.launch_builder(&self.gather_records)
                .arg(&d_in)
                .arg(&idx[0])
                .arg(&n32)
                .arg(&mut d_out)
                .launch(stride(n as u64 * (RECORD_LEN as u64 / 4)))
        }
        .map_err(err("launching gather_records"))?;
        s.synchronize().map_err(err("sorting on the GPU"))?;
        stats.sort_seconds = t.elapsed().as_secs_f64();

        // Copy the sorted records back into the pinned buffer.
        let t = Instant::now();
        {
            let (src, _record) = cudarc::driver::DevicePtr::device_ptr(&d_out, &s);
            // SAFETY: `d_out` holds `bytes` bytes, written by gather_records on this stream; the
            // host reads `staging` only after the synchronize below.
            unsafe { cu::memcpy_dtoh_async(staging, src, s.cu_stream()) }
                .map_err(err("copying records from the GPU"))?;
        }
        s.synchronize().map_err(err("copying records from the GPU"))?;
        stats.d2h_seconds = t.elapsed().as_secs_f64();
        Ok(stats)
    }
}

/// Distinct `&mut` to elements `a` and `b` (a != b) of a two-element array.
fn pair<T>(v: &mut [T; 2], a: usize, b: usize) -> (&mut T, &mut T) {
    let [x, y] = v;
    if (a, b) == (0, 1) {
        (x, y)
    } else {
        (y, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detect_reports_why_there_is_no_gpu_and_never_panics() {
        let inv = crate::detect();
        match driver_present() {
            Err(why) => {
                assert!(inv.devices.is_empty(), "{inv:?}");
                assert_eq!(inv.source, Source::None);
                assert_eq!(inv.note.as_deref(), Some(why.as_str()));
                assert!(why.contains("libcuda"), "{why}");
            }
            // A driver: either devices from it, or none and a note saying why.
            Ok(()) if inv.devices.is_empty() => assert!(inv.note.is_some() && inv.source == Source::None, "{inv:?}"),
            Ok(()) => {
                assert_eq!(inv.source, Source::Cuda);
                for (i, d) in inv.devices.iter().enumerate() {
                    assert_eq!(d.address, i.to_string());
                    assert!(!d.name.is_empty() && d.memory_bytes > 0, "{d:?}");
                }
            }
        }
    }
}
