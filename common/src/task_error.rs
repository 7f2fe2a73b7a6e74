//! The errors a task's code gives the executor that runs it, which the scheduler acts on; every
//! other error is an ordinary failure.
//!
//! - [`OutOfMemory`], anywhere in the error's chain: the task needs more memory than it was
//!   granted, or an allocation was refused. The executor reports the task OOM rather than failed,
//!   and the scheduler retries it with more memory.
//! - [`InputLost`]: the task found its input lost (every copy was on storage that died) and names
//!   the producing tasks; the scheduler runs those again, then the task (lineage recovery).

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

/// A task's input is lost: the tasks of the stage that wrote it whose output is gone, by task
/// index, and what the task met.
#[derive(Debug)]
pub struct InputLost {
    pub tasks: Vec<u32>,
    pub why: String,
}

impl InputLost {
    /// The first [`InputLost`] in `error`'s chain.
    pub fn find_in(error: &anyhow::Error) -> Option<&InputLost> {
        error.chain().find_map(|cause| cause.downcast_ref::<InputLost>())
    }
}

impl std::fmt::Display for InputLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: the input of tasks {:?} of the stage that wrote it is lost", self.why, self.tasks)
    }
}

impl std::error::Error for InputLost {}

#[cfg(test)]
mod tests {
    use super::{InputLost, OutOfMemory};

    #[test]
    fn found_anywhere_in_the_chain() {
        let e = anyhow::Error::new(OutOfMemory("partition 3 is too big".into())).context("reduce 3");
        assert!(OutOfMemory::is_in(&e));
        assert!(e.to_string().starts_with("reduce 3"));
        assert!(format!("{e:#}").contains("out of memory: partition 3 is too big"));
        assert!(!OutOfMemory::is_in(&anyhow::anyhow!("disk on fire")));
    }

    #[test]
    fn input_lost_names_the_producers() {
        let e = anyhow::Error::new(InputLost { tasks: vec![2, 5], why: "block 9 is lost".into() }).context("map 1");
        assert_eq!(InputLost::find_in(&e).map(|l| l.tasks.clone()), Some(vec![2, 5]));
        assert!(format!("{e:#}").contains("block 9 is lost: the input of tasks [2, 5]"));
        assert!(InputLost::find_in(&anyhow::anyhow!("disk on fire")).is_none());
    }
}
