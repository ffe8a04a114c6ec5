//! What can go wrong in a `trellisctl` command, worded for an operator, and the exit code of each
//! case: 2 for bad usage, 1 for everything else.

use std::fmt;

use tonic::{Code, Status};

use crate::service::{Service, Target};

/// A failed command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CtlError {
    /// The command line or an input file is wrong; nothing was sent.
    Usage(String),
    /// The service could not be connected to.
    Unreachable {
        service: Service,
        address: String,
        reason: String,
    },
    /// The service answered a call with a gRPC error.
    Rpc {
        service: Service,
        address: String,
        rpc: &'static str,
        code: Code,
        message: String,
    },
    /// Anything else (e.g. stdout closed, nothing answered).
    Failed(String),
}

impl CtlError {
    /// A gRPC error answered by `target` to `rpc`.
    pub fn rpc(target: &Target, rpc: &'static str, status: &Status) -> Self {
        Self::Rpc {
            service: target.service,
            address: target.address.clone(),
            rpc,
            code: status.code(),
            message: status.message().to_owned(),
        }
    }

    /// The process exit code for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            CtlError::Usage(_) => 2,
            _ => 1,
        }
    }
}

impl fmt::Display for CtlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CtlError::Usage(message) | CtlError::Failed(message) => f.write_str(message),
            CtlError::Unreachable {
                service,
                address,
                reason,
            } => write!(
                f,
                "cannot reach {} at {address}: {reason} (is {} running? set {})",
                service.label(),
                service.binary(),
                service.flag()
            ),
            CtlError::Rpc {
                service,
                address,
                rpc,
                code,
                message,
            } => {
                write!(
                    f,
                    "{} at {address} failed {rpc}: {}",
                    service.label(),
                    code_name(*code)
                )?;
                if !message.is_empty() {
                    write!(f, ": {message}")?;
                }
                if matches!(code, Code::DeadlineExceeded | Code::Cancelled) {
                    f.write_str(" (a longer --timeout may help)")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for CtlError {}

/// The canonical upper-case name of a gRPC status code ("PERMISSION_DENIED").
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn broker() -> Target {
        Target {
            service: Service::Broker,
            address: "127.0.0.1:7102".into(),
        }
    }

    #[test]
    fn unreachable_names_the_service_binary_and_flag() {
        let err = CtlError::Unreachable {
            service: Service::Ipam,
            address: "10.0.0.1:7104".into(),
            reason: "connection refused".into(),
        };
        assert_eq!(
            err.to_string(),
            "cannot reach the IPAM at 10.0.0.1:7104: connection refused \
             (is trellis-ipam running? set --ipam)"
        );
        assert_eq!(err.exit_code(), 1);
    }

    #[test]
    fn grpc_errors_show_code_and_message() {
        let err = CtlError::rpc(&broker(), "Peer", &Status::permission_denied("wrong token"));
        assert_eq!(
            err.to_string(),
            "the broker at 127.0.0.1:7102 failed Peer: PERMISSION_DENIED: wrong token"
        );
        let slow = CtlError::rpc(&broker(), "Peer", &Status::deadline_exceeded(""));
        assert_eq!(
            slow.to_string(),
            "the broker at 127.0.0.1:7102 failed Peer: DEADLINE_EXCEEDED (a longer --timeout may help)"
        );
    }

    #[test]
    fn usage_is_exit_code_2() {
        assert_eq!(CtlError::Usage("bad".into()).exit_code(), 2);
        assert_eq!(CtlError::Failed("bad".into()).exit_code(), 1);
    }
}
