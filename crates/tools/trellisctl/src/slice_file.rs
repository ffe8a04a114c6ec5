//! Reading a Kubernetes `discovery.k8s.io/v1` EndpointSlice from a JSON file (what `kubectl get
//! endpointslice NAME -o json` prints) into the endpoints service's proto. Unknown fields are
//! ignored; labels Trellis sets itself are dropped; a malformed file is a usage error.

use std::collections::HashMap;
use std::io::Read as _;
use std::path::Path;

use serde::Deserialize;
use trellis_api::pb::endpoints as pb;

use crate::error::CtlError;

/// Label linking a slice to its Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Labels the target's writer sets itself; never carried over.
fn reserved_label(key: &str) -> bool {
    key == SERVICE_NAME_LABEL
        || key == "endpointslice.kubernetes.io/managed-by"
        || key.starts_with("trellis.io/")
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Slice {
    #[serde(default)]
    metadata: Metadata,
    address_type: String,
    #[serde(default)]
    endpoints: Vec<Endpoint>,
    #[serde(default)]
    ports: Vec<Port>,
}

#[derive(Debug, Default, Deserialize)]
struct Metadata {
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    labels: HashMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Endpoint {
    #[serde(default)]
    addresses: Vec<String>,
    #[serde(default)]
    conditions: Conditions,
    #[serde(default)]
    hostname: String,
    #[serde(default)]
    node_name: String,
    #[serde(default)]
    zone: String,
}

#[derive(Debug, Default, Deserialize)]
struct Conditions {
    ready: Option<bool>,
    serving: Option<bool>,
    terminating: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Port {
    #[serde(default)]
    name: String,
    port: Option<i32>,
    #[serde(default)]
    protocol: String,
    #[serde(default)]
    app_protocol: String,
}

/// Reads `path` (`-` = stdin) and converts it.
pub fn read(path: &Path) -> Result<pb::EndpointSlice, CtlError> {
    let shown = path.display();
    let text = if path == Path::new("-") {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| CtlError::Usage(format!("cannot read the slice from stdin: {e}")))?;
        text
    } else {
        std::fs::read_to_string(path)
            .map_err(|e| CtlError::Usage(format!("cannot read --file {shown}: {e}")))?
    };
    parse(&text).map_err(|reason| CtlError::Usage(format!("--file {shown}: {reason}")))
}

/// Converts the JSON text of an EndpointSlice.
pub fn parse(text: &str) -> Result<pb::EndpointSlice, String> {
    let slice: Slice = serde_json::from_str(text)
        .map_err(|e| format!("not a discovery.k8s.io/v1 EndpointSlice in JSON: {e}"))?;
    let address_type = match slice.address_type.as_str() {
        "IPv4" => pb::AddressType::Ipv4,
        "IPv6" => pb::AddressType::Ipv6,
        "FQDN" => pb::AddressType::Fqdn,
        other => return Err(format!("addressType {other:?} is not IPv4, IPv6 or FQDN")),
    };
    let mut labels = slice.metadata.labels;
    let service_name = labels
        .get(SERVICE_NAME_LABEL)
        .cloned()
        .ok_or_else(|| format!("metadata.labels has no {SERVICE_NAME_LABEL:?} (the Service)"))?;
    labels.retain(|key, _| !reserved_label(key));
    let ports = slice
        .ports
        .into_iter()
        .map(|p| {
            let protocol = match p.protocol.as_str() {
                "" => pb::Protocol::Unspecified,
                "TCP" => pb::Protocol::Tcp,
                "UDP" => pb::Protocol::Udp,
                "SCTP" => pb::Protocol::Sctp,
                other => return Err(format!("port protocol {other:?} is not TCP, UDP or SCTP")),
            };
            Ok(pb::EndpointPort {
                name: p.name,
                port: p.port,
                protocol: protocol.into(),
                app_protocol: p.app_protocol,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(pb::EndpointSlice {
        namespace: slice.metadata.namespace,
        name: slice.metadata.name,
        service_name,
        address_type: address_type.into(),
        endpoints: slice
            .endpoints
            .into_iter()
            .map(|e| pb::Endpoint {
                addresses: e.addresses,
                conditions: Some(pb::EndpointConditions {
                    ready: e.conditions.ready,
                    serving: e.conditions.serving,
                    terminating: e.conditions.terminating,
                }),
                hostname: e.hostname,
                node_name: e.node_name,
                zone: e.zone,
            })
            .collect(),
        ports,
        labels,
        service: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBECTL: &str = r#"{
      "apiVersion": "discovery.k8s.io/v1",
      "kind": "EndpointSlice",
      "metadata": {
        "name": "web-abc12",
        "namespace": "shop",
        "labels": {
          "kubernetes.io/service-name": "web",
          "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
          "app": "web"
        },
        "resourceVersion": "123"
      },
      "addressType": "IPv4",
      "endpoints": [
        {"addresses": ["10.0.3.7"], "conditions": {"ready": true}, "nodeName": "n1",
         "targetRef": {"kind": "Pod", "name": "web-1"}}
      ],
      "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]
    }"#;

    #[test]
    fn kubectl_output_is_accepted() {
        let slice = parse(KUBECTL).expect("parses");
        assert_eq!(slice.namespace, "shop");
        assert_eq!(slice.name, "web-abc12");
        assert_eq!(slice.service_name, "web");
        assert_eq!(slice.address_type, pb::AddressType::Ipv4 as i32);
        assert_eq!(
            slice.labels,
            HashMap::from([("app".to_owned(), "web".to_owned())])
        );
        assert_eq!(slice.endpoints[0].addresses, vec!["10.0.3.7".to_owned()]);
        assert_eq!(
            slice.endpoints[0].conditions.as_ref().and_then(|c| c.ready),
            Some(true)
        );
        assert_eq!(slice.endpoints[0].node_name, "n1");
        assert_eq!(slice.ports[0].port, Some(8080));
        assert_eq!(slice.ports[0].protocol, pb::Protocol::Tcp as i32);
    }

    #[test]
    fn malformed_files_say_what_is_wrong() {
        assert!(
            parse("{")
                .expect_err("bad json")
                .contains("not a discovery.k8s.io/v1")
        );
        let no_service = KUBECTL.replace("kubernetes.io/service-name", "x");
        assert!(
            parse(&no_service)
                .expect_err("no service")
                .contains("service-name")
        );
        let bad_type = KUBECTL.replace("\"IPv4\"", "\"IPv5\"");
        assert!(parse(&bad_type).expect_err("type").contains("IPv5"));
        let bad_proto = KUBECTL.replace("\"TCP\"", "\"QUIC\"");
        assert!(parse(&bad_proto).expect_err("proto").contains("QUIC"));
    }

    #[test]
    fn a_missing_file_is_a_usage_error() {
        let err = read(Path::new("/nonexistent/slice.json")).expect_err("missing");
        assert_eq!(err.exit_code(), 2);
        assert!(err.to_string().contains("/nonexistent/slice.json"), "{err}");
    }
}
