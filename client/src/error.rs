//! The client's one error type: a kind to act on and a message naming the path or block.

use std::fmt;

pub use tern_proto::ErrorKind;

/// An error from any client call. `kind()` says what a caller can do about it; the message says
/// which path, block or server and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error { kind, message: message.into() }
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same error with `context` (e.g. the path) in front of its message.
    pub fn context(self, context: impl fmt::Display) -> Error {
        Error { kind: self.kind, message: format!("{context}: {}", self.message) }
    }

    pub(crate) fn unavailable(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Unavailable, message)
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Invalid, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.message, self.kind)
    }
}

impl std::error::Error for Error {}

/// What tonic says when an HTTP server that is not gRPC answers (e.g. an admin endpoint's 404).
const NOT_GRPC: &str = "grpc-status header missing";
/// What tonic says when the peer does not speak HTTP/2 at all: a storage server's block port
/// answers the HTTP/2 preface with a Tern frame refusing it.
const NOT_HTTP2: &str = "h2 protocol error";

impl From<tonic::Status> for Error {
    fn from(status: tonic::Status) -> Error {
        if status.message().starts_with(NOT_GRPC) {
            let why = status.message().rsplit(", ").next().unwrap_or_default();
            return Error::invalid(format!(
                "this port is not a Tern metadata server (is it the admin port?): it answers HTTP, not gRPC ({why})"
            ));
        }
        if status.message().starts_with(NOT_HTTP2) {
            // Its kind stays what tonic says: a real server's connection can break this way too.
            return Error::new(
                ErrorKind::of_status(&status),
                format!(
                    "this port is not a Tern metadata server or scheduler (is it a storage server's block port?): it \
                 does not speak HTTP/2 ({})",
                    status.message()
                ),
            );
        }
        let kind = ErrorKind::of_status(&status);
        let message = if status.message().is_empty() { status.code().description() } else { status.message() };
        Error::new(kind, message)
    }
}
