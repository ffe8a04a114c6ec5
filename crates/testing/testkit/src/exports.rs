//! The service exports the endpoint tests send, in-process or to real processes.
//!
//! One builder, so every test exports the same port and states readiness the same way, and a
//! change to the export API changes one place.

use trellis_api::pb::endpoints::{EndpointPort, ExportServiceRequest, ExportedEndpoint};

/// The export of service `namespace/name` (port `http` 8080) with `endpoints`, each
/// `(address, ready)`.
pub fn export_request(
    namespace: &str,
    name: &str,
    endpoints: &[(String, bool)],
) -> ExportServiceRequest {
    ExportServiceRequest {
        namespace: namespace.into(),
        name: name.into(),
        ports: vec![EndpointPort {
            name: "http".into(),
            port: Some(8080),
            ..Default::default()
        }],
        endpoints: endpoints
            .iter()
            .map(|(address, ready)| ExportedEndpoint {
                address: address.clone(),
                ready: Some(*ready),
            })
            .collect(),
    }
}
