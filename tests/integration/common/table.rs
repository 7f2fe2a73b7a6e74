//! The bookkeeping of an authorization table test (`authz.rs`, `scheduler_authz.rs`): each cell,
//! a call by a kind of caller, allowed or refused as the table says; the cells that differ are
//! reported together at the end, with the cluster's logs.

use std::collections::BTreeMap;
use std::fmt::Debug;

pub struct Table<K> {
    /// (allowed, refused) per caller kind, as expected.
    seen: BTreeMap<K, (u32, u32)>,
    wrong: Vec<String>,
}

impl<K: Ord + Copy + Debug> Table<K> {
    pub fn new() -> Table<K> {
        Table { seen: BTreeMap::new(), wrong: Vec::new() }
    }

    /// Records cell `name` by `kind`, `expected` to be allowed; `refusal` is its permission-denied
    /// message if it was refused, `answer` what it got otherwise. Returns the message of a rightful
    /// refusal, for the test's own checks of its wording.
    pub fn cell(
        &mut self,
        name: &str,
        kind: K,
        expected: bool,
        refusal: Option<String>,
        answer: &dyn Debug,
    ) -> Option<String> {
        let counts = self.seen.entry(kind).or_default();
        match (expected, refusal) {
            (true, None) => counts.0 += 1,
            (false, Some(message)) => {
                counts.1 += 1;
                return Some(message);
            }
            (true, Some(message)) => self.wrong.push(format!("{name} by {kind:?} was refused: {message}")),
            (false, None) => self.wrong.push(format!("{name} by {kind:?} was allowed ({answer:?})")),
        }
        None
    }

    /// Fails naming every cell that differs from the table (and `logs()`); prints the tally.
    pub fn finish(self, what: &str, logs: impl FnOnce() -> String) {
        assert!(
            self.wrong.is_empty(),
            "{} cells differ from the table:\n{}\n{}",
            self.wrong.len(),
            self.wrong.join("\n"),
            logs()
        );
        eprintln!("{what}: (allowed, refused) per caller kind: {:?}", self.seen);
    }
}
