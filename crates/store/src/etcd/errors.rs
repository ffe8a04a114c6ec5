//! How etcd client failures become [`StoreError`]s, and the deadline every request runs under.

use std::future::Future;
use std::time::Duration;

use tonic::Code;

use crate::error::StoreError;
use crate::kv::{LeaseId, Revision};

/// How long one request may take before the store is considered unavailable. The client's
/// balanced channel waits for a reachable endpoint rather than failing, so without this a
/// request to a dead etcd would hang forever.
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs one etcd request under [`REQUEST_TIMEOUT`]; the outer error is the timeout, the inner
/// one etcd's answer, for callers that react to a particular etcd error.
pub(super) async fn request_raw<T>(
    what: &str,
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<Result<T, etcd_client::Error>, StoreError> {
    tokio::time::timeout(REQUEST_TIMEOUT, fut)
        .await
        .map_err(|_| {
            StoreError::Unavailable(format!(
                "etcd {what} did not finish within {}s",
                REQUEST_TIMEOUT.as_secs()
            ))
        })
}

/// Runs one etcd request under [`REQUEST_TIMEOUT`]; `lease` names the lease the request is
/// about, so "lease not found" can say which.
pub(super) async fn request<T>(
    what: &str,
    lease: Option<LeaseId>,
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, StoreError> {
    request_raw(what, fut)
        .await?
        .map_err(|err| from_etcd(what, err, lease))
}

pub(super) fn from_etcd(what: &str, err: etcd_client::Error, lease: Option<LeaseId>) -> StoreError {
    use etcd_client::Error;
    match err {
        Error::GRpcStatus(status) => from_status(what, &status, lease),
        Error::TransportError(err) => StoreError::Unavailable(format!("etcd {what}: {err}")),
        Error::IoError(err) => StoreError::Unavailable(format!("etcd {what}: {err}")),
        Error::LeaseKeepAliveError(msg) if msg.contains("not found") => match lease {
            Some(lease) => StoreError::LeaseNotFound(lease),
            None => StoreError::Internal(format!("etcd {what}: {msg}")),
        },
        other => StoreError::Internal(format!("etcd {what}: {other}")),
    }
}

fn from_status(what: &str, status: &tonic::Status, lease: Option<LeaseId>) -> StoreError {
    let message = format!("etcd {what}: {}", status.message());
    match (status.code(), lease) {
        // The only thing our requests can fail to find is a lease.
        (Code::NotFound, Some(lease)) => StoreError::LeaseNotFound(lease),
        // etcd gives its own failures specific codes; Unknown comes from the transport.
        (
            Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Aborted
            | Code::ResourceExhausted
            | Code::Unknown,
            _,
        ) => StoreError::Unavailable(message),
        (code, _) => StoreError::Internal(format!("{message} ({code:?})")),
    }
}

/// Whether etcd refused a read at a revision because it has been compacted.
pub(super) fn is_compacted(err: &etcd_client::Error) -> bool {
    matches!(err, etcd_client::Error::GRpcStatus(status) if status.code() == Code::OutOfRange)
}

/// The revision in a response header, which etcd always sends.
pub(super) fn header_revision(
    what: &str,
    header: Option<&etcd_client::ResponseHeader>,
) -> Result<Revision, StoreError> {
    header
        .map(etcd_client::ResponseHeader::revision)
        .ok_or_else(|| StoreError::Internal(format!("etcd {what} response has no header")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: Code) -> etcd_client::Error {
        etcd_client::Error::GRpcStatus(tonic::Status::new(code, "boom"))
    }

    #[test]
    fn transient_codes_are_unavailable() {
        for code in [Code::Unavailable, Code::DeadlineExceeded, Code::Unknown] {
            assert!(matches!(
                from_etcd("get", status(code), None),
                StoreError::Unavailable(msg) if msg == "etcd get: boom"
            ));
        }
    }

    #[test]
    fn not_found_names_the_lease() {
        assert_eq!(
            from_etcd("revoke", status(Code::NotFound), Some(LeaseId(3))),
            StoreError::LeaseNotFound(LeaseId(3))
        );
        let keep_alive = etcd_client::Error::LeaseKeepAliveError("lease not found".into());
        assert_eq!(
            from_etcd("keep-alive", keep_alive, Some(LeaseId(3))),
            StoreError::LeaseNotFound(LeaseId(3))
        );
    }

    #[test]
    fn the_rest_is_internal() {
        assert!(matches!(
            from_etcd("txn", status(Code::InvalidArgument), None),
            StoreError::Internal(msg) if msg.contains("boom") && msg.contains("InvalidArgument")
        ));
        assert!(is_compacted(&status(Code::OutOfRange)));
    }
}
