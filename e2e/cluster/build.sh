#!/usr/bin/env bash
# Build the real kube-apiserver and etcd used by the e2e tests into an output directory
# (default: <repo>/.cache/e2e-bin), reusing earlier builds whenever the inputs are unchanged.
#
# Usage: e2e/cluster/build.sh [OUT_DIR]
#
# Reuse: the stamp is a hash of `go version`, this script (it holds the ldflags) and each
# module's go.mod, go.sum and main.go. OUT_DIR/.stamp records the hash of what is there; a
# machine-wide copy lives in ${XDG_CACHE_HOME:-$HOME/.cache}/istiod-e2e-bin/<hash>/ so a fresh
# clone elsewhere on the same machine copies the binaries instead of rebuilding (~minutes).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${1:-$repo/.cache/e2e-bin}"
bins=(kube-apiserver etcd)

die() { echo "e2e: $*" >&2; exit 1; }

if ! command -v go >/dev/null 2>&1; then
  die "Go toolchain not found (need go >= 1.26 on PATH) — cannot build kube-apiserver/etcd"
fi
export GOTOOLCHAIN=local CGO_ENABLED=0
# -mod=readonly: build exactly what go.mod/go.sum pin; -buildvcs=false: the repo's git state
# must not change the binaries.
export GOFLAGS="-mod=readonly -buildvcs=false"
goversion="$(go env GOVERSION)"
case "$goversion" in
  go1.2[6-9]* | go1.[3-9][0-9]* | go[2-9]*) ;;
  *) die "Go toolchain too old: $goversion (need go >= 1.26 on PATH) — cannot build kube-apiserver/etcd" ;;
esac

stamp="$(
  {
    go version
    cat "$here/build.sh"
    for b in "${bins[@]}"; do
      cat "$here/$b/go.mod" "$here/$b/go.sum" "$here/$b/main.go"
    done
  } | sha256sum | cut -c1-16
)"
machine_cache="${XDG_CACHE_HOME:-$HOME/.cache}/istiod-e2e-bin/$stamp"

have_all() { # have_all DIR: every binary is there and executable
  local b
  for b in "${bins[@]}"; do [[ -x "$1/$b" ]] || return 1; done
}

if have_all "$out" && [[ "$(cat "$out/.stamp" 2>/dev/null)" == "$stamp" ]]; then
  echo "e2e: kube-apiserver and etcd up to date in $out ($stamp)" >&2
  exit 0
fi

mkdir -p "$out"
tmp="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# install_from DIR: move/copy finished binaries into $out via renames, so a reader never sees
# a half-written binary.
install_from() {
  local b
  for b in "${bins[@]}"; do
    if [[ "$1" != "$tmp" ]]; then cp -p "$1/$b" "$tmp/$b"; fi
    mv -f "$tmp/$b" "$out/$b"
  done
  echo "$stamp" >"$out/.stamp"
}

if have_all "$machine_cache"; then
  install_from "$machine_cache"
  echo "e2e: copied kube-apiserver and etcd from $machine_cache to $out" >&2
  exit 0
fi

start=$SECONDS
echo "e2e: building kube-apiserver and etcd with $goversion (cold builds take 10-30 min)..." >&2

# Version stamps as upstream's hack/lib/version.sh sets them, so `kube-apiserver --version`
# and /version report the k8s.io/kubernetes release we depend on.
k8s_version="$(cd "$here/kube-apiserver" && go list -m -f '{{.Version}}' k8s.io/kubernetes)"
k8s_date="$(cd "$here/kube-apiserver" && go list -m -f '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' k8s.io/kubernetes)"
IFS=. read -r k8s_major k8s_minor _ <<<"${k8s_version#v}"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=$k8s_major -X $pkg.gitMinor=$k8s_minor"
  ldflags+=" -X $pkg.gitCommit= -X $pkg.gitTreeState=clean -X $pkg.buildDate=$k8s_date"
done

(cd "$here/kube-apiserver" && go build -trimpath -ldflags "$ldflags" -o "$tmp/kube-apiserver" .)
(cd "$here/etcd" && go build -trimpath -ldflags "-s -w" -o "$tmp/etcd" .)

# Publish to the machine-wide cache first (rename of a complete directory, so concurrent
# builds never see a partial copy), then into $out.
mkdir -p "$(dirname "$machine_cache")"
mc_tmp="$(mktemp -d "$machine_cache.tmp.XXXXXX")"
for b in "${bins[@]}"; do cp -p "$tmp/$b" "$mc_tmp/$b"; done
mv -T "$mc_tmp" "$machine_cache" 2>/dev/null || rm -rf "$mc_tmp"
install_from "$tmp"

echo "e2e: built kube-apiserver ($k8s_version) and etcd into $out in $((SECONDS - start))s" >&2
