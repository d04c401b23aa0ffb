#!/bin/bash
cd /app
got=$(python3 stats.py)
python3 - "$got" <<'PY' && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
import sys
assert abs(float(sys.argv[1]) - 3.5) < 1e-9, sys.argv[1]
PY
