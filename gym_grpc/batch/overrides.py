"""`gym-grpc collect`'s KEY=VALUE overrides: read, checked once before any rollout, applied to each row.

An override replaces a `responses_create_params` value in every task row. It is
the user's own command, so it is checked strictly: a key near a Responses create
parameter but not one ("temprature") is a typo and an error, and a value that no
row could carry (temperature=7, max_output_tokens=-5) is refused before the first
rollout, not reported on every row. A key far from all of them (an engine's own
`guided_grammar`) is passed on as it is, with a warning; common engine sampling
parameters (`top_k`, `min_p`...) pass without one. NeMo Gym's spellings are taken
as well: `+responses_create_params.temperature=0.6`, `+num_repeats=4`, `+limit=10`.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import Any

from gym_grpc import errors
from gym_grpc.data import rows
from gym_grpc.server import validation

#: Create parameters of the Responses API that a row may carry (those CreateParams
#: models, and the others that travel in its extra_json to the engine).
RESPONSES_CREATE_KEYS = frozenset(
    {
        *rows.ECHOED_KEYS,
        "model",
        "input",
        "background",
        "conversation",
        "include",
        "max_tool_calls",
        "previous_response_id",
        "prompt",
        "prompt_cache_key",
        "safety_identifier",
        "seed",
        "service_tier",
        "store",
        "stream",
        "top_logprobs",
        "truncation",
        "user",
    }
)

#: Sampling parameters an engine takes beside the Responses API's (vLLM's, the Chat
#: Completions API's): passed on to the engine, neither refused nor warned about.
ENGINE_KEYS = frozenset(
    {
        "frequency_penalty",
        "ignore_eos",
        "logit_bias",
        "min_p",
        "min_tokens",
        "n",
        "presence_penalty",
        "repetition_penalty",
        "skip_special_tokens",
        "stop",
        "stop_token_ids",
        "top_k",
    }
)

#: NeMo Gym's `ng_collect_rollouts` settings that are options of `gym-grpc collect`.
NEMO_OPTIONS = {"num_repeats": "--num-repeats", "limit": "--limit"}

#: The Responses API's range for temperature (engines may take more; a command may not).
TEMPERATURE_RANGE = (0.0, 2.0)


class OverrideError(errors.ConfigError):
    """An override the command cannot use; the message names it."""


@dataclass
class Overrides:
    """Overrides as read: `params` by dotted key, NeMo-spelled `options`, and warnings to print."""

    params: dict[str, Any] = field(default_factory=dict)
    options: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def parse(pairs: list[str]) -> Overrides:
    """Read and check `key=value` pairs (value read as JSON, else taken as text)."""
    found = Overrides()
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip("+"):
            raise OverrideError(f"override {pair!r}: expected key=value, such as temperature=0.7")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        key = key.lstrip("+")  # Hydra's "add this key", as NeMo Gym's commands are written
        if key in NEMO_OPTIONS:
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "num_repeats" else 0):
                raise OverrideError(f"override {pair!r}: {key} takes a whole number, like {NEMO_OPTIONS[key]}")
            found.options[key] = value
            continue
        key = key.removeprefix(rows.PARAMS_KEY + ".")
        _check_key(key, pair, found)
        found.params[key] = value
    _check_values(found.params)
    return found


def _check_key(key: str, pair: str, found: Overrides) -> None:
    top = key.split(".", 1)[0]
    known = RESPONSES_CREATE_KEYS | ENGINE_KEYS
    if top in known:
        return
    near = difflib.get_close_matches(top, sorted(known | NEMO_OPTIONS.keys()), n=1, cutoff=0.75)
    what = f"override {pair!r}: {top!r} is not a Responses create parameter"
    if near:
        raise OverrideError(f"{what}; did you mean {near[0]!r}?")
    found.warnings.append(f"{what}; sent to the engine as it is")


def _check_values(params: dict[str, Any]) -> None:
    """Apply the overrides to a one-message request and check it as every row will be checked."""
    trial: dict[str, Any] = {"input": "x"}
    apply(trial, params)
    try:
        validation.check_params(rows.params_from_json(trial), rows.PARAMS_KEY)
    except errors.InvalidArgument as e:  # RowError, and the checks a model server makes
        raise OverrideError(f"override: {e.message}") from None
    temperature = params.get("temperature")
    low, high = TEMPERATURE_RANGE
    if isinstance(temperature, int | float) and not low <= temperature <= high:
        raise OverrideError(f"override temperature={temperature}: the Responses API takes {low:g} to {high:g}")


def apply(params: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Set each dotted key of `overrides` in a responses_create_params dict."""
    for key, value in overrides.items():
        *parents, last = key.split(".")
        node = params
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[last] = value
