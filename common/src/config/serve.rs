//! Where a daemon serves and who may reach it: the block of keys every daemon's config flattens
//! in (`listen`, `admin_listen`, `tls_dir`, `trusted_network`), the trusted-network rule, and
//! where the cluster secret is found.

use std::net::SocketAddr;
use std::path::PathBuf;

/// The cluster secret's file name, in a TLS directory or a `tern up` directory.
pub const CLUSTER_SECRET_FILE: &str = "cluster.secret";

use serde::{Deserialize, Serialize};

/// The keys every daemon has, flattened into its config (`#[serde(flatten)]`), so a TOML file
/// writes them at the top level. Each daemon's `Config::default()` gives their defaults; what
/// `listen` serves and what the TLS material secures are in that daemon's docs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Serve {
    /// Address of the daemon's service (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Address of the admin endpoint (`/metrics`, `/health`; plain HTTP; port 0 picks a free port).
    pub admin_listen: SocketAddr,
    /// Directory of TLS material (`tern cert init`).
    pub tls_dir: Option<PathBuf>,
    /// The network is private: plain (unencrypted) listeners are allowed beyond loopback.
    pub trusted_network: bool,
}

impl Serve {
    /// Both endpoints on 127.0.0.1, no TLS, no trusted network: the defaults' shape.
    pub fn on_loopback(listen_port: u16, admin_port: u16) -> Serve {
        Serve {
            listen: SocketAddr::from(([127, 0, 0, 1], listen_port)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], admin_port)),
            tls_dir: None,
            trusted_network: false,
        }
    }

    /// Where the daemon's cluster secret is (the daemons that read one have a
    /// `cluster_secret_file` key): that file when set, else `cluster.secret` in `tls_dir`.
    pub fn cluster_secret_path(&self, cluster_secret_file: Option<&std::path::Path>) -> Option<PathBuf> {
        cluster_secret_file
            .map(std::path::Path::to_path_buf)
            .or_else(|| self.tls_dir.as_ref().map(|dir| dir.join(CLUSTER_SECRET_FILE)))
    }

    /// The trusted-network rule for both endpoints. `service` names what `listen` serves;
    /// `tls_encrypts_it` says whether `tls_dir`, when set, encrypts it (it never does the admin
    /// endpoint, which is plain HTTP whatever the TLS material).
    pub fn check(&self, service: &str, tls_encrypts_it: bool) -> anyhow::Result<()> {
        check_listen(service, self.listen, tls_encrypts_it && self.tls_dir.is_some(), self.trusted_network)?;
        check_listen("the admin endpoint (plain HTTP)", self.admin_listen, false, self.trusted_network)
    }
}

/// The trusted-network rule, checked by every daemon before it binds: plain TCP (block service or
/// gRPC) is fine on loopback; beyond it the daemon needs TLS material, or an explicit
/// `--trusted-network` saying the network itself is private.
pub fn check_listen(what: &str, addr: SocketAddr, has_tls: bool, trusted_network: bool) -> anyhow::Result<()> {
    if addr.ip().is_loopback() || has_tls || trusted_network {
        return Ok(());
    }
    anyhow::bail!(
        "refusing to serve {what} on {addr} without TLS: beyond loopback Tern needs TLS material. \
         Create it with `tern cert init --dir DIR` (copy DIR to every node), then start with \
         `--tls-dir DIR`; or pass `--trusted-network` if this network is private and plain TCP is acceptable"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_tcp_only_on_loopback_unless_trusted_or_tls() {
        let loopback: SocketAddr = "127.0.0.1:9070".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:9070".parse().unwrap();
        assert!(check_listen("the block service", loopback, false, false).is_ok());
        assert!(check_listen("the block service", "[::1]:1".parse().unwrap(), false, false).is_ok());
        let err = check_listen("the block service", any, false, false).unwrap_err().to_string();
        assert!(
            err.contains("tern cert init --dir DIR") && err.contains("--tls-dir") && err.contains("--trusted-network")
        );
        assert!(check_listen("the block service", any, true, false).is_ok());
        assert!(check_listen("the block service", any, false, true).is_ok());
    }

    #[test]
    fn the_admin_endpoint_is_never_covered_by_tls() {
        let wide = Serve { admin_listen: "0.0.0.0:9061".parse().unwrap(), ..Serve::on_loopback(9060, 0) };
        let tls = Serve { tls_dir: Some("/etc/tern/tls".into()), ..wide.clone() };
        assert!(tls.check("gRPC", true).unwrap_err().to_string().contains("admin endpoint"));
        assert!(Serve { trusted_network: true, ..tls }.check("gRPC", true).is_ok());
        let grpc =
            Serve { listen: "0.0.0.0:9060".parse().unwrap(), tls_dir: Some("/tls".into()), ..Serve::on_loopback(0, 0) };
        assert!(grpc.check("gRPC", true).is_ok());
        assert!(grpc.check("the block service over plain TCP", false).is_err());
    }
}
