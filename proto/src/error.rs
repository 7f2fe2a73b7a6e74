//! Error kinds shared by the control plane (gRPC statuses) and the data plane (error frames), and
//! the one way a message is cut to a bound.

use std::fmt;

/// What went wrong, coarsely enough that a caller can decide what to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorKind {
    /// The path, job, file or block does not exist (or is not sealed yet). Check the name.
    NotFound = 1,
    /// Create or mkdir on a path that exists. Pick another name or delete first.
    AlreadyExists = 2,
    /// Data was acknowledged but its storage server is gone. Recompute it.
    DataLost = 3,
    /// Every tier that could hold the data is full. Free space or add servers.
    OutOfSpace = 4,
    /// The request is malformed or not allowed in this state. A bug in the caller; do not retry.
    Invalid = 5,
    /// A server cannot be reached or is shutting down. Retry later.
    Unavailable = 6,
    /// A checksum did not match: bytes were damaged in flight or at rest. Retry, then recompute.
    Corrupt = 7,
    /// A bug or broken invariant on the server.
    Internal = 8,
    /// The caller's job token does not cover the block, shuffle or job it acted on (another
    /// job's data, a forged or expired token). Use the owning job's token.
    PermissionDenied = 9,
    /// The tenant's quota (jobs, or bytes of a tier) would be exceeded. Free data, end jobs, or
    /// raise the quota.
    QuotaExceeded = 10,
}

/// gRPC metadata key carrying the kind, where gRPC codes alone are ambiguous.
pub const KIND_METADATA_KEY: &str = "tern-kind";

impl ErrorKind {
    pub const ALL: [ErrorKind; 10] = [
        ErrorKind::NotFound,
        ErrorKind::AlreadyExists,
        ErrorKind::DataLost,
        ErrorKind::OutOfSpace,
        ErrorKind::Invalid,
        ErrorKind::Unavailable,
        ErrorKind::Corrupt,
        ErrorKind::Internal,
        ErrorKind::PermissionDenied,
        ErrorKind::QuotaExceeded,
    ];

    /// The code carried in an error frame's status field.
    pub fn code(self) -> u16 {
        self as u16
    }

    pub fn from_code(code: u16) -> Option<ErrorKind> {
        Self::ALL.into_iter().find(|k| k.code() == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not-found",
            ErrorKind::AlreadyExists => "already-exists",
            ErrorKind::DataLost => "data-lost",
            ErrorKind::OutOfSpace => "out-of-space",
            ErrorKind::Invalid => "invalid",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::Internal => "internal",
            ErrorKind::PermissionDenied => "permission-denied",
            ErrorKind::QuotaExceeded => "quota-exceeded",
        }
    }

    fn grpc_code(self) -> tonic::Code {
        match self {
            ErrorKind::NotFound => tonic::Code::NotFound,
            ErrorKind::AlreadyExists => tonic::Code::AlreadyExists,
            ErrorKind::DataLost | ErrorKind::Corrupt => tonic::Code::DataLoss,
            ErrorKind::OutOfSpace => tonic::Code::ResourceExhausted,
            ErrorKind::Invalid => tonic::Code::InvalidArgument,
            ErrorKind::Unavailable => tonic::Code::Unavailable,
            ErrorKind::Internal => tonic::Code::Internal,
            ErrorKind::PermissionDenied => tonic::Code::PermissionDenied,
            ErrorKind::QuotaExceeded => tonic::Code::ResourceExhausted,
        }
    }

    /// A gRPC status carrying this kind and `message`.
    pub fn status(self, message: impl Into<String>) -> tonic::Status {
        let mut status = tonic::Status::new(self.grpc_code(), message);
        status.metadata_mut().insert(KIND_METADATA_KEY, tonic::metadata::MetadataValue::from_static(self.name()));
        status
    }

    /// The kind a status carries: its `tern-kind` entry, else a reading of its gRPC code.
    pub fn of_status(status: &tonic::Status) -> ErrorKind {
        let named = status
            .metadata()
            .get(KIND_METADATA_KEY)
            .and_then(|v| v.to_str().ok())
            .and_then(|name| Self::ALL.into_iter().find(|k| k.name() == name));
        named.unwrap_or(match status.code() {
            tonic::Code::NotFound => ErrorKind::NotFound,
            tonic::Code::AlreadyExists => ErrorKind::AlreadyExists,
            tonic::Code::DataLoss => ErrorKind::DataLost,
            tonic::Code::ResourceExhausted => ErrorKind::OutOfSpace,
            tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition | tonic::Code::OutOfRange => {
                ErrorKind::Invalid
            }
            tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Cancelled
            | tonic::Code::Aborted => ErrorKind::Unavailable,
            tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => ErrorKind::PermissionDenied,
            _ => ErrorKind::Internal,
        })
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The longest start of `message` that fits in `max_bytes` without splitting a UTF-8 character:
/// how every bounded message (error frames, task results, stage errors) is cut.
pub fn cut_message(message: &str, max_bytes: usize) -> &str {
    if message.len() <= max_bytes {
        return message;
    }
    // 0 is always a boundary, so a boundary is found.
    let end = (0..=max_bytes).rev().find(|&i| message.is_char_boundary(i)).unwrap_or(0);
    &message[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_cut_on_character_boundaries() {
        assert_eq!(cut_message("short", 10), "short");
        assert_eq!(cut_message("exactly", 7), "exactly");
        assert_eq!(cut_message("cut here", 3), "cut");
        // "é" is two bytes: a cut through it leaves it out whole.
        assert_eq!(cut_message("caté", 4), "cat");
        assert_eq!(cut_message("caté", 5), "caté");
        assert_eq!(cut_message("€", 2), "");
    }

    #[test]
    fn codes_round_trip() {
        for kind in ErrorKind::ALL {
            assert_eq!(ErrorKind::from_code(kind.code()), Some(kind));
        }
        assert_eq!(ErrorKind::from_code(0), None);
        assert_eq!(ErrorKind::from_code(999), None);
    }

    #[test]
    fn statuses_carry_the_kind() {
        for kind in ErrorKind::ALL {
            let status = kind.status("boom");
            assert_eq!(ErrorKind::of_status(&status), kind);
            assert_eq!(status.message(), "boom");
        }
        // Without the metadata entry the code still says enough.
        let bare = tonic::Status::not_found("x");
        assert_eq!(ErrorKind::of_status(&bare), ErrorKind::NotFound);
        let bare = tonic::Status::unavailable("x");
        assert_eq!(ErrorKind::of_status(&bare), ErrorKind::Unavailable);
    }
}
