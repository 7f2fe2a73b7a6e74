//! Who a control-plane caller is: its [`Role`], its tenant, and the credential that proves them.
//!
//! Every daemon of a cluster reads one **cluster secret** (32 random bytes in a file only the
//! daemons' user reads; `tern up` and `tern cert init` make it). A caller proves its identity with a
//! **credential**: the text `tern1 <role> <tenant> <subject> <mac>`, where the mac is an
//! HMAC-SHA256 under the secret over the other fields, sent in the [`CREDENTIAL_HEADER`] of every
//! call. Daemons make their own credentials from the secret ([`ClusterSecret::credential`]); an
//! operator or a tenant is handed one (`DIR/credentials/admin`, `DIR/credentials/<tenant>`) and
//! never sees the secret, so a credential cannot be widened or moved to another subject.
//!
//! A caller with no credential is a client of the default tenant ([`Identity::anonymous`]): on a
//! trusted network every process may call the control plane, but only the secret's holders are
//! storage servers and only holders of an admin credential are operators.
//!
//! The subject names what the identity is bound to: a storage server's block-service address
//! (`host:port`), so that one server's credential cannot register, heartbeat or report for another
//! address; empty for the other roles.
//!
//! A job's own calls (its files under `/jobs/<job>`, its shuffles) are authorized by the job's
//! token, not by the role: the caller sends it in [`JOB_TOKEN_HEADER`] (one value per job).

use std::fmt;
use std::path::Path;

use aws_lc_rs::{constant_time, hmac, rand};

/// gRPC metadata key carrying the caller's credential.
pub const CREDENTIAL_HEADER: &str = "x-tern-credential";
/// gRPC metadata key carrying a job token (text form); repeated for several jobs.
pub const JOB_TOKEN_HEADER: &str = "x-tern-job-token";
/// Most job tokens one call carries (and the metadata server reads).
pub const MAX_TOKENS_PER_CALL: usize = 16;
/// Bytes of the cluster secret.
pub const SECRET_LEN: usize = 32;
/// The tenant of callers (and jobs) that name none.
pub const DEFAULT_TENANT: &str = "default";
/// Longest tenant name, in bytes.
pub const MAX_TENANT_NAME_BYTES: usize = 64;
/// Longest credential accepted (tenants are at most 64 bytes, subjects at most 256).
pub const MAX_CREDENTIAL_BYTES: usize = 512;
/// Longest credential subject (a `host:port`).
pub const MAX_SUBJECT_BYTES: usize = 256;
/// The credential format's first word.
const VERSION: &str = "tern1";
/// Bytes of a credential's mac (HMAC-SHA256).
const MAC_LEN: usize = 32;

/// What a caller may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// A storage server: registers, heartbeats, reports its inventory, receives the token key.
    Server,
    /// A metadata server.
    Metadata,
    /// The task scheduler.
    Scheduler,
    /// An executor of the scheduler's pool.
    Executor,
    /// An application of one tenant.
    Client,
    /// An operator: cordon, drain, end any job, act on any job's files.
    Admin,
}

impl Role {
    pub const ALL: [Role; 6] =
        [Role::Server, Role::Metadata, Role::Scheduler, Role::Executor, Role::Client, Role::Admin];

    pub fn name(self) -> &'static str {
        match self {
            Role::Server => "server",
            Role::Metadata => "metadata",
            Role::Scheduler => "scheduler",
            Role::Executor => "executor",
            Role::Client => "client",
            Role::Admin => "admin",
        }
    }

    pub fn parse(name: &str) -> Result<Role, IdentityError> {
        Role::ALL.into_iter().find(|role| role.name() == name).ok_or_else(|| {
            let names: Vec<&str> = Role::ALL.iter().map(|role| role.name()).collect();
            IdentityError(format!("unknown role {name:?}: one of {}", names.join(", ")))
        })
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A caller as the control plane sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub role: Role,
    /// The tenant a client acts for (the default tenant for the other roles).
    pub tenant: String,
    /// What the identity is bound to (a storage server's address); empty otherwise.
    pub subject: String,
}

impl Identity {
    /// A caller without a credential: a client of the default tenant.
    pub fn anonymous() -> Identity {
        Identity { role: Role::Client, tenant: DEFAULT_TENANT.to_string(), subject: String::new() }
    }

    pub fn new(role: Role, tenant: &str, subject: &str) -> Identity {
        let tenant = if tenant.is_empty() { DEFAULT_TENANT } else { tenant };
        Identity { role, tenant: tenant.to_string(), subject: subject.to_string() }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.role, self.subject.is_empty()) {
            (Role::Client, _) => write!(f, "client of tenant {}", self.tenant),
            (role, true) => write!(f, "{role}"),
            (role, false) => write!(f, "{role} {}", self.subject),
        }
    }
}

/// A credential that does not parse or verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct IdentityError(pub String);

/// The cluster secret: daemons make credentials with it and verify every caller's.
#[derive(Clone)]
pub struct ClusterSecret {
    bytes: [u8; SECRET_LEN],
    hmac: hmac::Key,
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

impl ClusterSecret {
    pub fn generate() -> ClusterSecret {
        let mut bytes = [0u8; SECRET_LEN];
        rand::fill(&mut bytes).expect("the system random source works");
        ClusterSecret::from_array(bytes)
    }

    fn from_array(bytes: [u8; SECRET_LEN]) -> ClusterSecret {
        ClusterSecret { hmac: hmac::Key::new(hmac::HMAC_SHA256, &bytes), bytes }
    }

    /// Reads a secret file (its bytes as hex, one line), refusing one that others may read.
    pub fn load(path: &Path) -> Result<ClusterSecret, IdentityError> {
        let text = read_private(path, "the cluster secret")?;
        let bytes = unhex(text.trim()).filter(|bytes| bytes.len() == SECRET_LEN).ok_or_else(|| {
            IdentityError(format!("{}: not a cluster secret ({SECRET_LEN} bytes as hex)", path.display()))
        })?;
        Ok(ClusterSecret::from_array(bytes.try_into().expect("length checked")))
    }

    /// Writes the secret to `path` (mode 0600, created new: an existing file is never replaced).
    pub fn write_new(&self, path: &Path) -> std::io::Result<()> {
        write_private(path, &hex(&self.bytes))
    }

    /// A credential for `identity`.
    pub fn credential(&self, identity: &Identity) -> String {
        let fields = fields(identity);
        let mac = hmac::sign(&self.hmac, fields.as_bytes());
        format!("{fields} {}", hex(mac.as_ref()))
    }

    /// The identity a credential proves; an error saying why when it does not.
    pub fn verify(&self, credential: &str) -> Result<Identity, IdentityError> {
        let bad = |why: &str| IdentityError(format!("the credential is not valid: {why}"));
        if credential.len() > MAX_CREDENTIAL_BYTES {
            return Err(bad(&format!("it is longer than {MAX_CREDENTIAL_BYTES} bytes")));
        }
        let words: Vec<&str> = credential.split(' ').collect();
        let [version, role, tenant, subject, mac] = words[..] else {
            return Err(bad("it is not five words (`tern1 ROLE TENANT SUBJECT MAC`)"));
        };
        if version != VERSION {
            return Err(bad(&format!("it is not a {VERSION} credential")));
        }
        let role = Role::parse(role).map_err(|e| bad(&e.0))?;
        let identity = Identity::new(role, unblank(tenant), unblank(subject));
        validate(&identity).map_err(|e| bad(&e.0))?;
        let mac = unhex(mac).filter(|mac| mac.len() == MAC_LEN).ok_or_else(|| bad("its mac is not 64 hex digits"))?;
        let expected = hmac::sign(&self.hmac, fields(&identity).as_bytes());
        constant_time::verify_slices_are_equal(expected.as_ref(), &mac)
            .map_err(|_| bad("it is not signed with this cluster's secret (forged, or from another cluster)"))?;
        Ok(identity)
    }
}

impl ClusterSecret {
    /// The identity a call's [`CREDENTIAL_HEADER`] proves: none is a client of the default
    /// tenant ([`Identity::anonymous`]); one that does not verify is an error saying why.
    pub fn caller(&self, headers: &tonic::metadata::MetadataMap) -> Result<Identity, IdentityError> {
        match headers.get(CREDENTIAL_HEADER) {
            None => Ok(Identity::anonymous()),
            Some(value) => self.verify(value.to_str().map_err(|_| IdentityError("the credential is not text".into()))?),
        }
    }
}

/// What a raw gRPC client presents on every call (`InterceptedService::new(channel, it)`): a
/// credential, or a job's token. (`tern_client::Client` presents its own, and every token it holds.)
#[derive(Debug, Clone, Default)]
pub struct Presents {
    credential: Option<tonic::metadata::AsciiMetadataValue>,
    tokens: Vec<tonic::metadata::AsciiMetadataValue>,
}

impl Presents {
    /// A credential (text as [`ClusterSecret::credential`] makes it).
    pub fn credential(credential: &str) -> Result<Presents, IdentityError> {
        Ok(Presents { credential: Some(header(credential, "a credential")?), tokens: Vec::new() })
    }

    /// A job's token (text form).
    pub fn job_token(token: &str) -> Result<Presents, IdentityError> {
        Presents::default().and_job_token(token)
    }

    /// These, and a job's token (text form).
    pub fn and_job_token(mut self, token: &str) -> Result<Presents, IdentityError> {
        self.tokens.push(header(token, "a job token")?);
        Ok(self)
    }
}

fn header(text: &str, what: &str) -> Result<tonic::metadata::AsciiMetadataValue, IdentityError> {
    text.trim().parse().map_err(|_| IdentityError(format!("{what} is one line of printable text")))
}

impl tonic::service::Interceptor for Presents {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let headers = request.metadata_mut();
        if let Some(credential) = &self.credential {
            headers.insert(CREDENTIAL_HEADER, credential.clone());
        }
        for token in &self.tokens {
            headers.append(JOB_TOKEN_HEADER, token.clone());
        }
        Ok(request)
    }
}

/// A gRPC channel whose every call presents [`Presents`].
pub type Presenting<C> = tonic::service::interceptor::InterceptedService<C, Presents>;

/// Reads a credential file (`tern up` writes them under `DIR/credentials/`).
pub fn load_credential(path: &Path) -> Result<String, IdentityError> {
    Ok(read_private(path, "a credential")?.trim().to_string())
}

/// Writes a credential file (mode 0600, created new).
pub fn write_credential(path: &Path, credential: &str) -> std::io::Result<()> {
    write_private(path, credential)
}

/// Checks the names a credential carries: a valid role's tenant and subject.
pub fn validate(identity: &Identity) -> Result<(), IdentityError> {
    validate_tenant(&identity.tenant)?;
    let subject = &identity.subject;
    if subject.len() > MAX_SUBJECT_BYTES || subject.bytes().any(|b| b.is_ascii_whitespace() || b.is_ascii_control()) {
        return Err(IdentityError(format!("subject {subject:?} is not up to {MAX_SUBJECT_BYTES} printable bytes")));
    }
    Ok(())
}

/// Tenant names: [A-Za-z0-9._-], 1 to [`MAX_TENANT_NAME_BYTES`] bytes.
pub fn validate_tenant(name: &str) -> Result<(), IdentityError> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() || name.len() > MAX_TENANT_NAME_BYTES || !name.chars().all(allowed) {
        return Err(IdentityError(format!(
            "tenant name {name:?} is not 1 to {MAX_TENANT_NAME_BYTES} of [A-Za-z0-9._-]"
        )));
    }
    Ok(())
}

/// The signed part of a credential: every field, blanks as "-".
fn fields(identity: &Identity) -> String {
    let blank = |s: &str| if s.is_empty() { "-".to_string() } else { s.to_string() };
    format!("{VERSION} {} {} {}", identity.role, blank(&identity.tenant), blank(&identity.subject))
}

fn unblank(s: &str) -> &str {
    if s == "-" {
        ""
    } else {
        s
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Lower-case hex only: one text per credential, so a verified one is exactly what the secret made.
fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect()
}

fn read_private(path: &Path, what: &str) -> Result<String, IdentityError> {
    use std::os::unix::fs::PermissionsExt;
    let cannot = |e: std::io::Error| IdentityError(format!("cannot read {what} from {}: {e}", path.display()));
    let mode = std::fs::metadata(path).map_err(cannot)?.permissions().mode() & 0o777;
    // Group-readable passes: Kubernetes' fsGroup makes a mounted Secret so, the group being the
    // daemon's own. Readable by others does not.
    if mode & 0o007 != 0 {
        return Err(IdentityError(format!(
            "{} holds {what} and is readable by others (mode {mode:o}): chmod 600 it",
            path.display()
        )));
    }
    std::fs::read_to_string(path).map_err(cannot)
}

fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    file.write_all(format!("{text}\n").as_bytes())?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_verify_and_carry_role_tenant_and_subject() {
        let secret = ClusterSecret::generate();
        for identity in [
            Identity::new(Role::Server, "", "10.0.0.7:7100"),
            Identity::new(Role::Admin, "", ""),
            Identity::new(Role::Client, "etl", ""),
        ] {
            assert_eq!(secret.verify(&secret.credential(&identity)).unwrap(), identity);
        }
    }

    #[test]
    fn a_changed_field_another_secret_or_garbage_is_refused_with_why() {
        let secret = ClusterSecret::generate();
        let client = secret.credential(&Identity::new(Role::Client, "etl", ""));
        let widened = client.replacen("client", "admin", 1);
        assert!(secret.verify(&widened).unwrap_err().0.contains("not signed"), "{widened}");
        let moved = secret.credential(&Identity::new(Role::Server, "", "a:1")).replacen("a:1", "b:1", 1);
        assert!(secret.verify(&moved).unwrap_err().0.contains("not signed"));
        assert!(ClusterSecret::generate().verify(&client).unwrap_err().0.contains("another cluster"));
        for garbage in ["", "tern1", "tern2 admin - - 00", "tern1 root - - 00", "tern1 admin - - zz", &"x".repeat(600)]
        {
            assert!(secret.verify(garbage).unwrap_err().0.starts_with("the credential is not valid"), "{garbage}");
        }
    }

    #[test]
    fn secret_files_round_trip_are_private_and_never_replaced() {
        let dir = std::env::temp_dir().join(format!("tern-identity-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cluster.secret");
        let secret = ClusterSecret::generate();
        secret.write_new(&path).unwrap();
        assert!(secret.write_new(&path).is_err(), "an existing secret was replaced");
        let loaded = ClusterSecret::load(&path).unwrap();
        let admin = Identity::new(Role::Admin, "", "");
        assert_eq!(loaded.verify(&secret.credential(&admin)).unwrap(), admin);
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o440)).unwrap();
        assert!(ClusterSecret::load(&path).is_ok(), "a Kubernetes Secret with fsGroup is group-readable");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(ClusterSecret::load(&path).unwrap_err().0.contains("chmod 600"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
