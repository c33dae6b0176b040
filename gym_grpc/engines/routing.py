"""Which engine of a pool a model call goes to: the key that keeps calls sharing a prompt on one engine.

An engine's prefix cache only helps calls that reach it. The calls of one rollout extend
one another, and the rollouts of a GRPO group begin with the same prompt: each set on one
engine reuses its cached prefix instead of computing it once per engine. The key of a call is

1. `prompt_cache_key` when the request has one (OpenAI's Responses field for exactly this;
   a row's `responses_create_params.prompt_cache_key`): what the caller says, say one per group;
2. else, with `route_by: prompt`, a digest of the conversation's start (instructions, tools and
   the input before the model's first turn), which every turn of a rollout and every rollout of
   a group share;
3. else (`route_by: session`, the default) the rollout's session id: turns stick together, groups
   spread over the engines.

The key is hashed onto the engines (EnginePool.for_key). Keys of few, large groups on few engines
may load them unevenly; session routing spreads best.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from gym_grpc.data.rows import params_extra
from gym_grpc.responses import input_items, turns
from gym_grpc.v1 import responses_pb2 as r

RouteBy = Literal["session", "prompt"]


def routing_key(params: r.CreateParams, session_id: str, route_by: RouteBy) -> str:
    """The key of a model call (see the module's docstring); empty for none (round robin)."""
    explicit = params_extra(params).get("prompt_cache_key")
    if isinstance(explicit, str) and explicit:
        return f"key:{explicit}"
    if route_by == "prompt":
        h = hashlib.blake2b(digest_size=16)
        h.update(params.instructions.encode())
        for tool in params.tools:
            h.update(tool.SerializeToString(deterministic=True))
        for item in turns(input_items(params)):
            if isinstance(item, list):  # the model's first turn: what follows differs between rollouts
                break
            h.update(item.SerializeToString(deterministic=True))
        return f"prompt:{h.hexdigest()}"
    return session_id
