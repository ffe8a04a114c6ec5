//! The Kubernetes Multi-Cluster Services API objects Trellis reads and writes
//! (`multicluster.x-k8s.io/v1beta1`, ADR 0029): `ServiceExport` (read: a Service to export) and
//! `ServiceImport` (written: what this cluster imports). Declared by hand as [`kube::Resource`]s
//! (the workspace's kube has no `derive` feature); `spec` and `status` stay JSON, Trellis
//! builds and reads them in [`crate::imports`] and [`crate::kube_source`].

use std::borrow::Cow;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The MCS API group.
pub const GROUP: &str = "multicluster.x-k8s.io";
/// The MCS API version Trellis speaks.
pub const VERSION: &str = "v1beta1";
/// ServiceExport condition: whether the ServiceExport exports its Service.
pub const VALID_CONDITION: &str = "Valid";
/// Label on imported EndpointSlices and derived Services: the imported Service's name (MCS).
pub const IMPORTED_SERVICE_LABEL: &str = "multicluster.kubernetes.io/service-name";
/// Annotation on a ServiceImport naming the Service Trellis derived for it.
pub const DERIVED_SERVICE_ANNOTATION: &str = "multicluster.kubernetes.io/derived-service";
/// Label on every ServiceImport and derived Service Trellis writes.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Annotation on a derived Service: the import (`namespace/name`) it belongs to. The writer
/// only updates or deletes a Service carrying it.
pub const IMPORT_ANNOTATION: &str = "trellis.io/service-import";

macro_rules! mcs_resource {
    ($name:ident, $kind:literal, $plural:literal) => {
        #[doc = concat!("A `", $kind, "` (multicluster.x-k8s.io/v1beta1).")]
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
        pub struct $name {
            #[serde(rename = "apiVersion", default)]
            pub api_version: String,
            #[serde(default)]
            pub kind: String,
            #[serde(default)]
            pub metadata: ObjectMeta,
            #[serde(default, skip_serializing_if = "Value::is_null")]
            pub spec: Value,
            #[serde(default, skip_serializing_if = "Value::is_null")]
            pub status: Value,
        }

        impl $name {
            /// An object with `metadata`, `spec` and no status.
            pub fn new(metadata: ObjectMeta, spec: Value) -> Self {
                Self {
                    api_version: format!("{GROUP}/{VERSION}"),
                    kind: $kind.to_owned(),
                    metadata,
                    spec,
                    status: Value::Null,
                }
            }
        }

        impl kube::Resource for $name {
            type DynamicType = ();
            type Scope = NamespaceResourceScope;

            fn kind(_: &()) -> Cow<'_, str> {
                $kind.into()
            }
            fn group(_: &()) -> Cow<'_, str> {
                GROUP.into()
            }
            fn version(_: &()) -> Cow<'_, str> {
                VERSION.into()
            }
            fn plural(_: &()) -> Cow<'_, str> {
                $plural.into()
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

mcs_resource!(ServiceExport, "ServiceExport", "serviceexports");
mcs_resource!(ServiceImport, "ServiceImport", "serviceimports");
