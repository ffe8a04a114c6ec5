#!/usr/bin/env python3
"""Security checks of a rendered kustomize overlay (issue 20), run by validate-deploy.sh:

- no container or init container is `privileged: true`;
- every workload (Deployment, StatefulSet, DaemonSet) is selected by a NetworkPolicy, and every
  port a policy names exists on the pods it selects (a typo would silently admit nothing);
- cert-manager Certificates (components/cert-manager) name the overlay's cluster
  (TRELLIS_CLUSTER_ID of ConfigMap trellis-cluster) and, for a service's Secret
  trellis-tls-<service>, that service, with server and client auth; each comes from an Issuer of
  the overlay; and every trellis-tls-* Secret a workload mounts is written by one of them. A
  certificate for another cluster or service passes every schema and would only show once the
  services run.

Usage: check-manifests.py RENDERED.yaml      (exit 1 listing each problem)
       check-manifests.py --self-test        (the checks reject a bad overlay)
"""

import sys

import yaml

WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}


def pod_spec(obj):
    kind = obj.get("kind")
    if kind in WORKLOADS or kind == "Job":
        return (obj.get("spec") or {}).get("template") or {}
    if kind == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]
    if kind == "Pod":
        return obj
    return None


def selects(selector, labels):
    wanted = (selector or {}).get("matchLabels") or {}
    return all(labels.get(k) == v for k, v in wanted.items())


def problems(objects):
    found = []
    policies = [o for o in objects if o.get("kind") == "NetworkPolicy"]
    for obj in objects:
        template = pod_spec(obj)
        if template is None:
            continue
        origin = f"{obj['kind']}/{obj['metadata']['name']}"
        spec = template.get("spec") or {}
        labels = (template.get("metadata") or {}).get("labels") or {}
        containers = (spec.get("initContainers") or []) + (spec.get("containers") or [])
        for c in containers:
            if ((c.get("securityContext") or {}).get("privileged")) is True:
                found.append(f"{origin}: container {c['name']} is privileged")
        if obj["kind"] not in WORKLOADS:
            continue
        selecting = [p for p in policies if selects(p["spec"].get("podSelector"), labels)]
        if not selecting:
            found.append(f"{origin}: no NetworkPolicy selects its pods")
        ports = {p.get("name") for c in containers for p in c.get("ports") or []}
        ports |= {p.get("containerPort") for c in containers for p in c.get("ports") or []}
        for policy in selecting:
            for rule in policy["spec"].get("ingress") or []:
                for port in rule.get("ports") or []:
                    if port.get("port") not in ports:
                        found.append(
                            f"NetworkPolicy/{policy['metadata']['name']}: port "
                            f"{port.get('port')!r} is not a port of {origin}"
                        )
    return found


SPIFFE_PREFIX = "spiffe://trellis/cluster/"
TLS_SECRET_PREFIX = "trellis-tls-"


def is_cert_manager(obj, kind):
    group = str(obj.get("apiVersion", "")).split("/")[0]
    return group == "cert-manager.io" and obj.get("kind") == kind


def certificate_problems(objects):
    certificates = [o for o in objects if is_cert_manager(o, "Certificate")]
    if not certificates:
        return []
    found = []
    cluster = next(
        (
            (o.get("data") or {}).get("TRELLIS_CLUSTER_ID")
            for o in objects
            if o.get("kind") == "ConfigMap"
            and o["metadata"]["name"].startswith("trellis-cluster")
            and "TRELLIS_CLUSTER_ID" in (o.get("data") or {})
        ),
        None,
    )
    if cluster is None:
        return ["Certificates, but no ConfigMap trellis-cluster with TRELLIS_CLUSTER_ID to name"]
    issuers = {o["metadata"]["name"] for o in objects if is_cert_manager(o, "Issuer")}
    written = set()
    for cert in certificates:
        origin = f"Certificate/{cert['metadata']['name']}"
        spec = cert.get("spec") or {}
        uris = spec.get("uris") or []
        usages = spec.get("usages") or []
        secret = spec.get("secretName", "")
        written.add(secret)
        ref = spec.get("issuerRef") or {}
        if ref.get("kind", "Issuer") == "Issuer" and ref.get("name") not in issuers:
            found.append(f"{origin}: issuer {ref.get('name')!r} is no Issuer of the overlay")
        if spec.get("isCA"):
            want = SPIFFE_PREFIX + cluster
            if want not in uris:
                found.append(f"{origin}: a CA of cluster {cluster} must name {want}, not {uris}")
        elif secret.startswith(TLS_SECRET_PREFIX):
            want = SPIFFE_PREFIX + cluster + "/" + secret[len(TLS_SECRET_PREFIX):]
            if want not in uris:
                found.append(f"{origin}: writes {secret}, so must name {want}, not {uris}")
            for usage in ("server auth", "client auth"):
                if usage not in usages:
                    found.append(f"{origin}: needs usage {usage!r}")
    for obj in objects:
        template = pod_spec(obj)
        if template is None:
            continue
        for volume in (template.get("spec") or {}).get("volumes") or []:
            secret = (volume.get("secret") or {}).get("secretName", "")
            if secret.startswith(TLS_SECRET_PREFIX) and secret not in written:
                found.append(
                    f"{obj['kind']}/{obj['metadata']['name']}: mounts {secret}, "
                    "which no Certificate writes"
                )
    return found


def self_test():
    bad = list(
        yaml.safe_load_all(
            """
kind: Deployment
metadata: {name: open}
spec:
  template:
    metadata: {labels: {app: open}}
    spec:
      initContainers: [{name: init, securityContext: {privileged: true}}]
      containers: [{name: main, ports: [{name: grpc, containerPort: 1}]}]
---
kind: Deployment
metadata: {name: closed}
spec:
  template:
    metadata: {labels: {app: closed}}
    spec:
      containers: [{name: main, ports: [{name: grpc, containerPort: 1}]}]
      volumes: [{name: tls, secret: {secretName: trellis-tls-ipam}}]
---
kind: ConfigMap
metadata: {name: trellis-cluster-5f2k8}
data: {TRELLIS_CLUSTER_ID: hub}
---
apiVersion: cert-manager.io/v1
kind: Issuer
metadata: {name: trellis-ca}
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata: {name: trellis-ca}
spec: {isCA: true, secretName: trellis-ca, uris: [spiffe://trellis/cluster/leaf-a],
       issuerRef: {name: trellis-ca}}
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata: {name: trellis-tls-broker}
spec: {secretName: trellis-tls-broker, uris: [spiffe://trellis/cluster/hub/forwarder],
       usages: [server auth], issuerRef: {name: trellis-ca-typo, kind: Issuer}}
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata: {name: trellis-tls-forwarder}
spec: {secretName: trellis-tls-forwarder, uris: [spiffe://trellis/cluster/hub/forwarder],
       usages: [server auth, client auth], issuerRef: {name: trellis-ca}}
---
kind: NetworkPolicy
metadata: {name: closed}
spec:
  podSelector: {matchLabels: {app: closed}}
  ingress: [{ports: [{port: grcp}]}]
"""
        )
    )
    found = problems(bad) + certificate_problems(bad)
    expected = [
        "Deployment/open: container init is privileged",
        "Deployment/open: no NetworkPolicy selects its pods",
        "NetworkPolicy/closed: port 'grcp' is not a port of Deployment/closed",
        "Certificate/trellis-ca: a CA of cluster hub must name spiffe://trellis/cluster/hub, "
        "not ['spiffe://trellis/cluster/leaf-a']",
        "Certificate/trellis-tls-broker: issuer 'trellis-ca-typo' is no Issuer of the overlay",
        "Certificate/trellis-tls-broker: writes trellis-tls-broker, so must name "
        "spiffe://trellis/cluster/hub/broker, not ['spiffe://trellis/cluster/hub/forwarder']",
        "Certificate/trellis-tls-broker: needs usage 'client auth'",
        "Deployment/closed: mounts trellis-tls-ipam, which no Certificate writes",
    ]
    if found != expected:
        sys.exit(f"check-manifests self-test: expected {expected}, got {found}")


def main():
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        return
    with open(sys.argv[1]) as f:
        objects = [o for o in yaml.safe_load_all(f) if o]
    found = problems(objects) + certificate_problems(objects)
    if found:
        sys.exit("\n".join(found))


if __name__ == "__main__":
    main()
