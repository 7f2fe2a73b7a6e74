//! Job tokens and grants: the data plane's capabilities.
//!
//! The metadata server holds one secret [`TokenKey`] (random, kept in its directory) and gives it
//! to storage servers when they register. With it, it signs:
//! - a **job token** ([`JobToken`], the `JobToken` message of `tern.proto`): job name, the job's
//!   registration serial, expiry (the lease's end) and lease, under an HMAC-SHA256. Clients get it
//!   from RegisterJob, RenewJob and RefreshToken; a data connection binds it to a slot with an
//!   `Auth` frame, and every frame acting for the job names that slot;
//! - a **grant** ([`grant`]): the first 16 bytes of an HMAC-SHA256 over (kind, id, serial), saying
//!   that a block or shuffle belongs to the job with that serial. The metadata server hands grants
//!   out with block locations and shuffles; frames carry them in their header.
//!
//! A storage server admits a frame when its grant matches the id and the serial of the token bound
//! to its slot (slot 0: serial 0, the volume principal that owns files outside `/jobs`). A client
//! of job A holding B's block ids (and even B's grants) cannot act on them: it holds no token with
//! B's serial. Checks are stateless, so they hold across restarts of either server.

use std::fmt;

use aws_lc_rs::{constant_time, hmac, rand};
use prost::Message;

use crate::v1::JobToken as WireToken;

/// Bytes of the secret key.
pub const KEY_LEN: usize = 32;
/// Bytes of a grant: a truncated HMAC-SHA256 (128 bits).
pub const GRANT_LEN: usize = 16;
/// Largest encoded token accepted (job names are at most 128 bytes).
pub const MAX_TOKEN_BYTES: usize = 512;
/// The principal owning files outside `/jobs` (long-lived volumes): every client acts as it on
/// slot 0, without a token.
pub const VOLUME_SERIAL: u64 = 0;

/// A grant: proof that an id belongs to a principal.
pub type Grant = [u8; GRANT_LEN];

/// What a grant covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum GrantKind {
    Block = 1,
    Shuffle = 2,
}

/// The metadata server's secret.
#[derive(Clone)]
pub struct TokenKey {
    bytes: [u8; KEY_LEN],
    hmac: hmac::Key,
}

impl fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TokenKey(..)")
    }
}

impl TokenKey {
    /// A new random key.
    pub fn generate() -> TokenKey {
        let mut bytes = [0u8; KEY_LEN];
        rand::fill(&mut bytes).expect("the system random source works");
        TokenKey::from_array(bytes)
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<TokenKey, TokenError> {
        let array: [u8; KEY_LEN] = bytes
            .try_into()
            .map_err(|_| TokenError::Malformed(format!("a key is {KEY_LEN} bytes, not {}", bytes.len())))?;
        Ok(TokenKey::from_array(array))
    }

    fn from_array(bytes: [u8; KEY_LEN]) -> TokenKey {
        TokenKey { hmac: hmac::Key::new(hmac::HMAC_SHA256, &bytes), bytes }
    }

    pub fn as_bytes(&self) -> &[u8; KEY_LEN] {
        &self.bytes
    }

    /// A signed token for `job` (registration `serial`), valid until `expires_unix_ms`.
    pub fn issue(&self, job: &str, serial: u64, expires_unix_ms: u64, lease_ms: u64) -> JobToken {
        let mut token = JobToken { job: job.to_string(), serial, expires_unix_ms, lease_ms, mac: [0; 32] };
        token.mac = self.sign(&token);
        token
    }

    fn sign(&self, token: &JobToken) -> [u8; 32] {
        let tag = hmac::sign(&self.hmac, &mac_input(token));
        tag.as_ref().try_into().expect("HMAC-SHA256 is 32 bytes")
    }

    /// Checks the token's signature (not its expiry: see [`JobToken::check_expiry`]).
    pub fn verify(&self, token: &JobToken) -> Result<(), TokenError> {
        constant_time::verify_slices_are_equal(&self.sign(token), &token.mac)
            .map_err(|_| TokenError::Forged(token.job.clone()))
    }

    /// The grant saying `id` (of `kind`) belongs to the principal with `serial`.
    pub fn grant(&self, kind: GrantKind, id: u64, serial: u64) -> Grant {
        let mut input = [0u8; 1 + 8 + 8 + 6];
        input[..6].copy_from_slice(b"grant1");
        input[6] = kind as u8;
        input[7..15].copy_from_slice(&id.to_le_bytes());
        input[15..23].copy_from_slice(&serial.to_le_bytes());
        let tag = hmac::sign(&self.hmac, &input);
        tag.as_ref()[..GRANT_LEN].try_into().expect("16 of 32 bytes")
    }

    /// True when `grant` is the grant of `id` for `serial` (compared in constant time).
    pub fn check_grant(&self, kind: GrantKind, id: u64, serial: u64, grant: &Grant) -> bool {
        constant_time::verify_slices_are_equal(&self.grant(kind, id, serial), grant).is_ok()
    }
}

/// A random u64 from the system's source (for serials).
pub fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    rand::fill(&mut bytes).expect("the system random source works");
    u64::from_le_bytes(bytes)
}

/// What the MAC covers: a domain tag, then every field, the name last (its length is implied).
pub fn mac_input(token: &JobToken) -> Vec<u8> {
    let mut input = Vec::with_capacity(6 + 24 + token.job.len());
    input.extend_from_slice(b"token1");
    input.extend_from_slice(&token.serial.to_le_bytes());
    input.extend_from_slice(&token.expires_unix_ms.to_le_bytes());
    input.extend_from_slice(&token.lease_ms.to_le_bytes());
    input.extend_from_slice(token.job.as_bytes());
    input
}

/// A job token, decoded (the wire form is the `JobToken` message).
#[derive(Clone, PartialEq, Eq)]
pub struct JobToken {
    pub job: String,
    pub serial: u64,
    pub expires_unix_ms: u64,
    pub lease_ms: u64,
    pub mac: [u8; 32],
}

impl fmt::Debug for JobToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The MAC is the secret part: never logged.
        write!(f, "JobToken(job {}, serial {}, expires {})", self.job, self.serial, self.expires_unix_ms)
    }
}

impl JobToken {
    /// The binary form: the `JobToken` message (what an `Auth` frame carries).
    pub fn encode(&self) -> Vec<u8> {
        WireToken {
            job: self.job.clone(),
            serial: self.serial,
            expires_unix_ms: self.expires_unix_ms,
            lease_ms: self.lease_ms,
            mac: self.mac.to_vec(),
        }
        .encode_to_vec()
    }

    pub fn decode(bytes: &[u8]) -> Result<JobToken, TokenError> {
        if bytes.len() > MAX_TOKEN_BYTES {
            return Err(TokenError::Malformed(format!("{} bytes, more than {MAX_TOKEN_BYTES}", bytes.len())));
        }
        let wire = WireToken::decode(bytes).map_err(|e| TokenError::Malformed(e.to_string()))?;
        let mac =
            wire.mac.as_slice().try_into().map_err(|_| TokenError::Malformed("its MAC is not 32 bytes".into()))?;
        Ok(JobToken {
            job: wire.job,
            serial: wire.serial,
            expires_unix_ms: wire.expires_unix_ms,
            lease_ms: wire.lease_ms,
            mac,
        })
    }

    /// The text form (lowercase hex of [`JobToken::encode`]): for gRPC fields, environment
    /// variables (`TERN_JOB_TOKEN`), Spark handles and the command line.
    pub fn to_text(&self) -> String {
        self.encode().iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_text(text: &str) -> Result<JobToken, TokenError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(TokenError::Malformed("it is empty".into()));
        }
        if !text.len().is_multiple_of(2) || text.len() > 2 * MAX_TOKEN_BYTES {
            return Err(TokenError::Malformed(format!("{} hex digits", text.len())));
        }
        // `get`, not indexing: a multi-byte character is not hex, and must not panic the server.
        let bytes: Option<Vec<u8>> =
            (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect();
        JobToken::decode(&bytes.ok_or_else(|| TokenError::Malformed("not hex".into()))?)
    }

    /// Ok while the token has not expired at `now_unix_ms` (give or take `skew_ms` of clock
    /// difference between the metadata server and the checker).
    pub fn check_expiry(&self, now_unix_ms: u64, skew_ms: u64) -> Result<(), TokenError> {
        if now_unix_ms > self.expires_unix_ms.saturating_add(skew_ms) {
            return Err(TokenError::Expired { job: self.job.clone(), ago_ms: now_unix_ms - self.expires_unix_ms });
        }
        Ok(())
    }
}

/// Why a token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("malformed job token: {0}")]
    Malformed(String),
    #[error("the token of job {0} is not signed by this cluster's metadata server (forged or from another cluster)")]
    Forged(String),
    #[error("the token of job {job} expired {ago_ms} ms ago (its lease lapsed, or it was not refreshed)")]
    Expired { job: String, ago_ms: u64 },
}

impl TokenError {
    pub fn kind(&self) -> crate::ErrorKind {
        match self {
            TokenError::Malformed(_) => crate::ErrorKind::Invalid,
            TokenError::Forged(_) | TokenError::Expired { .. } => crate::ErrorKind::PermissionDenied,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_verify() {
        let key = TokenKey::generate();
        let token = key.issue("etl-7", 42, 1_000_000, 30_000);
        let text = token.to_text();
        let back = JobToken::from_text(&text).unwrap();
        assert_eq!(back, token);
        key.verify(&back).unwrap();
        assert_eq!(JobToken::decode(&token.encode()).unwrap(), token);
    }

    #[test]
    fn altered_or_foreign_tokens_are_refused() {
        let key = TokenKey::generate();
        let token = key.issue("a", 1, 1_000, 10);
        for forged in [
            JobToken { job: "b".into(), ..token.clone() },
            JobToken { serial: 2, ..token.clone() },
            JobToken { expires_unix_ms: u64::MAX, ..token.clone() },
            JobToken { lease_ms: 11, ..token.clone() },
        ] {
            assert_eq!(key.verify(&forged), Err(TokenError::Forged(forged.job.clone())));
        }
        let other = TokenKey::generate();
        assert!(matches!(other.verify(&token), Err(TokenError::Forged(_))));
        let mut flipped = token.clone();
        flipped.mac[31] ^= 1;
        assert!(key.verify(&flipped).is_err());
        // A key persisted and loaded again verifies what the first signed.
        let loaded = TokenKey::from_bytes(key.as_bytes()).unwrap();
        loaded.verify(&token).unwrap();
    }

    #[test]
    fn expiry_allows_the_skew_only() {
        let token = TokenKey::generate().issue("a", 1, 10_000, 10);
        token.check_expiry(9_000, 0).unwrap();
        token.check_expiry(10_500, 1_000).unwrap();
        let err = token.check_expiry(12_000, 1_000).unwrap_err();
        assert_eq!(err, TokenError::Expired { job: "a".into(), ago_ms: 2_000 });
        assert_eq!(err.kind(), crate::ErrorKind::PermissionDenied);
    }

    #[test]
    fn grants_bind_kind_id_and_serial() {
        let key = TokenKey::generate();
        let grant = key.grant(GrantKind::Block, 7, 3);
        assert!(key.check_grant(GrantKind::Block, 7, 3, &grant));
        assert!(!key.check_grant(GrantKind::Block, 7, 4, &grant));
        assert!(!key.check_grant(GrantKind::Block, 8, 3, &grant));
        assert!(!key.check_grant(GrantKind::Shuffle, 7, 3, &grant));
        assert!(!TokenKey::generate().check_grant(GrantKind::Block, 7, 3, &grant));
    }

    #[test]
    fn malformed_text_is_refused_with_a_reason() {
        for bad in ["", "abc", "zz", &"00".repeat(MAX_TOKEN_BYTES + 1)] {
            let err = JobToken::from_text(bad).unwrap_err();
            assert!(matches!(err, TokenError::Malformed(_)), "{bad:?}: {err}");
        }
    }
}
