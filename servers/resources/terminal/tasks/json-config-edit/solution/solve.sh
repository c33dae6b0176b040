#!/bin/bash
set -euo pipefail
cd /app
jq '.server.port = 9090
    | .server.cors_origins += ["https://admin.example.com"]
    | .database.pool.max = 50
    | .features.enabled += ["metrics"]
    | del(.debug)' config.json > /tmp/config.json.new
mv /tmp/config.json.new config.json
cat config.json
