//! The block-frame decoder (`tern_proto::frame`): header decoding with any payload limit, whole
//! frames read from a byte stream, Free lists and error replies. Whatever the bytes: no panic,
//! every length within its limit, and a header that decodes encodes back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tern_proto::frame::{self, Frame, Header, FREE_ENTRY_LEN, HEADER_LEN, MAX_ERROR_MESSAGE_BYTES, MAX_PAYLOAD_BYTES};

fuzz_target!(|data: &[u8]| {
    let Some((&limit, data)) = data.split_first() else { return };
    // Limits from tiny to the hard ceiling.
    let max_payload = match limit % 4 {
        0 => 0,
        1 => 64,
        2 => 4096,
        _ => MAX_PAYLOAD_BYTES,
    };
    if let Some(raw) = data.get(..HEADER_LEN) {
        let raw: &[u8; HEADER_LEN] = raw.try_into().expect("a header's bytes");
        if let Ok(header) = Header::decode(raw, max_payload) {
            assert!(header.payload_len <= max_payload);
            // Version 2 has no reserved bytes: every field, slot and grant included, round-trips.
            assert_eq!(header.encode(), *raw, "a decoded header encodes back to its bytes");
        }
    }
    // A stream of frames: read until the end or the first error, as a connection would.
    let mut stream = data;
    let mut frames = 0;
    while let Ok(Some(frame)) = futures::executor::block_on(frame::read_frame(&mut stream, max_payload)) {
        assert_eq!(frame.payload.len(), frame.header.payload_len as usize);
        assert!(frame.payload.len() <= max_payload as usize);
        if let Ok(ids) = frame.free_ids() {
            assert_eq!(ids.len() * FREE_ENTRY_LEN, frame.payload.len());
        }
        let request_id = frame.header.request_id;
        let op = frame.header.op;
        if let Err((_, message)) = frame.into_result() {
            assert!(message.len() <= 4 * MAX_PAYLOAD_BYTES as usize);
        }
        frames += 1;
        if frames > 64 {
            break;
        }
        // An error reply of any message stays bounded and valid UTF-8.
        let text = String::from_utf8_lossy(data);
        let error = Frame::error(request_id, op, 0, tern_proto::ErrorKind::Invalid, &text);
        assert!(error.payload.len() <= MAX_ERROR_MESSAGE_BYTES);
        assert!(std::str::from_utf8(&error.payload).is_ok());
    }
    // Skipping any payload length never reads past what is there.
    let _ = futures::executor::block_on(frame::skip_payload(&mut &data[..], u32::from(limit) << 8));
});
