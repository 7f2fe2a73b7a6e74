//! The metadata server's request validation: the fuzz input is a sequence of calls, each a method
//! byte, a length byte and that many bytes decoded as the method's gRPC request type (prost), and
//! handed to the same state methods the gRPC handlers call (paths, sizes, ids, counts all from the
//! fuzzer). Checked by `tern_metadata::fuzzing::Harness`: no panic, every refusal a status with a
//! kind and a message, every accepted change replays on a second state as the log would.
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tern_metadata::fuzzing::Harness;

fuzz_target!(|data: &[u8]| {
    let mut harness = Harness::new();
    let mut rest = data;
    while let [method, len, tail @ ..] = rest {
        let len = usize::from(*len).min(tail.len());
        let (body, tail) = tail.split_at(len);
        if *method == 0xff {
            // Time passes: leases lapse, the server goes silent, the reaper runs.
            harness.advance(Duration::from_millis(u64::from(body.first().copied().unwrap_or(0)) * 1000));
        } else {
            harness.call(*method, body);
        }
        rest = tail;
    }
});
