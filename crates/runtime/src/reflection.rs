//! gRPC server reflection (v1 and v1alpha), built once per process and shared by every server
//! in it.
//!
//! Building a reflection service decodes and indexes every file descriptor the process serves:
//! about 100 KiB per service and version. A service binary runs one server, but the in-process
//! lab runs six per cluster, and at 255 clusters the copies took about 500 MiB of its heap
//! (measured with heaptrack; issue 17). The built services only hold an `Arc` to that index,
//! so every server clones the first one.

use std::any::Any;
use std::sync::OnceLock;

/// Returns the value `build` made on the first call through `cell`, cloned.
///
/// The cell is type-erased because the reflection services' types are opaque (`impl
/// ServerReflection`) and cannot be named in a `static`; `T` is inferred from `build`.
fn shared<T: Any + Clone + Send + Sync>(
    cell: &'static OnceLock<Box<dyn Any + Send + Sync>>,
    build: fn() -> T,
) -> Option<T> {
    cell.get_or_init(|| Box::new(build()))
        .downcast_ref::<T>()
        .cloned()
}

fn builder() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(trellis_api::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

/// Adds the reflection services (v1 and v1alpha) to `routes`.
pub fn add_to(routes: tonic::service::Routes) -> anyhow::Result<tonic::service::Routes> {
    static V1: OnceLock<Box<dyn Any + Send + Sync>> = OnceLock::new();
    static V1ALPHA: OnceLock<Box<dyn Any + Send + Sync>> = OnceLock::new();
    let unshared = || anyhow::anyhow!("the shared reflection service has another type");
    let v1 = shared(&V1, || builder().build_v1().map_err(|e| e.to_string()))
        .ok_or_else(unshared)?
        .map_err(anyhow::Error::msg)?;
    let v1alpha = shared(&V1ALPHA, || {
        builder().build_v1alpha().map_err(|e| e.to_string())
    })
    .ok_or_else(unshared)?
    .map_err(anyhow::Error::msg)?;
    Ok(routes.add_service(v1).add_service(v1alpha))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn the_value_is_built_once_and_cloned_after() {
        static CELL: OnceLock<Box<dyn Any + Send + Sync>> = OnceLock::new();
        static BUILT: AtomicUsize = AtomicUsize::new(0);
        let build = || {
            BUILT.fetch_add(1, Ordering::SeqCst);
            std::sync::Arc::new(7_u32)
        };
        let first = shared(&CELL, build).expect("the built type");
        let second = shared(&CELL, build).expect("the built type");
        assert_eq!(BUILT.load(Ordering::SeqCst), 1);
        assert!(std::sync::Arc::ptr_eq(&first, &second));
    }

    #[test]
    fn reflection_services_are_added() {
        let routes = add_to(tonic::service::Routes::default()).expect("built");
        let again = add_to(tonic::service::Routes::default()).expect("built again");
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
