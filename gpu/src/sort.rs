//! Sorting TeraSort records on one GPU.
//!
//! [`GpuSorter::sort`] orders 100-byte records by the `memcmp` order of their 10-byte keys, records
//! with equal keys in input order: byte for byte what the CPU sort (`tern_terasort::sort_records`)
//! produces. The records sit in a [`PinnedBuffer`] (page-locked host memory that a
//! reduce fills straight from its shuffle reader), are copied to the device, sorted there by an
//! LSD radix sort over the key bytes (`src/sort.cu`, compiled at run time by NVRTC), permuted on the
//! device, and copied back into the same pinned buffer, from which the output is written.

use serde::Serialize;

use tern_terasort::RECORD_LEN;

/// Why a GPU sort could not run. Callers tell [`GpuError::NoGpu`] (take the CPU path) and
/// [`GpuError::OutOfMemory`] (the task ran out of memory) from the rest.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum GpuError {
    /// No usable GPU: no driver library, no such device, no NVRTC, or built without `cuda`.
    #[error("no GPU: {0}")]
    NoGpu(String),
    /// The GPU (or pinned host memory) has too little room for this input.
    #[error("GPU out of memory: {0}")]
    OutOfMemory(String),
    /// The input is not something the sort takes (not whole records, too many records).
    #[error("bad GPU sort input: {0}")]
    Input(String),
    /// The driver reported an error while sorting.
    #[error("GPU error: {0}")]
    Cuda(String),
}

/// What one [`GpuSorter::sort`] did and how long each step took.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SortStats {
    pub records: u64,
    pub bytes: u64,
    /// Copying the records from pinned memory to the device.
    pub h2d_seconds: f64,
    /// Sorting the keys and permuting the records on the device.
    pub sort_seconds: f64,
    /// Copying the sorted records back into pinned memory.
    pub d2h_seconds: f64,
    /// The device's name and address, e.g. "NVIDIA H100 80GB HBM3 (GPU 0)".
    pub device: String,
}

/// Page-locked ("pinned") host memory of one GPU, as long as asked for: the device copies to and
/// from it at full speed, with no staging copy. A reduce reads its partition into it, sorts it in
/// place ([`GpuSorter::sort_pinned`]) and writes its output from it (it is `AsRef<[u8]>`, so
/// `Bytes::from_owner` sends it without a copy). Dropped, it goes back to its sorter's pool for
/// the next partition, since pinning pages costs more than copying them.
pub struct PinnedBuffer {
    #[cfg(feature = "cuda")]
    inner: crate::cuda::PinnedBuffer,
    #[cfg(not(feature = "cuda"))]
    never: std::convert::Infallible,
}

impl AsRef<[u8]> for PinnedBuffer {
    fn as_ref(&self) -> &[u8] {
        #[cfg(feature = "cuda")]
        {
            self.inner.bytes()
        }
        #[cfg(not(feature = "cuda"))]
        {
            match self.never {}
        }
    }
}

impl AsMut<[u8]> for PinnedBuffer {
    fn as_mut(&mut self) -> &mut [u8] {
        #[cfg(feature = "cuda")]
        {
            self.inner.bytes_mut()
        }
        #[cfg(not(feature = "cuda"))]
        {
            match self.never {}
        }
    }
}

/// One GPU, ready to sort: the kernels compiled and loaded, a stream, and a pool of pinned
/// buffers reused across sorts. Open one per task (or keep one per executor thread); it is `Send`.
pub struct GpuSorter {
    #[cfg(feature = "cuda")]
    engine: crate::cuda::Engine,
    /// Built without `cuda`, no sorter can exist.
    #[cfg(not(feature = "cuda"))]
    never: std::convert::Infallible,
}

impl GpuSorter {
    /// Opens the GPU at `address` (a CUDA device ordinal, "0", "1", ..., as [`crate::detect`] and
    /// discovery scripts name them) and compiles the sort kernels. Fails with [`GpuError::NoGpu`]
    /// when there is no driver, no such device or no NVRTC; never panics.
    pub fn open(address: &str) -> Result<GpuSorter, GpuError> {
        #[cfg(feature = "cuda")]
        {
            Ok(GpuSorter { engine: crate::cuda::Engine::open(address)? })
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(GpuError::NoGpu(format!("cannot open GPU {address:?}: built without the cuda feature")))
        }
    }

    /// The device this sorter runs on, e.g. "NVIDIA H100 80GB HBM3 (GPU 0)".
    pub fn device(&self) -> &str {
        #[cfg(feature = "cuda")]
        {
            self.engine.device()
        }
        #[cfg(not(feature = "cuda"))]
        {
            match self.never {}
        }
    }

    /// A pinned buffer of `len` bytes of this GPU (zeroed when first pinned; a reused one holds
    /// what it held before). Fails with [`GpuError::OutOfMemory`] when the host cannot pin that
    /// much.
    pub fn pinned_buffer(&self, len: usize) -> Result<PinnedBuffer, GpuError> {
        #[cfg(feature = "cuda")]
        {
            Ok(PinnedBuffer { inner: self.engine.pinned_buffer(len)? })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = len;
            match self.never {}
        }
    }

    /// Sorts the records in `buf` by key in place (equal keys in input order) and says what the
    /// sort took. `buf` must hold whole 100-byte records, fewer than 2^32 of them, and come from
    /// this sorter's [`GpuSorter::pinned_buffer`].
    pub fn sort_pinned(&mut self, buf: &mut PinnedBuffer) -> Result<SortStats, GpuError> {
        check_records(buf.as_ref())?;
        #[cfg(feature = "cuda")]
        {
            self.engine.sort_pinned(&mut buf.inner)
        }
        #[cfg(not(feature = "cuda"))]
        {
            match self.never {}
        }
    }

    /// Returns `records` sorted by key (equal keys in input order), and what the sort took: a
    /// copy into a pinned buffer, [`GpuSorter::sort_pinned`], and a copy out.
    pub fn sort(&mut self, records: &[u8]) -> Result<(Vec<u8>, SortStats), GpuError> {
        check_records(records)?;
        let mut buf = self.pinned_buffer(records.len())?;
        buf.as_mut().copy_from_slice(records);
        let stats = self.sort_pinned(&mut buf)?;
        Ok((buf.as_ref().to_vec(), stats))
    }
}

fn check_records(records: &[u8]) -> Result<(), GpuError> {
    if records.len().is_multiple_of(RECORD_LEN) {
        Ok(())
    } else {
        Err(GpuError::Input(format!(
            "input is not whole records: {} bytes after {} records",
            records.len() % RECORD_LEN,
            records.len() / RECORD_LEN
        )))
    }
}

#[cfg(test)]
mod tests {
    use tern_terasort::KEY_LEN;

    use super::*;
    use crate::detect;

    #[test]
    fn open_fails_cleanly_without_a_gpu_and_names_bad_addresses() {
        let inv = detect();
        match GpuSorter::open("0") {
            Ok(sorter) => assert!(!inv.devices.is_empty(), "opened {} though detect() found none", sorter.device()),
            Err(e) => {
                assert!(matches!(e, GpuError::NoGpu(_)), "{e}");
                assert!(e.to_string().starts_with("no GPU: "), "{e}");
            }
        }
        let e = GpuSorter::open("gpu-zero").err().expect("not an ordinal");
        assert!(matches!(e, GpuError::NoGpu(_)) && e.to_string().contains("gpu-zero"), "{e}");
        let e = GpuSorter::open("4096").err().expect("no machine has 4097 GPUs");
        assert!(matches!(e, GpuError::NoGpu(_)), "{e}");
    }

    /// Needs a GPU, so only with the `cuda` feature (without it no sorter can exist).
    #[cfg(feature = "cuda")]
    mod gpu_present {
        use super::*;

        /// Random records whose keys collide often: a few share whole keys, many share the first 8
        /// bytes, so the last two key bytes and the tie order (input order) are exercised too.
        fn tricky_records(n: usize, seed: u64) -> Vec<u8> {
            let mut rng = tern_common::SplitMix64(seed);
            let mut out = vec![0u8; n * RECORD_LEN];
            for (i, rec) in out.chunks_exact_mut(RECORD_LEN).enumerate() {
                for word in rec.chunks_mut(8) {
                    word.copy_from_slice(&rng.next_u64().to_le_bytes()[..word.len()]);
                }
                match i % 4 {
                    0 => rec[..KEY_LEN].copy_from_slice(&[7; KEY_LEN]),
                    1 => rec[..8].copy_from_slice(&[0xAB; 8]),
                    _ => {}
                }
                // Payload bytes name the input position, so a wrong tie order changes the output.
                rec[KEY_LEN..KEY_LEN + 8].copy_from_slice(&(i as u64).to_le_bytes());
            }
            out
        }

        /// The one test that needs a GPU: skipped, saying so, when [`detect`] finds none, unless
        /// `TERN_TEST_REQUIRE_GPU=1` says this run must exercise a GPU (then a missing one fails).
        #[test]
        fn gpu_sort_matches_cpu_sort_when_a_gpu_is_present() {
            let inv = detect();
            let Some(dev) = inv.devices.first() else {
                let why = inv.note.as_deref().unwrap_or("detect() found none");
                let required = std::env::var("TERN_TEST_REQUIRE_GPU").is_ok_and(|v| v == "1");
                assert!(!required, "TERN_TEST_REQUIRE_GPU=1 but no GPU runs this test: {why}");
                println!("skipped: no GPU ({why}); set TERN_TEST_REQUIRE_GPU=1 to make that a failure");
                return;
            };
            let mut sorter = GpuSorter::open(&dev.address).expect("detect() found this GPU");
            let err = sorter.sort(&[0u8; 150]).unwrap_err();
            assert!(matches!(err, GpuError::Input(_)) && err.to_string().contains("50 bytes"), "{err}");
            // Sizes around the tile (2048) and several tiles; the pinned buffer grows and is reused.
            for (seed, n) in [0usize, 1, 2, 2047, 2048, 2049, 100_000, 1_000_003, 5000].into_iter().enumerate() {
                let input = if seed % 2 == 0 {
                    tricky_records(n, seed as u64)
                } else {
                    let mut v = vec![0u8; n * RECORD_LEN];
                    tern_terasort::generate(seed as u64 * 1_000_000, n as u64, &mut v);
                    v
                };
                let mut cpu = Vec::new();
                tern_terasort::sort_records(&input, &mut cpu);
                let (gpu, stats) = sorter.sort(&input).unwrap();
                assert!(gpu == cpu, "GPU and CPU sorts differ for {n} records");
                assert_eq!((stats.records, stats.bytes), (n as u64, input.len() as u64));
                assert!(stats.device.contains(&dev.address));
                // In place in a pinned buffer (pooled: later sizes reuse earlier buffers), as the
                // GPU reduce does.
                let mut pinned = sorter.pinned_buffer(input.len()).unwrap();
                pinned.as_mut().copy_from_slice(&input);
                let in_place = sorter.sort_pinned(&mut pinned).unwrap();
                assert!(pinned.as_ref() == cpu.as_slice(), "the in-place sort differs for {n} records");
                assert_eq!(in_place.records, n as u64);
                drop(pinned);
                if n >= 100_000 {
                    println!(
                        "{n} records on {}: h2d {:.1} ms, sort {:.1} ms, d2h {:.1} ms",
                        stats.device,
                        stats.h2d_seconds * 1e3,
                        stats.sort_seconds * 1e3,
                        stats.d2h_seconds * 1e3
                    );
                }
            }
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn kernels_compile_when_nvrtc_is_present() {
        // Needs no GPU: NVRTC compiles without a driver. Where NVRTC is missing, the error must
        // be the clean "no GPU" one that sends callers to the CPU path.
        match (crate::cuda::nvrtc_present(), crate::cuda::compile_kernels()) {
            (Ok(()), Ok(ptx)) => {
                let ptx = ptx.to_src();
                for kernel in ["extract_keys", "radix_histogram", "exclusive_scan", "radix_scatter", "gather_records"] {
                    assert!(ptx.contains(&format!(".entry {kernel}")), "no {kernel} in the PTX");
                }
            }
            (Ok(()), Err(e)) => panic!("NVRTC is present but the kernels did not compile: {e}"),
            (Err(why), r) => {
                let e = r.expect_err("compiled without NVRTC?");
                assert_eq!(e, GpuError::NoGpu(why));
            }
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_cuda_feature_there_is_no_gpu() {
        let e = GpuSorter::open("0").err().expect("no sorter without cuda");
        assert!(e.to_string().contains("built without the cuda feature"), "{e}");
        let inv = detect();
        assert!(inv.devices.is_empty() && inv.note.unwrap().contains("cuda feature"));
    }
}
