"""Calling gym-grpc servers: `GymClient` for training loops, and a typed client per role over the stubs."""

from gym_grpc.client.stubs import AdminClient, AgentClient, ModelClient, ResourcesClient, ToolResult
from gym_grpc.client.training import (
    GymClient,
    RolloutResult,
    TokenTurn,
    max_concurrent_rollouts,
    set_max_concurrent_rollouts,
)

__all__ = [
    "AdminClient",
    "AgentClient",
    "GymClient",
    "ModelClient",
    "ResourcesClient",
    "RolloutResult",
    "TokenTurn",
    "ToolResult",
    "max_concurrent_rollouts",
    "set_max_concurrent_rollouts",
]
