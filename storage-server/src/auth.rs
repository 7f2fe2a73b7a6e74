//! Checking job tokens and grants on data frames (see `tern_proto::token`).
//!
//! The store holds the mode: `Open` (a store served without a metadata server, in tests and
//! tools: nothing is checked), `Pending` (a daemon before its first registration: it has no key
//! yet, so every data frame is refused as Unavailable), `Key` (the metadata server's key, given
//! in the registration reply). Each connection keeps its own slots: the token an `Auth` frame
//! bound, verified once; each frame then costs a map lookup, an expiry check and one HMAC.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;
use tern_proto::frame::{Header, Op, MAX_SLOT};
use tern_proto::token::{Grant, GrantKind, JobToken, TokenKey, VOLUME_SERIAL};
use tern_proto::ErrorKind;

/// Clock difference tolerated between the metadata server, which sets expiries, and this server.
pub const CLOCK_SKEW_MS: u64 = 2_000;

#[derive(Debug, Clone)]
enum Mode {
    Open,
    Pending,
    /// Shared: every frame's check takes it.
    Key(Arc<TokenKey>),
}

/// The store's token checking (see the module docs).
#[derive(Debug)]
pub struct Authority {
    mode: RwLock<Mode>,
}

impl Default for Authority {
    fn default() -> Authority {
        Authority { mode: RwLock::new(Mode::Open) }
    }
}

impl Authority {
    /// From now on data frames need a key; until [`Authority::set_key`] they are refused.
    pub fn require_tokens(&self) {
        *self.mode.write() = Mode::Pending;
    }

    pub fn set_key(&self, key: TokenKey) {
        *self.mode.write() = Mode::Key(Arc::new(key));
    }

    fn key(&self) -> Result<Option<Arc<TokenKey>>, Denied> {
        match &*self.mode.read() {
            Mode::Open => Ok(None),
            Mode::Pending => Err(Denied::new(
                ErrorKind::Unavailable,
                "this storage server has not registered with the metadata server yet, so it cannot check job tokens; \
                 retry shortly",
            )),
            Mode::Key(key) => Ok(Some(key.clone())),
        }
    }
}

/// A refusal: the kind and message of the error reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denied {
    pub kind: ErrorKind,
    pub message: String,
}

impl Denied {
    fn new(kind: ErrorKind, message: impl Into<String>) -> Denied {
        Denied { kind, message: message.into() }
    }
}

/// A connection's slots: slot number to the token bound there.
#[derive(Debug, Default)]
pub struct Slots {
    bound: HashMap<u16, JobToken>,
}

/// Who a frame acts as, once its slot is resolved.
pub struct Principal<'a> {
    key: Option<Arc<TokenKey>>,
    serial: u64,
    job: &'a str,
}

impl Slots {
    /// Handles an `Auth` frame: verifies `token` and binds it to slot `h.offset`.
    pub fn bind(&mut self, authority: &Authority, h: &Header, token: &[u8], now_unix_ms: u64) -> Result<(), Denied> {
        let slot = u16::try_from(h.offset).ok().filter(|s| (1..=MAX_SLOT).contains(s)).ok_or_else(|| {
            Denied::new(ErrorKind::Invalid, format!("Auth to slot {}: slots are 1 to {MAX_SLOT}", h.offset))
        })?;
        let token = JobToken::decode(token).map_err(|e| Denied::new(e.kind(), format!("Auth to slot {slot}: {e}")))?;
        if let Some(key) = authority.key()? {
            key.verify(&token).map_err(|e| Denied::new(e.kind(), format!("Auth to slot {slot}: {e}")))?;
            token
                .check_expiry(now_unix_ms, CLOCK_SKEW_MS)
                .map_err(|e| Denied::new(e.kind(), format!("Auth to slot {slot}: {e}")))?;
        }
        self.bound.insert(slot, token);
        Ok(())
    }

    /// Who `h` acts as: its slot's job (checked for expiry), or the volume principal on slot 0.
    /// `Ok(None)` when the store checks nothing.
    pub fn principal(
        &self,
        authority: &Authority,
        h: &Header,
        now_unix_ms: u64,
    ) -> Result<Option<Principal<'_>>, Denied> {
        let Some(key) = authority.key()? else {
            return Ok(None);
        };
        if h.slot == 0 {
            return Ok(Some(Principal { key: Some(key), serial: VOLUME_SERIAL, job: "" }));
        }
        let Some(token) = self.bound.get(&h.slot) else {
            let message = format!("{h}: slot {} holds no job token on this connection (send Auth first)", h.slot);
            return Err(Denied::new(ErrorKind::PermissionDenied, message));
        };
        token.check_expiry(now_unix_ms, CLOCK_SKEW_MS).map_err(|e| Denied::new(e.kind(), format!("{h}: {e}")))?;
        Ok(Some(Principal { key: Some(key), serial: token.serial, job: &token.job }))
    }
}

impl Principal<'_> {
    /// Ok when `grant` proves `id` (of `kind`) belongs to this principal.
    pub fn check(&self, op: Op, kind: GrantKind, id: u64, grant: &Grant) -> Result<(), Denied> {
        let Some(key) = &self.key else {
            return Ok(());
        };
        if key.check_grant(kind, id, self.serial, grant) {
            return Ok(());
        }
        let what = match kind {
            GrantKind::Block => "block",
            GrantKind::Shuffle => "shuffle",
        };
        let who = if self.serial == VOLUME_SERIAL {
            "the volume principal (no job token)".to_string()
        } else {
            format!("job {}", self.job)
        };
        Err(Denied::new(
            ErrorKind::PermissionDenied,
            format!(
                "{op:?} of {what} {id} refused: it does not belong to {who} (it is another job's, or the grant is \
                 wrong); act with the owning job's token"
            ),
        ))
    }
}

/// What a request's header grant covers: `Some((kind, id))` for ops on one block or shuffle.
pub fn covered(h: &Header) -> Option<(GrantKind, u64)> {
    match h.op {
        Op::Read | Op::Write | Op::WriteStaged | Op::Lease => Some((GrantKind::Block, h.block_id)),
        Op::Push | Op::Fetch => Some((GrantKind::Shuffle, h.segment_address().shuffle.get())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use tern_proto::frame::Frame;

    #[test]
    fn slots_bind_verified_tokens_and_frames_need_grants() {
        let authority = Authority::default();
        authority.require_tokens();
        let key = TokenKey::generate();
        let mut slots = Slots::default();
        let token = key.issue("a", 5, 10_000, 1_000);
        let auth = Frame::auth(1, 3, Bytes::from(token.encode()));
        // No key yet: refused as Unavailable.
        assert_eq!(slots.bind(&authority, &auth.header, &auth.payload, 0).unwrap_err().kind, ErrorKind::Unavailable);
        authority.set_key(key.clone());
        slots.bind(&authority, &auth.header, &auth.payload, 5_000).unwrap();

        let grant = key.grant(GrantKind::Block, 9, 5);
        let read = Frame::read(2, 9, 0, 1).authorized(3, grant);
        let who = slots.principal(&authority, &read.header, 5_000).unwrap().unwrap();
        who.check(Op::Read, GrantKind::Block, 9, &grant).unwrap();
        assert_eq!(who.check(Op::Read, GrantKind::Block, 10, &grant).unwrap_err().kind, ErrorKind::PermissionDenied);
        // Expired tokens stop working on the next frame.
        let late = slots.principal(&authority, &read.header, 20_000).err().unwrap();
        assert_eq!(late.kind, ErrorKind::PermissionDenied);
        // An unbound slot and slot 0 (the volume principal) do not act as the job.
        let unbound = Frame::read(3, 9, 0, 1).authorized(4, grant);
        assert!(slots.principal(&authority, &unbound.header, 5_000).is_err());
        let volume = Frame::read(4, 9, 0, 1);
        let who = slots.principal(&authority, &volume.header, 5_000).unwrap().unwrap();
        assert!(who.check(Op::Read, GrantKind::Block, 9, &grant).is_err());
        // Forged tokens and bad slots are refused at Auth.
        let forged = TokenKey::generate().issue("a", 5, 10_000, 1_000);
        let auth = Frame::auth(5, 4, Bytes::from(forged.encode()));
        assert_eq!(
            slots.bind(&authority, &auth.header, &auth.payload, 5_000).unwrap_err().kind,
            ErrorKind::PermissionDenied
        );
        let auth = Frame::auth(6, 0, Bytes::from(token.encode()));
        assert_eq!(slots.bind(&authority, &auth.header, &auth.payload, 5_000).unwrap_err().kind, ErrorKind::Invalid);
    }
}
