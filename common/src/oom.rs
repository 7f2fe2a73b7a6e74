//! The out-of-memory contract between the code a task runs and the executor that runs it.
//!
//! Task code (the TeraSort functions, the GPU reduce, any operator) fails with [`OutOfMemory`],
//! anywhere in its error's chain, when the task needs more memory than it was granted or an
//! allocation is refused; the executor reports such a task as OOM rather than failed, and the
//! scheduler retries it with more memory. Every other error is an ordinary failure.

/// A task needs more memory than it may use (or the system refused an allocation): retry it
/// with more. The message says what needed how much.
#[derive(Debug)]
pub struct OutOfMemory(pub String);

impl OutOfMemory {
    /// Whether `error`, or any error in its chain, is [`OutOfMemory`].
    pub fn is_in(error: &anyhow::Error) -> bool {
        error.chain().any(|cause| cause.is::<OutOfMemory>())
    }
}

impl std::fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "out of memory: {}", self.0)
    }
}

impl std::error::Error for OutOfMemory {}

#[cfg(test)]
mod tests {
    use super::OutOfMemory;

    #[test]
    fn found_anywhere_in_the_chain() {
        let e = anyhow::Error::new(OutOfMemory("partition 3 is too big".into())).context("reduce 3");
        assert!(OutOfMemory::is_in(&e));
        assert!(e.to_string().starts_with("reduce 3"));
        assert!(format!("{e:#}").contains("out of memory: partition 3 is too big"));
        assert!(!OutOfMemory::is_in(&anyhow::anyhow!("disk on fire")));
    }
}
