"""gym_grpc.adapters.trl's event loop, without TRL: what GymRollouts leaves behind when closed."""

from __future__ import annotations

import asyncio

from gym_grpc.adapters.trl import GymRollouts
from tests.support import start_run

WEATHER = {"responses_create_params": {"input": [{"role": "user", "content": "What is the weather in Paris?"}]}}


def test_close_leaves_no_task_of_the_client_pending_on_its_loop() -> None:
    """The RunMany calls' tasks end with the loop, not later: a task left pending on a closed loop
    is finalised by the garbage collector wherever it runs next (in CI, inside pytest's import
    of a module, where CPython 3.11 failed with "AST constructor recursion depth mismatch")."""
    with start_run() as run:
        rollouts = GymRollouts("weather_agent", [WEATHER], run.registry)
        (group,) = rollouts._run(rollouts._groups([0], 2))
        assert [r.ok for r in group] == [True, True], [r.failure for r in group]
        running = rollouts._run(_other_tasks())
        assert running, "the client keeps tasks on its loop between runs (its RunMany calls)"
        rollouts.close()
    assert [task for task in running if not task.done()] == []


async def _other_tasks() -> set[asyncio.Task]:
    """The tasks on the running loop, held here (the loop keeps only weak references)."""
    return asyncio.all_tasks() - {asyncio.current_task()}
