"""The task role: a server that chooses what a trainer trains on next (TaskService, docs/task-service.md).

servers:
  math_tasks:
    entrypoint: gym_grpc.tasks:TaskServer
    config:
      agent: math_agent
      datasets: [{name: train, jsonl_fpath: data/train.jsonl}]
"""

from gym_grpc.tasks.sampler import PoolRule, TaskSampler
from gym_grpc.tasks.server import TaskServer, TaskServerConfig

__all__ = ["PoolRule", "TaskSampler", "TaskServer", "TaskServerConfig"]
