//! The cluster's TLS material: one CA, and a node certificate signed by it that every daemon and
//! client presents (mutual TLS on QUIC and on gRPC).
//!
//! A TLS directory holds `ca.pem` (the cluster CA's certificate), `ca.key` (its key, needed only
//! to sign more certificates), `node.pem` and `node.key`. [`init`] makes them
//! (`tern cert init`); [`TlsMaterial::load`] reads them back and checks, before anything listens or
//! dials, that they parse, that the node certificate is valid now and that the CA signed it, so
//! a bad directory fails at start-up with a message naming the file, not at the first handshake.
//!
//! Every rustls config here is built with the aws-lc-rs provider passed explicitly; nothing relies
//! on a process-wide default (tonic's server does, so [`install_default_provider`] sets one).

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use time::{Duration as TimeDuration, OffsetDateTime};

/// File names inside a TLS directory.
pub const CA_CERT: &str = "ca.pem";
pub const CA_KEY: &str = "ca.key";
pub const NODE_CERT: &str = "node.pem";
pub const NODE_KEY: &str = "node.key";

/// Default validity of certificates made by [`init`], in days.
pub const DEFAULT_DAYS: u32 = 365;

/// The one crypto provider Tern uses: aws-lc-rs.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// Installs aws-lc-rs as the process-wide rustls provider (tonic's TLS server takes the process
/// default). Harmless when one is installed already.
pub fn install_default_provider() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

/// What `tern cert init` makes.
#[derive(Debug, Clone)]
pub struct InitOptions {
    /// Extra DNS names or IP addresses for the node certificate (beyond localhost, 127.0.0.1, ::1
    /// and this machine's hostname).
    pub hosts: Vec<String>,
    /// Validity in days, from now.
    pub days: u32,
    /// Replace an existing CA in the directory.
    pub force: bool,
}

impl Default for InitOptions {
    fn default() -> InitOptions {
        InitOptions { hosts: Vec::new(), days: DEFAULT_DAYS, force: false }
    }
}

/// Makes a cluster CA and a node certificate signed by it in `dir` (created if missing). Refuses
/// to replace an existing CA unless `force`. Returns the node certificate's subject names.
pub fn init(dir: &Path, options: &InitOptions) -> anyhow::Result<Vec<String>> {
    if options.days == 0 {
        bail!("--days must be at least 1");
    }
    let now = OffsetDateTime::now_utc();
    let not_after = now + TimeDuration::days(i64::from(options.days));
    // A minute of slack for clocks a little behind this one.
    init_with_validity(dir, options, now - TimeDuration::minutes(1), not_after)
}

/// [`init`] with explicit validity dates (tests make expired material with it).
pub fn init_with_validity(
    dir: &Path,
    options: &InitOptions,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
) -> anyhow::Result<Vec<String>> {
    let ca_path = dir.join(CA_CERT);
    if ca_path.exists() && !options.force {
        bail!(
            "{} exists: a cluster CA is there already (every node trusts it); \
             pass --force to replace it and re-issue every node's certificate",
            ca_path.display()
        );
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;

    let ca_key = KeyPair::generate().context("generating the CA key")?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.distinguished_name.push(DnType::CommonName, "Tern cluster CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages =
        vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    ca_params.not_before = not_before;
    ca_params.not_after = not_after;
    let ca_cert = ca_params.self_signed(&ca_key).context("signing the CA certificate")?;

    let names = node_names(&options.hosts);
    let node_key = KeyPair::generate().context("generating the node key")?;
    let mut node_params = CertificateParams::new(names.clone()).context("node certificate names")?;
    node_params.distinguished_name.push(DnType::CommonName, "Tern node");
    node_params.is_ca = IsCa::ExplicitNoCa;
    node_params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    // The same certificate serves a daemon's listeners and its (and clients') outgoing calls.
    node_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    node_params.use_authority_key_identifier_extension = true;
    node_params.not_before = not_before;
    node_params.not_after = not_after;
    let issuer = Issuer::new(ca_params, ca_key);
    let node_cert = node_params.signed_by(&node_key, &issuer).context("signing the node certificate")?;

    write_file(&dir.join(CA_KEY), issuer_key_pem(&issuer).as_bytes(), 0o600)?;
    write_file(&ca_path, ca_cert.pem().as_bytes(), 0o644)?;
    write_file(&dir.join(NODE_KEY), node_key.serialize_pem().as_bytes(), 0o600)?;
    write_file(&dir.join(NODE_CERT), node_cert.pem().as_bytes(), 0o644)?;
    // The daemons' secret beside their certificate: with --tls-dir they find it there.
    let secret = dir.join(tern_common::config::CLUSTER_SECRET_FILE);
    match fs::remove_file(&secret) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("replacing {}", secret.display()))
        }
        _ => {}
    }
    tern_proto::identity::ClusterSecret::generate()
        .write_new(&secret)
        .with_context(|| format!("writing {}", secret.display()))?;
    Ok(names)
}

fn issuer_key_pem(issuer: &Issuer<'_, KeyPair>) -> String {
    issuer.key().serialize_pem()
}

/// localhost, the loopback addresses, this machine's hostname and `extra`, without repeats.
fn node_names(extra: &[String]) -> Vec<String> {
    let mut names: Vec<String> = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
    if let Some(host) = hostname() {
        names.push(host);
    }
    names.extend(extra.iter().map(|h| h.trim().to_string()).filter(|h| !h.is_empty()));
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.to_ascii_lowercase()));
    names
}

/// This machine's hostname, if it has a usable one.
#[allow(unsafe_code)] // gethostname(2): std has no safe wrapper
pub fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = std::str::from_utf8(&buf[..end]).ok()?.trim().to_string();
    (!name.is_empty() && name != "localhost").then_some(name)
}

/// Writes `bytes` to a new file with `mode`, replacing any old one (whose mode would otherwise be
/// kept).
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> anyhow::Result<()> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("replacing {}", path.display())),
    }
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    file.write_all(bytes).with_context(|| format!("writing {}", path.display()))?;
    file.sync_all().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// A TLS directory (or the same three PEM pieces given in memory), loaded and checked.
#[derive(Debug, Clone)]
pub struct TlsMaterial {
    ca_pem: Vec<u8>,
    node_pem: Vec<u8>,
    key_pem: Vec<u8>,
    ca: CertificateDer<'static>,
    pub(crate) chain: Vec<CertificateDer<'static>>,
    pub(crate) key: Arc<PrivateKeyDer<'static>>,
}

/// Where TLS material came from, so that an error names the file (or setting) at fault and says
/// how to make new material.
#[derive(Debug, Clone)]
pub struct PemOrigin {
    /// The CA certificate's name in errors: a path, or a setting's name.
    pub ca: String,
    /// The node certificate's.
    pub node: String,
    /// The node key's.
    pub key: String,
    /// How to make new material, said when it is missing or expired.
    pub renew: String,
}

impl TlsMaterial {
    /// Reads `ca.pem`, `node.pem` and `node.key` from `dir` and checks them as
    /// [`TlsMaterial::from_pem`] does.
    pub fn load(dir: &Path) -> anyhow::Result<TlsMaterial> {
        let how = format!("create it with `tern cert init --dir {}`", dir.display());
        if !dir.is_dir() {
            bail!("no TLS material in {}: the directory does not exist; {how}", dir.display());
        }
        let read = |name: &str| -> anyhow::Result<Vec<u8>> {
            let path = dir.join(name);
            match fs::read(&path) {
                Ok(bytes) => Ok(bytes),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    bail!("no TLS material in {}: {} is missing; {how}", dir.display(), path.display())
                }
                Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
            }
        };
        let name = |file: &str| dir.join(file).display().to_string();
        let origin = PemOrigin {
            ca: name(CA_CERT),
            node: name(NODE_CERT),
            key: name(NODE_KEY),
            renew: format!("make new material with `tern cert init --dir {} --force`", dir.display()),
        };
        TlsMaterial::from_pem(read(CA_CERT)?, read(NODE_CERT)?, read(NODE_KEY)?, &origin)
    }

    /// Checks TLS material given as PEM: each piece parses, the CA and node certificates are
    /// valid now, the CA signed the node certificate and the key is the certificate's. Errors
    /// name the piece by `origin`.
    pub fn from_pem(
        ca_pem: Vec<u8>,
        node_pem: Vec<u8>,
        key_pem: Vec<u8>,
        origin: &PemOrigin,
    ) -> anyhow::Result<TlsMaterial> {
        let ca = parse_certs(&origin.ca, &ca_pem)?.swap_remove(0);
        let chain = parse_certs(&origin.node, &node_pem)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|e| anyhow::anyhow!("{}: not a PEM private key: {e}", origin.key))?;

        let now = OffsetDateTime::now_utc();
        check_validity(&origin.ca, "CA certificate", &ca, now, &origin.renew)?;
        check_validity(&origin.node, "node certificate", &chain[0], now, &origin.renew)?;

        let mut roots = RootCertStore::empty();
        roots.add(ca.clone()).map_err(|e| anyhow::anyhow!("{}: not a usable CA certificate: {e}", origin.ca))?;
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .context("building the certificate verifier")?;
        verifier.verify_client_cert(&chain[0], &chain[1..], UnixTime::now()).map_err(|e| {
            anyhow::anyhow!(
                "{} is not signed by the CA in {} ({e}); the node certificate must come from the same \
                 `tern cert init` as the CA certificate",
                origin.node,
                origin.ca
            )
        })?;
        // The key must be the certificate's: building a config checks that.
        rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .context("TLS 1.3 with aws-lc-rs")?
            .with_no_client_auth()
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| anyhow::anyhow!("{} does not go with {}: {e}", origin.key, origin.node))?;
        Ok(TlsMaterial { ca_pem, node_pem, key_pem, ca, chain, key: Arc::new(key) })
    }

    pub(crate) fn roots(&self) -> RootCertStore {
        let mut roots = RootCertStore::empty();
        roots.add(self.ca.clone()).expect("the CA certificate was checked at load");
        roots
    }

    /// A TLS 1.3 server config that requires client certificates signed by the cluster CA.
    pub fn server_config(&self, alpn: &[&[u8]]) -> anyhow::Result<rustls::ServerConfig> {
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(self.roots()), provider())
            .build()
            .context("building the client certificate verifier")?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())?;
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(config)
    }

    /// A TLS 1.3 client config that trusts the cluster CA only and presents the node certificate.
    pub fn client_config(&self, alpn: &[&[u8]]) -> anyhow::Result<rustls::ClientConfig> {
        let mut config = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(self.roots())
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())?;
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(config)
    }

    /// tonic's server TLS: the node identity, client certificates required from the cluster CA.
    pub fn tonic_server(&self) -> tonic::transport::ServerTlsConfig {
        install_default_provider();
        tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(&self.node_pem, &self.key_pem))
            .client_ca_root(tonic::transport::Certificate::from_pem(&self.ca_pem))
    }

    /// tonic's client TLS towards `host` (the name checked against the server's certificate).
    pub fn tonic_client(&self, host: &str) -> tonic::transport::ClientTlsConfig {
        install_default_provider();
        tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&self.ca_pem))
            .identity(tonic::transport::Identity::from_pem(&self.node_pem, &self.key_pem))
            .domain_name(server_name_of(host))
    }
}

/// A gRPC endpoint for `addr`, by one rule shared by daemons and clients: `https://host:port`
/// is TLS (and needs `material`), `http://host:port` is plain, and a bare `host:port` is TLS when
/// there is material and plain otherwise. TLS is mutual: the node certificate is presented, and
/// only a server certificate signed by the cluster CA is accepted.
pub fn grpc_endpoint(addr: &str, material: Option<&TlsMaterial>) -> anyhow::Result<tonic::transport::Endpoint> {
    let addr = addr.trim().trim_end_matches('/');
    let (rest, tls) = if let Some(rest) = addr.strip_prefix("https://") {
        (rest, true)
    } else if let Some(rest) = addr.strip_prefix("http://") {
        (rest, false)
    } else {
        (addr, material.is_some())
    };
    if rest.is_empty() || rest.contains("://") {
        bail!("{addr:?} is not host:port (or https://host:port)");
    }
    let scheme = if tls { "https" } else { "http" };
    let endpoint = tonic::transport::Endpoint::from_shared(format!("{scheme}://{rest}"))
        .with_context(|| format!("{addr:?} is not a valid host:port"))?;
    if !tls {
        return Ok(endpoint);
    }
    let material = material.ok_or_else(|| {
        anyhow::anyhow!(
            "{addr} is a TLS address but no TLS material was given: pass --tls-dir DIR \
             (the directory `tern cert init` made, or DIR/tls of `tern up --tls`)"
        )
    })?;
    endpoint.tls_config(material.tonic_client(rest)).with_context(|| format!("TLS towards {addr}"))
}

/// The host part of `host:port` (brackets of an IPv6 literal removed).
pub fn server_name_of(addr: &str) -> String {
    let addr = addr.trim();
    let addr = addr.strip_prefix("https://").or_else(|| addr.strip_prefix("http://")).unwrap_or(addr);
    let addr = addr.trim_end_matches('/');
    if let Some(rest) = addr.strip_prefix('[') {
        if let Some(end) = rest.find(']') {
            return rest[..end].to_string();
        }
    }
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.chars().all(|c| c.is_ascii_digit()) => host.to_string(),
        _ => addr.to_string(),
    }
}

fn parse_certs(name: &str, pem: &[u8]) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("{name}: not a PEM certificate: {e}"))?;
    if certs.is_empty() {
        bail!("{name}: not a PEM certificate: no CERTIFICATE block in it");
    }
    Ok(certs)
}

/// Fails unless `cert` is valid at `now`, naming the file and its dates.
fn check_validity(
    name: &str,
    what: &str,
    cert: &CertificateDer<'_>,
    now: OffsetDateTime,
    renew: &str,
) -> anyhow::Result<()> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| anyhow::anyhow!("{name}: not an X.509 certificate: {e}"))?;
    let validity = parsed.validity();
    let (from, to) = (validity.not_before.to_datetime(), validity.not_after.to_datetime());
    if now > to {
        bail!("{name}: the {what} expired on {} (valid from {}); {renew}", day(to), day(from));
    }
    if now < from {
        bail!(
            "{name}: the {what} is not valid yet: valid from {} to {} (is this machine's clock right?)",
            day(from),
            day(to)
        );
    }
    Ok(())
}

fn day(t: OffsetDateTime) -> String {
    let fmt = time::macros::format_description!("[year]-[month]-[day] [hour]:[minute]:[second] UTC");
    t.to_offset(time::UtcOffset::UTC).format(&fmt).unwrap_or_else(|_| t.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_then_load_round_trips_and_keys_are_private() {
        let dir = tempfile::tempdir().unwrap();
        let names =
            init(dir.path(), &InitOptions { hosts: vec!["store-1.example".into()], ..Default::default() }).unwrap();
        assert!(names.iter().any(|n| n == "store-1.example") && names.iter().any(|n| n == "127.0.0.1"), "{names:?}");
        let material = TlsMaterial::load(dir.path()).unwrap();
        material.server_config(&[b"x"]).unwrap();
        material.client_config(&[b"x"]).unwrap();
        use std::os::unix::fs::PermissionsExt;
        for key in [CA_KEY, NODE_KEY] {
            let mode = fs::metadata(dir.path().join(key)).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{key}");
        }
        // A second init without --force keeps the CA.
        let before = fs::read(dir.path().join(CA_CERT)).unwrap();
        let err = init(dir.path(), &InitOptions::default()).unwrap_err().to_string();
        assert!(err.contains("--force"), "{err}");
        assert_eq!(fs::read(dir.path().join(CA_CERT)).unwrap(), before);
        init(dir.path(), &InitOptions { force: true, ..Default::default() }).unwrap();
        assert_ne!(fs::read(dir.path().join(CA_CERT)).unwrap(), before);
    }

    #[test]
    fn missing_material_says_how_to_make_it() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let err = TlsMaterial::load(&missing).unwrap_err().to_string();
        assert!(err.contains("no TLS material in") && err.contains("tern cert init --dir"), "{err}");
        init(dir.path(), &InitOptions::default()).unwrap();
        fs::remove_file(dir.path().join(NODE_KEY)).unwrap();
        let err = TlsMaterial::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("node.key is missing") && err.contains("tern cert init --dir"), "{err}");
    }

    #[test]
    fn garbage_pem_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path(), &InitOptions::default()).unwrap();
        fs::write(dir.path().join(NODE_CERT), "hello").unwrap();
        let err = TlsMaterial::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("node.pem: not a PEM certificate"), "{err}");
    }

    #[test]
    fn expired_and_future_certificates_are_refused_with_their_dates() {
        let dir = tempfile::tempdir().unwrap();
        let now = OffsetDateTime::now_utc();
        init_with_validity(
            dir.path(),
            &InitOptions::default(),
            now - TimeDuration::days(30),
            now - TimeDuration::days(1),
        )
        .unwrap();
        let err = TlsMaterial::load(dir.path()).unwrap_err().to_string();
        let expiry = day(now - TimeDuration::days(1));
        assert!(err.contains("expired on") && err.contains(&expiry[..10]) && err.contains("ca.pem"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        init_with_validity(
            dir.path(),
            &InitOptions::default(),
            now + TimeDuration::days(2),
            now + TimeDuration::days(30),
        )
        .unwrap();
        let err = TlsMaterial::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("not valid yet"), "{err}");
    }

    #[test]
    fn expired_node_certificate_names_node_pem() {
        // A valid CA with an expired node certificate: the node file is named.
        let dir = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        init(dir.path(), &InitOptions::default()).unwrap();
        let now = OffsetDateTime::now_utc();
        init_with_validity(
            other.path(),
            &InitOptions::default(),
            now - TimeDuration::days(9),
            now - TimeDuration::days(2),
        )
        .unwrap();
        fs::copy(other.path().join(NODE_CERT), dir.path().join(NODE_CERT)).unwrap();
        let err = TlsMaterial::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("node.pem: the node certificate expired on"), "{err}");
    }

    #[test]
    fn node_certificate_of_another_ca_is_refused() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        init(a.path(), &InitOptions::default()).unwrap();
        init(b.path(), &InitOptions::default()).unwrap();
        for name in [NODE_CERT, NODE_KEY] {
            fs::copy(b.path().join(name), a.path().join(name)).unwrap();
        }
        let err = TlsMaterial::load(a.path()).unwrap_err().to_string();
        assert!(err.contains("is not signed by the CA in"), "{err}");
    }

    #[test]
    fn grpc_endpoints_follow_the_scheme_rule() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path(), &InitOptions::default()).unwrap();
        let material = TlsMaterial::load(dir.path()).unwrap();
        let uri = |addr: &str, m: Option<&TlsMaterial>| grpc_endpoint(addr, m).unwrap().uri().to_string();
        assert_eq!(uri("127.0.0.1:9060", None), "http://127.0.0.1:9060/");
        assert_eq!(uri("127.0.0.1:9060", Some(&material)), "https://127.0.0.1:9060/");
        assert_eq!(uri("http://127.0.0.1:9060", Some(&material)), "http://127.0.0.1:9060/");
        assert_eq!(uri("https://127.0.0.1:9060", Some(&material)), "https://127.0.0.1:9060/");
        let err = grpc_endpoint("https://127.0.0.1:9060", None).unwrap_err().to_string();
        assert!(err.contains("--tls-dir"), "{err}");
    }

    #[test]
    fn server_names_come_from_addresses() {
        assert_eq!(server_name_of("127.0.0.1:9060"), "127.0.0.1");
        assert_eq!(server_name_of("https://meta.example:9060/"), "meta.example");
        assert_eq!(server_name_of("[::1]:9060"), "::1");
        assert_eq!(server_name_of("host"), "host");
    }
}
