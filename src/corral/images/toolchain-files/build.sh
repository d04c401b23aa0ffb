#!/bin/bash
# Runs inside the build sandbox (fncall:bookworm, as root, with Debian's and
# npm's package sources reachable and nothing else); what it
# leaves under / becomes the fncall-langs toolkit. Arguments: the Debian
# packages. The rest of this folder has been written to /opt/corral/toolchains.
set -euo pipefail
T=/opt/corral/toolchains
export DEBIAN_FRONTEND=noninteractive
echo "step: apt-get update"
apt-get update -q
echo "step: apt-get install $*"
apt-get install -y -q --no-install-recommends "$@"

echo "step: npm install ($T/node/package.json)"
cd "$T/node"
npm install --no-audit --no-fund --loglevel=error
npm cache clean --force 2>/dev/null || true

echo "step: go build cache (testify, for the calls to copy)"
mkdir -p /tmp/gowarm && cd /tmp/gowarm
cat > warm_test.go <<'GO'
package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestWarm(t *testing.T) { assert.True(t, true); require.True(t, true) }
GO
GO111MODULE=off GOPATH=/usr/share/gocode GOCACHE="$T/go/cache" go test warm_test.go
cd / && rm -rf /tmp/gowarm

chmod -R a+rX "$T"
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /root/.npm /root/.cache /tmp/* /var/log/apt /var/log/dpkg.log
echo "step: done"
