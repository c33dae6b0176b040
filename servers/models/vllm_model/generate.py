"""vLLM's `/inference/v1/generate`: token ids in; ids, log-probs, text and weight versions out.

vLLM serves it when started with `--enable-scale-out` (`gym-grpc engine start` does); elsewhere it
answers 403 or 404 and the token path uses `/v1/completions` instead. Beside what /v1/completions
gives, each answer says which weight version sampled which tokens (`weight_versions`: spans of
the engine's version label, which a weight update through gym-grpc sets to the policy version), so
a turn caught by an update with PAUSE_MODE_KEEP tells its tokens apart.
"""

from __future__ import annotations

import json
from typing import Any

from gym_grpc.engines.vllm_grpc import NOT_SAMPLING
from gym_grpc.v1 import responses_pb2 as r

PATH = "/inference/v1/generate"
#: What an engine answers when it does not serve PATH (vLLM without --enable-scale-out: 403).
NOT_SERVED = frozenset({403, 404, 405})

_CONSTRAINTS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "guided_choice",
)


def request(body: dict[str, Any]) -> dict[str, Any]:
    """The generate request standing for a /v1/completions body (its `prompt` the token ids)."""
    sampling = {k: v for k, v in body.items() if k not in NOT_SAMPLING and k not in _CONSTRAINTS and k != "features"}
    if "max_completion_tokens" in sampling:
        sampling.setdefault("max_tokens", sampling.pop("max_completion_tokens"))
    outputs = _structured_outputs(body)
    if outputs:
        sampling["structured_outputs"] = outputs
    answer = {
        "token_ids": body["prompt"],
        "model": body.get("model"),
        "output_mode": "text",
        "sampling_params": sampling,
    }
    if "features" in body:  # the prompt's images (image_features.py)
        answer["features"] = body["features"]
    return answer


def as_completion(answer: dict[str, Any]) -> dict[str, Any]:
    """A generate answer in the form of a /v1/completions one (its first choice's log-probs as
    `token_logprobs`), `weight_versions` kept on the choice."""
    choices = answer.get("choices") or [{}]
    choice = dict(choices[0])
    content = (choice.get("logprobs") or {}).get("content") or []
    choice["logprobs"] = {"token_logprobs": [entry.get("logprob") for entry in content]}
    return {**answer, "choices": [choice, *choices[1:]]}


def spans(choice: dict[str, Any]) -> list[r.PolicyVersionSpan]:
    """The policy version of each run of a choice's generated tokens, from vLLM's weight version
    spans; none when the engine gave none or a label that is not a version (vLLM's "default",
    before any update)."""
    found = []
    for span in choice.get("weight_versions") or []:
        try:
            version = int(span["version"])
            found.append(r.PolicyVersionSpan(version=version, start=int(span["start"]), end=int(span["end"])))
        except (KeyError, TypeError, ValueError):
            return []
    return found


def _structured_outputs(body: dict[str, Any]) -> dict[str, Any]:
    """The request's output constraint as vLLM's StructuredOutputsParams."""
    outputs = dict(body.get("structured_outputs") or {})
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        kind = fmt.get("type")
        if kind == "json_schema":
            outputs["json"] = (fmt.get("json_schema") or {}).get("schema") or {}
        elif kind == "json_object":
            outputs["json_object"] = True
        elif kind == "structural_tag":
            outputs["structural_tag"] = json.dumps(fmt)
    for key, field in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_grammar", "grammar")):
        if body.get(key) is not None:
            outputs[field] = body[key]
    if body.get("guided_choice") is not None:
        outputs["choice"] = body["guided_choice"]
    return outputs
