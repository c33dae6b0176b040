#!/bin/bash
set -euo pipefail
cd /app
# field 7 is the path and field 9 the status (the timestamp holds one space)
awk 'index($7, "/api/") == 1 { n[$9]++ } END { for (s in n) print s, n[s] }' access.log \
  | sort -k2,2nr -k1,1n > api_status.txt
cat api_status.txt
