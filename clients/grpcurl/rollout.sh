#!/usr/bin/env bash
# Run one rollout through an agent:
#   rollout.sh AGENT_ADDRESS PROMPT [EXPECTED_ANSWER]      (no double quotes in the texts)
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$GRPCURL" "${FLAGS[@]}" -max-time 60 -d @ "$1" gym.v1.AgentService/Run <<JSON
{"task": {"responses_create_params": {"input_text": "$2", "temperature": 0}, "data_json": "{\"expected_answer\": \"${3:-}\"}"}}
JSON
