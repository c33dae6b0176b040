#!/bin/bash
# Verifier: runs hidden unit tests against /app/textkit; writes 1 (pass) or 0 (fail).
mkdir -p /logs/verifier
cd /app || { echo 0 > /logs/verifier/reward.txt; exit 0; }
if PYTHONDONTWRITEBYTECODE=1 python3 /tests/test_outputs.py -v; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
exit 0
