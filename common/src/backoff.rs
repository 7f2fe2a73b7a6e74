//! The one retry backoff: delays that grow by a factor from a first delay up to a cap, with
//! jitter, bounded by a number of attempts or a deadline. Every retry loop in Tern takes its
//! delays from here, so none can retry without a bound or in lock-step with its peers.
//!
//! ```
//! # use std::time::Duration;
//! # use tern_common::backoff::Backoff;
//! let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2)).attempts(8);
//! # let mut tries = 0;
//! loop {
//!     # tries += 1;
//!     # let result: Result<(), ()> = if tries < 3 { Err(()) } else { Ok(()) };
//!     match result {
//!         Ok(()) => break,
//!         Err(()) => match backoff.next() {
//!             Some(delay) => std::thread::sleep(delay),
//!             None => panic!("gave up after {} attempts", backoff.failures()),
//!         },
//!     }
//! }
//! ```

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use tokio::time::Instant;

use crate::rng::SplitMix64;

/// How much of each delay is drawn at random, so that clients that failed together do not all
/// retry together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// Exactly the delay (for tests that check the sequence).
    None,
    /// Uniform in `[0, delay]`: spreads retries most, but may retry at once.
    Full,
    /// Uniform in `[delay / 2, delay]`: keeps at least half the wait, so a bounded number of
    /// attempts still covers at least half the planned time.
    Equal,
}

/// Retry delays: the first is `initial`, each next one `factor` times the last, never above
/// `max`, each jittered; [`Backoff::next`] gives `None` once the attempts or the deadline are
/// spent. Without [`Backoff::attempts`] or [`Backoff::deadline`] it never ends.
#[derive(Debug, Clone)]
pub struct Backoff {
    /// The first delay, where [`Backoff::reset`] starts over.
    initial: Duration,
    /// The next delay before jitter.
    ceiling: Duration,
    max: Duration,
    factor: u32,
    jitter: Jitter,
    /// Attempts in all (the first try included), if bounded.
    attempts: Option<u32>,
    /// No delay ends past this instant (tokio's clock, so paused-clock tests pass it at once).
    deadline: Option<Instant>,
    /// Delays handed out so far: the failed attempts.
    failures: u32,
    rng: SplitMix64,
}

impl Backoff {
    /// Delays from `initial`, doubling up to `max`, with equal jitter, unbounded.
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        assert!(initial <= max, "backoff starts at {initial:?}, above its cap {max:?}");
        // A seed that differs per process and per backoff, so peers do not draw the same jitter.
        let seed = std::collections::hash_map::RandomState::new().build_hasher().finish();
        Backoff {
            initial,
            ceiling: initial,
            max,
            factor: 2,
            jitter: Jitter::Equal,
            attempts: None,
            deadline: None,
            failures: 0,
            rng: SplitMix64(seed),
        }
    }

    /// Grows each delay by `factor` (at least 1) instead of 2.
    pub fn factor(mut self, factor: u32) -> Backoff {
        self.factor = factor.max(1);
        self
    }

    pub fn jitter(mut self, jitter: Jitter) -> Backoff {
        self.jitter = jitter;
        self
    }

    /// At most `attempts` tries in all, the first included: `attempts - 1` delays.
    pub fn attempts(mut self, attempts: u32) -> Backoff {
        self.attempts = Some(attempts);
        self
    }

    /// No retry after `deadline`; the last delay is cut to end at it.
    pub fn deadline(mut self, deadline: Instant) -> Backoff {
        self.deadline = Some(deadline);
        self
    }

    /// How many delays were handed out: the attempts that failed so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Starts over from the first delay after a success, keeping the bounds and the generator
    /// (no new seed on a caller's hot path).
    pub fn reset(&mut self) {
        self.ceiling = self.initial;
        self.failures = 0;
    }

    fn jittered(&mut self, delay: Duration) -> Duration {
        let nanos = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        let drawn = match self.jitter {
            Jitter::None => nanos,
            Jitter::Full => self.rng.below(nanos.saturating_add(1)),
            Jitter::Equal => nanos / 2 + self.rng.below(nanos - nanos / 2 + 1),
        };
        Duration::from_nanos(drawn)
    }
}

impl Iterator for Backoff {
    type Item = Duration;

    /// The wait before the next attempt, or `None` when no attempt is left before the bound.
    fn next(&mut self) -> Option<Duration> {
        if self.attempts.is_some_and(|attempts| self.failures + 1 >= attempts) {
            return None;
        }
        let left = match self.deadline {
            Some(deadline) => Some(deadline.checked_duration_since(Instant::now()).filter(|left| !left.is_zero())?),
            None => None,
        };
        let ceiling = self.ceiling;
        self.ceiling = ceiling.saturating_mul(self.factor).min(self.max);
        self.failures += 1;
        let delay = self.jittered(ceiling);
        Some(left.map_or(delay, |left| delay.min(left)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(2);

    #[test]
    fn backoff_doubles_to_a_cap() {
        let mut backoff = Backoff::new(FIRST, MAX).jitter(Jitter::None);
        let delays: Vec<_> = (0..8).map(|_| backoff.next().unwrap()).collect();
        assert_eq!(delays[0], FIRST);
        assert_eq!(delays[1], FIRST * 2);
        assert_eq!(*delays.last().unwrap(), MAX);
        assert!(delays.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn reset_starts_over_from_the_first_delay() {
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(80)).jitter(Jitter::None);
        assert_eq!(backoff.by_ref().take(3).collect::<Vec<_>>(), [10, 20, 40].map(Duration::from_millis));
        backoff.reset();
        assert_eq!((backoff.failures(), backoff.next()), (0, Some(Duration::from_millis(10))));
    }

    #[test]
    fn factor_sets_the_growth() {
        let delays: Vec<_> = Backoff::new(FIRST, MAX).jitter(Jitter::None).factor(3).take(4).collect();
        assert_eq!(delays, [FIRST, FIRST * 3, FIRST * 9, MAX]);
    }

    #[test]
    fn jitter_stays_within_its_share_of_the_delay() {
        let planned: Vec<_> = Backoff::new(FIRST, MAX).jitter(Jitter::None).take(64).collect();
        for (jitter, floor) in [(Jitter::Full, 0), (Jitter::Equal, 2)] {
            let drawn: Vec<_> = Backoff::new(FIRST, MAX).jitter(jitter).take(64).collect();
            for (delay, plan) in drawn.iter().zip(&planned) {
                let least = if floor == 0 { Duration::ZERO } else { *plan / floor };
                assert!((least..=*plan).contains(delay), "{jitter:?}: {delay:?} outside [{least:?}, {plan:?}]");
            }
            assert_ne!(drawn, planned, "{jitter:?} drew no jitter at all");
        }
    }

    #[test]
    fn attempts_bound_the_delays() {
        let mut backoff = Backoff::new(FIRST, MAX).attempts(3);
        assert!(backoff.next().is_some() && backoff.next().is_some());
        assert_eq!(backoff.failures(), 2);
        assert_eq!(backoff.next(), None, "the third attempt was the last");
        assert_eq!(Backoff::new(FIRST, MAX).attempts(1).next(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_cuts_the_last_delay_and_ends_the_retries() {
        let mut backoff = Backoff::new(MAX, MAX).jitter(Jitter::None).deadline(Instant::now() + FIRST * 3);
        let delay = backoff.next().unwrap();
        assert_eq!(delay, FIRST * 3, "cut to the time left");
        tokio::time::sleep(delay).await;
        assert_eq!(backoff.next(), None);
    }
}
