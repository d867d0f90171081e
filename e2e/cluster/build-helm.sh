#!/usr/bin/env bash
# Build the real helm (helm.sh/helm/v4, module helm/) used by the chart tests into an output
# directory (default: <repo>/.cache/helm-bin), reusing earlier builds whenever the inputs are
# unchanged: as build.sh does for kube-apiserver and etcd, but with its own stamp so a helm bump
# never rebuilds the API server.
#
# Usage: e2e/cluster/build-helm.sh [OUT_DIR]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${1:-$repo/.cache/helm-bin}"

die() { echo "helm: $*" >&2; exit 1; }

command -v go >/dev/null 2>&1 || die "Go toolchain not found (need go >= 1.26 on PATH) — cannot build helm"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
goversion="$(go env GOVERSION)"
case "$goversion" in
  go1.2[6-9]* | go1.[3-9][0-9]* | go[2-9]*) ;;
  *) die "Go toolchain too old: $goversion (need go >= 1.26 on PATH) — cannot build helm" ;;
esac

stamp="$(cat <(go version) "$here/build-helm.sh" "$here/helm/go.mod" "$here/helm/go.sum" "$here/helm/main.go" | sha256sum | cut -c1-16)"
machine_cache="${XDG_CACHE_HOME:-$HOME/.cache}/istiod-helm-bin/$stamp"

if [[ -x "$out/helm" && "$(cat "$out/.stamp" 2>/dev/null)" == "$stamp" ]]; then
  echo "helm: up to date in $out ($stamp)" >&2
  exit 0
fi

mkdir -p "$out"
tmp="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# install_from DIR: a rename into $out, so a reader never sees a half-written binary.
install_from() {
  [[ "$1" == "$tmp" ]] || cp -p "$1/helm" "$tmp/helm"
  mv -f "$tmp/helm" "$out/helm"
  echo "$stamp" >"$out/.stamp"
}

if [[ -x "$machine_cache/helm" ]]; then
  install_from "$machine_cache"
  echo "helm: copied from $machine_cache to $out" >&2
  exit 0
fi

start=$SECONDS
echo "helm: building with $goversion (a cold build takes a few minutes)..." >&2
# The version as upstream's Makefile stamps it, so `helm version` reports the release we build.
helm_version="$(cd "$here/helm" && go list -m -f '{{.Version}}' helm.sh/helm/v4)"
(cd "$here/helm" && nice -n 10 go build -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version -X helm.sh/helm/v4/internal/version.gitTreeState=clean" \
  -o "$tmp/helm" .)

# Machine-wide cache first (rename of a complete directory), then $out.
mkdir -p "$(dirname "$machine_cache")"
mc_tmp="$(mktemp -d "$machine_cache.tmp.XXXXXX")"
cp -p "$tmp/helm" "$mc_tmp/helm"
mv -T "$mc_tmp" "$machine_cache" 2>/dev/null || rm -rf "$mc_tmp"
install_from "$tmp"

echo "helm: built $helm_version into $out in $((SECONDS - start))s" >&2
