//! `trellisctl token`: the broker's peering token (Broker.GetToken), or a new one
//! (Broker.RotateToken with `--rotate`); join tokens, which expire and can be revoked: a new
//! one with the command that joins with it (`--join [--ttl]`, Broker.CreateJoinToken), the
//! list (`--list`), a revocation (`--revoke ID`).

use serde::Serialize;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::{
    CreateJoinTokenRequest, GetTokenRequest, JoinToken, ListJoinTokensRequest,
    RevokeJoinTokenRequest, RotateTokenRequest,
};

use crate::cli::{Globals, TokenArgs};
use crate::error::CtlError;
use crate::output::Report;
use crate::service::Service;
use crate::table::Table;
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
    /// With `--join`: the join token's id and when it expires.
    pub join_token_id: Option<String>,
    pub expire_time: Option<String>,
}

/// A join token as `--list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JoinTokenView {
    pub id: String,
    pub create_time: Option<String>,
    pub expire_time: Option<String>,
    pub description: String,
}

impl From<&JoinToken> for JoinTokenView {
    fn from(t: &JoinToken) -> Self {
        Self {
            id: t.id.clone(),
            create_time: rfc3339(t.create_time.as_ref()),
            expire_time: rfc3339(t.expire_time.as_ref()),
            description: t.description.clone(),
        }
    }
}

/// What `token` printed: the token, the join tokens, or a revocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum TokenOutput {
    Token(TokenView),
    List { join_tokens: Vec<JoinTokenView> },
    Revoked { id: String, revoked: bool },
}

impl Report for TokenOutput {
    fn table(&self) -> String {
        match self {
            Self::Token(view) => view.table(),
            Self::List { join_tokens } => {
                let mut table = Table::new(&["ID", "EXPIRES", "CREATED", "DESCRIPTION"]);
                for t in join_tokens {
                    table.row([
                        t.id.clone(),
                        t.expire_time.clone().unwrap_or_default(),
                        t.create_time.clone().unwrap_or_default(),
                        t.description.clone(),
                    ]);
                }
                if table.is_empty() {
                    "no join tokens\n".into()
                } else {
                    table.render()
                }
            }
            Self::Revoked { id, revoked: true } => format!("revoked join token {id}\n"),
            Self::Revoked { id, revoked: false } => {
                format!("no join token {id} (already revoked or expired long ago)\n")
            }
        }
    }
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
pub async fn run(globals: &Globals, args: &TokenArgs) -> Result<TokenOutput, CtlError> {
    let target = globals.target(Service::Broker);
    let mut broker = BrokerClient::new(globals.connect(&target).await?);
    if args.list {
        let reply = broker
            .list_join_tokens(ListJoinTokensRequest {})
            .await
            .map_err(|s| CtlError::rpc(&target, "ListJoinTokens", &s))?
            .into_inner();
        return Ok(TokenOutput::List {
            join_tokens: reply.join_tokens.iter().map(JoinTokenView::from).collect(),
        });
    }
    if let Some(id) = &args.revoke {
        let reply = broker
            .revoke_join_token(RevokeJoinTokenRequest { id: id.clone() })
            .await
            .map_err(|s| CtlError::rpc(&target, "RevokeJoinToken", &s))?
            .into_inner();
        return Ok(TokenOutput::Revoked {
            id: id
                .split_once('.')
                .map_or(id.as_str(), |(id, _)| id)
                .to_owned(),
            revoked: reply.revoked,
        });
    }
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
        return Ok(TokenOutput::Token(TokenView {
            token: reply.token,
            create_time: None,
            rotated: true,
            previous_token_expire_time: rfc3339(reply.previous_token_expire_time.as_ref()),
            ca_cert_hash: None,
            join: None,
            join_token_id: None,
            expire_time: None,
        }));
    }
    let reply = broker
        .get_token(GetTokenRequest {})
        .await
        .map_err(|s| CtlError::rpc(&target, "GetToken", &s))?
        .into_inner();
    let ca_cert_hash = (!reply.ca_cert_hash.is_empty()).then_some(reply.ca_cert_hash);
    if !args.join {
        return Ok(TokenOutput::Token(TokenView {
            token: reply.token,
            create_time: rfc3339(reply.create_time.as_ref()),
            rotated: false,
            previous_token_expire_time: None,
            ca_cert_hash,
            join: None,
            join_token_id: None,
            expire_time: None,
        }));
    }
    if reply.advertised_broker.is_empty() {
        return Err(CtlError::Failed(
            "--join: this cluster advertises no broker address (discovery's \
             --advertise-broker), so no other cluster could reach it"
                .into(),
        ));
    }
    let created = broker
        .create_join_token(CreateJoinTokenRequest {
            ttl: args.ttl.map(|d| prost_types::Duration {
                seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
                nanos: 0,
            }),
            description: args.description.clone().unwrap_or_default(),
        })
        .await
        .map_err(|s| CtlError::rpc(&target, "CreateJoinToken", &s))?
        .into_inner();
    let made = created.join_token.unwrap_or_default();
    Ok(TokenOutput::Token(TokenView {
        join: Some(join_command(
            &reply.advertised_broker,
            &created.token,
            ca_cert_hash.as_deref(),
        )),
        token: created.token,
        create_time: rfc3339(made.create_time.as_ref()),
        rotated: false,
        previous_token_expire_time: None,
        ca_cert_hash,
        join_token_id: Some(made.id),
        expire_time: rfc3339(made.expire_time.as_ref()),
    }))
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
            join_token_id: None,
            expire_time: None,
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
                               "ca_cert_hash": null, "join": null,
                               "join_token_id": null, "expire_time": null})
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
