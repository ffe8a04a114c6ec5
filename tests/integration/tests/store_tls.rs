//! A service on an etcd that, like a production one, speaks only TLS and requires client
//! certificates (`--client-cert-auth`): with `--store etcds://…` and the `--store-*` flags the
//! IPAM stores and reads its state there; with a wrong CA, a missing key, no client certificate
//! or plaintext, it refuses to start with an error that names the flag to fix.

use std::process::Command;

use trellis_api::pb::ipam::GetSubnetsPerClusterRequest;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_integration::command::succeeds;
use trellis_integration::{ServiceProcess, bin_path, free_addr, ipam_args};
use trellis_testkit::Etcd;

const IPAM: &str = "trellis.ipam.v1.Ipam";

fn path(p: &std::path::Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_runs_on_an_etcd_that_requires_client_certificates() {
    let Some(etcd) = Etcd::start_tls_or_skip() else {
        return;
    };
    let files = etcd.tls_files().expect("a TLS etcd").clone();
    let addr = free_addr();
    let args = ipam_args(
        &addr.to_string(),
        &etcd.url("ipam"),
        "hub",
        &[
            "--store-ca-cert",
            path(&files.ca),
            "--store-cert",
            path(&files.client_cert),
            "--store-key",
            path(&files.client_key),
        ],
    );
    let mut ipam = ServiceProcess::start("trellis-ipam", args, addr, IPAM)
        .await
        .expect("the IPAM starts on the TLS etcd");
    let first = remap(&ipam).await;
    assert_ne!(
        first.pod_cidr_nat, "10.0.0.0/16",
        "a conflicting range is remapped"
    );

    // The allocation lives in the TLS etcd: a restarted IPAM reads it back unchanged.
    ipam.kill9();
    ipam.restart().await.expect("restarts");
    assert_eq!(remap(&ipam).await, first, "{}", ipam.log_tail(20));
}

/// Asks `ipam` to map a leaf whose pod CIDR conflicts with ours.
async fn remap(ipam: &ServiceProcess) -> trellis_api::pb::ipam::GetSubnetsPerClusterResponse {
    IpamClient::new(ipam.channel().await.expect("connects"))
        .get_subnets_per_cluster(GetSubnetsPerClusterRequest {
            cluster_id: "leaf-a".into(),
            cluster_name: "leaf-a".into(),
            pod_cidr: "10.0.0.0/16".into(),
            external_cidr: "10.201.0.0/16".into(),
        })
        .await
        .expect("allocates")
        .into_inner()
}

/// Runs the IPAM binary until it exits (it must fail); its stderr.
fn fails_with(store: &str, extra: &[&str]) -> String {
    let binary = bin_path("trellis-ipam").expect("trellis-ipam is built");
    let output = Command::new(binary)
        .args(ipam_args(&free_addr().to_string(), store, "hub", extra))
        .env("TRELLIS_LOG_FORMAT", "text")
        .output()
        .expect("runs");
    assert!(!output.status.success(), "started anyway");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_missing_etcd_credentials_fail_clearly_naming_the_flag() {
    let Some(etcd) = Etcd::start_tls_or_skip() else {
        return;
    };
    let files = etcd.tls_files().expect("a TLS etcd").clone();
    let url = etcd.url("ipam");
    let (ca, other_ca) = (path(&files.ca), path(&files.other_ca));
    let (cert, key) = (path(&files.client_cert), path(&files.client_key));

    let wrong_ca = fails_with(
        &url,
        &[
            "--store-ca-cert",
            other_ca,
            "--store-cert",
            cert,
            "--store-key",
            key,
        ],
    );
    assert!(wrong_ca.contains("--store-ca-cert"), "{wrong_ca}");

    let missing_key = fails_with(&url, &["--store-ca-cert", ca, "--store-cert", cert]);
    assert!(missing_key.contains("--store-key"), "{missing_key}");

    let no_client_cert = fails_with(&url, &["--store-ca-cert", ca]);
    assert!(no_client_cert.contains("--store-cert"), "{no_client_cert}");

    let no_ca = fails_with(&url, &[]);
    assert!(no_ca.contains("--store-ca-cert"), "{no_ca}");

    let plaintext_with_tls_flags = fails_with(
        &url.replacen("etcds://", "etcd://", 1),
        &["--store-ca-cert", ca],
    );
    assert!(
        plaintext_with_tls_flags.contains("etcds://"),
        "{plaintext_with_tls_flags}"
    );

    let unreadable = fails_with(
        &url,
        &[
            "--store-ca-cert",
            "/nonexistent/ca.pem",
            "--store-cert",
            cert,
            "--store-key",
            key,
        ],
    );
    assert!(
        unreadable.contains("--store-ca-cert") && unreadable.contains("/nonexistent/ca.pem"),
        "{unreadable}"
    );
}

/// Runs `etcdctl` against `etcd` with `args`.
fn etcdctl(etcd: &Etcd, args: &[&str]) {
    let tool = trellis_testkit::tool_path("etcdctl").expect("etcdctl is installed with etcd");
    succeeds(
        Command::new(tool)
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", etcd.endpoint()))
            .args(args),
        &format!("etcdctl {args:?}"),
    );
}

/// With etcd's authentication on, a service logs in with `--store-user` and the password from
/// `TRELLIS_STORE_PASSWORD`; a wrong password stops it naming the flags.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_logs_in_to_an_etcd_with_authentication() {
    let Some(etcd) = Etcd::start_or_skip() else {
        return;
    };
    etcdctl(&etcd, &["user", "add", "root:s3cret-pw"]);
    etcdctl(&etcd, &["auth", "enable"]);
    let url = etcd.url("ipam");

    let wrong = {
        let binary = bin_path("trellis-ipam").expect("trellis-ipam is built");
        let output = Command::new(binary)
            .args(ipam_args(
                &free_addr().to_string(),
                &url,
                "hub",
                &["--store-user", "root"],
            ))
            .env("TRELLIS_STORE_PASSWORD", "wrong")
            .output()
            .expect("runs");
        assert!(!output.status.success(), "started with a wrong password");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    assert!(wrong.contains("--store-user/--store-password"), "{wrong}");
    assert!(
        !wrong.contains("wrong\""),
        "the password is not echoed: {wrong}"
    );

    let without = fails_with(&url, &[]);
    assert!(without.contains("--store-user"), "{without}");

    let addr = free_addr();
    let args = ipam_args(&addr.to_string(), &url, "hub", &["--store-user", "root"]);
    let ipam = ServiceProcess::start_with_env(
        "trellis-ipam",
        args,
        vec![("TRELLIS_STORE_PASSWORD".into(), "s3cret-pw".into())],
        addr,
        IPAM,
    )
    .await
    .expect("the IPAM logs in and starts");
    let mapped = remap(&ipam).await;
    assert_ne!(mapped.pod_cidr_nat, "10.0.0.0/16");
}
