//! The `trellis.endpoints.v1.EndpointMapper` gRPC handlers: validate the request into domain
//! values (errors name the field), call [`Endpoints`], map the answer back. Nothing else
//! happens here.

use std::sync::Arc;

use tonic::{Request, Response, Status};
use trellis_api::pb::endpoints as pb;
use trellis_api::pb::endpoints::endpoint_mapper_server::EndpointMapper;
use trellis_api::{ClusterId, convert};
use trellis_error::{Error, Result};
use trellis_runtime::peer::{Authz, PeerMethods};

use crate::convert::port;
use crate::core::Endpoints;
use crate::core::translation::Translation;
use crate::exports::{ExportView, slice_of};
use crate::model::{MAX_ENDPOINTS, Slice, dns_label, dns_subdomain};
use crate::records::{ExportRecord, ExportSource, ExportedEndpoint, ReflectedRecord};

/// The gRPC face of one [`Endpoints`].
#[derive(Debug, Clone)]
pub struct EndpointsService {
    core: Arc<Endpoints>,
    authz: Authz,
}

/// The methods the peer listener serves (ADR 0014): a full peer pushing the slices it reflects
/// to us.
pub const PEER_METHODS: PeerMethods = PeerMethods {
    authenticated: &[
        "/trellis.endpoints.v1.EndpointMapper/ApplyReflectedSlice",
        "/trellis.endpoints.v1.EndpointMapper/DeleteReflectedSlice",
    ],
    anonymous: &[],
};

impl EndpointsService {
    /// Without mutual TLS: the source a request claims is trusted.
    pub fn new(core: Arc<Endpoints>) -> Self {
        Self::with_authz(core, Authz::off())
    }

    /// With `authz` checking the caller's certificate against the slice's source.
    pub fn with_authz(core: Arc<Endpoints>, authz: Authz) -> Self {
        Self { core, authz }
    }
}

fn translation(t: Translation) -> pb::AddressTranslation {
    pb::AddressTranslation {
        original_address: t.original,
        translated_address: t.translated,
        path: t.path.to_pb().into(),
        home_cluster: t.home.as_ref().map(convert::identity_to_pb),
        detail: t.detail,
    }
}

fn reflected(rec: ReflectedRecord) -> pb::ReflectedSlice {
    pb::ReflectedSlice {
        source: Some(convert::identity_to_pb(&rec.source)),
        slice: Some(rec.slice.to_pb()),
        generation: rec.generation,
        object_name: rec.object_name.unwrap_or_default(),
        update_time: Some(convert::timestamp(rec.update_time_nanos)),
    }
}

fn export_to_pb(view: ExportView) -> pb::Export {
    let slice = slice_of(&view.export).to_pb();
    pb::Export {
        namespace: view.export.namespace,
        name: view.export.name,
        ports: slice.ports,
        endpoints: view
            .export
            .endpoints
            .into_iter()
            .map(|e| pb::ExportedEndpoint {
                address: e.address,
                ready: Some(e.ready),
            })
            .collect(),
        reflected_to: view.reflected_to.iter().map(ToString::to_string).collect(),
        update_time: Some(convert::timestamp(view.export.update_time_nanos)),
    }
}

/// Validates an ExportService request into a record (the pod-CIDR check of the addresses is
/// the core's: it needs the local IPAM).
fn export_from_pb(req: &pb::ExportServiceRequest) -> Result<ExportRecord> {
    let namespace = dns_label("namespace", &req.namespace)?;
    let name = dns_label("name", &req.name)?;
    if req.ports.is_empty() {
        return Err(Error::invalid("ports", "at least one port is required"));
    }
    let ports = req
        .ports
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let field = format!("ports[{i}]");
            if p.port.is_none() {
                return Err(Error::invalid(format!("{field}.port"), "is required"));
            }
            port(&field, p)
        })
        .collect::<Result<Vec<_>>>()?;
    if req.endpoints.len() > MAX_ENDPOINTS {
        return Err(Error::invalid(
            "endpoints",
            format!(
                "has {} endpoints; at most {MAX_ENDPOINTS}",
                req.endpoints.len()
            ),
        ));
    }
    let mut family = None;
    let mut endpoints = Vec::with_capacity(req.endpoints.len());
    for (i, e) in req.endpoints.iter().enumerate() {
        let field = format!("endpoints[{i}].address");
        let ip = trellis_api::wire::ip(&field, &e.address)?;
        if *family.get_or_insert(ip.is_ipv4()) != ip.is_ipv4() {
            return Err(Error::invalid(
                field,
                "mixes address families; one export has one family",
            ));
        }
        endpoints.push(ExportedEndpoint {
            address: ip.to_string(),
            ready: e.ready.unwrap_or(true),
            hostname: None,
        });
    }
    Ok(ExportRecord {
        namespace,
        name,
        ports,
        endpoints,
        update_time_nanos: 0,
        source: ExportSource::Grpc,
        service: None,
    })
}

fn optional_id(field: &str, value: &str) -> Result<Option<ClusterId>> {
    if value.is_empty() {
        Ok(None)
    } else {
        ClusterId::parse(field, value).map(Some)
    }
}

#[tonic::async_trait]
impl EndpointMapper for EndpointsService {
    async fn reflect_endpoint_slice(
        &self,
        request: Request<pb::ReflectEndpointSliceRequest>,
    ) -> Result<Response<pb::ReflectEndpointSliceResponse>, Status> {
        let req = request.into_inner();
        let target = convert::identity_from_pb("target", req.target.as_ref())?;
        let slice = Slice::from_pb("slice", req.slice.as_ref())?;
        let done = self.core.reflect(&target, slice, req.deliver).await?;
        Ok(Response::new(pb::ReflectEndpointSliceResponse {
            slice: Some(done.slice.to_pb()),
            translations: done.translations.into_iter().map(translation).collect(),
            delivered: done.delivered,
        }))
    }

    async fn unreflect_endpoint_slice(
        &self,
        request: Request<pb::UnreflectEndpointSliceRequest>,
    ) -> Result<Response<pb::UnreflectEndpointSliceResponse>, Status> {
        let req = request.into_inner();
        let target = convert::identity_from_pb("target", req.target.as_ref())?;
        let namespace = dns_label("namespace", &req.namespace)?;
        let name = dns_subdomain("name", &req.name)?;
        let done = self
            .core
            .unreflect(&target, &namespace, &name, req.deliver)
            .await?;
        Ok(Response::new(pb::UnreflectEndpointSliceResponse {
            unreflected: done.unreflected,
            released_addresses: done.released,
            delivered: done.delivered,
        }))
    }

    async fn apply_reflected_slice(
        &self,
        request: Request<pb::ApplyReflectedSliceRequest>,
    ) -> Result<Response<pb::ApplyReflectedSliceResponse>, Status> {
        const RPC: &str = "ApplyReflectedSlice";
        let peer = self.authz.peer(&request, RPC)?;
        let req = request.into_inner();
        let source = convert::identity_from_pb("source", req.source.as_ref())?;
        // A cluster pushes only the slices it reflects itself.
        self.authz
            .require(peer.as_ref(), RPC, "source", source.id.as_str())?;
        let slice = Slice::from_pb("slice", req.slice.as_ref())?;
        if req.generation <= 0 {
            return Err(Error::invalid("generation", "must be positive").into());
        }
        if source.id == self.core.local().id {
            return Err(Error::invalid("source.cluster_id", "is this cluster").into());
        }
        let answer = self.core.apply(&source, slice, req.generation).await?;
        Ok(Response::new(pb::ApplyReflectedSliceResponse {
            applied: answer.applied,
            object_name: answer.object_name.unwrap_or_default(),
            held_generation: answer.held,
        }))
    }

    async fn delete_reflected_slice(
        &self,
        request: Request<pb::DeleteReflectedSliceRequest>,
    ) -> Result<Response<pb::DeleteReflectedSliceResponse>, Status> {
        const RPC: &str = "DeleteReflectedSlice";
        let peer = self.authz.peer(&request, RPC)?;
        let req = request.into_inner();
        let source = convert::identity_from_pb("source", req.source.as_ref())?;
        self.authz
            .require(peer.as_ref(), RPC, "source", source.id.as_str())?;
        let namespace = dns_label("namespace", &req.namespace)?;
        let name = dns_subdomain("name", &req.name)?;
        let deleted = self.core.delete(&source, &namespace, &name).await?;
        Ok(Response::new(pb::DeleteReflectedSliceResponse { deleted }))
    }

    async fn list_reflected_slices(
        &self,
        request: Request<pb::ListReflectedSlicesRequest>,
    ) -> Result<Response<pb::ListReflectedSlicesResponse>, Status> {
        let req = request.into_inner();
        let source = optional_id("source_cluster_id", &req.source_cluster_id)?;
        let namespace = if req.namespace.is_empty() {
            None
        } else {
            Some(dns_label("namespace", &req.namespace)?)
        };
        let slices = self
            .core
            .list(source.as_ref(), namespace.as_deref())
            .await?;
        Ok(Response::new(pb::ListReflectedSlicesResponse {
            reflected_slices: slices.into_iter().map(reflected).collect(),
        }))
    }

    async fn export_service(
        &self,
        request: Request<pb::ExportServiceRequest>,
    ) -> Result<Response<pb::ExportServiceResponse>, Status> {
        let export = export_from_pb(request.get_ref())?;
        let stored = self.core.export(export).await?;
        Ok(Response::new(pb::ExportServiceResponse {
            export: Some(export_to_pb(ExportView {
                export: stored,
                reflected_to: Vec::new(),
            })),
        }))
    }

    async fn unexport_service(
        &self,
        request: Request<pb::UnexportServiceRequest>,
    ) -> Result<Response<pb::UnexportServiceResponse>, Status> {
        let req = request.into_inner();
        let namespace = dns_label("namespace", &req.namespace)?;
        let name = dns_label("name", &req.name)?;
        let unexported = self
            .core
            .unexport(&namespace, &name, ExportSource::Grpc)
            .await?;
        Ok(Response::new(pb::UnexportServiceResponse { unexported }))
    }

    async fn list_exports(
        &self,
        _request: Request<pb::ListExportsRequest>,
    ) -> Result<Response<pb::ListExportsResponse>, Status> {
        let exports = self.core.list_exports().await?;
        Ok(Response::new(pb::ListExportsResponse {
            exports: exports.into_iter().map(export_to_pb).collect(),
        }))
    }
}

/// The gRPC routes of the endpoints service.
pub fn routes(core: Arc<Endpoints>, authz: Authz) -> tonic::service::Routes {
    tonic::service::Routes::new(
        trellis_api::pb::endpoints::endpoint_mapper_server::EndpointMapperServer::new(
            EndpointsService::with_authz(core, authz),
        )
        .max_decoding_message_size(crate::MAX_REQUEST_BYTES),
    )
}
