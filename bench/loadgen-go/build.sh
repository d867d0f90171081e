#!/usr/bin/env bash
# Build the load benchmark's compiled generator (bench/loadgen-go) into an output directory
# (default: <repo>/.cache/bench-bin), reusing earlier builds whenever the inputs are unchanged,
# as e2e/cluster/build.sh does for the e2e binaries.
#
# Usage: bench/loadgen-go/build.sh [OUT_DIR]
#
# Reuse: the stamp is a hash of `go version`, this script, go.mod, go.sum and the Go sources.
# OUT_DIR/.stamp records the hash of what is there; a machine-wide copy lives in
# ${XDG_CACHE_HOME:-$HOME/.cache}/istiod-bench-bin/<hash>/.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${1:-$repo/.cache/bench-bin}"

die() { echo "loadgen: $*" >&2; exit 1; }

command -v go >/dev/null 2>&1 || die "Go toolchain not found (need go >= 1.26 on PATH) — cannot build the load generator"
# -mod=readonly: build exactly what go.mod/go.sum pin; -buildvcs=false: the repo's git state
# must not change the binary.
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
goversion="$(go env GOVERSION)"
case "$goversion" in
  go1.2[6-9]* | go1.[3-9][0-9]* | go[2-9]*) ;;
  *) die "Go toolchain too old: $goversion (need go >= 1.26 on PATH) — cannot build the load generator" ;;
esac

stamp="$(cat <(go version) "$here/build.sh" "$here/go.mod" "$here/go.sum" "$here"/*.go | sha256sum | cut -c1-16)"
machine_cache="${XDG_CACHE_HOME:-$HOME/.cache}/istiod-bench-bin/$stamp"

if [[ -x "$out/loadgen" && "$(cat "$out/.stamp" 2>/dev/null)" == "$stamp" ]]; then
  echo "loadgen: up to date in $out ($stamp)" >&2
  exit 0
fi

mkdir -p "$out"
tmp="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# install_from DIR: a rename into $out, so a reader never sees a half-written binary.
install_from() {
  [[ "$1" == "$tmp" ]] || cp -p "$1/loadgen" "$tmp/loadgen"
  mv -f "$tmp/loadgen" "$out/loadgen"
  echo "$stamp" >"$out/.stamp"
}

if [[ -x "$machine_cache/loadgen" ]]; then
  install_from "$machine_cache"
  echo "loadgen: copied from $machine_cache to $out" >&2
  exit 0
fi

start=$SECONDS
echo "loadgen: building with $goversion (a cold build takes a minute or two)..." >&2
(cd "$here" && go build -trimpath -ldflags "-s -w" -o "$tmp/loadgen" .)

# Machine-wide cache first (rename of a complete directory, so concurrent builds never see a
# partial copy), then $out.
mkdir -p "$(dirname "$machine_cache")"
mc_tmp="$(mktemp -d "$machine_cache.tmp.XXXXXX")"
cp -p "$tmp/loadgen" "$mc_tmp/loadgen"
mv -T "$mc_tmp" "$machine_cache" 2>/dev/null || rm -rf "$mc_tmp"
install_from "$tmp"

echo "loadgen: built into $out in $((SECONDS - start))s" >&2
