#!/usr/bin/env bash
# Build Istio's own istioctl and pilot-agent (istio.io/istio, module istio/) into an output directory
# (default: <repo>/.cache/istio-bin), reused while the inputs are unchanged (go-binary.sh), as
# istio's `make build` does for a release: tags vtprotobuf,disable_pgv, -s -w, CGO off, version
# stamps. The drop-in tests run them against our istiod. Each binary prints nothing on stdout.
#
# Usage: e2e/cluster/build-istio.sh [OUT_DIR]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${1:-$repo/.cache/istio-bin}"
inputs=("$here/build-istio.sh" "$here/istio/go.mod" "$here/istio/go.sum")
slow="8-15 minutes on 2 cores"

build_into() {
  local istio_version istio_dir version ldflags pkg
  (cd "$here/istio" && go mod download istio.io/istio)
  istio_version="$(cd "$here/istio" && go list -m -f '{{.Version}}' istio.io/istio)"
  istio_dir="$(cd "$here/istio" && go list -m -f '{{.Dir}}' istio.io/istio)"
  # istio's VERSION file + "-dev" as its Makefile stamps a non-release build.
  version="$(cat "$istio_dir/VERSION")-dev"
  pkg=istio.io/istio/pkg/version
  ldflags="-s -w -X $pkg.buildVersion=$version -X $pkg.buildGitRevision=${istio_version##*-} -X $pkg.buildStatus=Clean"
  ldflags+=" -X $pkg.buildTag=$istio_version -X $pkg.buildHub=local -X $pkg.buildOS=linux -X $pkg.buildArch=$(go env GOARCH)"
  (cd "$here/istio" && nice -n 10 go build -trimpath -tags=vtprotobuf,disable_pgv -ldflags "$ldflags" \
    -o "$1/$bin" "$package")
}

source "$here/go-binary.sh"
for pair in istioctl:istio.io/istio/istioctl/cmd/istioctl pilot-agent:istio.io/istio/pilot/cmd/pilot-agent; do
  bin="${pair%%:*}" package="${pair#*:}"
  (go_binary)
done
