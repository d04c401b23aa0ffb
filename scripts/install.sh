#!/usr/bin/env bash
# Install everything Corral needs on a Debian 12 host, as root. Idempotent and
# cached: each step checks what is already there, so a second run installs
# nothing (apt is skipped when every package is present, the virtual
# environment is rebuilt only when pyproject.toml changes, images are found
# by their content labels).
set -euo pipefail
cd "$(dirname "$0")/.."
STAMPS=.stamps
mkdir -p "$STAMPS"
say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

if [ "$(id -u)" -ne 0 ]; then
  echo "install.sh: run as root (Corral mounts file systems and manages cgroups)" >&2
  exit 1
fi

# --- apt packages -------------------------------------------------------------
APT_PACKAGES=(
  crun runc                 # OCI runtimes (crun by default; runc for comparison)
  erofs-utils               # mkfs.erofs: image layers
  btrfs-progs               # per-sandbox writable space with a size limit
  fuse3 libfuse3-dev pkg-config  # on-demand layer loading (pyfuse3 builds against libfuse3)
  debootstrap               # Debian base images
  busybox-static            # the platform's tar inside sandboxes
  bash-static               # the platform shell inside sandboxes
  nftables iproute2         # sandbox networking
  bubblewrap                # a peer in the function-call benchmark
  postgresql                # the cluster state store (started by Corral, not by systemd)
  qemu-system-x86           # microVMs (TCG here; KVM where the host has it)
  ipxe-qemu                 # own disks' NIC option ROM: the firmware's network (DHCP at boot)
  qemu-utils ovmf           # users' own disks: qemu-img (checks, overlays), UEFI firmware
  grub-pc-bin grub-efi-amd64-bin xorriso mtools  # the own-disk tests' small bootable disk
  gcc libc6-dev make        # the static platform helpers
  musl-tools                # corral-nsexec linked against musl: no cpuid storm at each exec (native/Makefile)
  python3 python3-venv python3-dev
  ca-certificates curl tar
  skopeo zstd               # OCI registries: their protocol (pulls), zstd layers
  openssl                   # the registry tests' TLS certificates
  docker-registry           # a real registry for the tests, started by them on loopback
  chromium chromium-driver  # the browser tests (tests/integration/test_dashboard.py, test_liveview.py)
  novnc                     # the desktops' live view in a browser (api/liveview.py)
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "apt: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  say "apt: all ${#APT_PACKAGES[@]} packages present"
fi

# npm fetches Deno (the code-interpreter template's JavaScript kernel). Some
# machines carry it in their nodejs package; Debian's own is `npm`.
if ! command -v npm >/dev/null; then
  say "apt: installing npm"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends npm
fi

# Debian's docker-registry starts a registry on :5000 wherever systemd runs;
# Corral starts its own, on loopback, in the tests only.
if [ -d /run/systemd/system ] && systemctl is-enabled -q docker-registry 2>/dev/null; then
  say "docker-registry: disabling the packaged service (the tests start their own)"
  systemctl disable --now docker-registry
fi

# --- Python virtual environment -------------------------------------------------
PY=python3
if ! "$PY" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then PY=/usr/bin/python3; fi
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -x .venv/bin/python ] || [ "$(cat "$STAMPS/venv" 2>/dev/null)" != "$want" ]; then
  say "venv: creating .venv and installing corral[dev,cluster]"
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[dev,cluster]'
  echo "$want" > "$STAMPS/venv"
else
  say "venv: up to date"
fi

# The OpenAI Agents SDK's E2B client, for its test (tests/integration/
# test_openai_agents.py), and Corral's own provider for that SDK
# (corral.integrations.openai_agents): a venv of its own, since it pins e2b 2.31.
AGENTS="openai-agents[e2b]==0.24.0"
if [ ! -x .venv-agents/bin/python ] || [ "$(cat "$STAMPS/venv-agents" 2>/dev/null)" != "$AGENTS $want" ]; then
  say "venv: creating .venv-agents with $AGENTS"
  "$PY" -m venv .venv-agents
  .venv-agents/bin/pip install -q --upgrade pip
  .venv-agents/bin/pip install -q "$AGENTS" -e .
  echo "$AGENTS $want" > "$STAMPS/venv-agents"
else
  say "venv: .venv-agents up to date"
fi

# The RL frameworks Corral's adapters are tested with (corral.integrations;
# tests/integration/test_rl_adapters.py), from PyPI, in a venv of their own:
# verl brings torch (CPU use only, but PyPI's build carries CUDA's libraries:
# about 6 GiB), which Corral's own environment should not have to hold.
# cachetools: verl 0.9.1's agent loop imports it without declaring it.
RL="verl==0.9.1 skyrl-gym==0.4.0 gymnasium==1.4.0 cachetools"
if [ ! -x .venv-rl/bin/python ] || [ "$(cat "$STAMPS/venv-rl" 2>/dev/null)" != "$RL $want" ]; then
  say "venv: creating .venv-rl with $RL (torch included: a few minutes)"
  "$PY" -m venv .venv-rl
  .venv-rl/bin/pip install -q --upgrade pip
  # shellcheck disable=SC2086
  .venv-rl/bin/pip install -q $RL -e .
  echo "$RL $want" > "$STAMPS/venv-rl"
else
  say "venv: .venv-rl up to date"
fi

# harbor (its terminal-bench tasks on Corral: tests/integration/test_harbor.py)
# needs Python 3.12, which Debian 12 does not ship: its venv is made where
# a python3.12 is found, and its test says so where none is.
HARBOR="harbor==0.26.0"
PY312=""
for c in python3.12 python3.13 /usr/bin/python3.12 /usr/local/bin/python3.12 \
         /root/.pyenv/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.13*/bin/python3.13; do
  # A candidate counts only if it runs (a pyenv shim may name a version it cannot run).
  if "$c" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then PY312=$c; break; fi
done
if [ -n "$PY312" ] && { [ ! -x .venv-harbor/bin/python ] || [ "$(cat "$STAMPS/venv-harbor" 2>/dev/null)" != "$HARBOR $want" ]; }; then
  say "venv: creating .venv-harbor with $HARBOR ($PY312)"
  "$PY312" -m venv .venv-harbor
  .venv-harbor/bin/pip install -q --upgrade pip
  .venv-harbor/bin/pip install -q "$HARBOR" -e .
  echo "$HARBOR $want" > "$STAMPS/venv-harbor"
elif [ -z "$PY312" ]; then
  say "venv: no python3.12 on this machine: harbor's test will say so"
else
  say "venv: .venv-harbor up to date"
fi

# verl's SandboxFusion reward (tests/integration/test_verl_reward.py): its
# wheel alone. The test loads that module from it; verl's own package
# imports torch, which no test here needs.
VERL=verl-0.7.0-py3-none-any.whl
if [ ! -f "build/peers/$VERL" ]; then
  say "peers: verl 0.7.0's wheel (its SandboxFusion reward function)"
  .venv/bin/pip download -q --no-deps -d build/peers verl==0.7.0
else
  say "peers: verl's wheel present"
fi

# --- CRIU (containers suspended to disk) -----------------------------------------
say "criu: 4.1 from Debian trixie's source (bookworm's 3.17 fails on this kernel; cached)"
./scripts/build-criu.sh

# --- platform helpers (static C) ------------------------------------------------
say "platform: building static helpers"
make -s -C native

# --- images the tests and the demo start from ----------------------------------
say "images: debian-python:bookworm (debootstrap, cached)"
.venv/bin/corral image build debian-python:bookworm --debootstrap bookworm --packages python3
say "images: fncall:bookworm (function calls: python, bash, c, c++; cached)"
.venv/bin/corral image build fncall:bookworm --debootstrap bookworm --packages python3,gcc,g++,libc6-dev

say "images: fncall-python:bookworm (the Python packages code problems import, over fncall:bookworm; cached)"
.venv/bin/python -m corral.images.fncall_python
say "images: fncall-langs:bookworm (SandboxFusion's languages: Go, Java, Node.js, PHP, C#, Rust, R, ...; built in a sandbox; cached)"
.venv/bin/python -m corral.cli.toolchains

say "images: e2b-user:bookworm (E2B's 'base' template: the user 'user', home /home/user, sudo)"
# sudo is the platform's (docs/sudo.md): /etc/corral/sudo names who may.
.venv/bin/corral image build e2b-user:bookworm --run debian-python:bookworm --kind toolkit -- \
  bash -c "(id user >/dev/null 2>&1 || useradd -m -s /bin/bash -u 1000 user) && { [ -s /etc/hosts ] || printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' > /etc/hosts; } && mkdir -p /etc/corral && echo user > /etc/corral/sudo && ln -sfn /.corral/bin/corral-init /usr/bin/sudo"

say "images: e2b-tools, e2b-ci-langs, e2b-code-interpreter (E2B's base template's tools: pip, Node.js, git, curl; its code interpreter: R, Java, Jupyter, Deno, port 49999; built in sandboxes, cached)"
.venv/bin/python -m corral.cli.e2b_templates

say "images: debian-desktop:bookworm + corral-desktop (the full-VM desktop: X, twm, xterm; cached)"
.venv/bin/corral image build debian-desktop:bookworm --desktop

say "images: debian-xfce:bookworm + corral-xfce (XFCE, Chromium, Firefox, LibreOffice; a Dockerfile build, cached)"
.venv/bin/corral image build debian-xfce:bookworm --desktop xfce

say "images: pytest toolkit and the demo's project workspaces (PyPI sdists, pinned; cached)"
.venv/bin/python -m corral.rollout.demo_images

say "guest: microVM kernel and initramfs (Debian's linux-image + corral-init; cached)"
.venv/bin/python -m corral.runtimes.vm.guest

say "install complete"
