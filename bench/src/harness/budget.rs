//! When a cell's workers warm up, measure and stop, and what each records while it measures.

use std::time::{Duration, Instant};

use super::Histogram;

/// When a cell's workers start measuring and stop, and how many ops each may do at most.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget {
    warmup: Duration,
    measure: Duration,
    pub(super) measure_from: Instant,
    stop_at: Instant,
    /// Measured ops one worker may do at most.
    ops_per_worker: u64,
    /// Warm-up ops one worker may do at most; a worker that reaches it waits for the window.
    warmup_ops_per_worker: u64,
}

impl Budget {
    /// A budget of `warmup` then `measure`, and `ops_per_worker` measured ops per worker at most
    /// (an eighth of that, at least one, for the warm-up). Its clock starts at [`Budget::start`].
    pub(crate) fn new(warmup: Duration, measure: Duration, ops_per_worker: u64) -> Budget {
        Budget {
            warmup,
            measure,
            measure_from: Instant::now(),
            stop_at: Instant::now(),
            ops_per_worker,
            warmup_ops_per_worker: (ops_per_worker / 8).max(1),
        }
    }

    /// Ops one worker may do in all, warm-up included (what a Tern writer needs room for).
    pub(crate) fn ops_in_all(&self) -> u64 {
        self.ops_per_worker + self.warmup_ops_per_worker
    }

    /// Starts the clock: warm-up from now, then the measured window. Called once per-cell setup
    /// (connecting, allocating) is done, so setup is never timed.
    pub(crate) fn start(self) -> Budget {
        let measure_from = Instant::now() + self.warmup;
        Budget { measure_from, stop_at: measure_from + self.measure, ..self }
    }
}

/// What a worker does next.
enum Next {
    Go,
    /// Its warm-up ops are spent: wait this long for the measured window.
    Wait(Duration),
    Stop,
}

/// One worker's latencies and the end of its last measured op.
pub(crate) struct Recorder {
    pub(super) budget: Budget,
    warmed: u64,
    done: u64,
    pub(super) histogram: Histogram,
    pub(super) last_end: Option<Instant>,
}

impl Recorder {
    pub(crate) fn new(budget: Budget) -> Recorder {
        Recorder { budget, warmed: 0, done: 0, histogram: Histogram::default(), last_end: None }
    }

    fn next(&self) -> Next {
        let now = Instant::now();
        if now < self.budget.measure_from {
            if self.warmed < self.budget.warmup_ops_per_worker {
                return Next::Go;
            }
            return Next::Wait(self.budget.measure_from - now);
        }
        // At least one measured op each, so a cell whose warm-up ran past its window (ops slower
        // than the window, on a loaded machine) still measures something.
        if self.done < self.budget.ops_per_worker && (now < self.budget.stop_at || self.done == 0) {
            Next::Go
        } else {
            Next::Stop
        }
    }

    /// Records an op that started at `started` (ops started during warm-up are not measured).
    pub(crate) fn record(&mut self, started: Instant) {
        if started < self.budget.measure_from {
            self.warmed += 1;
        } else {
            self.done += 1;
            let end = Instant::now();
            self.histogram.record((end - started).as_nanos() as u64);
            self.last_end = Some(end);
        }
    }
}

/// Whether a worker's next op may start, waiting out the rest of the warm-up if its warm-up ops
/// are spent.
pub(crate) async fn go(recorder: &Recorder) -> bool {
    loop {
        match recorder.next() {
            Next::Go => return true,
            Next::Stop => return false,
            Next::Wait(wait) => tokio::time::sleep(wait).await,
        }
    }
}

/// [`go`] for a worker on its own thread.
pub(crate) fn go_blocking(recorder: &Recorder) -> bool {
    loop {
        match recorder.next() {
            Next::Go => return true,
            Next::Stop => return false,
            Next::Wait(wait) => std::thread::sleep(wait),
        }
    }
}
