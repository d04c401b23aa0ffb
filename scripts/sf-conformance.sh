#!/usr/bin/env bash
# SandboxFusion's own runner tests against a `corral serve` of this
# checkout, and the table of every test and its result
# (docs/sandboxfusion-conformance.md).
#
#   SF_MIRROR=<git dir of bytedance/SandboxFusion> make sf-conformance
#
# The runner is the workplace's (../shared/peers/sandboxfusion/run_sf_tests.sh,
# or PEERS=...). Every marker runs but those for GPUs and ByteDance's data
# services; the runner itself leaves out the one test that reaches the
# public internet.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/serve-lib.sh
. scripts/serve-lib.sh
: "${SF_MIRROR:?set SF_MIRROR to a git dir of github.com/bytedance/SandboxFusion}"
PEERS="${PEERS:-../shared/peers}"
RUNNER="$PEERS/sandboxfusion/run_sf_tests.sh"
[ -f "$RUNNER" ] || { echo "no SandboxFusion runner at $RUNNER (set PEERS)" >&2; exit 2; }
PORT="${PORT:-7182}"
TABLE="${TABLE:-docs/sandboxfusion-conformance.md}"
OUT="$(mktemp -d /tmp/sf-conformance.XXXX)"

start_serve "$PORT" "$OUT/serve.log"

SF_MIRROR="$SF_MIRROR" LANGS=all bash "$RUNNER" "http://127.0.0.1:$PORT" \
  -m "not cuda and not datalake and not dp_eval" --junitxml="$OUT/sf.xml" || true
REV="$(git --git-dir="$SF_MIRROR" rev-parse --short HEAD)"
.venv/bin/python scripts/junit_table.py "$OUT/sf.xml" \
  "SandboxFusion's own runner tests (bytedance/SandboxFusion $REV, every CPU marker), against corral serve" \
  --notes scripts/sf-conformance-notes.md > "$TABLE"
echo "wrote $TABLE: $(sed -n 3p "$TABLE")"
