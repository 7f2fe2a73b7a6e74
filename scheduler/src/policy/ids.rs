//! The ids the policy mints for its own bookkeeping: job keys and executor slots. Each is a
//! newtype with a private field, so a job key cannot be passed where a slot is meant, and only the
//! policy makes one (a job key when a job is added, a slot when an executor joins); the server
//! holds slots as opaque handles and maps its executor ids to them.

/// A job as the policy keys it: minted in submission order by [`Policy::add_job`], so ordering
/// keys orders jobs by submission (the tie-break within a priority, and the order of listings).
/// Never reused while the policy lives. Callers name jobs by their id string; the policy maps it.
///
/// [`Policy::add_job`]: super::Policy::add_job
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct JobKey(u64);

impl JobKey {
    /// The first key a policy hands out.
    pub(super) const FIRST: JobKey = JobKey(0);

    /// The key minted after this one.
    pub(super) fn next(self) -> JobKey {
        JobKey(self.0 + 1)
    }
}

/// An executor's place in the policy's registry, returned by [`Policy::add_executor`] and named in
/// every later call about that executor. A slot is reused by the next executor to join after its
/// executor leaves, so the server drops its mapping when it removes the executor.
///
/// [`Policy::add_executor`]: super::Policy::add_executor
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExecutorSlot(usize);

impl ExecutorSlot {
    /// The slot at `index` of the policy's executor table (the registry minting a new slot or
    /// walking its table).
    pub(super) fn at_index(index: usize) -> ExecutorSlot {
        ExecutorSlot(index)
    }

    /// Its index in the policy's executor table.
    pub(super) fn index(self) -> usize {
        self.0
    }
}
