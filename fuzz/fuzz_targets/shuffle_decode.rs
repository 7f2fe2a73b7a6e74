//! The shuffle payload decoders (`tern_proto::shuffle`): Push payloads, Fetch requests and Fetch
//! reply pages. Whatever the bytes: no panic, counts within their limits, what decodes encodes back
//! to the same bytes, and a page's batches never reach past the page.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tern_proto::shuffle::{batches, FetchRequest, PushHeader, BATCH_HEADER_LEN, MAX_FETCH_MAPS, PUSH_HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    if let Ok((header, batch)) = PushHeader::decode(data) {
        assert!(!batch.is_empty());
        assert_eq!(&header.encode()[..], &data[..PUSH_HEADER_LEN]);
    }
    if let Ok(request) = FetchRequest::decode(data) {
        assert!(request.maps.len() <= MAX_FETCH_MAPS);
        assert_eq!(&request.encode()[..], data, "a decoded Fetch request encodes back to its bytes");
        for (map, attempt) in &request.maps {
            assert_eq!(request.attempt_of(*map), Some(*attempt));
        }
    }
    let mut covered = 0;
    for batch in batches(Bytes::copy_from_slice(data)) {
        match batch {
            Ok((header, bytes)) => {
                assert_eq!(header.len as usize, bytes.len());
                covered += BATCH_HEADER_LEN + bytes.len();
                assert!(covered <= data.len(), "batches reach past the page");
            }
            Err(_) => break,
        }
    }
});
