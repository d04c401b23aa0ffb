# Sourced by the conformance scripts: start_serve PORT LOG starts a
# `corral serve` of this checkout in the background, stops it when the
# calling script exits, and returns once it answers /healthz.
start_serve() {
  .venv/bin/corral serve --port "$1" --log-level warning >"$2" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$1/healthz" >/dev/null && return 0
    sleep 0.1
  done
  echo "corral serve did not answer on port $1 (see $2)" >&2
  return 1
}
