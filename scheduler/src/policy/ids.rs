//! The ids the policy mints: job keys, executor slots and assignment ids. Each is a newtype with
//! a private field, so one cannot be passed where another is meant, and only the policy makes one
//! (a job key when a job is added, a slot when an executor joins, an assignment id when a task is
//! launched); the server holds slots as opaque handles and maps its executor ids to them. An
//! assignment id crosses the wire, and is taken back from it at one named edge.

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

/// One run of a task on an executor: minted by the policy when it launches the task (never 0, and
/// never reused while the policy lives), sent to the executor as `assignment_id`, named back in the
/// executor's report and in the cancels the server sends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AssignmentId(u64);

impl AssignmentId {
    /// The first id a policy hands out (0 is left unused on the wire).
    pub(super) const FIRST: AssignmentId = AssignmentId(1);

    /// The id minted after this one.
    pub(super) fn next(self) -> AssignmentId {
        AssignmentId(self.0 + 1)
    }

    /// The id an executor names in a report (the wire edge); unknown ids are ignored by the
    /// policy, so any number is safe here.
    pub fn from_wire(id: u64) -> AssignmentId {
        AssignmentId(id)
    }

    /// The id as the wire carries it.
    pub fn to_wire(self) -> u64 {
        self.0
    }
}
