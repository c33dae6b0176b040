#!/bin/bash
# Creates /app/logs with fixed modification times (all dates explicit, in UTC).
set -euo pipefail
cd /app
mk() {  # $1 = path under logs/, $2 = mtime
  mkdir -p "logs/$(dirname "$1")"
  printf 'log %s\nline 2 of %s\n' "$1" "$1" > "logs/$1"
  touch -d "$2" "logs/$1"
}
mk "app/app-2023-11-01.log"        "2023-11-01 23:50:00 UTC"
mk "app/app-2023-12-15.log"        "2023-12-15 23:50:00 UTC"
mk "app/app-2023-12-31.log"        "2024-01-01 00:10:00 UTC"   # name says 2023, mtime is 2024
mk "app/app-2024-02-01.log"        "2024-02-01 23:50:00 UTC"
mk "worker/worker-2023-10-10.log"  "2023-10-10 08:00:00 UTC"
mk "worker/retry queue.log"        "2023-07-04 12:00:00 UTC"
mk "worker/worker-2024-03-01.log"  "2024-03-01 08:00:00 UTC"
mk "worker/notes-2023-09-01.txt"   "2023-09-01 08:00:00 UTC"   # old, but not .log
mk "nginx/access.log"              "2024-04-01 00:00:00 UTC"
mk "nginx/access.log.1"            "2023-12-01 00:00:00 UTC"   # old, but not .log
mk "nginx/error.log"               "2023-12-31 23:59:59 UTC"
mk "old-2023.log"                  "2023-06-30 00:00:00 UTC"
