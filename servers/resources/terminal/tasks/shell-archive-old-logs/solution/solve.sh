#!/bin/bash
set -euo pipefail
cd /app/logs
mkdir -p /app/archive
find . -type f -name '*.log' ! -newermt '2024-01-01 00:00:00 UTC' -printf '%P\n' | sort > /tmp/old-logs.txt
cat /tmp/old-logs.txt
tar -czf /app/archive/logs-before-2024.tar.gz --verbatim-files-from -T /tmp/old-logs.txt
xargs -d '\n' rm -- < /tmp/old-logs.txt
tar -tzf /app/archive/logs-before-2024.tar.gz
