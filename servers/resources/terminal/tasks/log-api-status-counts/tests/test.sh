#!/bin/bash
# Verifier: /app/api_status.txt must equal the expected counts exactly
# (a missing final newline is tolerated; CRLF line endings are not).
mkdir -p /logs/verifier
out=/app/api_status.txt
if [ -f "$out" ] && diff <(cat "$out"; [ -n "$(tail -c1 "$out")" ] && echo) /tests/expected.txt; then
  echo PASS
  echo 1 > /logs/verifier/reward.txt
else
  echo FAIL
  echo 0 > /logs/verifier/reward.txt
fi
exit 0
