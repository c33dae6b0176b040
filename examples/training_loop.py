"""An on-policy GRPO loop as a trainer sees it: per step, a group of rollouts per task through a running
gym-grpc, samples with loss masks and advantages, and what an optimizer step would receive.

    gym-grpc run configs/quickstart.yaml &          # or configs/vllm.yaml + an environment, on a real engine
    python examples/training_loop.py --agent math_agent --tasks servers/resources/math/data/example.jsonl

or with the tasks a task server chooses (docs/task-service.md): groups that carry signal, drawn by difficulty

    gym-grpc run configs/quickstart.yaml configs/math_tasks.yaml &
    python examples/training_loop.py --agent math_agent --task-server math_tasks

No optimizer runs here (see docs/training.md for TRL): after each step the loop tells the model server
that its weights moved on (`weights_updated`), as a trainer does after pushing new weights to the
engine, so every turn says which version generated it. Prints one JSON line per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from gym_grpc import training
from gym_grpc.client import GymClient, RolloutResult, set_max_concurrent_rollouts


async def step(gym: GymClient, agent: str, tasks: list[dict], group_size: int) -> dict:
    """One step: a group per task, then the samples an optimizer step would get."""
    groups = await asyncio.gather(*(gym.run_group(task, group_size) for task in tasks))
    return train_on(gym, agent, groups)


async def served_step(gym: GymClient, task_server: str, groups: int, group_size: int) -> dict:
    """One step on the groups a task server chose: every one carries signal; the batch says what it cost."""
    batch = await gym.next_batch(task_server, groups, group_size)
    s = batch.summary
    cost = {
        "groups_tried": s.groups_tried,
        "groups_without_signal": s.groups_without_signal,
        "rollouts_run": s.rollouts,
    }
    return {**train_on(gym, batch.groups[0].agent, [g.results for g in batch.groups]), **cost} if batch.groups else cost


def train_on(gym: GymClient, agent: str, groups: list[list[RolloutResult]]) -> dict:
    """The samples of groups of rollouts, as an optimizer step would get them, and what they hold."""
    rollouts = [
        training.TrainingRollout.from_result(result, agent, task_index, repeat)
        for task_index, group in enumerate(groups)
        for repeat, result in enumerate(group)
    ]
    samples, stats = training.build(rollouts, current_version=gym.policy_version, max_lag=1)
    group_stats = training.assign_advantages(samples)
    trained = [s for s in samples if s.loss_multiplier]
    return {
        "policy_version": gym.policy_version,
        "rollouts": stats.rollouts,
        "failed": stats.failed,
        "samples": len(samples),
        "trained_samples": len(trained),
        "trained_tokens": sum(sum(s.response_mask) for s in trained),
        "context_tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in trained),
        "versions_seen": sorted({s.policy_version for s in trained if s.policy_version is not None}),
        "groups_with_signal": sum(1 for g in group_stats if g.std > 0),
        "mean_reward": sum(s.reward for s in trained) / len(trained) if trained else None,
        "advantages": [[round(s.advantage, 3) for s in samples if s.task_index == i] for i in range(len(groups))],
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registry", default="127.0.0.1:50050")
    parser.add_argument("--agent", required=True)
    parser.add_argument("--model-server", default="policy_model", help="told of each weight update")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tasks", type=Path, help="a tasks JSONL, as `gym-grpc collect` reads")
    source.add_argument("--task-server", help="a task server that chooses each step's tasks")
    parser.add_argument("--limit", type=int, default=4, help="tasks (groups) per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    tasks = (
        [] if args.tasks is None else [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    )
    set_max_concurrent_rollouts(64)  # one limit for training and evaluation rollouts alike
    async with GymClient(args.agent, args.registry) as gym:
        await gym.weights_updated(0, args.model_server)  # the weights the engine starts from
        for number in range(args.steps):
            if args.task_server:
                done = await served_step(gym, args.task_server, args.limit, args.group_size)
            else:
                done = await step(gym, args.agent, tasks[: args.limit], args.group_size)
            print(json.dumps({"step": number, **done}), flush=True)
            # ... the optimizer step and the weight push to the engine go here ...
            await gym.weights_updated(number + 1, args.model_server)


if __name__ == "__main__":
    asyncio.run(main())
