#!/usr/bin/env bash
# The services of one server (reflection, no .proto needed):   list.sh ADDRESS
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$GRPCURL" "${FLAGS[@]}" "$1" list
