//! The token key's file: `<dir>/token.key`, 32 random bytes made on first start, mode 0600, so
//! tokens and grants outlive restarts of the metadata server; and the cluster secret, with which
//! the server checks its callers' credentials (`tern_proto::identity`).

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use anyhow::{bail, Context};
use tern_proto::identity::ClusterSecret;
use tern_proto::token::{TokenKey, KEY_LEN};

pub const KEY_FILE: &str = "token.key";

/// Loads the key in `dir`, making it first if there is none.
pub fn load_or_create(dir: &Path) -> anyhow::Result<TokenKey> {
    let path = dir.join(KEY_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => {
            let mode = std::fs::metadata(&path)?.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                bail!(
                    "{} is readable by others (mode {mode:o}); it signs every job token: chmod 600 it",
                    path.display()
                );
            }
            TokenKey::from_bytes(&bytes).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = TokenKey::generate();
            let temp = dir.join(format!("{KEY_FILE}.tmp"));
            let _ = std::fs::remove_file(&temp);
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&temp)
                .with_context(|| format!("creating {}", temp.display()))?;
            file.write_all(key.as_bytes())?;
            file.sync_all()?;
            std::fs::rename(&temp, &path).with_context(|| format!("renaming {} into place", temp.display()))?;
            std::fs::File::open(dir)?.sync_all()?;
            debug_assert_eq!(key.as_bytes().len(), KEY_LEN);
            Ok(key)
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// The cluster secret: the configured file (`cluster_secret_file`, or `cluster.secret` in the TLS
/// directory), which must exist; without either, `<dir>/cluster.secret`, made on first start.
pub fn cluster_secret(config: &crate::Config) -> anyhow::Result<ClusterSecret> {
    let dir = &config.dir;
    let path = match config.serve.cluster_secret_path(config.cluster_secret_file.as_deref()) {
        Some(path) => path,
        None => {
            let path = dir.join(tern_common::config::CLUSTER_SECRET_FILE);
            match ClusterSecret::generate().write_new(&path) {
                Ok(()) => tracing::info!(
                    "made the cluster secret {}: storage servers need it (cluster_secret_file)",
                    path.display()
                ),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e).with_context(|| format!("creating {}", path.display())),
            }
            path
        }
    };
    ClusterSecret::load(&path).map_err(|e| {
        anyhow::anyhow!("{e} (make one with `tern cert init --dir DIR`, or point cluster_secret_file at it)")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_once_private_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create(dir.path()).unwrap();
        let mode = std::fs::metadata(dir.path().join(KEY_FILE)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let again = load_or_create(dir.path()).unwrap();
        assert_eq!(first.as_bytes(), again.as_bytes());
        std::fs::set_permissions(dir.path().join(KEY_FILE), std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = load_or_create(dir.path()).unwrap_err().to_string();
        assert!(err.contains("chmod 600"), "{err}");
    }
}
