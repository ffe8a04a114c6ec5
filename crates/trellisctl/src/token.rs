//! `trellisctl token`: the broker's peering token (Broker.GetToken), or a new one
//! (Broker.RotateToken with `--rotate`).

use serde::Serialize;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::{GetTokenRequest, RotateTokenRequest};

use crate::cli::{Globals, TokenArgs};
use crate::connect::Service;
use crate::error::CtlError;
use crate::output::Report;
use crate::units::rfc3339;

/// The token. The table form is the token alone, for `$(trellisctl token)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TokenView {
    pub token: String,
    /// When the current token was generated (null after `--rotate`).
    pub create_time: Option<String>,
    /// Whether this call replaced the token.
    pub rotated: bool,
    /// With `--rotate`: until when the previous token is still accepted; null when it is
    /// already invalid (and without `--rotate`).
    pub previous_token_expire_time: Option<String>,
}

impl Report for TokenView {
    fn table(&self) -> String {
        format!("{}\n", self.token)
    }
}

/// Runs `token`.
pub async fn run(globals: &Globals, args: &TokenArgs) -> Result<TokenView, CtlError> {
    let target = globals.target(Service::Broker);
    let mut broker = BrokerClient::new(globals.connect(&target).await?);
    if args.rotate {
        let grace = prost_types::Duration {
            seconds: i64::try_from(args.grace).unwrap_or(i64::MAX),
            nanos: 0,
        };
        let reply = broker
            .rotate_token(RotateTokenRequest {
                grace_period: Some(grace),
            })
            .await
            .map_err(|s| CtlError::rpc(&target, "RotateToken", &s))?
            .into_inner();
        Ok(TokenView {
            token: reply.token,
            create_time: None,
            rotated: true,
            previous_token_expire_time: rfc3339(reply.previous_token_expire_time.as_ref()),
        })
    } else {
        let reply = broker
            .get_token(GetTokenRequest {})
            .await
            .map_err(|s| CtlError::rpc(&target, "GetToken", &s))?
            .into_inner();
        Ok(TokenView {
            token: reply.token,
            create_time: rfc3339(reply.create_time.as_ref()),
            rotated: false,
            previous_token_expire_time: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::OutputFormat;
    use crate::output::render;

    #[test]
    fn table_is_the_token_alone_and_json_has_the_times() {
        let view = TokenView {
            token: "abc".into(),
            create_time: Some("2025-01-01T00:00:00Z".into()),
            rotated: false,
            previous_token_expire_time: None,
        };
        assert_eq!(
            render(&view, OutputFormat::Table).expect("renders"),
            "abc\n"
        );
        let json: serde_json::Value =
            serde_json::from_str(&render(&view, OutputFormat::Json).expect("renders"))
                .expect("json");
        assert_eq!(
            json,
            serde_json::json!({"token": "abc", "create_time": "2025-01-01T00:00:00Z",
                               "rotated": false, "previous_token_expire_time": null})
        );
    }
}
