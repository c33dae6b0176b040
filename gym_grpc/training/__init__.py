"""Training samples from rollouts (docs/training.md).

rollouts = list(read_rollouts(Path("rollouts.jsonl")))      # or TrainingRollout.from_result(...)
samples, stats = build(rollouts, non_monotonic="split")
assign_advantages(samples)                                  # GRPO, per task and agent
write(samples, "verl", Path("samples.parquet"))
"""

from gym_grpc.training.groups import GroupStats, assign_advantages
from gym_grpc.training.layouts import LAYOUTS, Layout, write
from gym_grpc.training.samples import (
    NonMonotonic,
    Sample,
    SampleStats,
    TrainingRollout,
    build,
    read_rollouts,
    samples_of,
)

__all__ = [
    "LAYOUTS",
    "GroupStats",
    "Layout",
    "NonMonotonic",
    "Sample",
    "SampleStats",
    "TrainingRollout",
    "assign_advantages",
    "build",
    "read_rollouts",
    "samples_of",
    "write",
]
