#!/usr/bin/env bash
# e2b-code-interpreter's own Python test suite (from the git tag of the PyPI
# version it installs) against an E2B-compatible API: the code-interpreter
# twin of ../shared/peers/e2b/run_e2b_tests.sh.
#
#   usage: e2b-interpreter-tests.sh API_URL API_KEY [pytest args...]
#
#   CI_MIRROR   required: the git dir of github.com/e2b-dev/code-interpreter
#   CI_VERSION  the e2b-code-interpreter version and tag (default 2.9.1)
#   E2B_VERSION the e2b it runs on (default 2.45.1: 2.9.1 breaks on e2b 2.63,
#               whose get_transport() lost an argument it passes)
#   WORK        scratch (default /tmp/e2b-ci-tests): the tests and a venv
#   JOBS        pytest-xdist workers (default 2)
set -euo pipefail
API_URL="${1:?usage: $0 API_URL API_KEY [pytest args]}"
API_KEY="${2:?usage: $0 API_URL API_KEY [pytest args]}"
shift 2
: "${CI_MIRROR:?set CI_MIRROR to the git dir of github.com/e2b-dev/code-interpreter}"
CI_VERSION="${CI_VERSION:-2.9.1}"
WORK="${WORK:-/tmp/e2b-ci-tests}"
JOBS="${JOBS:-2}"
TAG="@e2b/code-interpreter-python@$CI_VERSION"
SRC="$WORK/src-$CI_VERSION"
E2B_VERSION="${E2B_VERSION:-2.45.1}"
VENV="$WORK/venv-$CI_VERSION-e2b-$E2B_VERSION"

if [ ! -d "$SRC/python/tests" ]; then
  git --git-dir="$CI_MIRROR" rev-parse -q --verify "refs/tags/$TAG" >/dev/null \
    || { echo "tag $TAG not in $CI_MIRROR" >&2; exit 2; }
  mkdir -p "$SRC"
  git --git-dir="$CI_MIRROR" archive "$TAG" python/tests python/pytest.ini | tar -x -C "$SRC"
fi
if [ ! -x "$VENV/bin/pytest" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  # The package from PyPI, and its pyproject's dev group.
  "$VENV/bin/pip" install -q "e2b-code-interpreter==$CI_VERSION" "e2b==$E2B_VERSION" "pytest>=9.0.3,<10" \
    "pytest-asyncio>=1.3.0,<2" "pytest-xdist>=3.6.1,<4" "pytest-dotenv>=0.5.2,<0.6" \
    "python-dotenv>=1.0.0,<2" "pytest-timeout>=2.4.0,<3"
fi
export E2B_API_URL="$API_URL" E2B_SANDBOX_URL="$API_URL" E2B_API_KEY="$API_KEY"
export E2B_DOMAIN="${E2B_DOMAIN:-corral.local}" E2B_VALIDATE_API_KEY=false
unset E2B_DEBUG
cd "$SRC/python"
rm -f .env
ARGS=(-p no:cacheprovider -rfEs --timeout=180)
[ "$JOBS" != 0 ] && ARGS+=(-n "$JOBS")
exec "$VENV/bin/pytest" "${ARGS[@]}" "$@"
