"""Talking to inference engines: HTTP and vLLM gRPC links, their retries and pools, a local CPU vLLM."""

from gym_grpc.engines.http import Engine
from gym_grpc.engines.link import EngineError
from gym_grpc.engines.pool import EngineModelServer, EnginePool
from gym_grpc.engines.settings import EngineSettings
from gym_grpc.engines.vllm_grpc import GrpcEngine

__all__ = ["Engine", "EngineError", "EngineModelServer", "EnginePool", "EngineSettings", "GrpcEngine"]
