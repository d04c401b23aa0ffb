#!/usr/bin/env bash
# Build CRIU 4.1.x from Debian trixie's source package and install the criu
# binary to /usr/local/sbin/criu. Debian 12 (bookworm), as root. Idempotent:
# does nothing when /usr/local/sbin/criu --version already says 4.1.x.
#
# Why not apt's criu: bookworm's CRIU 3.17 fails `criu check` on kernels
# >= 6.13 (vDSO). Why a private apt config: the host's sources must stay
# bookworm-only; trixie is used here for its *source* package alone (a
# deb-src list, state and cache dirs of our own under $WORK/apt), and the
# build dependencies come from bookworm.
#
# Patches in scripts/criu-patches/ are applied on top (upstream fixes that
# 4.1.1 lacks; see each patch's header). The installed binary's stamp,
# /usr/local/sbin/criu.corral-stamp, names the version and the patches: a
# 4.1.x built without them is rebuilt.
#
# Environment: CRIU_WORK (default /var/cache/corral-criu) keeps the source
# and the build; CRIU_MIRROR (default: the Debian archive the host's own
# apt sources use for bookworm).
set -euo pipefail

PREFIX=/usr/local/sbin
WANT=4.1
WORK=${CRIU_WORK:-/var/cache/corral-criu}
host_mirror() {
  apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 'Identifier: Packages' 2>/dev/null |
    awk '$2 == "bookworm" { sub("/$", "", $1); print $1; exit }'
}
MIRROR=${CRIU_MIRROR:-$(host_mirror)}
PATCHES=$(cd "$(dirname "$0")" && pwd)/criu-patches
say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

if [ "$(id -u)" -ne 0 ]; then
  echo "build-criu.sh: run as root" >&2
  exit 1
fi
stamp="$WANT $(cat "$PATCHES"/*.patch 2>/dev/null | sha256sum | cut -c1-16)"
if "$PREFIX/criu" --version 2>/dev/null | grep -q "^Version: $WANT\." &&
  [ "$(cat "$PREFIX/criu.corral-stamp" 2>/dev/null)" = "$stamp" ]; then
  say "criu $("$PREFIX/criu" --version | sed -n 's/^Version: //p') ($stamp) is installed: nothing to do"
  exit 0
fi
t0=$(date +%s)
if [ -z "$MIRROR" ]; then
  echo "build-criu.sh: no bookworm Debian archive in the host's apt sources; set CRIU_MIRROR" >&2
  exit 1
fi

# --- build dependencies (from the host's own bookworm sources) ----------------
DEPS=(
  build-essential pkg-config dpkg-dev patch  # compiler, make; dpkg-source unpacks the .dsc
  libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler python3-protobuf
  libnl-3-dev libnl-route-3-dev libcap-dev libnet1-dev libbsd-dev
  libgnutls28-dev libnftables-dev uuid-dev
  libaio-dev                            # criu's zdtm helpers; harmless for `make criu`
  python3 git
)
missing=()
for p in "${DEPS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "apt (bookworm): installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# --- the source, through a private apt config ----------------------------------
mkdir -p "$WORK"/apt/{lists/partial,archives/partial,parts,prefs} "$WORK/src"
cat >"$WORK/apt/sources.list" <<EOF
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR trixie main
EOF
cat >"$WORK/apt/apt.conf" <<EOF
Dir::Etc::sourcelist "$WORK/apt/sources.list";
Dir::Etc::sourceparts "$WORK/apt/parts";
Dir::Etc::preferencesparts "$WORK/apt/prefs";
Dir::State "$WORK/apt";
Dir::State::lists "$WORK/apt/lists";
Dir::State::status "/var/lib/dpkg/status";
Dir::Cache "$WORK/apt";
Dir::Cache::archives "$WORK/apt/archives";
APT::Sandbox::User "root";
Acquire::Languages "none";
EOF
export APT_CONFIG="$WORK/apt/apt.conf"

srcdir=$(find "$WORK/src" -maxdepth 1 -type d -name "criu-$WANT.*" | sort -V | tail -1)
if [ -z "$srcdir" ]; then
  say "apt (private, trixie deb-src): fetching criu's source package"
  apt-get update -qq
  if ! (cd "$WORK/src" && apt-get source -qq "criu"); then
    # Some Debian mirrors/proxies serve the pool's tarballs but not every
    # .dsc (seen here: criu_4.1.1-1.dsc 404, criu_4.1.1.orig.tar.xz 200).
    # Fall back to the upstream tarball the same signed Sources index names,
    # checked against its SHA256: upstream CRIU without Debian's patches,
    # which `make criu` does not need.
    say "apt-get source failed: fetching the verified upstream tarball alone"
    info=$(apt-cache showsrc criu)
    dir=$(sed -n 's/^Directory: //p' <<<"$info" | head -1)
    read -r sha _size orig < <(sed -n '/^Checksums-Sha256:/,/^[^ ]/p' <<<"$info" \
      | grep -E ' criu_[0-9.]+\.orig\.tar\.[a-z0-9]+$' | head -1)
    [ -f "$WORK/src/$orig" ] && ! sha256sum -c --status <<<"$sha  $WORK/src/$orig" && rm -f "$WORK/src/$orig"
    [ -f "$WORK/src/$orig" ] ||
      /usr/lib/apt/apt-helper download-file "$MIRROR/$dir/$orig" "$WORK/src/$orig" "SHA256:$sha"
    sha256sum -c --status <<<"$sha  $WORK/src/$orig"
    tar -C "$WORK/src" -xf "$WORK/src/$orig"
  fi
  srcdir=$(find "$WORK/src" -maxdepth 1 -type d -name "criu-$WANT.*" | sort -V | tail -1)
  if [ -z "$srcdir" ]; then
    echo "build-criu.sh: trixie's criu source is not $WANT.x:" "$WORK"/src/criu-* >&2
    exit 1
  fi
fi
unset APT_CONFIG

# --- upstream fixes ------------------------------------------------------------------
for p in "$PATCHES"/*.patch; do
  [ -e "$p" ] || continue
  mark="$srcdir/.corral-applied-$(basename "$p")"
  [ -e "$mark" ] && continue
  say "patching: $(basename "$p")"
  patch -d "$srcdir" -p1 --forward --quiet <"$p"
  touch "$mark"
done

# --- build only the criu binary --------------------------------------------------
say "building $(basename "$srcdir") (make criu)"
make -C "$srcdir" -j"$(nproc)" criu >"$WORK/build.log" 2>&1 || {
  tail -30 "$WORK/build.log" >&2
  exit 1
}
install -D -m 0755 "$srcdir/criu/criu" "$PREFIX/criu"
echo "$stamp" >"$PREFIX/criu.corral-stamp"
"$PREFIX/criu" --version
say "criu built and installed in $(($(date +%s) - t0)) s"
