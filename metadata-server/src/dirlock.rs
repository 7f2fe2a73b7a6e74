//! The lock that keeps two metadata servers from sharing one state directory: tern-common's
//! [`DirLock`], shared with `tern up` (which locks its whole `--dir` the same way).

pub use tern_common::dirlock::DirLock;
