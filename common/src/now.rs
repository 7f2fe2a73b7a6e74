//! The time a change is made at, read once at the edge and passed in: [`Now`].
//!
//! State machines (the metadata server's state, the scheduler's policy) never read the clock
//! themselves: the code that receives a call or runs a timer reads it once ([`Now::read`]) and
//! hands the value down. So replaying a log record, or a test moving time on, gives the same
//! result on any host at any hour; what a record needs of the wall clock travels in the record.

use std::ops::{Add, AddAssign};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// One reading of both clocks: the monotonic one for leases, timeouts and rates, and the wall
/// clock (milliseconds since the Unix epoch) for times shown to users or written to logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Monotonic: what deadlines and durations are measured by (never goes back).
    pub instant: Instant,
    /// Wall clock, milliseconds since the Unix epoch (0 if the clock is before it).
    pub unix_ms: u64,
}

impl Now {
    /// Reads both clocks: the one edge constructor. Call it where a request or a timer comes
    /// in, once, and pass the value on.
    pub fn read() -> Now {
        let unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        Now { instant: Instant::now(), unix_ms }
    }

    /// A given reading (for tests, and for callers that already hold both clocks).
    pub fn at(instant: Instant, unix_ms: u64) -> Now {
        Now { instant, unix_ms }
    }
}

/// Moves both clocks on by the same amount, as time passing does (tests step time this way).
impl Add<Duration> for Now {
    type Output = Now;

    fn add(self, by: Duration) -> Now {
        Now { instant: self.instant + by, unix_ms: self.unix_ms.saturating_add(by.as_millis() as u64) }
    }
}

impl AddAssign<Duration> for Now {
    fn add_assign(&mut self, by: Duration) {
        *self = *self + by;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_clocks_move_together() {
        let start = Now::at(Instant::now(), 1_000);
        let later = start + Duration::from_millis(1_500);
        assert_eq!(later.unix_ms, 2_500);
        assert_eq!(later.instant.duration_since(start.instant), Duration::from_millis(1_500));
        let mut stepped = start;
        stepped += Duration::from_millis(1_500);
        assert_eq!(stepped, later);
    }
}
