# Sourced, not run: what e2e/cluster/build-helm.sh and bench/loadgen-go/build.sh share to build one
# Go binary and keep it. The toolchain is checked, the inputs stamped, and the binary reused from
# OUT_DIR or from a machine-wide copy (${XDG_CACHE_HOME:-$HOME/.cache}/istiod-<bin>-bin/<stamp>/)
# while the stamp is unchanged; every copy lands by a rename, so a reader never sees half a binary.
#
# The caller sets `bin` (the binary's name, also the log prefix), `out`, `inputs` (the files whose
# content makes the stamp, itself included), `slow` (how long a cold build takes, for the log line),
# defines `build_into DIR`, then calls go_binary.

die() { echo "$bin: $*" >&2; exit 1; }

go_binary() {
  command -v go >/dev/null 2>&1 || die "Go toolchain not found (need go >= 1.26 on PATH) — cannot build $bin"
  # -mod=readonly: build exactly what go.mod/go.sum pin; -buildvcs=false: the repo's git state
  # must not change the binary.
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
  goversion="$(go env GOVERSION)"
  case "$goversion" in
    go1.2[6-9]* | go1.[3-9][0-9]* | go[2-9]*) ;;
    *) die "Go toolchain too old: $goversion (need go >= 1.26 on PATH) — cannot build $bin" ;;
  esac

  stamp="$(cat <(go version) "${BASH_SOURCE[0]}" "${inputs[@]}" | sha256sum | cut -c1-16)"
  local machine_cache="${XDG_CACHE_HOME:-$HOME/.cache}/istiod-$bin-bin/$stamp"
  if [[ -x "$out/$bin" && "$(cat "$out/.stamp" 2>/dev/null)" == "$stamp" ]]; then
    echo "$bin: up to date in $out ($stamp)" >&2
    return 0
  fi

  mkdir -p "$out"
  tmp="$(mktemp -d "$out/.build.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  if [[ -x "$machine_cache/$bin" ]]; then
    _install_from "$machine_cache"
    echo "$bin: copied from $machine_cache to $out" >&2
    return 0
  fi

  local start=$SECONDS
  echo "$bin: building with $goversion (a cold build takes $slow)..." >&2
  build_into "$tmp"
  # Machine-wide cache first (rename of a complete directory, so concurrent builds never see a
  # partial copy), then $out.
  mkdir -p "$(dirname "$machine_cache")"
  local mc_tmp
  mc_tmp="$(mktemp -d "$machine_cache.tmp.XXXXXX")"
  cp -p "$tmp/$bin" "$mc_tmp/$bin"
  mv -T "$mc_tmp" "$machine_cache" 2>/dev/null || rm -rf "$mc_tmp"
  _install_from "$tmp"
  echo "$bin: built into $out in $((SECONDS - start))s" >&2
}

_install_from() { # DIR: a rename into $out
  [[ "$1" == "$tmp" ]] || cp -p "$1/$bin" "$tmp/$bin"
  mv -f "$tmp/$bin" "$out/$bin"
  echo "$stamp" >"$out/.stamp"
}
