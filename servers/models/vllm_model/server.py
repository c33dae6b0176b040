"""A model server for vLLM, SGLang and other OpenAI-compatible engines, with what RL training needs.

Without `return_token_ids` it speaks Chat Completions: the conversation goes
as messages, the engine renders and parses them.

With `return_token_ids` every assistant turn carries its prompt ids,
generated ids and the log-probs the engine reported when it sampled them (on
the turn's last output item), and by default (`token_in_token_out`) the
server talks to the engine in token ids (through vLLM's `/inference/v1/generate`
when it serves it, which also says which weight version sampled each token, else
`/v1/completions`; see generate.py): the first
turn is rendered by the engine's chat template, and every later turn's prompt
is the previous prompt + generated ids + the ids of only the messages that
came after (see token_prompts.py), so no turn is ever trained on ids the model
did not see. Rendering happens in this process when it has the engine's
tokenizer and chat template (`tokenizer_dir`, `chat_template`; templates.py):
then a turn costs the engine one request, the generation. Without them it asks
the engine's `/tokenize`, twice a turn (the session's last prompt is kept, so
earlier turns are not rendered again; `session_memory`). The server then reads reasoning (by its
tags) and tool calls (by `tool_call_parser`, as vLLM's `--tool-call-parser`)
from the generated text itself, and constrains tool calls to the tools'
schemas with a structural tag (`tool_call_grammar`; `tool_choice: required`
or a named function needs it). A history that does not extend the ids its
turns carry (a caller that edited an earlier message, a template that drops
earlier reasoning, a turn cut short) is counted (the `history` counters) and
handled by `non_monotonic`: `new_sample` renders the whole conversation and
starts a new sample at this turn (the default: the rollout goes on, each
sample is exactly what the model saw, and a trainer can tell from the ids
where one ends); `refuse` fails the call, naming the turn.

With `token_in_token_out: false` the Chat Completions path asks for the same
ids (`return_token_ids`, `logprobs` with `return_tokens_as_token_ids`); the
engine re-renders earlier turns from text, so a later prompt may not begin
with the earlier ids: `prefix_token_ids: check` fails such a call with the
position where they part, `require` sends them as `required_prefix_token_ids`
for engines that honour it (stock vLLM ignores it).

With a vLLM gRPC server as the engine (`base_url: grpc://host:port`; see
gym_grpc/engines/vllm_grpc.py) every call goes the token path: prompts are
rendered here (with the tokenizer the engine sends, unless `tokenizer_dir`
names one), a turn is one `Generate`, and the answer's ids are decoded here
into the text that tool calls and reasoning are read from; without
`return_token_ids` the ids are just not put on the items.

An engine's context-length error (HTTP 400) makes an incomplete response, so
the rollout ends and is scored instead of failing.

Per-row engine options ride in `responses_create_params.metadata` as NeMo Gym
writes them, each a JSON object in a string: `extra_body` (such as
`{"seed": 3}`) is merged into the request under the row's own fields and over
the config's `extra_body`; `chat_template_kwargs` is merged over the config's
and the row's own. A row's other unknown keys (`top_k`, `seed`) are request
fields as they are.

vLLM drops special tokens from the text it returns unless told
(`skip_special_tokens`); a sampling model does write them (SmolLM2 writes
`<filename>` in code-like text), and a text without them is not what the ids
say, nor what the next turn should re-render. So the server asks for them
(`skip_special_tokens: false` in the config; the end-of-turn token is not
part of the text either way).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import operator
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import Field, field_validator

from gym_grpc import errors
from gym_grpc.data import json_input
from gym_grpc.engines.http import Engine
from gym_grpc.engines.link import EngineError
from gym_grpc.engines.pool import EngineModelServer
from gym_grpc.engines.settings import EngineSettings
from gym_grpc.engines.vllm_grpc import GrpcEngine, default_tokenizer_cache, sampling_params
from gym_grpc.responses import assistant_message, input_items, item_body, new_id, new_response, turns
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import responses_pb2 as r

from . import chat, generate, image_features, templates, token_prompts, tool_calls

log = logging.getLogger("gym_grpc.vllm_model")
#: How many times in a row a turn the engine aborted is asked again (each wait for a weight update).
ABORTED_AGAIN = 16

_CONTEXT_ERRORS = ("context length", "maximum model length", "max_model_len", "context window")


class VLLMModelConfig(EngineSettings):
    return_token_ids: bool = Field(False, description="token ids and log-probs on every turn (for training)")
    token_in_token_out: bool = Field(
        True, description="with return_token_ids: send token ids to /v1/completions, never re-rendered history"
    )
    tool_call_parser: Literal["hermes"] = Field("hermes", description="how the chat template writes tool calls")
    tool_call_grammar: bool = Field(True, description="token path: constrain tool calls to the tools' schemas")
    non_monotonic: Literal["new_sample", "refuse"] = Field(
        "new_sample", description="token path: a history that does not extend its turns' ids"
    )
    prefix_token_ids: Literal["check", "require"] = Field(
        "check", description="chat path: check the engine's prompt ids against earlier turns, or require them"
    )
    render: Literal["auto", "local", "engine"] = Field(
        "auto",
        description="token path: where conversations become prompt ids: 'local' here, with the engine's tokenizer "
        "and chat template (tokenizer_dir, chat_template), so a turn costs the engine only its generation; "
        "'engine' its /tokenize; 'auto' local when tokenizer_dir is set",
    )
    tokenizer_dir: str | None = Field(
        None, description="token path: the directory of the model the engine serves (its tokenizer files)"
    )
    chat_template: str | None = Field(
        None, description="token path: the chat template file the engine was started with; null: the tokenizer's"
    )
    chat_template_content_format: Literal["string", "openai"] = Field(
        "string", description="token path: how the template reads a message's content, as vLLM's option of that name"
    )

    @field_validator("tokenizer_dir", "chat_template", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if value == "" else value  # `${policy_tokenizer_dir:-}` in configs/vllm.yaml

    verify_render: bool = Field(
        False,
        description="token path: render each conversation here and on the engine and fail on any difference "
        "(checks a local setup; costs the engine the requests local rendering saves)",
    )
    session_memory: int = Field(
        4096,
        ge=0,
        description="token path: sessions whose last prompt is kept, so that a turn renders only what is new; "
        "the oldest are forgotten past it (their next turn checks the whole history)",
    )
    reasoning_tags: tuple[str, str] = Field(("<think>", "</think>"), description="tags around reasoning in text")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="sent with every request")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="more request fields; a task's win")
    skip_special_tokens: bool | None = Field(
        False,
        description="false: the text keeps the special tokens the model sampled, as its ids do; "
        "null: not sent, for engines that refuse the field",
    )


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


def _carrier(turn: list[r.Item]) -> token_prompts.Carrier | None:
    """The ids an assistant turn carries, on its last item with ids; None without."""
    bodies = [body for body in map(item_body, turn) if body.generation_token_ids]
    return token_prompts.Carrier(bodies[-1].prompt_token_ids, bodies[-1].generation_token_ids) if bodies else None


def _carriers(items: list[r.Item]) -> list[token_prompts.Carrier | None]:
    """The ids each assistant turn of a conversation carries, in order."""
    return [_carrier(turn) for turn in turns(items) if isinstance(turn, list)]


def _history(params: r.CreateParams) -> tuple[list[token_prompts.Carrier | None], bytes | None, bytes]:
    """What a token-path turn reads of its conversation, in one pass: the ids each assistant turn
    carries (on its last item with ids), in order; and the digests token_prompts.Known keeps and
    checks, of the conversation before its last assistant turn (None without one) and of all of
    it. A digest is of the instructions and the items as they came, serialized and hashed in C: it
    costs a turn no Python work per earlier message or id (a digest of the messages as JSON and of
    each turn's ids, made twice a turn, was a fifth of a 16-call rollout's CPU in its profile). An
    item sent back other than it came (an id rewritten, keys reordered in a JSON string) only makes
    the turn check the whole history."""
    h = hashlib.blake2b(params.instructions.encode(), digest_size=20)
    carriers: list[token_prompts.Carrier | None] = []
    before_last = None
    for turn in turns(input_items(params)):
        if isinstance(turn, list):
            before_last = h.digest()
            carriers.append(_carrier(turn))
        for item in turn if isinstance(turn, list) else (turn,):
            serialized = item.SerializeToString(deterministic=True)
            h.update(len(serialized).to_bytes(8, "little"))
            h.update(serialized)
    return carriers, before_last, h.digest()


#: How vLLM names a token in its log-probs when asked to (return_tokens_as_token_ids).
_TOKEN_ID = "token_id:"


def _names_these_ids(tokens: list[str], ids: list[int]) -> bool:
    """Whether the log-prob tokens are exactly "token_id:N" of these ids, as in the usual
    answer: one comparison of strings. An id that is not an int is never a match.

    The tokens joined with spaces against the ids written so (a third of the cost of a string
    per id): as no id's digits hold a space, equal texts of as many tokens as ids split
    alike, so each token is its id's."""
    if len(tokens) != len(ids):
        return False
    if not ids:
        return True
    try:
        return " ".join(tokens) == _TOKEN_ID + f" {_TOKEN_ID}".join(map(int.__repr__, ids))
    except TypeError:  # a token that is not a string, an id that is not an int
        return False


def _checked_ids(
    engine: Engine | GrpcEngine, token_ids: list[int] | None, tokens: list[str] | None, values: list[float] | None
) -> tuple[list[int], list[float]]:
    """Generated ids and log-probs from every source the engine gave (its `token_ids`, and
    the log-prob tokens as "token_id:N"), checked against each other."""
    generated = None if token_ids is None else list(token_ids)
    if tokens is not None and (generated is None or not _names_these_ids(tokens, generated)):
        # The tokens are read one by one only when they do not simply name the ids: to
        # get the ids from them, or to say what is wrong. One pass in C per step (a real
        # answer has thousands of tokens); a bad token's position is looked for only then.
        if not all(map(operator.methodcaller("startswith", _TOKEN_ID), tokens)):
            position, token = next((i, t) for i, t in enumerate(tokens) if not t.startswith(_TOKEN_ID))
            raise errors.GymError(
                f"engine {engine.base_url}: log-prob token {position} is {token!r}, not 'token_id:N' "
                "(is return_tokens_as_token_ids supported?)",
                reason=errors.Reason.ENGINE_FAILED,
            )
        from_logprobs = list(map(int, map(operator.itemgetter(slice(len(_TOKEN_ID), None)), tokens)))
        if generated is not None and generated != from_logprobs:
            raise errors.GymError(
                f"engine {engine.base_url}: the generated ids in token_ids and in the log-probs disagree "
                f"({len(generated)} and {len(from_logprobs)} ids)",
                reason=errors.Reason.ENGINE_FAILED,
            )
        generated = from_logprobs
    if generated is None or values is None:
        raise errors.GymError(
            f"engine {engine.base_url} returned no generated token ids or log-probs; it needs "
            "logprobs with return_tokens_as_token_ids (vLLM) and, for prompt ids, return_token_ids (vLLM >= 0.10.2)",
            reason=errors.Reason.ENGINE_FAILED,
        )
    if len(values) != len(generated):
        raise errors.GymError(
            f"engine {engine.base_url}: {len(values)} log-probs for {len(generated)} generated tokens",
            reason=errors.Reason.ENGINE_FAILED,
        )
    return generated, list(map(float, values))


def _finish_reason(answer: dict[str, Any]) -> Any:
    try:
        return answer["choices"][0].get("finish_reason")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None  # malformed: the caller says so


def _attach(response: r.Response, prompt: list[int], generated: list[int], log_probs: list[float]) -> None:
    """The turn's ids go on its last output item."""
    carrier = item_body(response.output[-1])
    carrier.prompt_token_ids.extend(prompt)
    carrier.generation_token_ids.extend(generated)
    carrier.generation_log_probs.extend(log_probs)


class VLLMModel(EngineModelServer):
    Config = VLLMModelConfig
    config: VLLMModelConfig

    def capabilities(self) -> admin_pb.Capabilities:
        # With token ids on, a later prompt that does not begin with the earlier ids is never
        # sent silently: token in, token out (or, on the chat path, checked or required).
        capabilities = super().capabilities()
        capabilities.token_ids = capabilities.token_in_token_out = self.config.return_token_ids
        return capabilities

    async def start(self) -> None:
        await super().start()
        self._closings: dict[tuple[str, str], list[int]] = {}
        self._context: dict[str, int] = {}  # each engine's context length, as /tokenize or /models reports it
        self._described: set[str] = set()  # engines asked for it (once, even when they did not say)
        self._known: OrderedDict[str, token_prompts.Known] = OrderedDict()  # by session, the oldest first
        self._local: templates.LocalTemplate | None = None
        self._eos: dict[str, set[int]] = {}  # each gRPC engine's end-of-sequence ids
        self._no_generate: set[str] = set()  # HTTP engines that do not serve /inference/v1/generate
        self._extended_said: set[bool] = set()  # whether a later turn tokenized only what it added, logged once each
        self._defaults: dict[str, dict[str, Any]] = {}  # each gRPC engine's default sampling (generation config)
        self._fetching = asyncio.Lock()
        config = self.config
        if config.grpc and (config.render == "engine" or config.verify_render):
            raise errors.ConfigError(
                f"server {self.name!r}: a gRPC engine ({config.base_url[0]}) has no /tokenize: prompts are rendered "
                "here (render: auto or local, verify_render: false)"
            )
        if config.render == "local" and config.tokenizer_dir is None and not config.grpc:
            raise errors.ConfigError(f"server {self.name!r}: config.render is 'local' but no tokenizer_dir is given")
        if config.render != "engine" and config.tokenizer_dir is not None:
            self._local = await asyncio.to_thread(
                templates.LocalTemplate, config.tokenizer_dir, config.chat_template, config.chat_template_content_format
            )
            log.info(
                "%s: token path: prompts rendered here, with the tokenizer of %s and %s%s",
                self.name,
                config.tokenizer_dir,
                f"the chat template {config.chat_template}" if config.chat_template else "its own chat template",
                ", each checked against the engine's /tokenize (verify_render)" if config.verify_render else "",
            )

    def _chat_body(self, params: r.CreateParams) -> dict[str, Any]:
        """The Chat Completions request for `params`, with the config's and the row's engine options."""
        row_extra = _metadata_object(params, "extra_body")  # under the row's own fields, as in NeMo Gym
        special = (
            {} if self.config.skip_special_tokens is None else {"skip_special_tokens": self.config.skip_special_tokens}
        )
        body = {
            **special,
            **self.config.extra_body,
            **row_extra,
            **chat.to_request(params, self.config.model, self.config.reasoning_tags),
        }
        template_kwargs = {
            **self.config.chat_template_kwargs,
            **body.get("chat_template_kwargs", {}),
            **_metadata_object(params, "chat_template_kwargs"),
        }
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        return body

    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        body = self._chat_body(params)
        engine = self.engine_for(params, session_id)
        try:
            if isinstance(engine, GrpcEngine) or (self.config.return_token_ids and self.config.token_in_token_out):
                return await self._by_tokens(engine, params, body, session_id)
            return await self._by_chat(engine, params, body)
        except EngineError as e:
            detail = e.detail or ""
            if e.status == 400 and any(marker in detail.lower() for marker in _CONTEXT_ERRORS):
                return _context_full(params, self.config.model, detail)
            raise

    # --- token in, token out: /v1/completions ---------------------------------

    async def _by_tokens(
        self, engine: Engine | GrpcEngine, params: r.CreateParams, body: dict[str, Any], session_id: str
    ) -> r.Response:
        messages = body.pop("messages")
        with_images = any(
            isinstance(m.get("content"), list) and any(p.get("type") == "image_url" for p in m["content"])
            for m in messages
        )
        if with_images and (isinstance(engine, GrpcEngine) or engine.base_url in self._no_generate):
            raise errors.InvalidArgument(
                "a conversation with images takes the token path only on vLLM's HTTP server with "
                f"{generate.PATH} (--enable-scale-out): the images' features go beside the ids; use Chat Completions "
                "(token_in_token_out: false) with this engine",
                field="params.input",
            )
        template: dict[str, Any] = {key: body.pop(key) for key in ("tools", "chat_template_kwargs") if key in body}
        if "reasoning_effort" in body:  # a template option (gpt-oss), as vLLM's chat path passes it
            template.setdefault("chat_template_kwargs", {}).setdefault("reasoning_effort", body.pop("reasoning_effort"))
        choice = body.pop("tool_choice", "auto")
        choice = choice["function"]["name"] if isinstance(choice, dict) else choice
        parallel = body.pop("parallel_tool_calls", True)

        if isinstance(engine, GrpcEngine) and self._local is None:
            await self._engine_template(engine)
        local = self._local if self._local is not None and self._local.renders(messages) else None
        if local is None and isinstance(engine, GrpcEngine):
            raise errors.InvalidArgument(
                "the conversation has a part that is not text: only an HTTP engine renders it (a gRPC one takes "
                "token ids)",
                field="params.input",
            )

        async def render(conversation: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
            if local is None:
                assert isinstance(engine, Engine)
                return await self._tokenize(engine, {**template, "messages": conversation}, add_generation_prompt)
            ids = await local.render_shared(
                conversation,
                tools=template.get("tools"),
                template_kwargs=template.get("chat_template_kwargs"),
                add_generation_prompt=add_generation_prompt,
            )
            if self.config.verify_render:
                assert isinstance(engine, Engine)  # start() refuses verify_render with gRPC engines
                await self._verify_render(engine, template, conversation, add_generation_prompt, ids)
            return ids

        async def extension(
            through: list[dict[str, Any]], conversation: list[dict[str, Any]], closing: list[int]
        ) -> list[int] | None:
            assert local is not None
            added = await local.extension(
                through,
                conversation,
                tools=template.get("tools"),
                template_kwargs=template.get("chat_template_kwargs"),
                closing=closing,
            )
            if added is not None and self.config.verify_render:
                assert isinstance(engine, Engine)
                await self._verify_added(engine, template, through, conversation, closing, added)
            if (added is not None) not in self._extended_said:
                self._extended_said.add(added is not None)
                log.info(
                    "%s: token path: %s (servers/models/vllm_model/token_cuts.py)",
                    self.name,
                    "later turns tokenize only the text they add"
                    if added is not None
                    else "a later turn was tokenized whole: its text leaves no exact cut before what it adds, "
                    "or does not extend the text of the turns before",
                )
            return added

        carriers, earlier, whole = _history(params)
        try:
            closing = await self._closing(engine, template.get("chat_template_kwargs"), render)
            known = self._known.get(session_id)
            prompt = await token_prompts.build(
                messages, carriers, render, closing, known, earlier, None if local is None else extension
            )
        except ValueError as e:
            raise errors.InvalidArgument(str(e), field="params.input") from None
        self._remember(session_id, token_prompts.Known(whole, array("I", prompt.ids)))
        if prompt.broken is not None:
            self.counters.history(prompt.cause or "edited")
            if self.config.non_monotonic == "refuse":
                raise errors.FailedPrecondition(
                    f"the conversation does not extend the token ids of its earlier turns: {prompt.broken} "
                    "(non_monotonic: new_sample would start a new sample at this turn instead)"
                )
            log.info("new sample at this turn: %s", prompt.broken)
        tools = template.get("tools")
        parser = tool_calls.FORMATS[self.config.tool_call_parser]
        constrained = any(
            key in body for key in ("response_format", "structured_outputs", "guided_json", "guided_regex")
        )
        if tools and choice != "none" and self.config.tool_call_grammar and not constrained:  # the row's own wins
            try:
                body["response_format"] = parser.structural_tag(tools, choice, parallel)
            except ValueError as e:
                raise errors.InvalidArgument(f"params.tool_choice: {e}", field="params.tool_choice") from None
        body.update(prompt=prompt.ids, logprobs=0, return_token_ids=True, return_tokens_as_token_ids=True)
        if with_images:
            assert isinstance(engine, Engine)
            body["features"] = await self._image_features(engine, {**template, "messages": messages}, prompt.ids)
        if engine.base_url not in self._context and engine.base_url not in self._described:
            await self._context_length(engine)
        if engine.base_url in self._context:
            # /v1/completions stops at 16 tokens unless told; Chat Completions at the context's end. A
            # max_output_tokens past the context's end is cut to fit, as vLLM cuts prompt + max_tokens.
            room = self._context[engine.base_url] - len(prompt.ids)
            if room <= 0:
                return _context_full(params, self.config.model, f"{len(prompt.ids)} prompt tokens fill the context")
            body["max_tokens"] = min(body.get("max_tokens") or room, room)
        answer = await self._unaborted(engine, lambda: self._sample(engine, prompt.ids, body))
        try:
            completion = answer["choices"][0]
            text = completion.get("text") or ""
            logprobs = completion.get("logprobs") or {}
            generated, log_probs = _checked_ids(
                engine, completion.get("token_ids"), logprobs.get("tokens"), logprobs.get("token_logprobs")
            )
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            raise errors.GymError(
                f"engine {engine.base_url} answered a malformed completion: {e!r}", reason=errors.Reason.ENGINE_FAILED
            ) from None
        echoed = completion.get("prompt_token_ids")
        if echoed is not None and list(echoed) != prompt.ids:
            raise errors.GymError(
                f"engine {engine.base_url} reports other prompt ids than it was sent "
                f"({len(echoed)} ids for {len(prompt.ids)})",
                reason=errors.Reason.ENGINE_FAILED,
            )
        reasoning, rest = chat.split_reasoning(text, self.config.reasoning_tags)
        content, calls = parser.parse(rest) if tools and choice != "none" else (rest, [])
        message = {
            "role": "assistant",
            "content": content,
            "reasoning_content": reasoning,
            "tool_calls": [
                {"id": new_id("call"), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ],
        }
        as_chat = {**answer, "choices": [{**completion, "message": message}]}
        response = chat.to_response(as_chat, self.config.reasoning_tags, params)
        if self.config.return_token_ids:
            _attach(response, prompt.ids, generated, log_probs)
        spans = generate.spans(completion)
        if spans:
            carrier = item_body(response.output[-1])
            carrier.policy_version = min(span.version for span in spans)  # the oldest: see responses.proto
            if len(spans) > 1:
                carrier.policy_version_spans.extend(spans)
                self.counters.caught_by_update["spanning"] += 1
        return response

    async def _unaborted(
        self, engine: Engine | GrpcEngine, send: Callable[[], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        """The engine's answer to `send()`; one it aborted (a weight update with PAUSE_MODE_ABORT) is
        asked again: it waits on the paused engine and is generated under the new weights once it
        resumes."""
        for _ in range(1 + ABORTED_AGAIN):
            answer = await send()
            if _finish_reason(answer) != "abort":
                return answer
            self.counters.caught_by_update["regenerated"] += 1
        raise errors.GymError(
            f"engine {engine.base_url} aborted the turn {1 + ABORTED_AGAIN} times in a row",
            reason=errors.Reason.ENGINE_FAILED,
        )

    async def _sample(self, engine: Engine | GrpcEngine, prompt: list[int], body: dict[str, Any]) -> dict[str, Any]:
        """The turn's generation, as a /v1/completions answer."""
        if isinstance(engine, GrpcEngine):
            return await self._generate(engine, prompt, body)
        if engine.base_url not in self._no_generate:
            try:
                return generate.as_completion(await engine.post(generate.PATH, generate.request(body), from_root=True))
            except EngineError as e:
                if e.status not in generate.NOT_SERVED:
                    raise
                self._no_generate.add(engine.base_url)
                log.info(
                    "%s: engine %s does not serve %s (HTTP %d): the token path uses /v1/completions, and a turn "
                    "caught by a weight update is stamped with the version served when it ends",
                    self.name,
                    engine.base_url,
                    generate.PATH,
                    e.status,
                )
        if "features" in body:
            raise errors.InvalidArgument(
                f"engine {engine.base_url} does not serve {generate.PATH}: a conversation with images takes the "
                "token path only there (--enable-scale-out); use Chat Completions (token_in_token_out: false)",
                field="params.input",
            )
        return await engine.post("/completions", body)

    async def _engine_template(self, engine: GrpcEngine) -> None:
        """Without tokenizer_dir, the tokenizer of a gRPC engine, fetched from it once (GetTokenizer)."""
        async with self._fetching:
            if self._local is not None:
                return
            directory = await engine.tokenizer_files(default_tokenizer_cache())
            config = self.config
            self._local = await asyncio.to_thread(
                templates.LocalTemplate, directory, config.chat_template, config.chat_template_content_format
            )
            log.info(
                "%s: token path: prompts rendered here, with the tokenizer %s sent (in %s) and %s",
                self.name,
                engine.base_url,
                directory,
                f"the chat template {config.chat_template}" if config.chat_template else "its own chat template",
            )

    async def _generate(self, engine: GrpcEngine, prompt: list[int], body: dict[str, Any]) -> dict[str, Any]:
        """A generation on a vLLM gRPC server, as the /v1/completions answer it stands for: the text is
        the generated ids decoded here, as vLLM's detokenizer writes it (without the end-of-sequence or
        stop token that ended it, and cut before a stop string)."""
        assert self._local is not None
        sampling = sampling_params({**self._defaults.get(engine.base_url, {}), **body})
        complete = await engine.generate(prompt, sampling)
        if complete.finish_reason == "abort":
            return {"choices": [{"finish_reason": "abort"}]}
        if complete.finish_reason not in ("stop", "length"):
            raise errors.GymError(
                f"engine {engine.base_url}: the generation ended with {complete.finish_reason!r}",
                reason=errors.Reason.ENGINE_FAILED,
            )
        ids = list(complete.output_ids)
        logprobs = complete.output_logprobs
        if list(logprobs.token_ids) != ids:
            raise errors.GymError(
                f"engine {engine.base_url}: log-probs for {len(logprobs.token_ids)} tokens of the {len(ids)} generated",
                reason=errors.Reason.ENGINE_FAILED,
            )
        shown = ids
        stopped_by = complete.WhichOneof("matched_stop")
        stop_ids = self._eos.get(engine.base_url, set()) | set(sampling.stop_token_ids)
        ended_by_token = stopped_by == "matched_token_id" or (stopped_by is None and ids and ids[-1] in stop_ids)
        if complete.finish_reason == "stop" and ended_by_token and not sampling.include_stop_str_in_output:
            shown = ids[:-1]
        # In this thread: a fast tokenizer decodes a turn's ids in microseconds, less than a thread hop.
        text = self._local.tokenizer.decode(shown, skip_special_tokens=sampling.skip_special_tokens)
        # A turn cut inside a character (byte-level tokens) decodes to a trailing U+FFFD, which vLLM's
        # incremental detokenizer never writes: it holds such bytes back until the character is whole.
        text = text.rstrip("\ufffd")
        if stopped_by == "matched_stop_str" and not sampling.include_stop_str_in_output:
            at = text.find(complete.matched_stop_str)
            text = text if at < 0 else text[:at]
        usage = {
            "prompt_tokens": complete.prompt_tokens,
            "completion_tokens": complete.completion_tokens,
            "total_tokens": complete.prompt_tokens + complete.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": complete.cached_tokens},
        }
        choice = {
            "text": text,
            "token_ids": ids,
            "logprobs": {"token_logprobs": list(logprobs.token_logprobs)},
            "finish_reason": complete.finish_reason,
        }
        return {"model": self.config.model, "choices": [choice], "usage": usage}

    def _remember(self, session_id: str, known: token_prompts.Known) -> None:
        """Keep a session's last prompt (see token_prompts.Known), forgetting the oldest past session_memory."""
        if not session_id or not self.config.session_memory:
            return
        self._known[session_id] = known
        self._known.move_to_end(session_id)
        while len(self._known) > self.config.session_memory:
            self._known.popitem(last=False)

    async def _verify_render(
        self,
        engine: Engine,
        template: dict[str, Any],
        conversation: list[dict[str, Any]],
        generation: bool,
        ids: list[int],
    ) -> None:
        """verify_render: the engine's own rendering of `conversation` must be `ids`, to the token."""
        expected = await self._tokenize(engine, {**template, "messages": conversation}, generation)
        if expected != ids:
            apart = next(
                (i for i, (a, b) in enumerate(zip(ids, expected, strict=False)) if a != b), min(len(ids), len(expected))
            )
            raise errors.GymError(
                f"the local chat template renders a conversation of {len(conversation)} messages other than the "
                f"engine {engine.base_url}: {len(ids)} ids here, {len(expected)} there, apart from position {apart} "
                "(check tokenizer_dir, chat_template and chat_template_content_format against the engine's)",
                reason=errors.Reason.ENGINE_FAILED,
            )

    async def _verify_added(
        self,
        engine: Engine,
        template: dict[str, Any],
        through: list[dict[str, Any]],
        conversation: list[dict[str, Any]],
        closing: list[int],
        added: list[int],
    ) -> None:
        """verify_render: what `conversation` adds to `through`, found here from only the added text, must
        be what the engine's own renderings of the two say it is, to the token."""
        start, whole = await asyncio.gather(
            self._tokenize(engine, {**template, "messages": through}, False),
            self._tokenize(engine, {**template, "messages": conversation}, True),
        )
        if whole[: len(start)] != start or start[-len(closing) :] != closing or whole[len(start) :] != added:
            raise errors.GymError(
                f"the local chat template renders what a conversation of {len(conversation)} messages adds to "
                f"its first {len(through)} other than the engine {engine.base_url}: {len(added)} ids here, "
                f"{len(whole) - len(start)} there (check tokenizer_dir, chat_template and "
                "chat_template_content_format against the engine's)",
                reason=errors.Reason.ENGINE_FAILED,
            )

    async def _context_length(self, engine: Engine | GrpcEngine) -> None:
        """The engine's context length, from its /models (vLLM's `max_model_len`), when nothing said it yet;
        of a gRPC engine, with its end-of-sequence ids and default sampling, from GetModelInfo."""
        self._described.add(engine.base_url)
        if isinstance(engine, GrpcEngine):
            info = await engine.model_info()
            if info.max_context_length:
                self._context[engine.base_url] = info.max_context_length
            self._eos[engine.base_url] = set(info.eos_token_ids)
            self._defaults[engine.base_url] = _default_sampling(info.default_sampling_params_json)
            return
        try:
            models = (await engine.get("/models")).get("data") or []
        except EngineError:
            return
        for model in models:
            if isinstance(model, dict) and isinstance(model.get("max_model_len"), int):
                if model.get("id") in (self.config.model, None) or len(models) == 1:
                    self._context[engine.base_url] = model["max_model_len"]
                    return

    async def _closing(
        self, engine: Engine | GrpcEngine, template_kwargs: dict[str, Any] | None, render: token_prompts.Render
    ) -> list[int]:
        """The template's turn closing, found once per engine and template options."""
        key = (engine.base_url, json.dumps(template_kwargs, sort_keys=True))
        if key not in self._closings:
            self._closings[key] = await token_prompts.turn_closing(render)
        return self._closings[key]

    # --- the chat path: /v1/chat/completions ----------------------------------

    async def _by_chat(self, engine: Engine, params: r.CreateParams, body: dict[str, Any]) -> r.Response:
        prefix = None
        if self.config.return_token_ids:
            carriers = _carriers(input_items(params))
            if any(carriers) and carriers[-1] is None:
                raise errors.InvalidArgument(
                    "the last assistant turn of the input has no token ids although an earlier one has: "
                    "the prompt cannot be checked against the ids the model generated",
                    field="params.input",
                )
            if carriers and carriers[-1] is not None:
                prefix = [*carriers[-1].prompt, *carriers[-1].generated]
            body.update(logprobs=True, top_logprobs=0, return_tokens_as_token_ids=True, return_token_ids=True)
            if prefix is not None and self.config.prefix_token_ids == "require":
                body["required_prefix_token_ids"] = prefix
        answer = await self._unaborted(engine, lambda: engine.post("/chat/completions", body))
        try:
            response = chat.to_response(answer, self.config.reasoning_tags, params)
            choice = answer["choices"][0]
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise errors.GymError(
                f"engine {engine.base_url} answered a malformed completion: {e!r}", reason=errors.Reason.ENGINE_FAILED
            ) from None
        if not self.config.return_token_ids:
            return response
        entries = (choice.get("logprobs") or {}).get("content")
        generated, log_probs = _checked_ids(
            engine,
            choice.get("token_ids"),
            None if entries is None else [str(entry.get("token", "")) for entry in entries],
            None if entries is None else [entry["logprob"] for entry in entries],
        )
        prompt = answer.get("prompt_token_ids")
        if prompt is None:
            request: dict[str, Any] = {k: body[k] for k in ("messages", "tools", "chat_template_kwargs") if k in body}
            prompt = await self._tokenize(engine, request, True)
        prompt = list(prompt)
        if prefix is not None and prompt[: len(prefix)] != prefix:
            apart = next((i for i, (a, b) in enumerate(zip(prompt, prefix, strict=False)) if a != b), len(prompt))
            raise errors.FailedPrecondition(
                f"engine {engine.base_url}: this turn's prompt ids part from the earlier turns' ids at "
                f"position {apart} of {len(prefix)}; the chat template re-tokenizes history differently, "
                "so the rollout would be off-policy (token_in_token_out: true sends the earlier ids as they were)"
            )
        _attach(response, prompt, generated, log_probs)
        return response

    async def _image_features(self, engine: Engine, request: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
        """The features of the conversation's images (vLLM's /v1/chat/completions/render), placed in `prompt`."""
        try:
            render = await engine.post("/chat/completions/render", {**request, "model": self.config.model})
        except EngineError as e:
            if e.status not in generate.NOT_SERVED:
                raise
            raise errors.InvalidArgument(
                f"engine {engine.base_url} does not serve /v1/chat/completions/render (HTTP {e.status}): a "
                "conversation with images takes the token path only with vLLM's render and generate; use Chat "
                "Completions (token_in_token_out: false)",
                field="params.input",
            ) from None
        try:
            return image_features.place(render, prompt)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise errors.GymError(
                f"engine {engine.base_url}: the images of the conversation cannot be given beside its token ids: {e}",
                reason=errors.Reason.ENGINE_FAILED,
            ) from None

    async def _tokenize(self, engine: Engine, request: dict[str, Any], add_generation_prompt: bool) -> list[int]:
        """The ids of a conversation as the engine's chat template renders it (vLLM's /tokenize)."""
        request = {**request, "model": self.config.model, "add_generation_prompt": add_generation_prompt}
        reply = await engine.post("/tokenize", request, from_root=True)
        tokens = reply.get("tokens")
        if isinstance(reply.get("max_model_len"), int):
            self._context[engine.base_url] = reply["max_model_len"]
        if not isinstance(tokens, list):
            raise errors.GymError(
                f"engine {engine.base_url}: /tokenize returned no tokens", reason=errors.Reason.ENGINE_FAILED
            )
        return tokens


def _default_sampling(text: str) -> dict[str, Any]:
    """An engine's default sampling (vLLM's, from the model's generation config), as request fields."""
    try:
        defaults = json.loads(text) if text else {}
    except json.JSONDecodeError:
        log.warning("the engine's default sampling is not JSON, not used: %r", text[:200])
        return {}
    return defaults if isinstance(defaults, dict) else {}


def _context_full(params: r.CreateParams, model: str, message: str) -> r.Response:
    """The answer to a conversation longer than the engine's context: incomplete, nothing generated."""
    log.info("context full, the rollout ends here: %s", message[:200])
    response = new_response(params, model)
    response.status = r.RESPONSE_STATUS_INCOMPLETE
    response.incomplete_details.reason = r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS
    response.output.append(assistant_message("", r.ITEM_STATUS_INCOMPLETE))
    return response
