#!/usr/bin/env bash
# Validates the deployment files offline (no Docker engine, no Kubernetes cluster needed):
#   - deploy/grafana/*.json: well-formed JSON with panels, querying only metrics the code registers;
#   - deploy/prometheus/*.yaml: the alerting rules and their tests query only metrics the code
#     registers (promtool checks the rules themselves, in tests/integration/tests/deploy_monitoring.rs);
#   - docker-compose.yml against the compose-spec JSON schema bundled in check-jsonschema;
#   - every kustomize overlay, rendered with `kubectl kustomize`, strictly against the
#     Kubernetes OpenAPI schemas bundled in kubernetes-validate (unknown fields are errors, and
#     so is a kind it has no schema for), and by scripts/check-manifests.py: no privileged
#     container, a NetworkPolicy for every workload, only ports that exist in the policies, and
#     cert-manager certificates that name the overlay's cluster and service;
#   - the overlays' cert-manager.io resources (components/cert-manager), which are CRDs that
#     kubernetes-validate has no schema for, against scripts/cert-manager-v1-subset.schema.json
#     instead (a hand-written subset of cert-manager's schema, as strict about unknown fields).
# Fails on the first invalid file. KUBERNETES_VERSIONS (default "1.30.0 latest") lists the
# versions the manifests are checked against; "latest" is the newest one kubernetes-validate
# bundles. That flag/env consistency with the binaries is checked by
# tests/integration/tests/deploy_flags.rs, not here.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export PATH="$root/.tools/bin:$PATH"

log() { printf 'validate-deploy: %s\n' "$*"; }
fail() { printf 'validate-deploy: FAILED: %s\n' "$*" >&2; exit 1; }

for tool in check-jsonschema kubernetes-validate kubectl; do
  command -v "$tool" >/dev/null 2>&1 || fail "$tool not found (scripts/setup.sh installs check-jsonschema and kubernetes-validate; kubectl must be on PATH)"
done

# --- docker-compose.yml -----------------------------------------------------------------------
out=$(check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml 2>&1) \
  || fail "docker-compose.yml does not match the compose-spec schema:"$'\n'"$out"
services=$(grep -cE '^  [a-z0-9-]+:' <(sed -n '/^services:/,/^[a-z]/p' docker-compose.yml))
log "docker-compose.yml: valid against the compose-spec schema ($services services)"

# Every metric $1 names is one the code registers (a renamed metric would leave an empty panel
# or an alert that never fires): names without the encoder's suffixes, quoted in crates/ or
# services/.
registered() {
  for metric in $(grep -oE '\b(grpc_server|grpc_client|trellis)_[a-z_]+' "$1" | sed -E 's/_(total|bucket|count|sum)$//' | sort -u); do
    grep -rqF "\"$metric\"" crates services || fail "$1 queries $metric, which no service registers"
  done
}

# --- Grafana dashboards ---------------------------------------------------------------------
for f in deploy/grafana/*.json; do
  out=$(python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); assert d["panels"], "no panels"; print(len(d["panels"]))' "$f" 2>&1) \
    || fail "$f is not a valid dashboard JSON:"$'\n'"$out"
  log "$f: valid JSON ($out panels)"
  registered "$f"
done

# --- Prometheus alerting rules --------------------------------------------------------------
for f in deploy/prometheus/*.yaml; do
  registered "$f"
  log "$f: queries only registered metrics"
done

# --- kustomize overlays -----------------------------------------------------------------------
read -r -a versions <<<"${KUBERNETES_VERSIONS:-1.30.0 latest}"
version_args=()
for v in "${versions[@]}"; do
  [ "$v" = latest ] && continue
  version_args+=(--kubernetes-version "$v")
done
# Without -k, kubernetes-validate uses its newest schemas; with some -k it uses only those.
if [[ " ${versions[*]} " == *" latest "* ]] && ((${#version_args[@]})); then
  latest=$(kubernetes-validate --help | sed -n 's/.*Defaults to \([0-9.]*\).*/\1/p' | head -n1)
  [ -n "$latest" ] || fail "cannot tell kubernetes-validate's newest Kubernetes version"
  version_args+=(--kubernetes-version "$latest")
fi

python3 scripts/check-manifests.py --self-test || fail "scripts/check-manifests.py accepts a bad overlay"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
overlays=(deploy/kustomize/overlays/*/)
[ -d "${overlays[0]}" ] || fail "no overlays under deploy/kustomize/overlays"
for dir in "${overlays[@]}"; do
  dir=${dir%/}
  name=$(basename "$dir")
  rendered="$tmp/$name.yaml"
  kubectl kustomize "$dir" >"$rendered" 2>"$tmp/$name.err" \
    || fail "kubectl kustomize $dir:"$'\n'"$(cat "$tmp/$name.err")"
  # cert-manager.io resources go to a file each for check-jsonschema (which reads one document
  # per file), the others, as rendered, to the file kubernetes-validate reads.
  core="$tmp/$name.core.yaml"
  certs="$tmp/$name.cert-manager"
  mkdir -p "$certs"
  python3 - "$rendered" "$core" "$certs" <<'PY' || fail "$dir: cannot split the rendered resources"
import re, sys, yaml
rendered, core, certs = sys.argv[1:]
rest, n = [], 0
for text in re.split(r"(?m)^---\n", open(rendered).read()):
    doc = yaml.safe_load(text)
    if not doc:
        continue
    if str(doc.get("apiVersion", "")).split("/")[0] == "cert-manager.io":
        n += 1
        meta = doc.get("metadata") or {}
        with open(f"{certs}/{n:03d}-{doc.get('kind')}-{meta.get('name')}.yaml", "w") as f:
            f.write(text)
    else:
        rest.append(text)
with open(core, "w") as f:
    f.write("---\n".join(rest))
PY
  cert_files=("$certs"/*.yaml)
  cert_note=""
  if [ -e "${cert_files[0]}" ]; then
    out=$(check-jsonschema --schemafile scripts/cert-manager-v1-subset.schema.json "${cert_files[@]}" 2>&1) \
      || fail "$dir: cert-manager.io resources do not match scripts/cert-manager-v1-subset.schema.json:"$'\n'"$out"
    cert_kinds=$(cat "${cert_files[@]}" | grep -E '^kind: ' | sort | uniq -c | awk '{printf "%s%s %s", sep, $1, $3; sep=", "}')
    cert_note="; ${#cert_files[@]} cert-manager.io resources valid against scripts/cert-manager-v1-subset.schema.json: $cert_kinds"
  fi
  rc=0
  report=$(kubernetes-validate --strict "${version_args[@]}" "$core" 2>&1) || rc=$?
  # ERROR: invalid resource; WARN: no schema for a kind (a typo'd kind or apiVersion);
  # FATAL: unsupported Kubernetes version. kubernetes-validate exits 0 on WARN.
  problems=$(grep -vE '^INFO ' <<<"$report" || true)
  if ((rc != 0)) || [ -n "$problems" ]; then
    fail "$dir (kubernetes-validate exit $rc):"$'\n'"${problems:-$report}"
  fi
  out=$(python3 scripts/check-manifests.py "$rendered" 2>&1) \
    || fail "$dir (no privileged containers, a NetworkPolicy for every workload, certificates for this cluster):"$'\n'"$out"
  checked=$(grep -c '^INFO ' <<<"$report" || true)
  resources=$(grep -cE '^kind: ' "$core" || true)
  [ "$checked" -gt 0 ] && [ "$resources" -gt 0 ] || fail "$dir: kubernetes-validate checked no resource"
  kinds=$(grep -E '^kind: ' "$core" | sort | uniq -c | awk '{printf "%s%s %s", sep, $1, $3; sep=", "}')
  against=$(sed -n 's/.* against version \([0-9.]*\)$/\1/p' <<<"$report" | sort -uV | paste -sd' ' -)
  log "$dir: $resources resources valid (--strict; Kubernetes $against): $kinds$cert_note"
done
log "ok"
