#!/bin/bash
set -euo pipefail
cd /app
sed -i \
  -e '/^\[database\]/,/^\[/ s/^timeout = 30$/timeout = 60\nssl_mode = require/' \
  -e '/^\[logging\]/,/^\[/ s/^level = INFO$/level = DEBUG/' \
  service.ini
cat service.ini
