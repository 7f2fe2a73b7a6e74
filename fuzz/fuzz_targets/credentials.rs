//! The control plane's and data plane's proofs (`tern_proto::identity`, `tern_proto::token`):
//! bytes as a credential, as a job token (binary and text) and as a grant. Whatever the bytes: no
//! panic; nothing verifies under a key it was not made with, except the genuine credential,
//! token and grant the input's first bytes choose (so the fuzzer explores near-misses of them).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tern_proto::identity::{ClusterSecret, Identity, Role};
use tern_proto::token::{GrantKind, JobToken, TokenKey};

fuzz_target!(|data: &[u8]| {
    let (secret, key) = fixed_keys();
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(identity) = secret.verify(text) {
            // Only the genuine credentials verify: the fuzzer cannot forge a mac.
            assert_eq!(secret.credential(&identity), text, "a credential verified that this secret did not make");
        }
        if let Ok(token) = JobToken::from_text(text) {
            assert!(key.verify(&token).is_err() || key.issue(&token.job, token.serial, token.expires_unix_ms, token.lease_ms) == token);
        }
    }
    if let Ok(token) = JobToken::decode(data) {
        assert!(key.verify(&token).is_err() || key.issue(&token.job, token.serial, token.expires_unix_ms, token.lease_ms) == token);
    }
    if data.len() >= 32 {
        let id = u64::from_le_bytes(data[..8].try_into().unwrap());
        let serial = u64::from_le_bytes(data[8..16].try_into().unwrap());
        let grant: [u8; 16] = data[16..32].try_into().unwrap();
        for kind in [GrantKind::Block, GrantKind::Shuffle] {
            assert_eq!(key.check_grant(kind, id, serial, &grant), key.grant(kind, id, serial) == grant);
        }
    }
    // A genuine credential with one byte changed never verifies as anything else.
    let genuine = secret.credential(&Identity::new(Role::Client, "t", ""));
    if let Some(&flip) = data.first() {
        let mut bytes = genuine.clone().into_bytes();
        let at = usize::from(flip) % bytes.len();
        bytes[at] ^= data.get(1).copied().unwrap_or(1).max(1);
        if let Ok(text) = String::from_utf8(bytes) {
            if let Ok(identity) = secret.verify(&text) {
                assert_eq!(secret.credential(&identity), text);
            }
        }
    }
});

/// A fixed secret and key, made once (random: the fuzzer must not know them).
fn fixed_keys() -> &'static (ClusterSecret, TokenKey) {
    static KEYS: std::sync::OnceLock<(ClusterSecret, TokenKey)> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| (ClusterSecret::generate(), TokenKey::generate()))
}
