//! The bounded property-based fuzz of the block-frame and shuffle-payload decoders that CI runs
//! (the unbounded one is `fuzz/`, cargo-fuzz). Seeded, so a failure names its case and repeats:
//! valid frames of every op, then mutated (bits flipped, cut short, lengths replaced with oversized
//! ones), and random bytes. Every case must decode to the frame sent or be refused with the right
//! error, never panic, never read past a refused header's length.

#![allow(clippy::unwrap_used, reason = "test support: helpers outside #[test] fns unwrap as the tests do")]

use bytes::{BufMut, Bytes, BytesMut};
use tern_proto::frame::{self, Frame, FrameError, Header, Op, HEADER_LEN, MAX_PAYLOAD_BYTES};
use tern_proto::shuffle::{batches, BatchHeader, FetchRequest, PushHeader, SegmentAddress, MAX_FETCH_MAPS};
use tern_proto::{ErrorKind, MapAttempt, MapIndex, PartitionIndex, ShuffleId, StorageClass};

/// Cases per property: seconds in all, on a slow machine.
const CASES: u64 = 20_000;

use tern_common::SplitMix64 as Rng;

/// This test's draws, over the shared generator.
trait Draw {
    fn bytes(&mut self, len: usize) -> Vec<u8>;
}

impl Draw for Rng {
    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next_u64() as u8).collect()
    }
}

/// A segment of shuffle `block`, its partition and index drawn in that order.
fn segment(rng: &mut Rng, block: u64) -> SegmentAddress {
    let partition = PartitionIndex::from_wire(rng.next_u64() as u32);
    SegmentAddress { shuffle: ShuffleId::from_wire(block), partition, index: rng.next_u64() as u32 }
}

/// `(map, attempt)` pairs drawn as plain numbers, typed as a Fetch lists them.
fn typed(maps: Vec<(u32, u32)>) -> Vec<(MapIndex, MapAttempt)> {
    maps.into_iter().map(|(map, attempt)| (MapIndex::from_wire(map), MapAttempt::from_wire(attempt))).collect()
}

fn valid_frame(rng: &mut Rng) -> Frame {
    let id = rng.next_u64();
    let block = rng.next_u64();
    let len = rng.below(300) as usize;
    let payload = Bytes::from(rng.bytes(len));
    match rng.below(8) {
        0 => Frame::ping(id),
        1 => Frame::write(id, block, rng.next_u64() as u32, payload),
        2 => Frame::read(id, block, rng.next_u64() as u32, rng.next_u64() as u32),
        3 => Frame::free(id, &(0..rng.below(20)).map(|_| rng.next_u64()).collect::<Vec<_>>()),
        4 => {
            let map = MapIndex::from_wire(rng.next_u64() as u32);
            let attempt = MapAttempt::from_wire(rng.next_u64() as u32);
            let mut p = BytesMut::from(&PushHeader { map, attempt, class: StorageClass::Any }.encode()[..]);
            p.put_slice(&payload);
            Frame::push(id, segment(rng, block), p.freeze())
        }
        5 => {
            let mut maps: Vec<(u32, u32)> =
                (0..rng.below(10)).map(|_| (rng.next_u64() as u32, rng.next_u64() as u32)).collect();
            maps.sort_unstable();
            maps.dedup_by_key(|m| m.0);
            let request =
                FetchRequest { cursor: rng.next_u64() as u32, max_bytes: rng.next_u64() as u32, maps: typed(maps) };
            Frame::fetch(id, segment(rng, block), request.encode())
        }
        6 => Frame::reply(&Frame::read(id, block, 0, 5).header, rng.next_u64() as u32, payload),
        _ => Frame::error(id, Op::Write, block, ErrorKind::OutOfSpace, &String::from_utf8_lossy(&payload)),
    }
}

fn wire(frame: &Frame) -> Vec<u8> {
    let mut out = frame.header.encode().to_vec();
    out.extend_from_slice(&frame.payload);
    out
}

fn read(bytes: &[u8], max: u32) -> Result<Option<Frame>, FrameError> {
    block_on(frame::read_frame(&mut &bytes[..], max))
}

/// Polls a future over in-memory bytes, which never waits, to completion.
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(future)
}

#[test]
fn valid_frames_round_trip_and_mutated_ones_are_refused() {
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    for case in 0..CASES {
        let mut rng = Rng(case);
        let frame = valid_frame(&mut rng);
        let bytes = wire(&frame);
        let got = runtime.block_on(frame::read_frame(&mut &bytes[..], MAX_PAYLOAD_BYTES));
        assert_eq!(got.unwrap().as_ref(), Some(&frame), "case {case}: a valid frame did not round trip");

        let mut bad = bytes.clone();
        let result = match rng.below(4) {
            // One bit flipped: in the header the header crc catches it, in the payload its crc.
            0 => {
                let at = rng.below(bad.len() as u64) as usize;
                bad[at] ^= 1 << rng.below(8);
                let err = runtime.block_on(frame::read_frame(&mut &bad[..], MAX_PAYLOAD_BYTES)).unwrap_err();
                let expected = match at {
                    0 | 1 => matches!(err, FrameError::BadMagic(_)),
                    2 => matches!(err, FrameError::UnsupportedVersion(_)),
                    _ if at < HEADER_LEN => matches!(err, FrameError::HeaderChecksum { .. }),
                    _ => matches!(err, FrameError::PayloadChecksum { .. }),
                };
                assert!(expected, "case {case}: bit flipped at byte {at} gave {err}");
                continue;
            }
            // Cut short anywhere: truncated, or a clean end only when nothing was sent.
            1 => {
                let at = rng.below(bad.len() as u64) as usize;
                bad.truncate(at);
                runtime.block_on(frame::read_frame(&mut &bad[..], MAX_PAYLOAD_BYTES))
            }
            // An oversized payload length, header resealed: refused before a payload byte.
            2 => {
                let mut header = frame.header;
                header.payload_len = MAX_PAYLOAD_BYTES + 1 + (rng.next_u64() as u32 % (u32::MAX - MAX_PAYLOAD_BYTES));
                let raw = header.encode();
                let err = Header::decode(&raw, MAX_PAYLOAD_BYTES).unwrap_err();
                assert!(matches!(err, FrameError::PayloadTooLarge { .. }), "case {case}: {err}");
                assert!(err.is_fatal(), "case {case}: an oversized frame leaves the stream unusable");
                continue;
            }
            // A receiver limit below the payload.
            _ => {
                let max = frame.header.payload_len.saturating_sub(1 + rng.below(4) as u32);
                if frame.header.payload_len == 0 {
                    continue;
                }
                runtime.block_on(frame::read_frame(&mut &bad[..], max))
            }
        };
        match result {
            Ok(None) => assert!(bad.is_empty(), "case {case}: a clean end after {} bytes", bad.len()),
            Ok(Some(f)) => panic!("case {case}: a mutated frame decoded: {}", f.header),
            Err(FrameError::Truncated { .. } | FrameError::PayloadTooLarge { .. }) => {}
            Err(e) => panic!("case {case}: unexpected error {e}"),
        }
    }
}

#[test]
fn random_bytes_never_panic_and_errors_carry_a_kind() {
    for case in 0..CASES / 4 {
        let mut rng = Rng(case ^ 0xdead_beef);
        let len = rng.below(200) as usize;
        let mut bytes = rng.bytes(len);
        // Half start like a frame, so decoding gets past the magic.
        if case % 2 == 0 && bytes.len() >= 3 {
            bytes[..3].copy_from_slice(&[b'T', b'B', 1]);
        }
        match read(&bytes, rng.below(u64::from(MAX_PAYLOAD_BYTES)) as u32) {
            Ok(None) => assert!(bytes.is_empty()),
            Ok(Some(frame)) => panic!("case {case}: random bytes decoded as {}", frame.header),
            Err(e) => {
                assert!(!e.to_string().is_empty());
                assert!(matches!(e.kind(), ErrorKind::Invalid | ErrorKind::Corrupt), "case {case}: {e}");
            }
        }
        let _ = Frame { header: Frame::ping(1).header, payload: Bytes::from(bytes.clone()) }.free_ids();
        let _ = PushHeader::decode(&bytes);
        if let Ok(request) = FetchRequest::decode(&bytes) {
            assert_eq!(&request.encode()[..], &bytes[..], "case {case}");
        }
        let mut covered = 0;
        for batch in batches(Bytes::from(bytes.clone())) {
            let Ok((header, data)) = batch else { break };
            assert_eq!(header.len as usize, data.len());
            covered += 16 + data.len();
        }
        assert!(covered <= bytes.len());
    }
}

#[test]
fn shuffle_payloads_mutated_are_refused_with_a_reason() {
    for case in 0..CASES / 4 {
        let mut rng = Rng(case ^ 0x5eed);
        let mut maps: Vec<(u32, u32)> =
            (0..rng.below(16)).map(|_| (rng.next_u64() as u32, rng.next_u64() as u32)).collect();
        maps.sort_unstable();
        maps.dedup_by_key(|m| m.0);
        let request =
            FetchRequest { cursor: rng.next_u64() as u32, max_bytes: rng.next_u64() as u32, maps: typed(maps) };
        let mut bytes = request.encode().to_vec();
        assert_eq!(FetchRequest::decode(&bytes).unwrap(), request, "case {case}");
        match rng.below(3) {
            // Not 8 plus 8 per map.
            0 => {
                bytes.truncate(bytes.len() - 1 - rng.below(7) as usize);
                let err = FetchRequest::decode(&bytes).unwrap_err();
                assert!(err.to_string().contains("8 plus 8 per map"), "case {case}: {err}");
            }
            // Maps out of order.
            1 if request.maps.len() >= 2 => {
                let (a, b) = (8, 8 + 8 * (request.maps.len() - 1));
                let first: Vec<u8> = bytes[a..a + 8].to_vec();
                let last: Vec<u8> = bytes[b..b + 8].to_vec();
                bytes[a..a + 8].copy_from_slice(&last);
                bytes[b..b + 8].copy_from_slice(&first);
                let err = FetchRequest::decode(&bytes).unwrap_err();
                assert!(err.to_string().contains("ascending"), "case {case}: {err}");
                assert!(!err.is_fatal(), "a bad payload leaves the stream at a frame boundary");
            }
            // A page whose last batch claims more bytes than remain.
            _ => {
                let len = 1 + rng.below(64) as usize;
                let data = rng.bytes(len);
                let header = BatchHeader {
                    map: MapIndex::from_wire(1),
                    attempt: MapAttempt::from_wire(0),
                    len: data.len() as u32 + 1,
                    crc: 0,
                };
                let mut page = header.encode().to_vec();
                page.extend_from_slice(&data);
                let results: Vec<_> = batches(Bytes::from(page)).collect();
                assert!(matches!(results.as_slice(), [Err(FrameError::BadShufflePayload(_))]), "case {case}");
            }
        }
    }
    // Too many maps listed is refused by count, before anything is allocated for them.
    let too_many = vec![0u8; 8 + 8 * (MAX_FETCH_MAPS + 1)];
    let err = FetchRequest::decode(&too_many).unwrap_err();
    assert!(err.to_string().contains("at most"), "{err}");
}
