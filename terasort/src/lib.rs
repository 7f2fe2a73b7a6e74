//! TeraSort, Tern's main job: the records and their checks, the per-task functions on a Tern
//! cluster, and the in-process driver.
//!
//! The records, pure and in memory (no I/O, no cluster; all that the GPU sort needs):
//! * [`gensort`] generates the Sort Benchmark's 100-byte records (10-byte key + 90-byte payload)
//!   exactly as Chris Nyberg's `gensort` does, so that any part of the input can be generated
//!   independently from its first record number (`gensort -bN`).
//! * [`validate`] checks sorted output the way `valsort` does: record count, the 128-bit sum of the
//!   zlib CRC-32 of every record (order-independent, so input and output must match), duplicate and
//!   unordered keys; parts validate in parallel and join in order.
//! * [`partition`] maps a key to a reduce partition by a uniform split of its first 8 bytes
//!   (gensort keys are uniformly random, so no sampling is needed).
//! * [`sort`] sorts a buffer of records by the `memcmp` order of their keys, on all cores.
//!
//! ## Which gensort
//! The record layout the TeraSort notes describe (bytes 10-11 `00 11`, the record number as 32 hex
//! digits, `88 99 AA BB`, hex filler, `CC DD EE FF`) is the binary record of gensort **1.2** (April
//! 2009), which Hadoop's TeraGen reproduces. From gensort 1.3 on, including 1.5, the binary record
//! is pseudo-random in every byte instead (nine more LCG outputs xor'ed with per-part constants).
//! Keys are identical in every version: the top 10 bytes of the generator's output for the record.
//! [`gensort::generate`] writes the 1.2 / TeraGen layout; [`gensort::generate_format`] with
//! [`gensort::Format::Gensort15`] writes gensort 1.5's binary records (their valsort checksum
//! matches published gensort 1.5 output), and with [`gensort::Format::Ascii`] `gensort -a` records.
//! The checksum and sortedness checks do not depend on the layout.
//!
//! On a cluster (cargo feature `cluster`, on by default):
//! * [`tasks`]: generate, map, read a reduce partition, sort, write and publish a part, one
//!   definition for the commands, the driver and the executor's operators;
//! * [`stages`]: teragen, map and reduce as tasks of a scheduler job's stages (the executor's
//!   TeraSort operators), the GPU reduce included, with the GPU handed in as a [`stages::DeviceSorter`];
//! * [`external`]: a reduce partition larger than its memory, sorted in runs on scratch disk and
//!   merged into its output part;
//! * [`driver`]: `tern terasort` in one process, with its own retries;
//! * [`in_memory`]: the same records sorted in memory by the same sort, the limit the shuffle is
//!   measured against (bounded: it samples above 1 GiB).

pub mod gensort;
pub mod partition;
pub mod sort;
pub mod validate;

#[cfg(feature = "cluster")]
pub mod driver;
#[cfg(feature = "cluster")]
pub mod external;
#[cfg(feature = "cluster")]
pub mod in_memory;
#[cfg(feature = "cluster")]
pub mod stages;
#[cfg(feature = "cluster")]
pub mod tasks;

pub use gensort::{
    generate, generate_format, generate_parallel, generate_parallel_format, record_key, Format, KEY_LEN, RECORD_LEN,
};
pub use partition::RangePartitioner;
pub use sort::{sort_records, try_sort_records};
pub use validate::{checksum, checksum_exact, validate_parallel, Summary, Validator};
