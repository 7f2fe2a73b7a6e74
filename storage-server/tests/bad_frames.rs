//! The bounded property-based fuzz of the block service that CI runs (the unbounded one is
//! `fuzz/`, cargo-fuzz): seeded random scripts of mutated valid frames, random bytes, oversized
//! lengths and out-of-order requests (writes at wrong offsets, reads past the end, fetches before
//! any push, frees of unknown ids), turned into byte streams by `tern_storage::fuzzing`, sent to
//! the real connection handler in memory and to a real block service over loopback TCP. Every
//! case gets whole reply frames (errors with a kind and a message) or a clean close, and the
//! server serves a good request afterwards.

#![allow(clippy::unwrap_used, reason = "test support: helpers outside #[test] fns unwrap as the tests do")]

use std::time::Duration;

use bytes::Bytes;
use tern_proto::frame::{self, Frame, MAX_PAYLOAD_BYTES};
use tern_proto::shuffle::FetchRequest;
use tern_proto::ErrorKind;
use tern_storage::fuzzing::{script_to_wire, serve_script};
use tern_storage::Limits;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

mod common;

use common::{call, call_ok, pushed_by, segment, serve, wanted};

use tern_common::SplitMix64 as Rng;

/// This test's draws, over the shared generator.
trait Script {
    fn script(&mut self, max: u64) -> Vec<u8>;
}

impl Script for Rng {
    fn script(&mut self, max: u64) -> Vec<u8> {
        let len = self.next_u64() % max;
        (0..len).map(|_| self.next_u64() as u8).collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_scripts_in_memory_get_replies_and_the_server_goes_on() {
    let (mut replies, mut errors) = (0, 0);
    for case in 0..1500u64 {
        let script = Rng(case).script(400);
        // Half as frames built from the script, half the script's raw bytes.
        let wire = if case % 4 == 3 { script } else { script_to_wire(&script) };
        let exchange = tokio::spawn(async move { serve_script(&wire).await });
        let exchange = exchange.await.unwrap_or_else(|e| panic!("case {case}: {e}"));
        replies += exchange.replies;
        errors += exchange.errors;
    }
    // The scripts reached the handler: many replies, errors among them, and not only errors.
    assert!(replies > 3000 && errors > 500 && errors < replies, "{replies} replies, {errors} errors");
}

/// Reads reply frames until the server closes the connection; each must be a whole reply.
async fn drain(stream: &mut TcpStream, case: u64) -> usize {
    let mut count = 0;
    loop {
        let next = tokio::time::timeout(Duration::from_secs(10), frame::read_frame(stream, MAX_PAYLOAD_BYTES)).await;
        match next.unwrap_or_else(|_| panic!("case {case}: no reply or close within 10 s")) {
            Ok(Some(reply)) => {
                assert!(reply.header.response, "case {case}: {}", reply.header);
                if let Err((_, message)) = reply.into_result() {
                    assert!(!message.is_empty(), "case {case}: an error reply without a message");
                }
                count += 1;
            }
            Ok(None) => return count,
            // The server reset the connection after its error reply: also a close.
            Err(frame::FrameError::Io(_)) => return count,
            Err(e) => panic!("case {case}: the server sent something other than reply frames: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_scripts_over_tcp_leave_the_server_serving() {
    let server = serve(8, Limits { max_connections: 8, max_in_flight_per_connection: 8 }).await;
    let mut good = TcpStream::connect(server.addr).await.unwrap();
    for case in 0..200u64 {
        let script = Rng(case ^ 0x7c9).script(600);
        let wire = if case % 5 == 4 { script } else { script_to_wire(&script) };
        let stream = TcpStream::connect(server.addr).await.unwrap();
        let (rd, mut wr) = stream.into_split();
        let sender = tokio::spawn(async move {
            let _ = wr.write_all(&wire).await;
            let _ = wr.shutdown().await;
            wr
        });
        let mut rd = rd.reunite(sender.await.unwrap()).unwrap();
        drain(&mut rd, case).await;
        // The long-lived connection and a fresh one are both served.
        call_ok(&mut good, &Frame::ping(case)).await;
        let mut fresh = TcpStream::connect(server.addr).await.unwrap();
        call_ok(&mut fresh, &Frame::ping(case)).await;
    }
}

#[tokio::test]
async fn out_of_order_requests_are_refused_and_the_connection_goes_on() {
    let server = serve(4, Limits::default()).await;
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    let fetch = FetchRequest { cursor: 0, max_bytes: 1 << 20, maps: wanted(&[(0, 0)]) }.encode();
    let push = {
        let mut p = pushed_by(0, 0).encode().to_vec();
        p.extend_from_slice(b"batch");
        Bytes::from(p)
    };
    // (request, the error kind it must get, or None when it must succeed)
    let cases: Vec<(Frame, Option<ErrorKind>)> = vec![
        (Frame::read(1, 5, 0, 1), Some(ErrorKind::NotFound)),
        (Frame::write(2, 5, 7, Bytes::from_static(b"gap")), Some(ErrorKind::Invalid)),
        (Frame::fetch(3, segment((42, 0, 0)), fetch.clone()), Some(ErrorKind::NotFound)),
        (Frame::free(4, &[1, 2, 3, u64::MAX]), None),
        (Frame::write(5, 5, 0, Bytes::from_static(b"0123")), None),
        (Frame::read(6, 5, 2, 10), Some(ErrorKind::Invalid)),
        (Frame::write(7, 5, 2, Bytes::from_static(b"again")), Some(ErrorKind::Invalid)),
        (Frame::push(8, segment((42, 0, 0)), push), None),
        (Frame::fetch(9, segment((42, 0, 1)), fetch), Some(ErrorKind::NotFound)),
        (Frame::ping(10), None),
    ];
    for (request, expected) in cases {
        let got = call(&mut s, &request).await;
        match (expected, got) {
            (None, Ok(_)) => {}
            (Some(kind), Err((got, message))) => {
                assert_eq!(got, kind, "{}: {message}", request.header);
                assert!(!message.is_empty());
            }
            (expected, got) => panic!("{}: expected {expected:?}, got {got:?}", request.header),
        }
    }
    // Free of ids it never held counts none freed.
    assert_eq!(call_ok(&mut s, &Frame::free(11, &[77, 78])).await.header.length, 0);
}
