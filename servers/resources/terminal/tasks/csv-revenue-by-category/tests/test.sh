#!/bin/bash
# Verifier: /app/revenue.csv must equal the expected table exactly
# (a missing final newline is tolerated; CRLF line endings are not).
mkdir -p /logs/verifier
out=/app/revenue.csv
if [ -f "$out" ] && diff <(cat "$out"; [ -n "$(tail -c1 "$out")" ] && echo) /tests/expected.csv; then
  echo PASS
  echo 1 > /logs/verifier/reward.txt
else
  echo FAIL
  echo 0 > /logs/verifier/reward.txt
fi
exit 0
