//! The storage server's request handling: the fuzz input is a script (see
//! `tern_storage::fuzzing::script_to_wire`) of mostly well-formed block frames, corrupted as it
//! says, fed to the real block service over an in-memory connection with a small DRAM tier.
//! Every reply must be a well-formed frame, every error must name its kind and reason, and the
//! server must serve a new connection afterwards. A panic in any server task aborts the run
//! (libFuzzer's panic hook), so it is found even though the service would survive it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tern_storage::fuzzing::{script_to_wire, serve_script};

/// A runtime per input: dropping it drops every task the input started (connection tasks end
/// asynchronously after an abort), so nothing of one input outlives it, and LeakSanitizer's
/// check after each input sees only real leaks.
fn run(wire: &[u8]) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    runtime.block_on(serve_script(wire));
}

fuzz_target!(|data: &[u8]| {
    run(&script_to_wire(data));
    // Raw input as the stream too: what a peer speaking anything at all sends.
    run(data);
});
