//! What the control plane's authorization adds per call, in isolation: a credential's check
//! (HMAC-SHA256) and a job token's (hex decode, protobuf decode, HMAC-SHA256), as
//! `metadata-server/src/authz.rs` does them. Best of 7 runs of 200,000 each (BENCHMARKS.md,
//! "Authorization's cost per call"): `cargo run --release -p tern-proto --example authz_cost`.
use std::time::Instant;
use tern_proto::identity::{ClusterSecret, Identity, Role};
use tern_proto::token::{JobToken, TokenKey};

fn best(mut f: impl FnMut() -> bool) -> f64 {
    let n = 200_000;
    (0..7)
        .map(|_| {
            let t = Instant::now();
            let mut ok = 0;
            for _ in 0..n {
                ok += f() as u32;
            }
            assert_eq!(ok, n as u32);
            t.elapsed().as_secs_f64() * 1e9 / n as f64
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    let secret = ClusterSecret::generate();
    let credential = secret.credential(&Identity::new(Role::Server, "", "10.0.0.1:9070"));
    let key = TokenKey::generate();
    let token = key.issue("spark-application-1234567890", 0x1234_5678_9abc, 1_800_000_000_000, 60_000).to_text();
    let c = best(|| secret.verify(std::hint::black_box(&credential)).is_ok());
    let t = best(|| JobToken::from_text(std::hint::black_box(&token)).is_ok_and(|tok| key.verify(&tok).is_ok()));
    println!("credential check: {c:.0} ns; job token check: {t:.0} ns (token text {} bytes)", token.len());
}
