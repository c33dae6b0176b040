"""A model server for engines that only speak Chat Completions: vLLM, SGLang, ...

With `return_token_ids`, every answer carries what RL training needs: the
engine is asked for token ids and log-probs (`logprobs` with
`return_tokens_as_token_ids`, and `return_token_ids` for the prompt ids and
the generated ids), and prompt ids, generation ids and log-probs go on the
last output item of the turn. Two sources of the same ids must agree, or the
call fails: nothing is silently mixed.

Multi-turn: when earlier assistant items come back with their token ids, the
prompt of this turn must begin with exactly the prompt and generation ids of
the last of them, or the rollout would be trained off-policy. With
`prefix_token_ids: require` those ids are sent as `required_prefix_token_ids`
(for engines that accept it, as NeMo RL's vLLM does); with `check` (stock
vLLM) the engine's prompt ids are compared with them, and a mismatch fails
the call with the position where they part.

An engine's context-length error (HTTP 400) makes an incomplete response, so
the rollout ends and is scored instead of failing.

Per-row engine options ride in `responses_create_params.metadata` as NeMo Gym
writes them, each a JSON object in a string: `extra_body` (such as
`{"seed": 3}`) is merged into the request under the row's own fields and over
the config's `extra_body`; `chat_template_kwargs` is merged over the config's
and the row's own. A row's other unknown keys (`top_k`, `seed`) are request
fields as they are.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import Field

from gym_grpc import errors, json_input
from gym_grpc.engines import Engine, EngineError, EngineModelServer, EngineSettings
from gym_grpc.responses import assistant_message, input_items, item_body, new_response, turns
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import responses_pb2 as r

from . import chat

log = logging.getLogger("gym_grpc.vllm_model")

_CONTEXT_ERRORS = ("context length", "maximum model length", "max_model_len", "context window")


class VLLMModelConfig(EngineSettings):
    return_token_ids: bool = Field(False, description="ask for token ids and log-probs (for training)")
    prefix_token_ids: Literal["check", "require"] = Field(
        "check", description="check the engine's prompt ids against earlier turns, or require them"
    )
    reasoning_tags: tuple[str, str] = Field(("<think>", "</think>"), description="tags around reasoning in text")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="sent with every request")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="more request fields; a task's win")


def _metadata_object(params: r.CreateParams, key: str) -> dict[str, Any]:
    """The JSON object in the string `metadata[key]` (NeMo Gym's way to pass engine options); {} without."""
    text = params.metadata.get(key)
    if not text:
        return {}
    try:
        value = json_input.loads(text)
    except (json.JSONDecodeError, json_input.TooDeep) as e:
        raise errors.InvalidArgument(f"params.metadata.{key}: not JSON ({e})", field=f"params.metadata.{key}") from None
    if not isinstance(value, dict):
        raise errors.InvalidArgument(
            f"params.metadata.{key}: expected a JSON object, got {text[:80]!r}", field=f"params.metadata.{key}"
        )
    return value


def _prefix(items: list[r.Item]) -> list[int] | None:
    """Prompt + generation ids of the last assistant turn, when the conversation carries ids."""
    assistant = [part for part in turns(items) if isinstance(part, list)]
    carriers = [[c for c in map(item_body, turn) if c.generation_token_ids] for turn in assistant]
    if not any(carriers):
        return None
    if not carriers[-1]:
        raise errors.InvalidArgument(
            "the last assistant turn of the input has no token ids although an earlier one has: "
            "the prompt cannot be checked against the ids the model generated",
            field="params.input",
        )
    last = carriers[-1][-1]
    return list(last.prompt_token_ids) + list(last.generation_token_ids)


def _generated_ids(engine: Engine, choice: dict[str, Any]) -> tuple[list[int], list[float]]:
    """Generation ids and log-probs of a choice, from every source the engine gave, checked."""
    logprobs = (choice.get("logprobs") or {}).get("content")
    from_logprobs = values = None
    if logprobs is not None:
        from_logprobs, values = [], []
        for position, entry in enumerate(logprobs):
            token = str(entry.get("token", ""))
            if not token.startswith("token_id:"):
                raise errors.GymError(
                    f"engine {engine.base_url}: log-prob token {position} is {token!r}, not 'token_id:N' "
                    "(is return_tokens_as_token_ids supported?)"
                )
            from_logprobs.append(int(token.removeprefix("token_id:")))
            values.append(float(entry["logprob"]))
    token_ids = choice.get("token_ids")
    if token_ids is not None and from_logprobs is not None and list(token_ids) != from_logprobs:
        raise errors.GymError(
            f"engine {engine.base_url}: the generated ids in token_ids and in the log-probs disagree "
            f"({len(token_ids)} and {len(from_logprobs)} ids)"
        )
    generated = list(token_ids) if token_ids is not None else from_logprobs
    if generated is None or values is None:
        raise errors.GymError(
            f"engine {engine.base_url} returned no generated token ids or log-probs; it needs "
            "logprobs with return_tokens_as_token_ids (vLLM) and, for prompt ids, return_token_ids (vLLM >= 0.10.2)"
        )
    if len(values) != len(generated):
        raise errors.GymError(
            f"engine {engine.base_url}: {len(values)} log-probs for {len(generated)} generated tokens"
        )
    return generated, values


class VLLMModel(EngineModelServer):
    Config = VLLMModelConfig
    config: VLLMModelConfig

    def capabilities(self) -> admin_pb.Capabilities:
        # With token ids on, a later prompt that does not begin with the earlier ids fails the call
        # (prefix_token_ids: check) or cannot happen (require): token in, token out.
        capabilities = super().capabilities()
        capabilities.token_ids = capabilities.token_in_token_out = self.config.return_token_ids
        return capabilities

    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        tags = self.config.reasoning_tags
        row_extra = _metadata_object(params, "extra_body")  # under the row's own fields, as in NeMo Gym
        body = {**self.config.extra_body, **row_extra, **chat.to_request(params, self.config.model, tags)}
        template_kwargs = {
            **self.config.chat_template_kwargs,
            **body.get("chat_template_kwargs", {}),
            **_metadata_object(params, "chat_template_kwargs"),
        }
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        prefix = None
        if self.config.return_token_ids:
            prefix = _prefix(input_items(params))
            body.update(logprobs=True, top_logprobs=0, return_tokens_as_token_ids=True, return_token_ids=True)
            if prefix is not None and self.config.prefix_token_ids == "require":
                body["required_prefix_token_ids"] = prefix
        engine = self.engines.for_session(session_id)
        try:
            answer = await engine.post("/chat/completions", body)
        except EngineError as e:
            if e.status == 400 and any(marker in e.detail.lower() for marker in _CONTEXT_ERRORS):
                return _context_full(params, self.config.model, e.detail)
            raise
        try:
            response = chat.to_response(answer, tags, params)
            choice = answer["choices"][0]
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise errors.GymError(f"engine {engine.base_url} answered a malformed completion: {e!r}") from None
        if self.config.return_token_ids:
            await self._attach_tokens(engine, body, answer, choice, response, prefix)
        return response

    async def _attach_tokens(
        self,
        engine: Engine,
        body: dict[str, Any],
        answer: dict[str, Any],
        choice: dict[str, Any],
        response: r.Response,
        prefix: list[int] | None,
    ) -> None:
        generated, log_probs = _generated_ids(engine, choice)
        prompt = answer.get("prompt_token_ids")
        if prompt is None:
            prompt = await self._tokenize(engine, body)
        prompt = list(prompt)
        if prefix is not None and prompt[: len(prefix)] != prefix:
            apart = next((i for i, (a, b) in enumerate(zip(prompt, prefix, strict=False)) if a != b), len(prompt))
            raise errors.FailedPrecondition(
                f"engine {engine.base_url}: this turn's prompt ids part from the earlier turns' ids at "
                f"position {apart} of {len(prefix)}; the chat template re-tokenizes history differently, "
                "so the rollout would be off-policy (use prefix_token_ids: require with an engine that "
                "accepts required_prefix_token_ids, or a template that keeps history as generated)"
            )
        last = response.output[-1]
        carrier = item_body(last)
        carrier.prompt_token_ids.extend(prompt)
        carrier.generation_token_ids.extend(generated)
        carrier.generation_log_probs.extend(log_probs)

    async def _tokenize(self, engine: Engine, body: dict[str, Any]) -> list[int]:
        """Prompt ids from the engine's /tokenize, for engines that do not return them."""
        request = {k: body[k] for k in ("model", "messages", "tools", "chat_template_kwargs") if k in body}
        request["add_generation_prompt"] = True
        tokens = (await engine.post("/tokenize", request, from_root=True)).get("tokens")
        if not isinstance(tokens, list):
            raise errors.GymError(f"engine {engine.base_url}: /tokenize returned no tokens")
        return tokens


def _context_full(params: r.CreateParams, model: str, message: str) -> r.Response:
    """The answer to a conversation longer than the engine's context: incomplete, nothing generated."""
    log.info("context full, the rollout ends here: %s", message[:200])
    response = new_response(params, model)
    response.status = r.RESPONSE_STATUS_INCOMPLETE
    response.incomplete_details.reason = r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS
    response.output.append(assistant_message("", r.ITEM_STATUS_INCOMPLETE))
    return response
