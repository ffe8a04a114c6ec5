#!/usr/bin/env python3
"""Security checks of a rendered kustomize overlay (issue 20), run by validate-deploy.sh:

- no container or init container is `privileged: true`;
- every workload (Deployment, StatefulSet, DaemonSet) is selected by a NetworkPolicy, and every
  port a policy names exists on the pods it selects (a typo would silently admit nothing).

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
---
kind: NetworkPolicy
metadata: {name: closed}
spec:
  podSelector: {matchLabels: {app: closed}}
  ingress: [{ports: [{port: grcp}]}]
"""
        )
    )
    found = problems(bad)
    expected = [
        "Deployment/open: container init is privileged",
        "Deployment/open: no NetworkPolicy selects its pods",
        "NetworkPolicy/closed: port 'grcp' is not a port of Deployment/closed",
    ]
    if found != expected:
        sys.exit(f"check-manifests self-test: expected {expected}, got {found}")


def main():
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        return
    with open(sys.argv[1]) as f:
        objects = [o for o in yaml.safe_load_all(f) if o]
    found = problems(objects)
    if found:
        sys.exit("\n".join(found))


if __name__ == "__main__":
    main()
