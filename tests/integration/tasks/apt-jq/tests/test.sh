#!/bin/bash
[ "$(cat /app/name.txt 2>/dev/null)" = "corral" ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
