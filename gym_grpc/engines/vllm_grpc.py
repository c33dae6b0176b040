"""vLLM's gRPC server as an engine (a base URL `grpc://host:port`): token ids in, token ids and log-probs out.

vLLM serves gRPC with `python -m vllm.entrypoints.launchers.grpc_server` (or
`vllm serve --grpc`; the `smg-grpc-servicer` package in the engine's
environment). Its service, `vllm.grpc.engine.VllmEngine` (the `smg-grpc-proto`
package, here too), takes prompts as token ids and answers token ids and
log-probs, never text: the model server renders prompts and decodes answers
with the engine's own tokenizer (`tokenizer_files` fetches it from the engine,
`GetTokenizer`, when the config names no directory). It has no chat, no
/tokenize, no pause and no weight loading: an engine in gRPC mode serves a fixed
model (vLLM's HTTP server is the one with the RL control API).

A `Generate` whose caller is cancelled (a rollout cancelled or past its deadline)
is cancelled on the engine too: the task's cancellation cancels the RPC, which
ends the request in vLLM (the servicer's generator is cancelled, and AsyncLLM
aborts what it was generating). Failures are retried as for HTTP engines (gym_grpc.engines.link):
UNAVAILABLE as a connection failure (and waited for while the engine is still
starting: its health answers NOT_SERVING while it warms up), RESOURCE_EXHAUSTED
as a rate limit, INTERNAL and UNKNOWN as a server error (vLLM's answer when its
engine core dies), DEADLINE_EXCEEDED of an attempt (`read_timeout`) as a time-out;
other codes are the engine's answer (EngineError).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import os
import uuid
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from gym_grpc import errors, tracing
from gym_grpc.engines.link import EngineError, EngineLink
from gym_grpc.engines.retries import Failure
from gym_grpc.engines.settings import GRPC_SCHEME, EngineSettings
from gym_grpc.server.counters import Counters

log = logging.getLogger("gym_grpc.engines.vllm_grpc")

_RETRIED = {
    grpc.StatusCode.UNAVAILABLE: "connect",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rate_limited",
    grpc.StatusCode.INTERNAL: "server_error",
    grpc.StatusCode.UNKNOWN: "server_error",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
}
#: The HTTP status an engine's gRPC answer stands for (EngineError, the model server's checks).
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.UNIMPLEMENTED: 501,
}


def default_tokenizer_cache() -> Path:
    """Where tokenizers fetched from engines are kept, one directory per SHA-256 of their files."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gym-grpc" / "tokenizers"


class GrpcEngine(EngineLink):
    """One vLLM gRPC server."""

    def __init__(self, base_url: str, settings: EngineSettings, counters: Counters | None = None) -> None:
        super().__init__(base_url, settings, counters)
        self.target = base_url.removeprefix(GRPC_SCHEME)
        self._channel: grpc.aio.Channel | None = None
        self._stub: vllm_engine_pb2_grpc.VllmEngineStub | None = None
        self._slots = asyncio.Semaphore(settings.max_connections) if settings.max_connections else None

    def _engine(self) -> vllm_engine_pb2_grpc.VllmEngineStub:
        if self._stub is None:
            options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
            self._channel = grpc.aio.insecure_channel(self.target, options=options)
            self._stub = vllm_engine_pb2_grpc.VllmEngineStub(self._channel)
        return self._stub

    def _failure(self, error: Exception) -> Failure | None:
        if not isinstance(error, grpc.aio.AioRpcError):
            return None
        code = error.code()
        if code != grpc.StatusCode.UNAVAILABLE:
            self._heard_from()
        kind = _RETRIED.get(code)
        if kind is None:
            raise EngineError(
                _HTTP_STATUS.get(code, 500), error.details() or "", self.base_url, answered=f"gRPC {code.name}"
            ) from None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return Failure("timeout", f"no answer within read_timeout ({self.settings.read_timeout:g} s)")
        return Failure(kind, f"gRPC {code.name}: {error.details()}")  # type: ignore[arg-type]

    async def generate(self, prompt: Sequence[int], sampling: pb.SamplingParams) -> pb.GenerateComplete:
        """Generate from `prompt` (token ids): the engine's final answer (ids, log-probs, finish reason)."""

        async def attempt() -> pb.GenerateComplete:
            request = pb.GenerateRequest(
                request_id=f"gym-{uuid.uuid4().hex}",  # one per attempt: a retry is a new request
                tokenized=pb.TokenizedInput(input_ids=prompt),
                sampling_params=sampling,
                stream=False,
            )
            complete = None
            with tracing.engine_request("", self.base_url, "vllm.grpc.engine.VllmEngine/Generate", "") as span:
                # A task cancelled here cancels its RPC (grpc.aio), and vLLM's servicer aborts the generation.
                replies = self._engine().Generate(
                    request, timeout=self.settings.read_timeout, metadata=tracing.outgoing()
                )
                async for reply in replies:
                    self._heard_from()
                    if reply.HasField("complete"):
                        complete = reply.complete
                if complete is None:
                    raise errors.GymError(
                        f"engine {self.base_url}: Generate ended without its answer", reason=errors.Reason.ENGINE_FAILED
                    )
                tracing.engine_tokens(span, complete.prompt_tokens, complete.completion_tokens)
            return complete

        if self._slots is None:
            return await self._retried(f"engine {self.base_url} Generate", attempt)
        async with self._slots:
            return await self._retried(f"engine {self.base_url} Generate", attempt)

    async def model_info(self) -> pb.GetModelInfoResponse:
        """The model the engine serves: its context length, end-of-sequence ids, default sampling."""
        return await self._retried(
            f"engine {self.base_url} GetModelInfo",
            lambda: self._engine().GetModelInfo(pb.GetModelInfoRequest(), timeout=self.settings.read_timeout),
        )

    async def server_info(self) -> pb.GetServerInfoResponse:
        """The engine's state: the requests it is running, whether it is paused."""
        return await self._retried(
            f"engine {self.base_url} GetServerInfo",
            lambda: self._engine().GetServerInfo(pb.GetServerInfoRequest(), timeout=self.settings.read_timeout),
        )

    async def tokenizer_files(self, cache: Path) -> Path:
        """The engine's tokenizer files (GetTokenizer: a ZIP, checked by its SHA-256), unpacked under
        `cache`/<sha256> once; the directory."""

        async def attempt() -> tuple[bytes, str]:
            data, sha = bytearray(), ""
            async for chunk in self._engine().GetTokenizer(
                common_pb2.GetTokenizerRequest(), timeout=self.settings.read_timeout
            ):
                self._heard_from()
                data += chunk.data
                sha = chunk.sha256 or sha
            return bytes(data), sha

        data, sha = await self._retried(f"engine {self.base_url} GetTokenizer", attempt)
        actual = hashlib.sha256(data).hexdigest()
        if sha and sha != actual:
            raise errors.GymError(
                f"engine {self.base_url}: the tokenizer's SHA-256 is {actual}, not the {sha} the engine announced",
                reason=errors.Reason.ENGINE_FAILED,
            )
        directory = cache / actual
        if not (directory / ".complete").exists():
            await asyncio.to_thread(_unpack, data, directory, self.base_url)
        return directory

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


def _unpack(data: bytes, directory: Path, url: str) -> None:
    """The tokenizer ZIP into `directory` (files at its top level only: a name with a path is refused)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = [info.filename for info in archive.infolist() if not info.is_dir()]
            if any(Path(name).name != name for name in names):
                raise errors.GymError(
                    f"engine {url}: the tokenizer archive has paths in it ({names[:5]})",
                    reason=errors.Reason.ENGINE_FAILED,
                )
            staging = directory.with_name(f"{directory.name}.{uuid.uuid4().hex}")
            staging.mkdir(parents=True)
            archive.extractall(staging)
    except zipfile.BadZipFile as e:
        raise errors.GymError(
            f"engine {url}: the tokenizer is not a ZIP archive ({e})", reason=errors.Reason.ENGINE_FAILED
        ) from None
    (staging / ".complete").touch()
    try:
        staging.rename(directory)  # another process may have unpacked it first: theirs is as good
    except OSError:
        pass


# --- a request's fields as vLLM's gRPC sampling parameters -------------------------------------

_FLOATS = ("top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_FLAGS = ("skip_special_tokens", "spaces_between_special_tokens", "ignore_eos", "include_stop_str_in_output")
#: Request fields that are not sampling: what the model server sends beside them (a /v1/completions body).
NOT_SAMPLING = frozenset(
    {
        "model",
        "prompt",
        "n",
        "stream",
        "echo",
        "return_token_ids",
        "return_tokens_as_token_ids",
        "user",
        "store",
        "metadata",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "truncation",
    }
)


def _constraint(body: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The output constraint of a request, as the field of SamplingParams' `constraint` it sets."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        kind = fmt.get("type")
        if kind == "json_schema":
            yield "json_schema", json.dumps((fmt.get("json_schema") or {}).get("schema") or {})
        elif kind == "json_object":
            yield "json_object", True
        elif kind == "structural_tag":
            yield "structural_tag", json.dumps(fmt)
    outputs = body.get("structured_outputs")
    if isinstance(outputs, dict):
        for key, field in (("json", "json_schema"), ("regex", "regex"), ("grammar", "grammar")):
            if outputs.get(key) is not None:
                value = outputs[key]
                yield field, value if isinstance(value, str) else json.dumps(value)
        if outputs.get("structural_tag") is not None:
            yield "structural_tag", outputs["structural_tag"]
        if outputs.get("json_object"):
            yield "json_object", True
        if outputs.get("choice") is not None:
            yield "choice", pb.ChoiceConstraint(choices=list(outputs["choice"]))
    for key, field in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_grammar", "grammar")):
        if body.get(key) is not None:
            yield field, body[key] if isinstance(body[key], str) else json.dumps(body[key])
    if body.get("guided_choice") is not None:
        yield "choice", pb.ChoiceConstraint(choices=list(body["guided_choice"]))


_CONSTRAINT_KEYS = frozenset(
    {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_grammar", "guided_choice"}
)
#: Every request field sampling_params reads or leaves out on purpose.
_KNOWN = (
    NOT_SAMPLING
    | _CONSTRAINT_KEYS
    | frozenset(
        {
            *_FLOATS,
            *_FLAGS,
            *("temperature", "top_k", "max_tokens", "max_completion_tokens", "min_tokens", "seed"),
            *("truncate_prompt_tokens", "logprobs", "stop", "stop_token_ids", "logit_bias"),
        }
    )
)
_unsent_logged: set[str] = set()


def sampling_params(body: dict[str, Any]) -> pb.SamplingParams:
    """vLLM's gRPC SamplingParams for a /v1/completions request body (its sampling fields; the
    prompt goes apart). A field that has no counterpart there is logged once and not sent, as
    vLLM's HTTP server ignores fields it does not know; a value of the wrong type is an error
    that names the field."""
    params = pb.SamplingParams(spaces_between_special_tokens=True)  # vLLM's default, not proto3's
    try:
        for key in _FLOATS:
            if body.get(key) is not None:
                setattr(params, key, float(body[key]))
        for key in _FLAGS:
            if body.get(key) is not None:
                setattr(params, key, bool(body[key]))
        if body.get("temperature") is not None:
            params.temperature = float(body["temperature"])
        if body.get("top_k") is not None:
            params.top_k = max(int(body["top_k"]), 0)  # vLLM's -1 (every token) is 0 here
        tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if tokens is not None:
            params.max_tokens = int(tokens)
        for key in ("min_tokens", "seed", "truncate_prompt_tokens"):
            if body.get(key) is not None:
                setattr(params, key, int(body[key]))
        if body.get("logprobs") is not None:
            params.logprobs = int(body["logprobs"])
        stop = body.get("stop")
        if stop:
            params.stop.extend([stop] if isinstance(stop, str) else list(stop))
        if body.get("stop_token_ids"):
            params.stop_token_ids.extend(int(t) for t in body["stop_token_ids"])
        if body.get("logit_bias"):
            for token, bias in body["logit_bias"].items():
                params.logit_bias[int(token)] = float(bias)
        constraints = dict(_constraint(body))
        if len(constraints) > 1:
            raise errors.InvalidArgument(
                f"the request constrains its output {len(constraints)} ways ({', '.join(constraints)}); vLLM takes one",
                field="params",
            )
        for field, value in constraints.items():
            if field == "choice":
                params.choice.CopyFrom(value)
            else:
                setattr(params, field, value)
    except (TypeError, ValueError) as e:
        raise errors.InvalidArgument(f"a sampling field has a value vLLM cannot take: {e}", field="params") from None
    for key in body.keys() - _KNOWN - _unsent_logged:
        _unsent_logged.add(key)
        log.warning("request field %r has no counterpart in vLLM's gRPC SamplingParams; it is not sent", key)
    return params
