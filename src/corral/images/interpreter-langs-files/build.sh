#!/bin/bash
# Runs inside the build sandbox (debian-python:bookworm + e2b-user + e2b-tools, as root,
# with Debian's package sources reachable and nothing else); what it leaves
# under / becomes the e2b-ci-langs toolkit. Arguments: the Debian packages.
# The rest of this folder has been written to /opt/corral/interpreter/java.
set -euo pipefail
J=/opt/corral/interpreter/java
export DEBIAN_FRONTEND=noninteractive
echo "step: apt-get update"
apt-get update -q
echo "step: apt-get install $*"
apt-get install -y -q --no-install-recommends "$@"

echo "step: the Java kernel (JShell)"
# sun.misc.Signal is the JDK's supported way to take SIGINT; javac warns.
javac -nowarn -XDignore.symbol.file -d "$J" "$J/CorralJShell.java" 2>&1 | grep -v -i "proprietary\|warning" || true
test -f "$J/CorralJShell.class"
mkdir -p /usr/local/share/jupyter/kernels/java
cat > /usr/local/share/jupyter/kernels/java/kernel.json <<JSON
{"argv": ["/usr/bin/python3", "$J/java_kernel.py", "-f", "{connection_file}"],
 "display_name": "Java (JShell)", "language": "java", "interrupt_mode": "signal"}
JSON
test -f /usr/share/jupyter/kernels/ir/kernel.json

chmod -R a+rX "$J"
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /root/.cache /tmp/* /var/log/apt /var/log/dpkg.log
echo "step: done"
