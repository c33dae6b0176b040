#!/usr/bin/env bash
# A service or message of one server:   describe.sh ADDRESS [gym.v1.ResourcesService | gym.v1.Task | ...]
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$GRPCURL" "${FLAGS[@]}" "$1" describe "${2:-gym.v1.ResourcesService}"
