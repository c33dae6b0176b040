#!/usr/bin/env bash
# Run several rollouts through an agent over one RunMany call, one run per PROMPT EXPECTED pair:
#   many.sh AGENT_ADDRESS PROMPT EXPECTED [PROMPT EXPECTED ...]      (no double quotes in the texts)
# Each result comes back under the run's id (1, 2, ...) as its rollout finishes.
set -euo pipefail
source "$(dirname "$0")/common.sh"
agent=$1
shift
runs=() id=0
while [ $# -ge 2 ]; do
    id=$((id + 1))
    runs+=("{\"id\": $id, \"timeout_seconds\": 60, \"run\": {\"task\": {\"responses_create_params\": {\"input_text\": \"$1\", \"temperature\": 0}, \"data_json\": \"{\\\"expected_answer\\\": \\\"$2\\\"}\"}}}")
    shift 2
done
IFS=,
echo "{\"runs\": [${runs[*]}]}" | "$GRPCURL" "${FLAGS[@]}" -max-time 90 -d @ "$agent" gym.v1.AgentService/RunMany
