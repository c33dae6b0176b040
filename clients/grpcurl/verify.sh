#!/usr/bin/env bash
# Score an answer with a resources server's verifier, no rollout needed:
#   verify.sh RESOURCES_ADDRESS EXPECTED_ANSWER ANSWER_TEXT      (no double quotes in the texts)
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$GRPCURL" "${FLAGS[@]}" -d @ "$1" gym.v1.ResourcesService/Verify <<JSON
{
  "session_id": "grpcurl-verify",
  "task": {"responses_create_params": {"input_text": "(not used)"}, "data_json": "{\"expected_answer\": \"$2\"}"},
  "response": {"output": [{"message": {"role": "ROLE_ASSISTANT", "text": "$3"}}]}
}
JSON
