#!/usr/bin/env bash
# Every server a `gym-grpc run` started, with its addresses:   servers.sh REGISTRY_ADDRESS
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$GRPCURL" "${FLAGS[@]}" "$1" gym.v1.RegistryService/ListServers
