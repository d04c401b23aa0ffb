#!/bin/bash
# Runs inside the build sandbox (debian-python:bookworm + e2b-user, as root,
# with Debian's package sources reachable and nothing else); what it leaves
# under / becomes the e2b-tools toolkit: the tools E2B's base template has.
# Arguments: the Debian packages.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
echo "step: apt-get update"
apt-get update -q
echo "step: apt-get install $*"
apt-get install -y -q --no-install-recommends "$@"
# E2B's base has a pip that installs: Debian's Python refuses `pip install`
# outside a venv (PEP 668) unless this marker is gone. The sandbox is the
# environment being managed.
rm -f /usr/lib/python3*/EXTERNALLY-MANAGED
command -v pip pip3 node npm git curl pgrep >/dev/null
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /root/.cache /root/.npm /tmp/* /var/log/apt /var/log/dpkg.log
echo "step: done"
