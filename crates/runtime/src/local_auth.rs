//! Authentication of this cluster's own callers on the plaintext listener (ADR 0020): one
//! shared local token per cluster (a Kubernetes Secret mounted in every Trellis pod, read from
//! `--local-token-file`). With it, a call on the plaintext listener must carry
//! `authorization: Bearer <token>` unless it is health, reflection or one of the service's
//! cluster-facing methods (those are authenticated by mutual TLS on the peer listener, ADR
//! 0014, or trust claimed identities in plaintext mode, as before). Services send the token
//! on the channels to their local peers ([`crate::client::local_channel`]), never on channels
//! to other clusters.
//!
//! - [`LocalToken`]: the token, or off; its `Debug` never shows it;
//! - [`LocalAuthLayer`]: the tower layer that refuses an unauthenticated call with
//!   UNAUTHENTICATED before any handler runs, so nothing changes.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;

use crate::admission::{AdmissionLayer, Check};
use crate::log_limit::LogLimit;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};

/// The header carrying the token.
pub const HEADER: &str = "authorization";

/// This cluster's local token, or off (no `--local-token-file`: every caller is trusted, as
/// before issue 20).
#[derive(Clone, Default)]
pub struct LocalToken(Option<Arc<str>>);

impl fmt::Debug for LocalToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "LocalToken(<redacted>)"
        } else {
            "LocalToken(off)"
        })
    }
}

impl LocalToken {
    /// No local authentication.
    pub fn off() -> Self {
        Self(None)
    }

    /// `token` (16 to 256 printable ASCII characters without spaces).
    pub fn new(token: &str) -> anyhow::Result<Self> {
        if token.len() < 16 || token.len() > 256 {
            anyhow::bail!("the local token must be 16 to 256 characters long");
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            anyhow::bail!("the local token must be printable ASCII without spaces");
        }
        Ok(Self(Some(token.into())))
    }

    /// The token in the file at `path`, surrounding whitespace (a trailing newline) removed.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).context("cannot read the local token")?;
        Self::new(text.trim())
    }

    /// Whether calls are authenticated.
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Adds the token to an outgoing request's metadata (nothing when off).
    pub fn attach(&self, metadata: &mut MetadataMap) {
        if let Some(token) = &self.0
            && let Ok(value) = AsciiMetadataValue::try_from(format!("Bearer {token}"))
        {
            metadata.insert(HEADER, value);
        }
    }

    /// Whether the `authorization` header `presented` carries this token (always when off).
    /// Compared in constant time wherever the first difference is.
    pub fn accepts(&self, presented: Option<&http::HeaderValue>) -> bool {
        let Some(token) = &self.0 else {
            return true;
        };
        let Some(bearer) = presented
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
        else {
            return false;
        };
        bearer.len() == token.len()
            && bearer
                .bytes()
                .zip(token.bytes())
                .fold(0u8, |acc, (x, y)| acc | (x ^ y))
                == 0
    }
}

/// Paths served without the token: health, reflection, and the cluster-facing methods.
fn exempt(path: &str, cluster_facing: &[&str]) -> bool {
    path.starts_with("/grpc.health.v1.Health/")
        || path.starts_with("/grpc.reflection.")
        || cluster_facing.contains(&path)
}

/// What the plaintext listener checks: the local token on every path except health,
/// reflection and the cluster-facing methods.
#[derive(Debug, Clone)]
pub struct LocalAuth {
    token: LocalToken,
    cluster_facing: Vec<&'static str>,
}

/// A tower layer enforcing the local token on the plaintext listener.
pub type LocalAuthLayer = AdmissionLayer<LocalAuth>;

impl LocalAuth {
    /// Requires `token` on every path except health, reflection and `cluster_facing`.
    pub fn layer(token: LocalToken, cluster_facing: Vec<&'static str>) -> LocalAuthLayer {
        AdmissionLayer::new(Self {
            token,
            cluster_facing,
        })
    }
}

impl Check for LocalAuth {
    fn check<B>(&self, request: &http::Request<B>) -> std::result::Result<(), tonic::Status> {
        let path = request.uri().path();
        if !self.token.is_on()
            || exempt(path, &self.cluster_facing)
            || self.token.accepts(request.headers().get(HEADER))
        {
            return Ok(());
        }
        let presented = request.headers().contains_key(HEADER);
        // Anyone who reaches the listener can trigger it: one line per period.
        static REFUSALS: LogLimit = LogLimit::new(crate::log_limit::PERIOD);
        if let Some(held_back) = REFUSALS.admit() {
            tracing::warn!(
                path,
                presented,
                held_back,
                "refused an intra-cluster call without this cluster's local token"
            );
        }
        Err(tonic::Status::unauthenticated(format!(
            "{path} needs this cluster's local token (authorization: Bearer, see \
             --local-token-file); {}",
            if presented {
                "the one presented is not it"
            } else {
                "none was presented"
            }
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef-local";

    fn header(value: &str) -> http::HeaderValue {
        http::HeaderValue::from_str(value).expect("header")
    }

    #[test]
    fn only_the_exact_bearer_token_is_accepted() {
        let token = LocalToken::new(TOKEN).expect("valid");
        assert!(token.accepts(Some(&header(&format!("Bearer {TOKEN}")))));
        for bad in [
            TOKEN.to_owned(),
            format!("Bearer {TOKEN}x"),
            format!("Bearer {}", &TOKEN[1..]),
            format!("bearer {TOKEN}"),
            "Bearer ".to_owned(),
        ] {
            assert!(!token.accepts(Some(&header(&bad))), "{bad}");
        }
        assert!(!token.accepts(None));
        assert!(LocalToken::off().accepts(None), "off trusts every caller");
    }

    #[test]
    fn attach_sends_what_accepts_expects_and_debug_hides_it() {
        let token = LocalToken::new(TOKEN).expect("valid");
        let mut metadata = MetadataMap::new();
        token.attach(&mut metadata);
        let sent = metadata.into_headers();
        assert!(token.accepts(sent.get(HEADER)));
        assert!(!format!("{token:?}").contains(TOKEN));
        let mut none = MetadataMap::new();
        LocalToken::off().attach(&mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn unusable_tokens_and_files_are_refused() {
        assert!(LocalToken::new("short").is_err());
        assert!(LocalToken::new("with a space inside it").is_err());
        assert!(LocalToken::new(&"x".repeat(257)).is_err());
        let dir = std::env::temp_dir().join(format!("trellis-local-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("token");
        std::fs::write(&file, format!("{TOKEN}\n")).expect("write");
        let token = LocalToken::from_file(&file).expect("reads, trailing newline dropped");
        assert!(token.accepts(Some(&header(&format!("Bearer {TOKEN}")))));
        assert!(LocalToken::from_file(&dir.join("missing")).is_err());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn health_reflection_and_cluster_facing_methods_are_exempt() {
        let facing = ["/trellis.peering.v1.Broker/Handshake"];
        assert!(exempt("/grpc.health.v1.Health/Check", &facing));
        assert!(exempt(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            &facing
        ));
        assert!(exempt("/trellis.peering.v1.Broker/Handshake", &facing));
        assert!(!exempt("/trellis.peering.v1.Broker/GetToken", &facing));
    }
}
