"""An OpenAI-compatible inference engine for tests: a real aiohttp HTTP server.

    engine = FakeEngine([Turn(tool_calls=[("add", '{"a": 2, "b": 3}')]), Turn(content="5")])
    base_url = await engine.start()     # http://127.0.0.1:PORT/v1; engine.stop() at the end

It speaks the wire format of vLLM's `/v1/chat/completions` (with its token
fields: `logprobs` + `return_tokens_as_token_ids` give "token_id:N" tokens,
`return_token_ids` gives `prompt_token_ids` and `choices[].token_ids`,
`required_prefix_token_ids` as NeMo RL's vLLM accepts it), `/v1/completions`
with a prompt of token ids (as vLLM: generated text, `token_ids`,
`logprobs.tokens`/`token_logprobs`, `prompt_token_ids`), `/tokenize`, and
OpenAI's `/v1/responses`. Its "model" is a script of turns; its tokenizer is
byte-level with a ChatML template, so prompt ids are real functions of the
messages. Like a real model it writes tool calls in its own text format
(hermes: `<tool_call>\n{...}\n</tool_call>`, arguments as generated), which
its template re-renders differently; `sampled_splits` makes it sample "th" as
one token (258) that its tokenizer never produces, as real samplers do.
Faults on demand: HTTP errors for the first N requests (with a Retry-After
header if asked), hanging, a context limit; and a late start, on a socket
bound before (connections to it are refused until then). It also has the part
of vLLM's RL control API a weight update uses (`/pause`, `/resume`,
`/collective_rpc` reload_weights, `/update_weight_version`): each call is
recorded, and any of them can answer an error or wait (`control_faults`).

`write_tokenizer(directory)` writes its tokenizer and chat template as a model
directory's files (tokenizer.json, tokenizer_config.json), which transformers
loads and renders to the very ids its /tokenize gives: what a model server that
renders prompts itself (vllm_model's `tokenizer_dir`) reads from a real model.
As vLLM does, the template gets tool-call arguments as objects and writes them
with `tojson`, and a message's text parts joined by newlines.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

IM_START, IM_END, TH = 256, 257, 258


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8", "surrogatepass"))  # an engine passes on what JSON decodes


def encode_sampled(text: str) -> list[int]:
    """Ids as a sampler may pick them: "th" as the one token TH, which encode() never makes."""
    ids: list[int] = []
    for index, piece in enumerate(text.split("th")):
        ids += ([TH] if index else []) + encode(piece)
    return ids


#: What vLLM answers (HTTP 400, on /tokenize and on the chat path) for a conversation its tokenizer
#: cannot encode, such as one with half a character: JSON decodes the escape of a lone surrogate in a
#: call's arguments into one (seen on the local CPU vLLM).
UNENCODABLE = "TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]"


def _encodable(text: str) -> str:
    """`text`, or UnicodeEncodeError where a tokenizer could not encode it (see UNENCODABLE)."""
    text.encode("utf-8")
    return text


def _unencodable() -> web.Response:
    error = {"message": UNENCODABLE, "type": "BadRequestError", "param": None, "code": 400}
    return web.json_response({"error": error}, status=400)


def _arguments_text(arguments: Any) -> str:
    """Tool-call arguments as the template writes them: parsed to an object, as vLLM passes them
    ({} when they are not one), then `tojson` (transformers': ensure_ascii off)."""
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) and arguments else arguments or {}
    except json.JSONDecodeError:
        parsed = {}
    return json.dumps(parsed if isinstance(parsed, dict) else {}, ensure_ascii=False)


#: FakeEngine.render as a chat template (transformers renders it with trim_blocks and lstrip_blocks).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] -%}"
    '{{ \'<tool_call>{"name": "\' + call.function.name + \'", "arguments": \' + (call.function.arguments | tojson)'
    " + '}</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def write_tokenizer(directory: Path) -> Path:
    """Write the fake engine's tokenizer (a byte per token, `<|im_start|>` 256 and `<|im_end|>` 257)
    and CHAT_TEMPLATE as a model directory's tokenizer files; returns the directory. Needs the
    `tokenizers` package (transformers brings it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 characters byte-level BPE writes bytes as, one each
    by_byte = {b: c for c, b in zip(sorted(alphabet, key=_byte_of), range(256), strict=True)}
    vocab = {by_byte[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _byte_of(char: str) -> int:
    """The byte that byte-level BPE writes as `char` (GPT-2's table: printable bytes as themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}
    return table[char]


def decode(ids: list[int]) -> str:
    return b"".join(b"th" if i == TH else bytes([i]) for i in ids if i < 256 or i == TH).decode("utf-8", "replace")


def _usage(prompt: list[int], generated: list[int]) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(generated),
        "total_tokens": len(prompt) + len(generated),
    }


def hermes_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


@dataclass
class Turn:
    """What the scripted model says in one call."""

    content: str = ""
    tool_calls: list[tuple[str, str]] = field(default_factory=list)
    #: Reasoning returned in the message's reasoning field (as with a reasoning parser).
    reasoning_field: str | None = None


class FakeEngine:
    def __init__(
        self,
        turns: list[Turn] | Callable[[dict], Turn] | None = None,
        *,
        strip_history_reasoning: bool = False,
        max_model_len: int = 1_000_000,
        sampled_splits: bool = False,
    ) -> None:
        self.turns = turns or [Turn(content="ok")]
        self.strip_history_reasoning = strip_history_reasoning
        self.max_model_len = max_model_len
        self.sampled_splits = sampled_splits
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        #: Requests by path ("/v1/completions", "/tokenize"...), as an engine's access log counts them.
        self.calls: Counter[str] = Counter()
        self.fail_next: list[int] = []  # statuses to answer the next requests with
        self.retry_after: str | None = None  # the Retry-After header of those answers
        self.hang = False
        self.disagree = False  # token_ids and log-prob tokens that differ
        self.without_token_ids = False  # an older vLLM: no return_token_ids
        self.recorded: list[dict] = []  # /v1/responses answers, served verbatim in turn before the script
        #: How many of the next generations end with finish_reason "abort", as vLLM answers a
        #: request that /pause?mode=abort stopped (each takes its turn of the script).
        self.abort_next = 0
        #: The RL control calls, in order: "pause keep", "reload /path", "label 3", "resume".
        self.control: list[str] = []
        self.paused = False
        self.weight_version = "default"
        #: By control path ("/pause", "/collective_rpc", ...): an HTTP status to answer, or an event
        #: to wait for before answering (a hang until it is set).
        self.control_faults: dict[str, int | asyncio.Event] = {}
        #: What GET /metrics answers (Prometheus text, as vLLM's: the load a model server reads,
        #: gym_grpc.engines.load); None: 404, as an engine without metrics.
        self.metrics: str | None = None
        self.runner: web.AppRunner | None = None
        self.base_url = ""

    async def start(self, sock: socket.socket | None = None) -> str:
        """Serve on 127.0.0.1, on a free port or on `sock` (bound, not yet listening); the base URL."""
        app = web.Application(middlewares=[self._count])
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/metrics", self._metrics)
        for path in ("/pause", "/resume", "/collective_rpc", "/update_weight_version"):
            app.router.add_post(path, self._control)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        if sock is None:
            site: web.BaseSite = web.TCPSite(self.runner, "127.0.0.1", 0, backlog=8192)
        else:
            site = web.SockSite(self.runner, sock, backlog=8192)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self.base_url

    @web.middleware
    async def _count(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        self.calls[request.path] += 1
        return await handler(request)

    async def _models(self, request: web.Request) -> web.Response:
        """vLLM's model list: one model, with its context length."""
        return web.json_response(
            {"object": "list", "data": [{"id": "fake", "object": "model", "max_model_len": self.max_model_len}]}
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            return web.Response(status=404, text="404: Not Found")
        return web.Response(text=self.metrics, content_type="text/plain", charset="utf-8")

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # --- the tokenizer and template ----------------------------------------

    def render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        ids: list[int] = []
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        for position, message in enumerate(messages):
            content = message.get("content") or ""
            if isinstance(content, list):  # text parts joined by newlines, as vLLM does
                content = "\n".join(p.get("text", "") for p in content)
            if message["role"] == "assistant":
                if self.strip_history_reasoning and position < last_user and "</think>" in content:
                    content = content.split("</think>", 1)[1]
                for call in message.get("tool_calls") or []:
                    function = call["function"]
                    arguments = _arguments_text(function.get("arguments"))
                    content += f'<tool_call>{{"name": "{function["name"]}", "arguments": {arguments}}}</tool_call>'
                ids += [IM_START, *encode("assistant\n" + _encodable(content)), IM_END, *encode("\n")]
            else:
                ids += [IM_START, *encode(f"{message['role']}\n{_encodable(content)}"), IM_END, *encode("\n")]
        if add_generation_prompt:
            ids += [IM_START, *encode("assistant\n")]
        return ids

    # --- endpoints -----------------------------------------------------------

    def _aborted(self, finish: str) -> str:
        if self.abort_next:
            self.abort_next -= 1
            return "abort"
        return finish

    async def _control(self, request: web.Request) -> web.Response:
        """vLLM's RL control API, as a weight update uses it (see gym_grpc/engines/weights.py)."""
        body = await request.json() if request.can_read_body else {}
        path = request.path
        if path == "/pause":
            self.paused = True
            self.control.append(f"pause {request.query.get('mode', 'abort')}")
        elif path == "/resume":
            self.paused = False
            self.control.append("resume")
        elif path == "/collective_rpc":
            self.control.append(f"reload {body['kwargs']['weights_path']}")
        else:
            self.control.append(f"label {body['new_version']}")
        fault = self.control_faults.get(path)
        if isinstance(fault, asyncio.Event):
            await fault.wait()
        elif fault is not None:
            return web.json_response({"error": {"message": f"injected {fault}", "code": fault}}, status=fault)
        if path == "/collective_rpc" and not Path(body["kwargs"]["weights_path"]).is_dir():
            error = {"message": "Call to collective_rpc method failed: Worker failed", "code": 500}
            return web.json_response({"error": error}, status=500)
        if path == "/update_weight_version":
            self.weight_version = body["new_version"]
        return web.json_response({"status": "ok"})

    async def _gate(self, request: web.Request) -> tuple[dict, web.Response | None]:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail_next:
            status = self.fail_next.pop(0)
            headers = {"Retry-After": self.retry_after} if self.retry_after is not None else None
            error = {"error": {"message": f"injected {status}", "code": status}}
            return body, web.json_response(error, status=status, headers=headers)
        return body, None

    def _next_turn(self, body: dict) -> Turn:
        if callable(self.turns):
            return self.turns(body)
        index = min(len(self.requests) - 1, len(self.turns) - 1)
        return self.turns[index]

    async def _chat(self, request: web.Request) -> web.Response:
        body, failed = await self._gate(request)
        if failed is not None:
            return failed
        try:
            prompt = self.render(body["messages"], add_generation_prompt=True)
        except UnicodeEncodeError:
            return _unencodable()
        prefix = body.get("required_prefix_token_ids")
        if prefix:
            prompt = list(prefix) + prompt[len(prefix) :]
        limit = body.get("max_tokens")
        too_long = self._too_long(prompt, limit)
        if too_long is not None:
            return too_long
        turn = self._next_turn(body)
        calls: list[dict[str, Any]] = [
            {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:8]}", "type": "function", "function": {"name": n, "arguments": a}}
            for n, a in turn.tool_calls
        ]
        text = turn.content + "".join(
            f'<tool_call>{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}</tool_call>'
            for c in calls
        )
        generated = (encode_sampled(text) if self.sampled_splits else encode(text)) + [IM_END]
        finish = "tool_calls" if calls else "stop"
        content = turn.content
        if limit is not None and len(generated) > limit:
            generated, finish, calls = generated[:limit], "length", []
            content = bytes(generated).decode("utf-8", "ignore")
        message: dict[str, Any] = {"role": "assistant", "content": content or None, "tool_calls": calls}
        if turn.reasoning_field is not None:
            message["reasoning_content"] = turn.reasoning_field
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": self._aborted(finish)}
        if body.get("logprobs"):
            as_ids = body.get("return_tokens_as_token_ids")
            tokens = [t + 1 if self.disagree and i == 0 else t for i, t in enumerate(generated)]
            choice["logprobs"] = {
                "content": [
                    {
                        "token": f"token_id:{t}" if as_ids else chr(t % 256),
                        "logprob": -0.01 * (i % 7),
                        "top_logprobs": [],
                    }
                    for i, t in enumerate(tokens)
                ]
            }
        answer: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "fake"),
            "choices": [choice],
            "usage": _usage(prompt, generated),
        }
        if body.get("return_token_ids") and not self.without_token_ids:
            answer["prompt_token_ids"] = prompt
            choice["token_ids"] = generated
        return web.json_response(answer)

    def _too_long(self, prompt: list[int], limit: int | None) -> web.Response | None:
        if len(prompt) + (limit or 0) <= self.max_model_len:
            return None
        message = (
            f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
            f"{len(prompt) + (limit or 0)} tokens. Please reduce the length of the messages or completion."
        )
        return web.json_response(
            {"object": "error", "message": message, "type": "BadRequestError", "code": 400}, status=400
        )

    async def _completions(self, request: web.Request) -> web.Response:
        """vLLM's /v1/completions for a prompt of token ids, with its token fields."""
        body, failed = await self._gate(request)
        if failed is not None:
            return failed
        prompt = body["prompt"]
        limit = body.get("max_tokens")
        too_long = self._too_long(prompt, limit)
        if too_long is not None:
            return too_long
        generated, finish = self.generate(body, limit)
        choice: dict[str, Any] = {"index": 0, "text": decode(generated), "finish_reason": self._aborted(finish)}
        if body.get("logprobs") is not None:
            as_ids = body.get("return_tokens_as_token_ids")
            choice["logprobs"] = {
                "tokens": [
                    f"token_id:{t + 1 if self.disagree and i == 0 else t}" if as_ids else decode([t])
                    for i, t in enumerate(generated)
                ],
                "token_logprobs": [-0.01 * (i % 7) for i in range(len(generated))],
                "top_logprobs": None,
                "text_offset": list(range(len(generated))),
            }
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = prompt
            choice["token_ids"] = generated
        return web.json_response(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.get("model", "fake"),
                "choices": [choice],
                "usage": _usage(prompt, generated),
            }
        )

    def generate(self, body: dict, limit: int | None) -> tuple[list[int], str]:
        """The next scripted turn as generated ids (its text, then `<|im_end|>`) and the finish reason."""
        turn = self._next_turn(body)
        text = turn.content + "".join(hermes_call(name, arguments) for name, arguments in turn.tool_calls)
        generated = (encode_sampled(text) if self.sampled_splits else encode(text)) + [IM_END]
        if limit is not None and len(generated) > limit:
            return generated[:limit], "length"
        return generated, "stop"

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            tokens = self.render(body["messages"], body.get("add_generation_prompt", False))
        except UnicodeEncodeError:
            return _unencodable()
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len})

    async def _responses(self, request: web.Request) -> web.Response:
        body, failed = await self._gate(request)
        if failed is not None:
            return failed
        if self.recorded:
            return web.json_response(self.recorded.pop(0))
        turn = self._next_turn(body)
        output: list[dict] = []
        if turn.content:
            output.append(
                {
                    "type": "message",
                    "id": f"msg_{uuid.uuid4().hex}",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": turn.content, "annotations": [], "logprobs": []}],
                }
            )
        for name, arguments in turn.tool_calls:
            output.append(
                {
                    "type": "function_call",
                    "id": f"fc_{uuid.uuid4().hex}",
                    "call_id": f"call_{uuid.uuid4().hex}",
                    "name": name,
                    "arguments": arguments,
                    "status": "completed",
                }
            )
        answer = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": time.time(),
            "model": body.get("model"),
            "status": "completed",
            "output": output,
            "usage": {
                "input_tokens": 11,
                "output_tokens": 7,
                "total_tokens": 18,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
            "tool_choice": "auto",
            "tools": body.get("tools", []),
            "parallel_tool_calls": True,
            "store": False,
            "service_tier": "default",
            "text": {"format": {"type": "text"}, "verbosity": "medium"},
        }
        return web.json_response(answer)
