//! Whether the block service is also served over RDMA, decided once at start-up (see
//! `Config::rdma`), with one clear log line when it is not.

use std::net::SocketAddr;

use anyhow::bail;
use tern_transport::rdma_provider::Lendable;
use tern_transport::Listener;

use crate::config::RdmaMode;

/// The RDMA listener on the block service's bound `addr` (its connections lending views of
/// `lendable`, the DRAM arena, for one-sided READs), or `None` (logged why) when `mode` and
/// this host do not call for one. `Err` only for `RdmaMode::On` that cannot be honoured.
pub(crate) fn listener(
    mode: RdmaMode,
    trusted_network: bool,
    addr: SocketAddr,
    lendable: Option<Lendable>,
) -> anyhow::Result<Option<Box<dyn Listener>>> {
    if mode == RdmaMode::Off {
        return Ok(None);
    }
    let devices = match tern_transport::rdma_devices() {
        Ok(devices) => devices,
        Err(why) if mode == RdmaMode::On => bail!("rdma = on, but {why}"),
        Err(why) => {
            tracing::info!("block service: {why}; serving TCP only");
            return Ok(None);
        }
    };
    // RDMA carries plain frames: only where plain TCP frames are allowed too.
    if !addr.ip().is_loopback() && !trusted_network {
        let why = format!(
            "RDMA device {devices:?} present, but RDMA frames are not encrypted and {addr} is not on a trusted network (set trusted_network)"
        );
        if mode == RdmaMode::On {
            bail!("rdma = on, but {why}");
        }
        tracing::info!("block service: {why}; serving TCP only");
        return Ok(None);
    }
    match tern_transport::bind_rdma(addr, lendable) {
        Ok(listener) => {
            tracing::info!("block service: RDMA on {addr} (devices {devices:?})");
            Ok(Some(listener))
        }
        Err(e) if mode == RdmaMode::On => bail!("rdma = on, but serving RDMA on {addr} failed: {e}"),
        Err(e) => {
            tracing::warn!("block service: RDMA device {devices:?} present, but serving RDMA on {addr} failed ({e}); serving TCP only");
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_never_probes_and_on_without_a_device_fails() {
        let addr: SocketAddr = "127.0.0.1:9070".parse().unwrap();
        assert!(listener(RdmaMode::Off, false, addr, None).unwrap().is_none());
        // Where this test runs there is no RDMA device (or no RDMA build): `on` must refuse to
        // start, naming why, and `auto` must go on without RDMA.
        if tern_transport::rdma_devices().is_err() {
            let err = listener(RdmaMode::On, false, addr, None).err().expect("rdma = on without a device must fail");
            assert!(err.to_string().contains("rdma = on, but"), "{err}");
            assert!(listener(RdmaMode::Auto, false, addr, None).unwrap().is_none());
        }
    }
}
