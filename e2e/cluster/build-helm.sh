#!/usr/bin/env bash
# Build the real helm (helm.sh/helm/v4, module helm/) used by the chart tests into an output
# directory (default: <repo>/.cache/helm-bin), reusing earlier builds whenever the inputs are
# unchanged (go-binary.sh): as build.sh does for kube-apiserver and etcd, but with its own stamp
# so a helm bump never rebuilds the API server.
#
# Usage: e2e/cluster/build-helm.sh [OUT_DIR]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
bin=helm
out="${1:-$repo/.cache/helm-bin}"
inputs=("$here/build-helm.sh" "$here/helm/go.mod" "$here/helm/go.sum" "$here/helm/main.go")
slow="a few minutes"

build_into() {
  # The version as upstream's Makefile stamps it, so `helm version` reports the release we build.
  local helm_version
  helm_version="$(cd "$here/helm" && go list -m -f '{{.Version}}' helm.sh/helm/v4)"
  (cd "$here/helm" && nice -n 10 go build -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version -X helm.sh/helm/v4/internal/version.gitTreeState=clean" \
    -o "$1/helm" .)
}

source "$here/go-binary.sh"
go_binary
