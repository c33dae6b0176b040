#!/bin/bash
# Verifier: /app/answer.txt must hold the hash of the commit "Tune network settings"
# (the one that added the line), and the repository history must be unchanged.
mkdir -p /logs/verifier
fail() { echo "FAIL: $*"; echo 0 > /logs/verifier/reward.txt; exit 0; }
repo=/app/service
[ -f /app/answer.txt ] || fail "no /app/answer.txt"
[ "$(git -C $repo rev-list --count HEAD 2>/dev/null)" = 7 ] || fail "history changed"
[ "$(git -C $repo log -1 --format=%s HEAD)" = "Update README" ] || fail "HEAD moved"
expected=$(git -C $repo log --format='%H %s' | awk '$2 == "Tune" && $3 == "network" {print $1}')
[ ${#expected} -eq 40 ] || fail "could not find expected commit"
# sanity: the expected commit really adds the line
git -C $repo show --format= "$expected" | grep -qx '+REQUEST_TIMEOUT = 45' || fail "internal"
lines=$(grep -c . /app/answer.txt)
answer=$(tr -d ' \t\r\n' < /app/answer.txt)
[ "$lines" = 1 ] || fail "answer.txt must have exactly one non-empty line"
[ "$answer" = "$expected" ] || fail "got '$answer', expected '$expected'"
echo PASS
echo 1 > /logs/verifier/reward.txt
exit 0
