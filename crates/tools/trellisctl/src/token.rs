//! `trellisctl token`: the broker's peering token (Broker.GetToken), or a new one
//! (Broker.RotateToken with `--rotate`).

use serde::Serialize;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::{GetTokenRequest, RotateTokenRequest};

use crate::cli::{Globals, TokenArgs};
use crate::error::CtlError;
use crate::output::Report;
use crate::service::Service;
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
    /// With mutual TLS: the hash that pins this cluster's CA (`peer --ca-cert-hash`).
    pub ca_cert_hash: Option<String>,
    /// With `--join`: the command a joining cluster runs.
    pub join: Option<String>,
}

impl Report for TokenView {
    fn table(&self) -> String {
        match &self.join {
            Some(join) => format!("{join}\n"),
            None => format!("{}\n", self.token),
        }
    }
}

/// The join command for a cluster advertising `broker` with `token` (and `hash` with TLS).
fn join_command(broker: &str, token: &str, hash: Option<&str>) -> String {
    let mut command = format!("trellisctl peer --remote-broker {broker} --token {token}");
    if let Some(hash) = hash {
        command.push_str(&format!(" --ca-cert-hash {hash}"));
    }
    command
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
            ca_cert_hash: None,
            join: None,
        })
    } else {
        let reply = broker
            .get_token(GetTokenRequest {})
            .await
            .map_err(|s| CtlError::rpc(&target, "GetToken", &s))?
            .into_inner();
        let ca_cert_hash = (!reply.ca_cert_hash.is_empty()).then_some(reply.ca_cert_hash);
        let join = if args.join {
            if reply.advertised_broker.is_empty() {
                return Err(CtlError::Failed(
                    "--join: this cluster advertises no broker address (discovery's \
                     --advertise-broker), so no other cluster could reach it"
                        .into(),
                ));
            }
            Some(join_command(
                &reply.advertised_broker,
                &reply.token,
                ca_cert_hash.as_deref(),
            ))
        } else {
            None
        };
        Ok(TokenView {
            token: reply.token,
            create_time: rfc3339(reply.create_time.as_ref()),
            rotated: false,
            previous_token_expire_time: None,
            ca_cert_hash,
            join,
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
            ca_cert_hash: None,
            join: None,
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
                               "rotated": false, "previous_token_expire_time": null,
                               "ca_cert_hash": null, "join": null})
        );
    }
}

#[cfg(test)]
mod join_tests {
    use super::*;

    #[test]
    fn the_join_command_pins_the_ca_when_there_is_one() {
        assert_eq!(
            join_command("hub:7112", "tok", Some("sha256:ab")),
            "trellisctl peer --remote-broker hub:7112 --token tok --ca-cert-hash sha256:ab"
        );
        assert_eq!(
            join_command("hub:7102", "tok", None),
            "trellisctl peer --remote-broker hub:7102 --token tok"
        );
    }
}
