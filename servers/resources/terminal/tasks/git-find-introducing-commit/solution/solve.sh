#!/bin/bash
set -euo pipefail
cd /app/service
# -G with an anchored regex matches only commits whose diff adds/removes that exact line;
# --reverse puts the oldest first, and we keep the first commit that *adds* it.
for c in $(git log --reverse --format=%H -G '^REQUEST_TIMEOUT = 45$'); do
  if git show --format= "$c" | grep -qx '+REQUEST_TIMEOUT = 45'; then
    echo "$c" > /app/answer.txt
    break
  fi
done
cat /app/answer.txt
