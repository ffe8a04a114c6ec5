//! Domain errors shared by every Trellis crate, and the one table that maps them to gRPC
//! status codes.
//!
//! Domain code returns [`Error`]; only the wire boundary turns it into a [`tonic::Status`]
//! (and back, when a service calls another one). The table lives here rather than in
//! `trellis-runtime` because Rust's orphan rule puts a `From<Error> for Status` impl next to
//! the type it converts; `trellis-runtime` re-exports it.

use tonic::{Code, Status};

/// Result with the domain [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, in terms a caller can act on. Each variant is one row of the gRPC table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The request is malformed; `field` names the offending request field.
    #[error("invalid {field}: {reason}")]
    InvalidArgument { field: String, reason: String },
    /// The named entity does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The entity already exists in a form that conflicts with the request.
    #[error("{0}")]
    AlreadyExists(String),
    /// The system is not in a state that allows the operation (e.g. a prerequisite is missing).
    #[error("{0}")]
    FailedPrecondition(String),
    /// A finite resource (address pool, quota) is used up.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The caller is known but not allowed to do this.
    #[error("{0}")]
    PermissionDenied(String),
    /// The caller could not be authenticated.
    #[error("{0}")]
    Unauthenticated(String),
    /// A concurrent writer kept winning; retrying the whole operation may succeed.
    #[error("{0}")]
    Aborted(String),
    /// A position outside what exists any more, e.g. a watch resuming from compacted history:
    /// the caller must start over (list, then watch).
    #[error("{0}")]
    OutOfRange(String),
    /// A dependency (store, remote service) cannot be reached right now.
    #[error("{0}")]
    Unavailable(String),
    /// The operation did not finish within its deadline.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// A bug or a corrupted record: never the caller's fault.
    #[error("{0}")]
    Internal(String),
}

impl Error {
    /// An [`Error::InvalidArgument`] naming `field`.
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The gRPC code this error maps to: the single source of that mapping.
    pub fn code(&self) -> Code {
        match self {
            Self::InvalidArgument { .. } => Code::InvalidArgument,
            Self::NotFound(_) => Code::NotFound,
            Self::AlreadyExists(_) => Code::AlreadyExists,
            Self::FailedPrecondition(_) => Code::FailedPrecondition,
            Self::ResourceExhausted(_) => Code::ResourceExhausted,
            Self::PermissionDenied(_) => Code::PermissionDenied,
            Self::Unauthenticated(_) => Code::Unauthenticated,
            Self::Aborted(_) => Code::Aborted,
            Self::OutOfRange(_) => Code::OutOfRange,
            Self::Unavailable(_) => Code::Unavailable,
            Self::DeadlineExceeded(_) => Code::DeadlineExceeded,
            Self::Internal(_) => Code::Internal,
        }
    }

    /// The error of a parser that named its fields relative to `parent`: an
    /// [`Error::InvalidArgument`]'s field becomes `parent.field` (unchanged when `parent` is
    /// empty); other kinds are returned as they are. Parsers of hot request paths name fields
    /// this way, so that a field's full path is only formatted when it is wrong.
    #[must_use]
    pub fn under(self, parent: &str) -> Self {
        match self {
            Self::InvalidArgument { field, reason } if !parent.is_empty() => {
                Self::InvalidArgument {
                    field: format!("{parent}.{field}"),
                    reason,
                }
            }
            other => other,
        }
    }

    /// Prefixes the message with context, keeping the kind (and so the gRPC code).
    #[must_use]
    pub fn context(self, what: impl std::fmt::Display) -> Self {
        match self {
            Self::InvalidArgument { field, reason } => Self::InvalidArgument {
                field,
                reason: format!("{what}: {reason}"),
            },
            Self::NotFound(m) => Self::NotFound(format!("{what}: {m}")),
            Self::AlreadyExists(m) => Self::AlreadyExists(format!("{what}: {m}")),
            Self::FailedPrecondition(m) => Self::FailedPrecondition(format!("{what}: {m}")),
            Self::ResourceExhausted(m) => Self::ResourceExhausted(format!("{what}: {m}")),
            Self::PermissionDenied(m) => Self::PermissionDenied(format!("{what}: {m}")),
            Self::Unauthenticated(m) => Self::Unauthenticated(format!("{what}: {m}")),
            Self::Aborted(m) => Self::Aborted(format!("{what}: {m}")),
            Self::OutOfRange(m) => Self::OutOfRange(format!("{what}: {m}")),
            Self::Unavailable(m) => Self::Unavailable(format!("{what}: {m}")),
            Self::DeadlineExceeded(m) => Self::DeadlineExceeded(format!("{what}: {m}")),
            Self::Internal(m) => Self::Internal(format!("{what}: {m}")),
        }
    }
}

impl From<Error> for Status {
    fn from(err: Error) -> Self {
        Status::new(err.code(), err.to_string())
    }
}

/// The reverse of the table, for a service that calls another one: the remote's status keeps
/// its meaning instead of collapsing into "internal".
impl From<Status> for Error {
    fn from(status: Status) -> Self {
        let msg = status.message().to_owned();
        match status.code() {
            Code::InvalidArgument => Self::InvalidArgument {
                field: "request".to_owned(),
                reason: msg,
            },
            Code::NotFound => Self::NotFound(msg),
            Code::AlreadyExists => Self::AlreadyExists(msg),
            Code::FailedPrecondition => Self::FailedPrecondition(msg),
            Code::ResourceExhausted => Self::ResourceExhausted(msg),
            Code::PermissionDenied => Self::PermissionDenied(msg),
            Code::Unauthenticated => Self::Unauthenticated(msg),
            Code::Aborted => Self::Aborted(msg),
            Code::OutOfRange => Self::OutOfRange(msg),
            Code::Unavailable | Code::Cancelled => Self::Unavailable(msg),
            Code::DeadlineExceeded => Self::DeadlineExceeded(msg),
            Code::Ok | Code::Unknown | Code::Unimplemented | Code::Internal | Code::DataLoss => {
                Self::Internal(format!("{}: {msg}", status.code()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn under_names_the_field_by_its_full_path() {
        let inner = Error::invalid("cluster_id", "is required");
        assert_eq!(
            inner.clone().under("network_config.origin").to_string(),
            "invalid network_config.origin.cluster_id: is required"
        );
        assert_eq!(inner.clone().under("").to_string(), inner.to_string());
        let other = Error::NotFound("no such relay".into());
        assert_eq!(other.clone().under("x").to_string(), other.to_string());
    }

    #[test]
    fn invalid_argument_names_the_field() {
        let status = Status::from(Error::invalid("pod_cidr", "not a CIDR"));
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), "invalid pod_cidr: not a CIDR");
    }

    #[test]
    fn codes_survive_a_round_trip_through_status() {
        let all = [
            Error::invalid("f", "r"),
            Error::NotFound("x".into()),
            Error::AlreadyExists("x".into()),
            Error::FailedPrecondition("x".into()),
            Error::ResourceExhausted("x".into()),
            Error::PermissionDenied("x".into()),
            Error::Unauthenticated("x".into()),
            Error::Aborted("x".into()),
            Error::OutOfRange("x".into()),
            Error::Unavailable("x".into()),
            Error::DeadlineExceeded("x".into()),
            Error::Internal("x".into()),
        ];
        for err in all {
            let code = err.code();
            let back = Error::from(Status::from(err));
            assert_eq!(back.code(), code);
        }
    }

    #[test]
    fn context_keeps_the_kind() {
        let err = Error::ResourceExhausted("pools full".into()).context("cluster c1");
        assert_eq!(err.code(), Code::ResourceExhausted);
        assert_eq!(err.to_string(), "cluster c1: pools full");
    }
}
