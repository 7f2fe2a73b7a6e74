//! Tern's GPU support: which GPUs an executor has, and sorting TeraSort records on one.
//!
//! * [`discovery`]: an executor's GPU [`Inventory`], from `--gpus N` ([`declared`]), from a discovery
//!   script printing Spark's `{"name":"gpu","addresses":[...]}` ([`from_discovery_script`]), or
//!   from the CUDA driver ([`detect`]); [`resolve`] applies that order of precedence.
//! * [`sort`]: [`GpuSorter`] sorts TeraSort records (`tern_terasort`'s layout: 100 bytes, a
//!   10-byte key first) on one GPU, in place in a [`PinnedBuffer`] (page-locked host memory the
//!   caller fills), with a radix-sort kernel compiled at run time by NVRTC (`src/sort.cu`). Its
//!   output is byte-identical to the CPU sort's.
//!
//! The CUDA path is the `cuda` cargo feature (on by default). cudarc loads the driver and NVRTC
//! libraries at run time, so the crate builds with no CUDA toolkit installed; with no driver, no
//! device or no NVRTC at run time nothing panics: [`detect`] reports no GPU with a note saying why
//! and [`GpuSorter::open`] fails with [`GpuError::NoGpu`], so callers take their CPU path.

// kill(2) on a discovery script's process group that overran its time limit.
#[allow(unsafe_code)]
pub mod discovery;
pub mod sort;

#[cfg(feature = "cuda")]
// The CUDA driver API through cudarc: device memory, pinned host memory, async copies.
#[allow(unsafe_code)]
mod cuda;

pub use discovery::{declared, detect, from_discovery_script, from_discovery_script_with_timeout, resolve};
pub use sort::{GpuError, GpuSorter, PinnedBuffer, SortStats};

use std::path::PathBuf;

use serde::Serialize;

/// One GPU an executor can hand to tasks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GpuDevice {
    /// The address tasks are given (in `TERN_GPU_ADDRESSES`) and [`GpuSorter::open`] takes: the CUDA
    /// device ordinal as a string ("0", "1", ...), as Spark's discovery scripts print it.
    pub address: String,
    /// The device's name ("NVIDIA H100 80GB HBM3"); empty when declared or named by a script.
    pub name: String,
    /// The device's memory; 0 when unknown (declared or named by a script).
    pub memory_bytes: u64,
}

/// Where an [`Inventory`] came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Source {
    /// The CUDA driver, through cudarc.
    Cuda,
    /// A discovery script's output.
    Script(PathBuf),
    /// `--gpus N`.
    Declared,
    /// Nowhere: no GPUs ([`Inventory::note`] says why).
    None,
}

/// The GPUs an executor advertises.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Inventory {
    pub devices: Vec<GpuDevice>,
    pub source: Source,
    /// Why there are no devices (no driver library, no device, built without the `cuda` feature,
    /// ...), or other things worth a log line; `None` when there is nothing to say.
    pub note: Option<String>,
}

impl Inventory {
    /// No GPUs, and why.
    pub fn none(why: impl Into<String>) -> Inventory {
        Inventory { devices: Vec::new(), source: Source::None, note: Some(why.into()) }
    }

    /// The devices' addresses, in order.
    pub fn addresses(&self) -> Vec<String> {
        self.devices.iter().map(|d| d.address.clone()).collect()
    }
}
