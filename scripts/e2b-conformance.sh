#!/usr/bin/env bash
# E2B's own Python SDK test suite against a `corral serve` of this checkout,
# and the table of every test and its result (docs/e2b-conformance.md).
#
#   E2B_MIRROR=<git dir of e2b-dev/E2B> make e2b-conformance
#
# Through a cluster's gateway: URL=<gateway> KEY=<a project's key>
# WHERE="a gateway" TABLE=docs/e2b-conformance-gateway.md; the older client:
# E2B_VERSION=2.31.0 TABLE=docs/e2b-conformance-2.31.md; e2b-code-interpreter's
# own tests: SUITE=interpreter CI_MIRROR=<git dir of e2b-dev/code-interpreter>
# TABLE=docs/e2b-conformance-interpreter.md.
#
# The runner is the workplace's (../shared/peers/e2b/run_e2b_tests.sh, or
# PEERS=...): it takes the tests from the tag of the SDK version it installs.
# TIER=core (default) is the lifecycle, list, commands and files tests; the
# PTY, snapshot, pause, fork, metrics and secure tests are added
# (EXTRA_PYTEST_ARGS replaces them). TIER=all TABLE=docs/e2b-conformance-all.md:
# every sync test but template builds, the failures named.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/serve-lib.sh
. scripts/serve-lib.sh
: "${E2B_MIRROR:=}"
[ "${SUITE:-sdk}" = interpreter ] || [ -n "$E2B_MIRROR" ] \
  || { echo "set E2B_MIRROR to a git dir of github.com/e2b-dev/E2B (with its tags)" >&2; exit 2; }
PEERS="${PEERS:-../shared/peers}"
RUNNER="$PEERS/e2b/run_e2b_tests.sh"
[ -x "$RUNNER" ] || [ -f "$RUNNER" ] || { echo "no E2B runner at $RUNNER (set PEERS)" >&2; exit 2; }
PORT="${PORT:-7179}"
TABLE="${TABLE:-docs/e2b-conformance.md}"
URL="${URL:-}"  # an E2B API already running (a gateway): not started here
KEY="${KEY:-e2b_00}"
OUT="$(mktemp -d /tmp/e2b-conformance.XXXX)"

WHERE="${WHERE:-corral serve}"
if [ -z "$URL" ]; then
  start_serve "$PORT" "$OUT/serve.log"
  URL="http://127.0.0.1:$PORT"
fi
if [ "${SUITE:-sdk}" = interpreter ]; then
  # e2b-code-interpreter's own tests (CI_MIRROR: its git dir), every one.
  bash scripts/e2b-interpreter-tests.sh "$URL" "$KEY" --junitxml="$OUT/e2b.xml" tests \
    | tee "$OUT/run.log" || true
  .venv/bin/python scripts/junit_table.py "$OUT/e2b.xml" \
    "e2b-code-interpreter ${CI_VERSION:-2.9.1}, its own tests, against $WHERE" > "$TABLE"
  echo "wrote $TABLE ($OUT has the logs)"
  exit 0
fi
S=tests/sync/sandbox_sync
TIER="${TIER:-core}"
ADDED="$S/pty $S/test_snapshot_api.py $S/test_snapshot.py tests/sync/api_sync/test_sbx_snapshot.py
       $S/test_fork.py $S/test_metrics.py $S/test_secure.py"
WHAT="TIER=core + PTY, snapshots, pause, fork, metrics, secure"
if [ "$TIER" != core ]; then
  ADDED="" WHAT="TIER=$TIER"  # all: every sync test but template builds
fi
EXTRA_PYTEST_ARGS="--junitxml=$OUT/e2b.xml ${EXTRA_PYTEST_ARGS:-$ADDED}" \
  TIER="$TIER" E2B_MIRROR="$E2B_MIRROR" bash "$RUNNER" "$URL" "$KEY" "$URL" \
  | tee "$OUT/run.log" || true
.venv/bin/python scripts/junit_table.py "$OUT/e2b.xml" \
  "E2B Python SDK ${E2B_VERSION:-2.45.1}, its own tests ($WHAT), against $WHERE" \
  > "$TABLE"
echo "wrote $TABLE ($OUT has the logs)"
