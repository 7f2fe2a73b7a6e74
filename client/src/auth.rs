//! The job tokens a client holds, and what each data frame acts under (see `tern_proto::token`).
//!
//! A client holds the token of every job it started (refreshed by its session's renewals) and of
//! jobs whose tokens it was given ([`crate::Client::add_job_token`], or `TERN_JOB_TOKEN` at
//! connect): executors, Spark tasks, scheduler tasks. A token nearing its expiry is refreshed
//! (RefreshToken) before use, so a process that only holds a token keeps working while the
//! job's driver renews the lease.
//!
//! Every control-plane call carries the client's credential, if it has one, and the tokens it
//! holds ([`Calls`]): the metadata server authorizes a call on a job's files or shuffles by the
//! job's token (`tern_proto::identity`).

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tern_proto::identity::{CREDENTIAL_HEADER, JOB_TOKEN_HEADER};
use tern_proto::token::{Grant, JobToken, GRANT_LEN};
use tern_proto::v1 as pb;
use tern_transport::failover::Failover;

use crate::error::{Error, ErrorKind, Result};
use crate::Client;

/// Environment variable naming job tokens (text form, separated by commas or whitespace) a
/// client adds when it connects.
pub const TOKEN_ENV: &str = "TERN_JOB_TOKEN";
/// Environment variable naming the tenant jobs are registered for (default "default").
pub const TENANT_ENV: &str = "TERN_TENANT";
/// Environment variable holding the credential a client acts with (its text, not a file): an
/// executor sets it for each task to a client credential of the task's tenant.
pub const CREDENTIAL_ENV: &str = "TERN_CREDENTIAL";

/// One job's token as held.
#[derive(Debug)]
pub(crate) struct Held {
    pub(crate) token: JobToken,
    pub(crate) text: String,
    pub(crate) encoded: Bytes,
    /// The text as a control-plane header.
    header: tonic::metadata::AsciiMetadataValue,
}

impl Held {
    fn new(token: JobToken) -> Held {
        let text = token.to_text();
        let header = text.parse().expect("a token's text is hex");
        Held { text, encoded: Bytes::from(token.encode()), token, header }
    }
}

/// The tokens a client holds, by job name.
#[derive(Debug, Default)]
pub(crate) struct Tokens {
    held: Mutex<HashMap<String, Arc<Held>>>,
    /// One refresh at a time: a burst of frames near expiry costs one RefreshToken call.
    refreshing: tokio::sync::Mutex<()>,
}

impl Tokens {
    /// Adds (or replaces) the token in `text`; returns its job.
    pub(crate) fn add(&self, text: &str) -> Result<String> {
        let token = JobToken::from_text(text).map_err(|e| Error::new(e.kind(), e.to_string()))?;
        let job = token.job.clone();
        let mut held = self.held.lock();
        // An older token of the same registration (a handle made before renewals) is not taken
        // over the fresher one held.
        let newer = held
            .get(&job)
            .is_some_and(|old| old.token.serial == token.serial && old.token.expires_unix_ms > token.expires_unix_ms);
        if !newer {
            held.insert(job.clone(), Arc::new(Held::new(token)));
        }
        Ok(job)
    }

    pub(crate) fn get(&self, job: &str) -> Option<Arc<Held>> {
        self.held.lock().get(job).cloned()
    }

    pub(crate) fn remove(&self, job: &str) {
        self.held.lock().remove(job);
    }

    /// Adds the tokens `TERN_JOB_TOKEN` names, if set.
    pub(crate) fn add_from_env(&self) -> Result<()> {
        let Ok(value) = std::env::var(TOKEN_ENV) else {
            return Ok(());
        };
        for text in value.split(|c: char| c == ',' || c.is_whitespace()).filter(|t| !t.is_empty()) {
            self.add(text).map_err(|e| e.context(format_args!("{TOKEN_ENV}")))?;
        }
        Ok(())
    }
}

/// The metadata channel, with the caller's headers on every call.
pub(crate) type Calls = tonic::service::interceptor::InterceptedService<Failover, CallerHeaders>;

/// Adds the credential and the job tokens held to each call.
#[derive(Clone)]
pub(crate) struct CallerHeaders {
    credential: Option<tonic::metadata::AsciiMetadataValue>,
    tokens: Arc<Tokens>,
}

impl tonic::service::Interceptor for CallerHeaders {
    fn call(&mut self, mut request: tonic::Request<()>) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        let headers = request.metadata_mut();
        if let Some(credential) = &self.credential {
            headers.insert(CREDENTIAL_HEADER, credential.clone());
        }
        for held in self.tokens.held.lock().values().take(tern_proto::identity::MAX_TOKENS_PER_CALL) {
            headers.append(JOB_TOKEN_HEADER, held.header.clone());
        }
        Ok(request)
    }
}

/// `channel` with [`CallerHeaders`]; a credential that cannot be a header is refused.
pub(crate) fn calls(channel: Failover, credential: Option<&str>, tokens: Arc<Tokens>) -> Result<Calls> {
    let credential = credential
        .map(|text| text.trim().parse().map_err(|_| Error::invalid("the credential is not one line of printable text")))
        .transpose()?;
    Ok(tonic::service::interceptor::InterceptedService::new(channel, CallerHeaders { credential, tokens }))
}

/// What one data frame acts under: a job's token (bound to a slot of its connection) or none
/// (the volume principal), and the grant of its block or shuffle.
#[derive(Debug, Clone)]
pub(crate) struct Access {
    pub(crate) token: Option<Arc<Held>>,
    pub(crate) grant: Grant,
}

/// The job owning `path` ("" outside `/jobs`), from a normalized path.
pub(crate) fn job_of(path: &str) -> &str {
    path.strip_prefix("/jobs/").map(|rest| rest.split('/').next().unwrap_or_default()).unwrap_or_default()
}

/// A grant as the metadata server sent it; a missing one (an old server) is all zeros, which a
/// checking storage server refuses with a clear error.
pub(crate) fn grant_of(bytes: &[u8]) -> Grant {
    bytes.try_into().unwrap_or([0; GRANT_LEN])
}

impl Client {
    /// Adds a job's token (its text form, as `RegisterJob` handed it out): this client may then
    /// act on the job's files and shuffles. Returns the job's name.
    pub fn add_job_token(&self, token: &str) -> Result<String> {
        self.inner.tokens.add(token)
    }

    /// The text form of the token this client holds for `job`, to hand to the job's other
    /// processes (executors, tasks).
    pub fn job_token(&self, job: &str) -> Option<String> {
        self.inner.tokens.get(job).map(|held| held.text.clone())
    }

    pub(crate) fn forget_job_token(&self, job: &str) {
        self.inner.tokens.remove(job)
    }

    /// What a frame on `job`'s data ("" = outside `/jobs`) with `grant` acts under. Refreshes a
    /// token in the last third of its life.
    pub(crate) async fn access(&self, job: &str, grant: &[u8]) -> Result<Access> {
        let grant = grant_of(grant);
        if job.is_empty() {
            return Ok(Access { token: None, grant });
        }
        let Some(held) = self.inner.tokens.get(job) else {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "this client holds no token for job {job}: start the job with it, or give it the job's token \
                     (in {TOKEN_ENV})"
                ),
            ));
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or_default();
        let left = held.token.expires_unix_ms.saturating_sub(now);
        if left > held.token.lease_ms / 3 {
            return Ok(Access { token: Some(held), grant });
        }
        let _one = self.inner.tokens.refreshing.lock().await;
        let held = self.inner.tokens.get(job).unwrap_or(held);
        if held.token.expires_unix_ms.saturating_sub(now) > held.token.lease_ms / 3 {
            return Ok(Access { token: Some(held), grant });
        }
        let refreshed = self.metadata().refresh_token(pb::RefreshTokenRequest { token: held.text.clone() }).await;
        match refreshed {
            Ok(reply) => {
                self.inner.tokens.add(&reply.into_inner().token)?;
                Ok(Access { token: self.inner.tokens.get(job), grant })
            }
            // The old token is used as is: if it expired, the storage server says so.
            Err(status) => {
                tracing::debug!("refreshing the token of job {job}: {}", Error::from(status));
                Ok(Access { token: Some(held), grant })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_of_paths() {
        assert_eq!(job_of("/jobs/etl/out/part-0"), "etl");
        assert_eq!(job_of("/jobs/etl"), "etl");
        assert_eq!(job_of("/data/x"), "");
        assert_eq!(job_of("/jobsx/y"), "");
    }

    #[test]
    fn tokens_are_held_by_job() {
        let key = tern_proto::token::TokenKey::generate();
        let tokens = Tokens::default();
        let text = key.issue("j", 3, 1, 2).to_text();
        assert_eq!(tokens.add(&text).unwrap(), "j");
        assert_eq!(tokens.get("j").unwrap().text, text);
        assert!(tokens.get("k").is_none());
        assert_eq!(tokens.add("not a token").unwrap_err().kind(), ErrorKind::Invalid);
        tokens.remove("j");
        assert!(tokens.get("j").is_none());
    }
}
