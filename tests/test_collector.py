"""The collector against real servers in this process: failures, resume, the window."""

import asyncio
import io
import json

from gym_grpc.collector import CollectOptions, collect
from gym_grpc.responses import input_items, message_text
from gym_grpc.v1 import responses_pb2 as r
from servers.agents.simple_agent.agent import SimpleAgent
from tests.support import Calculator, ScriptedModel, say, static_registry


class EchoModel(ScriptedModel):
    """Answers with the prompt; fails on prompts containing "fail"; counts concurrent calls."""

    def __init__(self):
        super().__init__([])
        self.active = self.peak = 0

    async def create_response(self, params, session_id):
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(0.01)
            text = message_text(input_items(params)[-1].message)
            if "fail" in text:
                raise RuntimeError("engine exploded")
            return r.Response(status=r.RESPONSE_STATUS_COMPLETED, output=say(text))
        finally:
            self.active -= 1


async def _servers(start):
    model = EchoModel()
    m = await start(model)
    env = await start(Calculator())
    agent = await start(
        SimpleAgent(
            {"model_server": "model", "resources_server": "calc"},
            name="agent",
            registry=static_registry(model=m, calc=env),
        )
    )
    return model, static_registry(agent=agent)


def _write_tasks(path, prompts):
    lines = [json.dumps({"responses_create_params": {"input": p}, "expected_answer": p}) for p in prompts]
    path.write_text("\n".join(lines) + "\n")


def _keys(path):
    return sorted((row["task_index"], row["repeat_index"]) for row in map(json.loads, path.read_text().splitlines()))


async def test_a_failed_rollout_is_reported_and_the_rest_are_collected(start, tmp_path):
    _, registry = await _servers(start)
    tasks, out, log = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl", io.StringIO()
    _write_tasks(tasks, ["one", "please fail", "three"])
    options = CollectOptions(input=tasks, output=out, agent="agent", num_repeats=2, progress=False)
    summary = await collect(registry, options, log=log)
    assert (summary.collected, summary.failed) == (4, 2)
    assert _keys(out) == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert "task 1 repeat 0 failed" in log.getvalue() and "RuntimeError" in log.getvalue()
    assert summary.metrics["agent"]["reward"] == 1.0
    await registry.close()


async def test_resume_after_a_torn_write_collects_every_key_exactly_once(start, tmp_path):
    _, registry = await _servers(start)
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    _write_tasks(tasks, ["a", "b", "c"])
    options = CollectOptions(input=tasks, output=out, agent="agent", num_repeats=2, progress=False)
    await collect(registry, options, log=io.StringIO())
    lines = out.read_text().splitlines()
    # As if the collector was killed: two rows finished, the third half-written.
    out.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:40])
    summary = await collect(registry, options, log=io.StringIO())
    assert (summary.skipped, summary.collected) == (2, 4)
    assert _keys(out) == [(t, k) for t in range(3) for k in range(2)]
    await registry.close()


async def test_the_in_flight_window_bounds_concurrent_rollouts(start, tmp_path):
    model, registry = await _servers(start)
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    _write_tasks(tasks, [f"task {i}" for i in range(20)])
    options = CollectOptions(input=tasks, output=out, agent="agent", max_in_flight=3, progress=False)
    summary = await collect(registry, options, log=io.StringIO())
    assert summary.collected == 20
    assert model.peak == 3
    await registry.close()
