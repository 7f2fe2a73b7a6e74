//! Why a request was refused, before it is given its context and sent as a gRPC status.
//!
//! The modules that own state (namespace, placement, jobs) know *why* something failed ("already
//! exists", "block 17 on storage server 2 is lost: ..."); the request handler knows *what* was being
//! done ("create /a/b"). A [`Refusal`] carries the first until [`Refusal::status`] adds the second,
//! so every status reads "create /a/b: already exists".

use std::fmt::Display;

use tern_proto::ErrorKind;

/// A refused request: its kind and the reason, without the operation it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub kind: ErrorKind,
    pub reason: String,
}

impl Refusal {
    pub fn new(kind: ErrorKind, reason: impl Into<String>) -> Refusal {
        Refusal { kind, reason: reason.into() }
    }

    /// The gRPC status for this refusal within `context`, e.g. "create /a/b".
    pub fn status(self, context: impl Display) -> tonic::Status {
        self.kind.status(format!("{context}: {}", self.reason))
    }
}

/// Adds the operation's context to a refused result.
pub trait Context<T> {
    fn context(self, context: impl Display) -> Result<T, tonic::Status>;
}

impl<T> Context<T> for Result<T, Refusal> {
    fn context(self, context: impl Display) -> Result<T, tonic::Status> {
        self.map_err(|refusal| refusal.status(context))
    }
}

/// Shorthands for the refusals every module makes.
pub fn not_found(reason: impl Into<String>) -> Refusal {
    Refusal::new(ErrorKind::NotFound, reason)
}

pub fn invalid(reason: impl Into<String>) -> Refusal {
    Refusal::new(ErrorKind::Invalid, reason)
}

pub fn already_exists(reason: impl Into<String>) -> Refusal {
    Refusal::new(ErrorKind::AlreadyExists, reason)
}
