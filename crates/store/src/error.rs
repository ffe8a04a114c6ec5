//! What a store operation can fail with, and how that maps onto the domain error.

use crate::kv::{LeaseId, Revision};

/// Why a store operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The backend cannot be reached or did not answer in time; retrying later may succeed.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A watch asked to replay history the store no longer keeps.
    #[error(
        "watch start revision {requested} is compacted (oldest replayable revision is \
         {compacted}); relist and watch from the listing's revision"
    )]
    Compacted {
        /// The start revision the watch asked for.
        requested: Revision,
        /// The oldest start revision the store could still replay from.
        compacted: Revision,
    },
    /// The lease expired, was revoked, or never existed.
    #[error("lease {0} not found (expired or revoked)")]
    LeaseNotFound(LeaseId),
    /// The store URL is malformed; the message says how.
    #[error("invalid store url: {0}")]
    InvalidUrl(String),
    /// The backend answered with something that should not happen: a bug, not a transient
    /// condition.
    #[error("store internal error: {0}")]
    Internal(String),
}

/// The store's errors in domain terms.
///
/// [`StoreError::Compacted`] becomes [`OutOfRange`](trellis_error::Error::OutOfRange): the
/// requested history is gone, and restarting the whole list-then-watch cycle succeeds, which is
/// what gRPC's `OUT_OF_RANGE` tells a watch client.
impl From<StoreError> for trellis_error::Error {
    fn from(err: StoreError) -> Self {
        let msg = err.to_string();
        match err {
            StoreError::Unavailable(_) => Self::Unavailable(msg),
            StoreError::Compacted { .. } => Self::OutOfRange(msg),
            StoreError::LeaseNotFound(_) => Self::NotFound(msg),
            StoreError::InvalidUrl(reason) => Self::invalid("store", reason),
            StoreError::Internal(_) => Self::Internal(msg),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_error::Error;

    #[test]
    fn maps_onto_domain_errors() {
        let compacted = StoreError::Compacted {
            requested: 3,
            compacted: 9,
        };
        assert!(matches!(
            Error::from(StoreError::Unavailable("x".into())),
            Error::Unavailable(_)
        ));
        assert!(matches!(Error::from(compacted), Error::OutOfRange(_)));
        assert!(matches!(
            Error::from(StoreError::LeaseNotFound(LeaseId(7))),
            Error::NotFound(_)
        ));
        assert!(matches!(
            Error::from(StoreError::Internal("x".into())),
            Error::Internal(_)
        ));
    }

    #[test]
    fn invalid_url_names_the_store_field() {
        let err = Error::from(StoreError::InvalidUrl("unknown scheme \"x\"".into()));
        assert_eq!(err, Error::invalid("store", "unknown scheme \"x\""));
        assert_eq!(err.to_string(), "invalid store: unknown scheme \"x\"");
    }

    #[test]
    fn messages_are_lowercase_and_specific() {
        let err = StoreError::Compacted {
            requested: 3,
            compacted: 9,
        };
        assert!(
            err.to_string()
                .starts_with("watch start revision 3 is compacted")
        );
        assert_eq!(
            StoreError::LeaseNotFound(LeaseId(255)).to_string(),
            "lease ff not found (expired or revoked)"
        );
    }
}
