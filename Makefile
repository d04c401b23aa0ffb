# The two commands a newcomer runs (as root, on Debian 12):
#   make demo   install everything, then run the main job
#   make test   install everything, then run the test suite
.PHONY: install demo test lint unit integration bench e2b-conformance sf-conformance v2-host clean

install:
	./scripts/install.sh

demo: install
	.venv/bin/corral demo

test: install lint unit integration

lint:
	.venv/bin/ruff check src tests bench
	.venv/bin/ruff format --check src tests bench
	.venv/bin/mypy
	MYPYPATH=bench .venv/bin/mypy bench/*.py  # scripts run by `corral bench`, importing bench/_common
	.venv/bin/python -m corral.sdk.gen_sync --check
	.venv/bin/python -m corral.api.gen_routes --check

unit:
	.venv/bin/pytest -q tests/unit -m unit

integration:
	.venv/bin/pytest -q tests/integration -m integration
	.venv/bin/pytest -q tests/redteam -m redteam

bench: install
	.venv/bin/corral bench

# E2B's own SDK tests against this checkout (docs/e2b.md): E2B_MIRROR=<git dir>.
e2b-conformance:
	./scripts/e2b-conformance.sh

# SandboxFusion's own runner tests against this checkout (docs/fncall-languages.md):
# SF_MIRROR=<git dir>.
sf-conformance:
	./scripts/sf-conformance.sh

# The cgroup-bound suites on a pure cgroup v2 host: a QEMU guest on Debian's
# 6.12 kernel over this checkout (docs/cgroups.md). Long under TCG.
v2-host: install
	.venv/bin/python -m tests.framework.v2host

clean:
	rm -rf build .stamps
