#!/bin/bash
python3 - <<'PY'
import json
lines = open("/app/log.txt").read().splitlines()
want = {"lines": len(lines), "errors": sum(x.startswith("ERROR") for x in lines)}
try:
    got = json.load(open("/app/report.json"))
except Exception:
    got = None
ok = got == want
json.dump({"reward": 1.0 if ok else 0.0, "lines_ok": float(bool(got) and got.get("lines") == want["lines"])}, open("/logs/verifier/reward.json", "w"))
PY
