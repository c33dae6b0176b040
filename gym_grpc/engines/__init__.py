"""Talking to inference engines: an HTTP client for OpenAI-compatible engines, its retries, a local CPU vLLM."""

from gym_grpc.engines.http import Engine, EngineError, EngineModelServer, EnginePool, EngineSettings

__all__ = ["Engine", "EngineError", "EngineModelServer", "EnginePool", "EngineSettings"]
