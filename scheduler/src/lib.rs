//! Tern's serverless task scheduler and elastic executor pool.
//!
//! Jobs are DAGs of stages; stages pass data only through Tern shuffles and files, so executors
//! hold no state a later stage needs and may join or leave at any moment.
