//! The bounded fuzz of the proofs that CI runs (the unbounded one is `fuzz/`'s `credentials`
//! target): credentials (`tern_proto::identity`), job tokens and grants (`tern_proto::token`),
//! genuine ones mutated (bits flipped, cut short, fields swapped or widened) and random bytes.
//! Seeded, so a failure names its case. Nothing may verify but what the key made; nothing may panic.

#![allow(clippy::unwrap_used, reason = "test support: helpers outside #[test] fns unwrap as the tests do")]

use tern_common::SplitMix64 as Rng;
use tern_proto::identity::{ClusterSecret, Identity, Role};
use tern_proto::token::{GrantKind, JobToken, TokenKey};

/// Cases per property: well under a second each.
const CASES: u64 = 20_000;

fn mutate(rng: &mut Rng, mut bytes: Vec<u8>) -> Vec<u8> {
    match rng.next_u64() % 4 {
        0 if !bytes.is_empty() => {
            let at = (rng.next_u64() as usize) % bytes.len();
            bytes[at] ^= 1 << (rng.next_u64() % 8);
        }
        1 => bytes.truncate((rng.next_u64() as usize) % (bytes.len() + 1)),
        2 => bytes.extend((0..rng.next_u64() % 8).map(|_| rng.next_u64() as u8)),
        _ => bytes = (0..rng.next_u64() % 200).map(|_| rng.next_u64() as u8).collect(),
    }
    bytes
}

#[test]
fn only_genuine_credentials_verify() {
    let secret = ClusterSecret::generate();
    let identities = [
        Identity::new(Role::Client, "etl", ""),
        Identity::new(Role::Admin, "", ""),
        Identity::new(Role::Server, "", "10.0.0.1:9070"),
    ];
    let mut rng = Rng(33);
    for case in 0..CASES {
        let genuine = secret.credential(&identities[(case % 3) as usize]);
        let mutated = mutate(&mut rng, genuine.into_bytes());
        let Ok(text) = String::from_utf8(mutated) else { continue };
        if let Ok(identity) = secret.verify(&text) {
            assert_eq!(secret.credential(&identity), text, "case {case}: {text:?} verified as {identity:?}");
        }
    }
    // Widening a credential's role or tenant, or moving it to another subject, breaks its mac.
    let client = secret.credential(&identities[0]);
    for forged in [
        client.replace(" client ", " admin "),
        client.replace(" etl ", " other "),
        client.replace(" - ", " 10.0.0.9:1 "),
    ] {
        assert!(secret.verify(&forged).is_err(), "{forged}");
    }
}

#[test]
fn only_genuine_tokens_and_grants_verify() {
    let key = TokenKey::generate();
    let mut rng = Rng(34);
    for case in 0..CASES {
        let genuine = key.issue("job-a", case, u64::MAX / 2, 30_000);
        let bytes = mutate(&mut rng, genuine.encode());
        if let Ok(token) = JobToken::decode(&bytes) {
            if key.verify(&token).is_ok() {
                assert!(token == genuine, "case {case}: a changed token verified");
            }
        }
        let text = mutate(&mut rng, genuine.to_text().into_bytes());
        if let Ok(token) = JobToken::from_text(&String::from_utf8_lossy(&text)) {
            assert!(key.verify(&token).is_err() || token == genuine, "case {case}: a changed token's text verified");
        }
        let kind = if case % 2 == 0 { GrantKind::Block } else { GrantKind::Shuffle };
        let grant = key.grant(kind, case, 7);
        let changed: [u8; 16] = mutate(&mut rng, grant.to_vec()).try_into().unwrap_or([0; 16]);
        assert_eq!(key.check_grant(kind, case, 7, &changed), changed == grant, "case {case}");
        assert!(!key.check_grant(kind, case, 8, &grant), "case {case}: a grant holds for another serial");
    }
}
