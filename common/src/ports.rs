//! Tern's default ports, stated once: the daemons' configs, the CLI's defaults, `tern up`'s
//! layout (`tern_local::PortLayout`, whose layout from 9060 is exactly these) and the docs use
//! these. README's tables are held to the daemons' defaults by a test (`src/daemons.rs`).

/// The metadata server's gRPC port; the base of the default layout.
pub const METADATA: u16 = 9060;
/// The metadata server's admin endpoint (`/metrics`, `/health`, `/ready`).
pub const METADATA_ADMIN: u16 = METADATA + 1;
/// The task scheduler's gRPC port.
pub const SCHEDULER: u16 = METADATA + 2;
/// The task scheduler's admin endpoint.
pub const SCHEDULER_ADMIN: u16 = METADATA + 3;
/// A storage server's block-service port (TCP and QUIC).
pub const STORAGE: u16 = METADATA + 10;
/// A storage server's admin endpoint.
pub const STORAGE_ADMIN: u16 = STORAGE + 1;

/// `127.0.0.1:PORT`: where a client looks for a daemon on its own host by default.
pub fn loopback(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

/// The metadata server a client uses when told none (`--metadata`, `TERN_METADATA`).
pub fn default_metadata() -> String {
    loopback(METADATA)
}

/// The scheduler a client uses when told none (`--scheduler`, `TERN_SCHEDULER`).
pub fn default_scheduler() -> String {
    loopback(SCHEDULER)
}
