#!/usr/bin/env bash
# Build the load benchmark's compiled generator (bench/loadgen-go) into an output directory
# (default: <repo>/.cache/bench-bin), reusing earlier builds whenever the inputs are unchanged,
# as e2e/cluster/build-helm.sh does for helm (both through e2e/cluster/go-binary.sh).
#
# Usage: bench/loadgen-go/build.sh [OUT_DIR]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
bin=loadgen
out="${1:-$repo/.cache/bench-bin}"
inputs=("$here/build.sh" "$here/go.mod" "$here/go.sum" "$here"/*.go)
slow="a minute or two"

build_into() {
  (cd "$here" && go build -trimpath -ldflags "-s -w" -o "$1/loadgen" .)
}

source "$repo/e2e/cluster/go-binary.sh"
go_binary
