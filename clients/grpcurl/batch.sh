#!/usr/bin/env bash
# A batch of groups that carry signal, chosen and rolled out by a task server (docs/task-service.md):
#   batch.sh TASK_SERVER_ADDRESS GROUPS [GROUP_SIZE]
# Each group prints as it completes; the last message is the batch's summary (what it cost).
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$GRPCURL" "${FLAGS[@]}" -max-time 600 -d "{\"groups\": $2, \"group_size\": ${3:-0}}" "$1" gym.v1.TaskService/NextBatch
