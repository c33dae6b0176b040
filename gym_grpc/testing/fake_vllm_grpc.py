"""The fake engine (fake_engine.py) as a vLLM gRPC server: a real grpc.aio server of smg_grpc_proto's VllmEngine.

    fake = FakeEngine([Turn(content="5")])
    grpc_engine = FakeGrpcEngine(fake, tokenizer_dir)
    base_url = await grpc_engine.start()     # grpc://127.0.0.1:PORT; grpc_engine.stop() at the end

It answers `Generate` (token ids in; the fake's next scripted turn as ids and
log-probs out, `max_tokens` and the context limit honoured), `GetModelInfo` (the
context length, `<|im_end|>` as end-of-sequence), `GetTokenizer` (the files
`write_tokenizer` wrote, as a ZIP with its SHA-256, as vLLM's servicer sends
them), `GetServerInfo` (the requests it is generating) and `HealthCheck`. It
shares the FakeEngine's script, its `requests` (each Generate's sampling
parameters as a dict, with the prompt as `prompt`), its `calls` (by RPC
name) and its faults: `fail_next` HTTP statuses are answered as the gRPC codes
vLLM's servicer would use (429 RESOURCE_EXHAUSTED, 500 INTERNAL, 503
UNAVAILABLE, other 4xx INVALID_ARGUMENT), and `hang` keeps a Generate open
until it is cancelled, which `cancelled` counts; `metadata` keeps each Generate's metadata (a
trace's `traceparent`). A stand-in for tests of the
client side only: the real vLLM gRPC server is what tests/real_engine runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from pathlib import Path

import grpc
from google.protobuf import json_format
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from gym_grpc.testing.fake_engine import IM_END, FakeEngine

_CODES = {429: grpc.StatusCode.RESOURCE_EXHAUSTED, 500: grpc.StatusCode.INTERNAL, 503: grpc.StatusCode.UNAVAILABLE}


class FakeGrpcEngine(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, fake: FakeEngine, tokenizer_dir: Path) -> None:
        self.fake = fake
        self.tokenizer_dir = tokenizer_dir
        self.running = 0
        self.cancelled = 0
        #: The metadata of each Generate call, as a dict.
        self.metadata: list[dict[str, str | bytes]] = []
        self.server: grpc.aio.Server | None = None
        self.base_url = ""

    async def start(self, port: int = 0) -> str:
        """Serve on 127.0.0.1, on a free port or on `port`; the base URL."""
        self.server = grpc.aio.server()
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self, self.server)
        port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        self.base_url = f"grpc://127.0.0.1:{port}"
        return self.base_url

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=0.5)

    async def _gate(self, name: str, context: grpc.aio.ServicerContext) -> None:
        self.fake.calls[name] += 1
        if self.fake.fail_next:
            status = self.fake.fail_next.pop(0)
            await context.abort(_CODES.get(status, grpc.StatusCode.INVALID_ARGUMENT), f"injected {status}")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        self.metadata.append(dict(context.invocation_metadata() or ()))
        await self._gate("Generate", context)
        prompt = list(request.tokenized.input_ids)
        sampling = request.sampling_params
        body = {
            **json_format.MessageToDict(
                sampling, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            ),
            "prompt": prompt,
        }
        self.fake.requests.append(body)
        limit = sampling.max_tokens if sampling.HasField("max_tokens") else None
        if len(prompt) + (limit or 0) > self.fake.max_model_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"This model's maximum context length is {self.fake.max_model_len} tokens",
            )
        self.running += 1
        try:
            if self.fake.hang:
                await asyncio.sleep(3600)
            generated, finish = self.fake.generate(body, limit)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        logprobs = pb.OutputLogProbs(
            token_ids=generated, token_logprobs=[-0.01 * (i % 7) for i in range(len(generated))]
        )
        complete = pb.GenerateComplete(
            output_ids=generated,
            finish_reason=finish,
            prompt_tokens=len(prompt),
            completion_tokens=len(generated),
            output_logprobs=logprobs if sampling.HasField("logprobs") else None,
        )
        yield pb.GenerateResponse(complete=complete)

    async def GetModelInfo(self, request, context):  # noqa: N802
        await self._gate("GetModelInfo", context)
        return pb.GetModelInfoResponse(
            served_model_name="fake", max_context_length=self.fake.max_model_len, eos_token_ids=[IM_END]
        )

    async def GetServerInfo(self, request, context):  # noqa: N802
        await self._gate("GetServerInfo", context)
        return pb.GetServerInfoResponse(active_requests=self.running, server_type="fake")

    async def HealthCheck(self, request, context):  # noqa: N802
        return pb.HealthCheckResponse(healthy=True)

    async def GetTokenizer(self, request, context):  # noqa: N802
        await self._gate("GetTokenizer", context)
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            for path in sorted(self.tokenizer_dir.iterdir()):
                archive.write(path, path.name)
        data = buffer.getvalue()
        half = len(data) // 2
        yield common_pb2.GetTokenizerChunk(data=data[:half])
        yield common_pb2.GetTokenizerChunk(data=data[half:], sha256=hashlib.sha256(data).hexdigest())
