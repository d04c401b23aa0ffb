#!/usr/bin/env bash
# SandboxFusion (github.com/bytedance/SandboxFusion) as a benchmark peer:
# installs it from its repository into virtual environments on this machine
# and runs its own HTTP server (uvicorn sandbox.server.server:app, as its
# Makefile's `run` target does) with its own isolation ON, `isolation: lite`:
# per run a fresh overlayfs over the host's / (tmpfs upper), cgroup v1
# memory+cpu groups (cgexec), `unshare --pid`, a network namespace with a
# veth and NAT (its scripts/create_net_namespace.sh), and chroot onto the
# overlay. Code therefore runs with the host's toolchains (python3.11,
# gcc/g++, bash, node). Nothing of SandboxFusion is copied into this repo.
#
#   bench/sandboxfusion_peer.sh start    # install (idempotent) + start + wait
#   bench/sandboxfusion_peer.sh stop     # stop + remove leftovers
#   bench/sandboxfusion_peer.sh install  # install only
#   bench/sandboxfusion_peer.sh status
#
# Then: POST http://127.0.0.1:$PORT/run_code {"language":"python","code":"print(1)"}
#
# Environment:
#   PORT      (7183)  listen port on 127.0.0.1
#   SF_ROOT   (/opt/sf-peer)  everything lives here (must be on the root
#             filesystem: the sandbox's chroot is an overlay of / only, so
#             the runtime venv must be visible through it)
#   SF_MIRROR (/work/.mirror/bytedance+SandboxFusion/repo)  bare git dir
#   PYTHON    interpreter for the venvs (default: /usr/bin/python3 if it is
#             3.11 with venv, else python3 on PATH)
#
# Must run as root (lite isolation mounts, makes cgroups and netns via sudo).
#
# What stands in for what, and why:
# * conda. SandboxFusion's python runner calls get_python_rt_env(
#   'sandbox-runtime'): find_conda_root() walks up from sys.executable to
#   the first directory holding `condabin`, then runs
#   `bash -c "source <root>/bin/activate sandbox-runtime && which python"`
#   and puts that python's directory first on the sandbox's PATH. Its
#   Docker images ship miniconda; there is no conda here and none can be
#   downloaded (only PyPI, apt and npm are reachable). So SF_ROOT is laid
#   out like a conda root: SF_ROOT/condabin/ (empty marker dir), the
#   server's venv at SF_ROOT/envs/sandbox, the runtime's venv at
#   SF_ROOT/envs/sandbox-runtime (plain venv, no extra packages; upstream's
#   runtime has numpy & co.), and SF_ROOT/bin/activate, a small bash script
#   that for `sandbox-runtime` puts SF_ROOT/envs/sandbox-runtime/bin first
#   on PATH.
# * Config. SANDBOX_CONFIG names a yaml next to sandbox/configs/run_config.py.
#   We write sandbox/configs/sf_peer.yaml into the installed source tree:
#   upstream's default local.yaml with `sandbox.isolation: lite` (as its
#   ci.yaml has), log colours off, and the dataset registry minus modules
#   that import `transformers` (only repobench_p; it would pull in
#   transformers/tokenizers just for a dataset endpoint, and /run_code never
#   touches datasets).
# * docs/build. server.py mounts the docs site from docs/build, which only
#   exists after an `npm run build` of the docusaurus docs; starlette refuses
#   to start without the directory, so an empty placeholder is made.
# * Host tools the isolation shells out to (sudo, mount, cgcreate/cgset/
#   cgexec/cgdelete from cgroup-tools, ip, iptables, unshare, chroot) are
#   installed from apt if missing. Its cgroup calls are cgroup v1
#   (memory.limit_in_bytes, cpu.cfs_quota_us): this host has v1 hierarchies.
# * Node's runtime/node/node_modules (jest, puppeteer...) is not installed;
#   plain `nodejs` runs don't need it (SandboxFusion symlinks it, dangling).
#
# Server python deps are the versions in SandboxFusion's poetry.lock (within
# its pyproject ranges), minus transformers and the mysql extra.
set -euo pipefail

PORT="${PORT:-7183}"
SF_ROOT="${SF_ROOT:-/opt/sf-peer}"
SF_MIRROR="${SF_MIRROR:-/work/.mirror/bytedance+SandboxFusion/repo}"
SRC="$SF_ROOT/src"
SERVER_ENV="$SF_ROOT/envs/sandbox"
RT_ENV="$SF_ROOT/envs/sandbox-runtime"
RUN_DIR="$SF_ROOT/run"
PID_FILE="$RUN_DIR/server.pid"
LOG_FILE="${SF_LOG:-$RUN_DIR/server.log}"
CONFIG_NAME=sf_peer
SYS_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

log() { echo "[sf-peer] $*" >&2; }
die() { log "error: $*"; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

[ "$(id -u)" = 0 ] || die "must run as root"

pick_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if [ -x /usr/bin/python3 ] &&
     /usr/bin/python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    echo /usr/bin/python3
  else
    command -v python3 || die "no python3"
  fi
}

server_requirements() {
  cat <<'EOF'
pydantic==2.6.4
pydantic-core==2.16.3
fastapi==0.103.2
starlette==0.27.0
anyio==3.7.1
uvicorn[standard]==0.25.0
uvloop==0.20.0
httptools==0.6.1
websockets==13.1
watchfiles==0.24.0
python-dotenv==1.0.1
structlog==23.3.0
psutil==5.9.8
aiofiles==23.2.1
aiohttp==3.10.6
tenacity==8.5.0
databases[aiosqlite]==0.9.0
sqlalchemy==2.0.35
aiosqlite==0.20.0
greenlet==3.1.1
pyyaml==6.0.2
EOF
}

install_host_tools() {
  local missing=()
  for c in sudo mount umount ip iptables cgcreate cgset cgexec cgdelete unshare chroot sysctl; do
    command -v "$c" >/dev/null 2>&1 || PATH="$SYS_PATH" command -v "$c" >/dev/null 2>&1 || missing+=("$c")
  done
  [ ${#missing[@]} -eq 0 ] && return
  log "installing host tools (missing: ${missing[*]})"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    sudo iptables cgroup-tools iproute2 util-linux coreutils procps >/dev/null
}

install_sources() {
  local rev
  rev="$(git --git-dir="$SF_MIRROR" rev-parse HEAD)" || die "no SandboxFusion git dir at $SF_MIRROR"
  if [ -f "$SRC/.sf_rev" ] && [ "$(cat "$SRC/.sf_rev")" = "$rev" ]; then return; fi
  log "extracting SandboxFusion ${rev:0:12} into $SRC"
  rm -rf --one-file-system "$SRC.new"
  mkdir -p "$SRC.new"
  git --git-dir="$SF_MIRROR" archive HEAD | tar -x -C "$SRC.new"
  rm -rf --one-file-system "$SRC"
  mv "$SRC.new" "$SRC"
  echo "$rev" > "$SRC/.sf_rev"
}

make_venv() {  # dir
  [ -x "$1/bin/python" ] && "$1/bin/python" -c 'import sys' 2>/dev/null && return
  log "creating venv $1 with $PY"
  rm -rf --one-file-system "$1"
  "$PY" -m venv "$1"
}

install_server_env() {
  make_venv "$SERVER_ENV"
  local req="$SF_ROOT/requirements-server.txt" stamp="$SERVER_ENV/.sf_req_sha"
  server_requirements > "$req"
  local sha; sha="$(sha256sum "$req" | cut -d' ' -f1)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sha" ]; then return; fi
  log "pip installing server requirements"
  local out
  # (this host's pip config names local index dirs that warn per package)
  if ! out="$("$SERVER_ENV/bin/pip" install -q -r "$req" 2>&1)"; then
    echo "$out" >&2; die "pip install failed"
  fi
  echo "$out" | grep -v 'is ignored: it is neither a file nor a directory' >&2 || true
  echo "$sha" > "$stamp"
}

install_conda_standin() {
  mkdir -p "$SF_ROOT/condabin" "$SF_ROOT/bin" "$RUN_DIR"
  make_venv "$RT_ENV"
  cat > "$SF_ROOT/bin/activate" <<EOF
# Stand-in for conda's bin/activate (see bench/sandboxfusion_peer.sh):
# \`source $SF_ROOT/bin/activate ENV\` puts $SF_ROOT/envs/ENV/bin first on PATH.
_sf_env="\${1:-sandbox-runtime}"
if [ ! -d "$SF_ROOT/envs/\$_sf_env/bin" ]; then
  echo "activate: no env \$_sf_env" >&2
  return 1 2>/dev/null || exit 1
fi
export CONDA_PREFIX="$SF_ROOT/envs/\$_sf_env"
export CONDA_DEFAULT_ENV="\$_sf_env"
export PATH="$SF_ROOT/envs/\$_sf_env/bin:\$PATH"
unset _sf_env
EOF
}

write_config() {
  mkdir -p "$SRC/docs/build"
  [ -f "$SRC/docs/build/index.html" ] ||
    echo '<html><body>SandboxFusion docs not built (benchmark peer)</body></html>' > "$SRC/docs/build/index.html"
  "$SERVER_ENV/bin/python" - "$SRC" "$CONFIG_NAME" <<'EOF'
import os, re, sys, yaml
src, name = sys.argv[1], sys.argv[2]
cfg_dir = os.path.join(src, 'sandbox', 'configs')
with open(os.path.join(cfg_dir, 'local.yaml')) as f:
    cfg = yaml.safe_load(f)
cfg['sandbox']['isolation'] = 'lite'
cfg['sandbox']['cleanup_process'] = False
cfg['sandbox']['restore_bash'] = False
cfg['common']['logging_color'] = False
keep = []
for item in cfg['dataset']['registry']:
    path = os.path.join(src, *item['module_path'].split('.')) + '.py'
    text = open(path).read()
    if re.search(r'^\s*(from|import)\s+transformers\b', text, re.M):
        print(f'[sf-peer] config: leaving out dataset module {item["module_path"]} (needs transformers)', file=sys.stderr)
        continue
    keep.append(item)
cfg['dataset']['registry'] = keep
out = os.path.join(cfg_dir, f'{name}.yaml')
with open(out, 'w') as f:
    f.write('# written by bench/sandboxfusion_peer.sh: local.yaml with isolation lite\n')
    yaml.safe_dump(cfg, f, sort_keys=False)
EOF
}

do_install() {
  local t0; t0="$(now)"
  PY="$(pick_python)"
  install_host_tools
  install_sources
  install_server_env
  install_conda_standin
  write_config
  # the stand-in must resolve the runtime python the way SandboxFusion asks
  local got
  got="$(bash -c "source $SF_ROOT/bin/activate sandbox-runtime && which python")"
  [ "$got" = "$RT_ENV/bin/python" ] || die "activate stand-in resolves python to '$got'"
  log "install ok in $(since "$t0")s (python $("$SERVER_ENV/bin/python" -V 2>&1 | cut -d' ' -f2), SandboxFusion $(cut -c1-12 "$SRC/.sf_rev"))"
}

server_pid() {
  [ -f "$PID_FILE" ] || return 1
  local pid; pid="$(cat "$PID_FILE")"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null &&
    tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q 'sandbox.server.server:app' && echo "$pid"
}

http_get() {  # url -> body (fails on error)
  "$SERVER_ENV/bin/python" - "$1" <<'EOF'
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
    sys.stdout.write(r.read().decode())
EOF
}

do_start() {
  if pid="$(server_pid)"; then
    log "already running (pid $pid) on port $(cat "$RUN_DIR/port" 2>/dev/null || echo '?')"
    return 0
  fi
  do_install
  case "$PORT" in 7070|7179|7182) die "port $PORT is reserved for Corral; pick another";; esac
  if "$SERVER_ENV/bin/python" -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $PORT)) != 0)"; then
    die "port $PORT already in use"
  fi
  # what existed before, so that stop removes only what SandboxFusion made
  ip netns list 2>/dev/null | awk '{print $1}' > "$RUN_DIR/netns.before"
  iptables -w -t nat -S POSTROUTING 2>/dev/null > "$RUN_DIR/nat.before" || true
  echo "$PORT" > "$RUN_DIR/port"
  local t0; t0="$(now)"
  log "starting SandboxFusion (isolation lite) on 127.0.0.1:$PORT, log $LOG_FILE"
  (
    cd "$SRC"
    exec env -u VIRTUAL_ENV -u PYTHONPATH -u PYTHONHOME \
      PATH="$SERVER_ENV/bin:$SYS_PATH" \
      SANDBOX_CONFIG="$CONFIG_NAME" \
      setsid "$SERVER_ENV/bin/python" -m uvicorn sandbox.server.server:app \
        --host 127.0.0.1 --port "$PORT"
  ) > "$LOG_FILE" 2>&1 < /dev/null &
  local pid=$!
  echo "$pid" > "$PID_FILE"
  for _ in $(seq 600); do
    if [ "$(http_get "http://127.0.0.1:$PORT/v1/ping" 2>/dev/null)" = '"pong"' ]; then
      log "up (pid $pid) in $(since "$t0")s"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { tail -n 40 "$LOG_FILE" >&2; die "server exited during start"; }
    sleep 0.2
  done
  tail -n 40 "$LOG_FILE" >&2
  die "server did not answer /v1/ping within 120s"
}

kill_tree() {  # pid: TERM, wait, KILL; also its process group (setsid made it a leader)
  local pid="$1"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null || true
  kill -KILL -- "-$pid" 2>/dev/null || true
}

cleanup_leftovers() {
  # cgroups: SandboxFusion keeps (caches) sandbox_mem_xxxxxx / sandbox_cpu_xxxxxx
  # groups for the server's lifetime and never removes them on shutdown
  local d p n=0
  for d in /sys/fs/cgroup/memory/sandbox_mem_* /sys/fs/cgroup/cpu/sandbox_cpu_* \
           /sys/fs/cgroup/cpu,cpuacct/sandbox_cpu_*; do
    [ -d "$d" ] || continue
    for p in $(cat "$d/tasks" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
    for _ in $(seq 25); do [ -s "$d/tasks" ] || break; sleep 0.2; done
    rmdir "$d" 2>/dev/null && n=$((n + 1)) || log "could not remove cgroup $d"
  done
  [ "$n" -gt 0 ] && log "removed $n cgroups"

  # overlays: /tmp/overlay_xxxxxx/{merged{,/proc,/sys,/dev},tmpfs}, normally
  # unmounted after each run; left only if the server died mid-run
  local m
  for m in $(awk '{print $2}' /proc/mounts | grep -E '^/tmp/overlay_[a-z]{6}/' | tac); do
    umount -l "$m" 2>/dev/null && log "unmounted $m" || true
  done
  for d in /tmp/overlay_[a-z][a-z][a-z][a-z][a-z][a-z]; do
    [ -d "$d" ] || continue
    if awk '{print $2}' /proc/mounts | grep -q "^$d/"; then
      log "still mounted under $d; not removing it"
    else
      rm -rf --one-file-system "$d"
    fi
  done

  # netns (+veth, +NAT rule): cached for the server's lifetime, never removed
  local ext ns addr subnet
  ext="$(ip route | awk '/^default/{print $5; exit}')"
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^[a-z]{6}$' || true); do
    local ours=0
    ip link show "veth-$ns-br" >/dev/null 2>&1 && ours=1
    if [ -f "$RUN_DIR/netns.before" ] && ! grep -qx "$ns" "$RUN_DIR/netns.before"; then ours=1; fi
    [ "$ours" = 1 ] || continue
    addr="$(ip -4 -o addr show dev "veth-$ns-br" 2>/dev/null | awk '{print $4}' | head -n1)"
    if [ -n "$addr" ] && [ -n "$ext" ]; then
      subnet="${addr%.*/*}"
      iptables -w -t nat -D POSTROUTING -s "$subnet.0/24" -o "$ext" -j MASQUERADE 2>/dev/null || true
    fi
    ip netns delete "$ns" 2>/dev/null && log "deleted netns $ns" || log "could not delete netns $ns"
    ip link delete "veth-$ns-br" 2>/dev/null || true
  done
  # NAT rules of SandboxFusion's 172.16-31.x.0/24 subnets made since start
  if [ -f "$RUN_DIR/nat.before" ]; then
    local rule
    iptables -w -t nat -S POSTROUTING 2>/dev/null |
      grep -E '^-A POSTROUTING -s 172\.(1[6-9]|2[0-9]|3[01])\.[0-9]+\.0/24 .*-j MASQUERADE$' |
      while read -r rule; do
        grep -qxF -- "$rule" "$RUN_DIR/nat.before" && continue
        # shellcheck disable=SC2086
        iptables -w -t nat ${rule/-A POSTROUTING/-D POSTROUTING} && log "removed NAT rule: $rule"
      done || true
  fi
}

do_stop() {
  local pid
  if pid="$(server_pid)"; then
    log "stopping pid $pid"
    kill_tree "$pid"
  else
    log "not running"
  fi
  rm -f "$PID_FILE"
  cleanup_leftovers
  rm -f "$RUN_DIR/netns.before" "$RUN_DIR/nat.before" "$RUN_DIR/port"
  log "stopped"
}

do_status() {
  if pid="$(server_pid)"; then
    echo "running pid $pid port $(cat "$RUN_DIR/port" 2>/dev/null || echo '?') log $LOG_FILE"
  else
    echo "not running"; return 1
  fi
}

case "${1:-}" in
  start) do_start ;;
  stop) do_stop ;;
  install) do_install ;;
  status) do_status ;;
  *) echo "usage: $0 start|stop|install|status" >&2; exit 2 ;;
esac
