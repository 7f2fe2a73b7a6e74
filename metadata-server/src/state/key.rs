//! The token key as replicated state: chosen once and carried in a [`LogTokenKey`] record, so
//! every replica (and every restart, and a new leader after a failover) signs and verifies job
//! tokens and grants with the same key. A state that has never logged one signs with a random
//! key until it does (tests; a server logs its key before serving).

use tern_common::Now;
use tern_proto::token::TokenKey;
use tern_proto::v1::log_record::Change;
use tern_proto::v1::LogTokenKey;
use tonic::Status;

use super::State;
use crate::error::{invalid, Context, Refusal};

impl State {
    /// Whether a log record has set the key (after a replay: whether the log carries one).
    pub fn key_logged(&self) -> bool {
        self.key.1
    }

    /// Signs tokens and grants with `key` from now on, unlogged (tests: servers log theirs).
    #[cfg(test)]
    pub fn set_key(&mut self, key: TokenKey) {
        self.key = (key, false);
    }

    /// Makes `key` the key from now on, through the log (once per cluster: the caller checks
    /// [`State::key_logged`] first).
    pub fn log_key(&mut self, key: &TokenKey, now: Now) -> Result<(), Status> {
        let change = Change::TokenKey(LogTokenKey { key: key.as_bytes().to_vec() });
        self.commit(change, now).context("log the token key")?;
        Ok(())
    }

    /// Applies a logged key.
    pub(super) fn apply_key(&mut self, log: &LogTokenKey) -> Result<(), Refusal> {
        let key = TokenKey::from_bytes(&log.key).map_err(|e| invalid(format!("a logged token key: {e}")))?;
        self.key = (key, true);
        Ok(())
    }

    /// The record that sets the key, for a snapshot (none while it was never logged).
    pub(super) fn key_record(&self) -> Option<Change> {
        self.key.1.then(|| Change::TokenKey(LogTokenKey { key: self.key.0.as_bytes().to_vec() }))
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods, reason = "tests may read the clock")]
mod tests {
    use tern_proto::v1::*;

    use super::super::tests::{config, state};
    use super::*;

    /// A token issued by one state verifies on another that replayed the first one's log (or
    /// its snapshot): the key travels in the records, not in a file.
    #[test]
    fn a_logged_key_travels_in_the_log_and_the_snapshot() {
        let (mut state, now) = state();
        assert!(!state.key_logged());
        let key = TokenKey::generate();
        state.log_key(&key, now).unwrap();
        assert!(state.key_logged());
        let job = RegisterJobRequest { name: "j".into(), ..Default::default() };
        let token = state.register_job(job, now).unwrap().token;
        let journal = state.take_journal();
        for records in [journal, state.snapshot(now)] {
            let mut other = State::new(&config(), now);
            assert!(other.check_job_token("j", &token, "renew").is_err(), "a fresh state has its own key");
            other.restore(&records, now).unwrap();
            assert!(other.key_logged());
            other.check_job_token("j", &token, "renew").unwrap();
        }
    }

    #[test]
    fn a_bad_logged_key_is_refused() {
        let (mut state, now) = state();
        let record = LogRecord { unix_ms: 0, change: Some(Change::TokenKey(LogTokenKey { key: vec![1, 2, 3] })) };
        let err = state.replay(&record, now).unwrap_err();
        assert!(err.reason.contains("token key"), "{}", err.reason);
        assert!(!state.key_logged());
    }
}
