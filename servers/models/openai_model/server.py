"""A model server for engines that speak the OpenAI Responses API (`POST /responses`).

The request is the task's create parameters as Responses JSON, without the
training fields (engines reject them) and with the configured model; the
answer maps straight into gym.v1. Use it for hosted APIs and for engines with
a native Responses endpoint. For token ids from vLLM, use the vllm server.
"""

from __future__ import annotations

from pydantic import field_validator

from gym_grpc import errors
from gym_grpc.data import rows
from gym_grpc.engines.http import Engine
from gym_grpc.engines.pool import EngineModelServer
from gym_grpc.engines.settings import GRPC_SCHEME, EngineSettings
from gym_grpc.v1 import responses_pb2 as r


class OpenAIModelConfig(EngineSettings):
    @field_validator("base_url")
    @classmethod
    def _http_only(cls, value: list[str]) -> list[str]:
        if any(url.startswith(GRPC_SCHEME) for url in value):
            raise ValueError("the Responses API is HTTP: a vLLM gRPC server is for the vllm model server")
        return value


class OpenAIModel(EngineModelServer):
    Config = OpenAIModelConfig
    config: OpenAIModelConfig

    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        body = rows.params_to_json(params, training=False)
        body["model"] = self.config.model
        body.setdefault("store", False)
        engine = self.engine_for(params, session_id)
        assert isinstance(engine, Engine)  # the config has HTTP base URLs only
        answer = await engine.post("/responses", body)
        try:
            return rows.response_from_json(answer)
        except rows.RowError as e:
            raise errors.GymError(
                f"engine {engine.base_url} answered what gym.v1 cannot carry: {e}", reason=errors.Reason.ENGINE_FAILED
            ) from None
