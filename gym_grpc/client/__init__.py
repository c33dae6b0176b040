"""Calling gym-grpc servers: `GymClient` for training loops, and a typed client per role over the stubs."""

from gym_grpc.client.stubs import AdminClient, AgentClient, ModelClient, ResourcesClient, TaskClient, ToolResult
from gym_grpc.client.training import (
    GymClient,
    RolloutResult,
    RolloutSlot,
    TaskBatch,
    TaskGroup,
    TokenTurn,
    acquire_rollout_slot,
    max_concurrent_rollouts,
    rollouts_in_flight,
    set_max_concurrent_rollouts,
)

__all__ = [
    "AdminClient",
    "AgentClient",
    "GymClient",
    "ModelClient",
    "ResourcesClient",
    "RolloutResult",
    "RolloutSlot",
    "TaskBatch",
    "TaskClient",
    "TaskGroup",
    "TokenTurn",
    "ToolResult",
    "acquire_rollout_slot",
    "max_concurrent_rollouts",
    "rollouts_in_flight",
    "set_max_concurrent_rollouts",
]
