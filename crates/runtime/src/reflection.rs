//! gRPC server reflection (v1 and v1alpha), built once per set of served services and shared
//! by every server in the process that serves that set; and the answer to a method a port does
//! not serve.
//!
//! Reflection lists what the port serves (its services, health and reflection), not every
//! service whose descriptors the process carries: `grpcurl list` on the IPAM's port shows the
//! IPAM, not the gateway. Building a reflection service decodes and indexes every file
//! descriptor: about 100 KiB per service and version. The in-process lab runs six servers per
//! cluster, and at 255 clusters one copy per server took about 500 MiB of its heap (issue 17);
//! the built services only hold an `Arc` to that index, so servers of the same services share
//! the first one built.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Reflection's own services, listed on every port with health.
const ALWAYS: [&str; 3] = [
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

/// Built values by key, type-erased because the reflection services' types are opaque (`impl
/// ServerReflection`) and cannot be named in a `static`.
type Cache = Mutex<HashMap<Vec<&'static str>, Box<dyn Any + Send + Sync>>>;

/// Returns the value `build` made on the first call for `key` through `cache`, cloned.
fn shared<T: Any + Clone + Send + Sync>(
    cache: &'static OnceLock<Cache>,
    key: &[&'static str],
    build: impl FnOnce() -> T,
) -> Option<T> {
    let mut built = cache
        .get_or_init(Cache::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    built
        .entry(key.to_vec())
        .or_insert_with(|| Box::new(build()))
        .downcast_ref::<T>()
        .cloned()
}

fn builder(services: &[&'static str]) -> tonic_reflection::server::Builder<'static> {
    let mut builder = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(trellis_api::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
    for name in services.iter().chain(ALWAYS.iter()) {
        builder = builder.with_service_name(*name);
    }
    builder
}

/// Adds the reflection services (v1 and v1alpha) listing `services` (with health and
/// reflection) to `routes`.
pub fn add_to(
    routes: tonic::service::Routes,
    services: &[&'static str],
) -> anyhow::Result<tonic::service::Routes> {
    static V1: OnceLock<Cache> = OnceLock::new();
    static V1ALPHA: OnceLock<Cache> = OnceLock::new();
    let mut key = services.to_vec();
    key.sort_unstable();
    key.dedup();
    let unshared = || anyhow::anyhow!("the shared reflection service has another type");
    let v1 = shared(&V1, &key, || {
        builder(&key).build_v1().map_err(|e| e.to_string())
    })
    .ok_or_else(unshared)?
    .map_err(anyhow::Error::msg)?;
    let v1alpha = shared(&V1ALPHA, &key, || {
        builder(&key).build_v1alpha().map_err(|e| e.to_string())
    })
    .ok_or_else(unshared)?
    .map_err(anyhow::Error::msg)?;
    Ok(routes.add_service(v1).add_service(v1alpha))
}

/// Answers every path `routes` does not serve with `UNIMPLEMENTED` naming what this port
/// serves (tonic's own answer has an empty message, which leaves a caller at the wrong port
/// guessing).
pub fn answer_unserved(
    routes: tonic::service::Routes,
    services: &[&'static str],
) -> tonic::service::Routes {
    let served = services.join(", ");
    let router = routes.into_axum_router().fallback(move |uri: http::Uri| {
        let status = unserved(uri.path(), &served);
        async move {
            let (parts, ()) = status.into_http::<()>().into_parts();
            http::Response::from_parts(parts, tonic::body::Body::empty())
        }
    });
    tonic::service::Routes::from(router)
}

/// The status for a call of `path` on a port serving `served`.
fn unserved(path: &str, served: &str) -> tonic::Status {
    tonic::Status::unimplemented(format!(
        "{path} is not served on this port, which serves {served} (with health and reflection)"
    ))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn the_value_is_built_once_per_key_and_cloned_after() {
        static CACHE: OnceLock<Cache> = OnceLock::new();
        static BUILT: AtomicUsize = AtomicUsize::new(0);
        let build = || {
            BUILT.fetch_add(1, Ordering::SeqCst);
            std::sync::Arc::new(7_u32)
        };
        let first = shared(&CACHE, &["a"], build).expect("the built type");
        let second = shared(&CACHE, &["a"], build).expect("the built type");
        assert_eq!(BUILT.load(Ordering::SeqCst), 1);
        assert!(std::sync::Arc::ptr_eq(&first, &second));
        let other = shared(&CACHE, &["b"], build).expect("the built type");
        assert_eq!(BUILT.load(Ordering::SeqCst), 2, "another set of services");
        assert!(!std::sync::Arc::ptr_eq(&first, &other));
    }

    #[test]
    fn an_unserved_method_is_told_what_the_port_serves() {
        let status = unserved(
            "/trellis.gateway.v1.Gateway/ListTunnels",
            "trellis.ipam.v1.Ipam",
        );
        assert_eq!(status.code(), tonic::Code::Unimplemented);
        assert!(
            status.message().contains("trellis.ipam.v1.Ipam")
                && status
                    .message()
                    .contains("/trellis.gateway.v1.Gateway/ListTunnels"),
            "{}",
            status.message()
        );
    }

    #[test]
    fn reflection_services_are_added() {
        let routes = add_to(tonic::service::Routes::default(), &["x.y.Z"]).expect("built");
        let again = add_to(tonic::service::Routes::default(), &["x.y.Z"]).expect("built again");
        // Both routers answer the reflection paths (an unknown path falls back to
        // UNIMPLEMENTED instead); the services themselves are exercised by the grpcurl tests.
        for r in [routes, again] {
            let router = format!("{:?}", r.into_axum_router());
            assert!(
                router.contains("grpc.reflection.v1.ServerReflection"),
                "{router}"
            );
            assert!(
                router.contains("grpc.reflection.v1alpha.ServerReflection"),
                "{router}"
            );
        }
    }
}
