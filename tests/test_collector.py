"""The collector against real servers in this process: failures, resume, overrides,
deadlines, group metrics, warnings, events, interruption and outputs that cannot be written."""

import asyncio
import io
import json
import time

import pytest

from gym_grpc import errors
from gym_grpc.batch import collector
from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data.jsonl import failures_path
from gym_grpc.launch.runner import RegistryServer
from gym_grpc.responses import input_items, message_text
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import registry_service_pb2 as reg
from tests.support import Calculator, EchoModel, eventually, static_registry, task


async def _servers(start, delay=0.01, env=None, model=None):
    model = model or EchoModel(delay)
    m = await start(model)
    env = env or await start(Calculator())
    registry = static_registry(model=m, calc=env)
    agent = await start(
        SimpleAgent({"model_server": "model", "resources_server": "calc"}, name="agent", registry=registry)
    )
    return model, static_registry(agent=agent)


def _write_tasks(path, prompts, **params):
    rows = [{"responses_create_params": {"input": p, **params}, "expected_answer": p} for p in prompts]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _keys(path):
    return sorted((row["task_index"], row["repeat_index"]) for row in _read(path))


def _options(tmp_path, **kwargs):
    kwargs.setdefault("input", tmp_path / "tasks.jsonl")
    return CollectOptions(output=tmp_path / "out.jsonl", agent="agent", progress=False, **kwargs)


async def test_a_failed_rollout_goes_to_the_sidecar_and_the_rest_are_collected(start, tmp_path):
    _, registry = await _servers(start)
    _write_tasks(tmp_path / "tasks.jsonl", ["one", "please fail", "three"])
    log = io.StringIO()
    summary = await collect(registry, _options(tmp_path, num_repeats=2), log=log)
    assert (summary.done, summary.failed) == (4, 2)
    assert _keys(tmp_path / "out.jsonl") == [(0, 0), (0, 1), (2, 0), (2, 1)]
    failures = _read(failures_path(tmp_path / "out.jsonl"))
    assert sorted((f["task_index"], f["repeat_index"]) for f in failures) == [(1, 0), (1, 1)]
    assert failures[0]["error"]["code"] == "INTERNAL"
    assert "RuntimeError" in failures[0]["error"]["message"] and failures[0]["error"]["class"] == "GymError"
    assert "task 1 repeat" in log.getvalue()
    row = _read(tmp_path / "out.jsonl")[0]
    assert set(row["timings"]) == {"model", "tools", "verify", "total"}
    assert row["timings"]["total"] >= row["timings"]["model"] > 0
    await registry.close()


async def test_an_environment_at_its_session_cap_fails_rollouts_that_a_rerun_collects(start, tmp_path):
    env = await start(Calculator({"max_sessions": 1}))
    _, registry = await _servers(start, env=env)
    holder = ResourcesClient(static_registry(calc=env), "calc")
    await holder.seed_session("held", task("x"))  # another agent's rollout holds the only session
    _write_tasks(tmp_path / "tasks.jsonl", ["one", "two"])
    summary = await collect(registry, _options(tmp_path), log=io.StringIO())
    assert (summary.done, summary.failed) == (0, 2)
    failures = _read(failures_path(tmp_path / "out.jsonl"))
    assert {f["error"]["code"] for f in failures} == {"RESOURCE_EXHAUSTED"}
    assert "max_sessions: 1" in failures[0]["error"]["message"]
    await holder.close_session("held")
    summary = await collect(registry, _options(tmp_path, max_in_flight=1), log=io.StringIO())
    assert summary.failed == 0 and _keys(tmp_path / "out.jsonl") == [(0, 0), (1, 0)]
    await holder.registry.close()
    await registry.close()


async def test_resume_after_a_torn_write_collects_every_key_exactly_once(start, tmp_path):
    _, registry = await _servers(start)
    _write_tasks(tmp_path / "tasks.jsonl", ["a", "b", "c"])
    options = _options(tmp_path, num_repeats=2)
    await collect(registry, options, log=io.StringIO())
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    # As if the collector was killed: two rows finished, the third half-written.
    (tmp_path / "out.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:40])
    summary = await collect(registry, options, log=io.StringIO())
    assert (summary.skipped, summary.done) == (2, 4)
    assert _keys(tmp_path / "out.jsonl") == [(t, k) for t in range(3) for k in range(2)]
    assert summary.metrics["agent"]["rollouts"] == 6  # the summary covers both runs
    await registry.close()


async def test_resume_passes_over_an_output_line_too_deep_to_parse(start, tmp_path):
    _, registry = await _servers(start)
    _write_tasks(tmp_path / "tasks.jsonl", ["a", "b"])
    options = _options(tmp_path)
    await collect(registry, options, log=io.StringIO())
    with (tmp_path / "out.jsonl").open("a") as out:
        out.write("[" * 100_000 + "]" * 100_000 + "\n")  # not a row of ours: Python's parser overflows on it
    summary = await collect(registry, options, log=io.StringIO())
    assert (summary.skipped, summary.done) == (2, 0)
    assert summary.metrics["agent"]["rollouts"] == 2
    await registry.close()


async def test_a_second_collect_into_an_output_another_is_writing_stops_at_once_and_writes_nothing(start, tmp_path):
    """Two at once would each run every key the output lacks (every row written twice) and write their
    rollouts in flight into one states file; the second stops before it runs anything."""
    gate = asyncio.Event()
    model, registry = await _servers(start, model=EchoModel(gate=gate))
    _write_tasks(tmp_path / "tasks.jsonl", ["one", "two", "three"])
    first = asyncio.ensure_future(collect(registry, _options(tmp_path, num_repeats=2), log=io.StringIO()))
    await eventually(lambda: model.active == 6, "the first run's rollouts in flight")
    with pytest.raises(errors.OutputInUse, match="another run is writing .*out.jsonl"):
        await collect(registry, _options(tmp_path, num_repeats=2), log=io.StringIO())
    assert len(model.requests) == 6  # the second asked for nothing
    gate.set()
    assert (await first).done == 6
    assert _keys(tmp_path / "out.jsonl") == [(t, r) for t in range(3) for r in range(2)]
    again = await collect(registry, _options(tmp_path, num_repeats=2), log=io.StringIO())  # held no longer
    assert (again.done, again.skipped) == (0, 6)
    await registry.close()


async def test_the_in_flight_window_bounds_concurrent_rollouts(start, tmp_path):
    model, registry = await _servers(start)
    _write_tasks(tmp_path / "tasks.jsonl", [f"task {i}" for i in range(20)])
    summary = await collect(registry, _options(tmp_path, max_in_flight=3), log=io.StringIO())
    assert summary.done == 20
    assert model.peak == 3
    await registry.close()


async def test_overrides_win_over_the_rows_values(start, tmp_path):
    model, registry = await _servers(start)
    _write_tasks(tmp_path / "tasks.jsonl", ["x", "y"], temperature=0.9)
    overrides = {"temperature": 0.25, "reasoning.effort": "low"}
    await collect(registry, _options(tmp_path, overrides=overrides), log=io.StringIO())
    assert [p.temperature for p in model.requests] == [0.25, 0.25]
    assert {p.reasoning.effort for p in model.requests} == {"low"}
    for row in _read(tmp_path / "out.jsonl"):
        assert row["responses_create_params"]["temperature"] == 0.25  # the row says what was run
    await registry.close()


async def test_an_expired_deadline_is_a_failure_row_not_a_hang(start, tmp_path):
    _, registry = await _servers(start, delay=30)
    _write_tasks(tmp_path / "tasks.jsonl", ["slow", "slower"])
    began = time.monotonic()
    summary = await collect(registry, _options(tmp_path, timeout=0.5), log=io.StringIO())
    assert time.monotonic() - began < 10
    assert (summary.done, summary.failed) == (0, 2)
    codes = {f["error"]["code"] for f in _read(failures_path(tmp_path / "out.jsonl"))}
    assert codes == {"DEADLINE_EXCEEDED"}
    await registry.close()


def _rollout_row(task_index, repeat, reward, text="answer"):
    response = {
        "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]
    }
    return {
        "responses_create_params": {"input": "q"},
        "expected_answer": 7,
        "response": response,
        "reward": reward,
        "correct": reward == 1.0,
        "verifier_fields": ["correct"],
        "task_index": task_index,
        "repeat_index": repeat,
        "model_calls": 1,
    }


async def test_group_metrics_and_warnings_come_from_the_whole_output(tmp_path):
    _write_tasks(tmp_path / "tasks.jsonl", ["a", "b", "c"])
    rewards = {0: [1.0, 0.0, 1.0], 1: [0.0, 0.0, 0.0], 2: [1.0, 1.0, 2.0]}
    rows = [
        _rollout_row(t, k, x, text="" if (t, k) == (1, 2) else "answer")
        for t, xs in rewards.items()
        for k, x in enumerate(xs)
    ]
    (tmp_path / "out.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows + rows[:1]))
    summary = await collect(static_registry(), _options(tmp_path, num_repeats=3), log=io.StringIO())
    assert summary.skipped == 9 and summary.done == 0
    m = summary.metrics["agent"]
    assert m["rollouts"] == 9 and m["reward"] == 6 / 9 and m["correct"] == 4 / 9
    assert "expected_answer" not in m  # a task field, not something the rollout produced
    # task 2 passes three times: a reward of 2 is at least the threshold of 1
    assert m["pass@1"] == pytest.approx((2 / 3 + 0 + 1) / 3)
    assert m["pass@3"] == pytest.approx(2 / 3)
    assert m["mean@3"] == pytest.approx((2 / 3 + 0 + 4 / 3) / 3)
    text = "\n".join(summary.warnings)
    assert "1 of 9 rollouts have no assistant text" in text
    assert "1 rewards outside [0, 1] (from 2 to 2)" in text
    assert "1 rows repeat a key" in text


async def test_identical_rewards_are_a_warning(start, tmp_path):
    _, registry = await _servers(start)
    _write_tasks(tmp_path / "tasks.jsonl", ["x", "y", "z"])
    (tmp_path / "tasks.jsonl").write_text((tmp_path / "tasks.jsonl").read_text().replace('"expected_answer"', '"e"'))
    summary = await collect(registry, _options(tmp_path), log=io.StringIO())
    assert summary.warnings == ["agent: all 3 rewards are 0: is the verifier or the data broken?"]
    await registry.close()


async def test_events_record_every_step_of_every_rollout(start, tmp_path):
    _, registry = await _servers(start)
    _write_tasks(tmp_path / "tasks.jsonl", ["a", "b"])
    events = tmp_path / "events.jsonl"
    await collect(registry, _options(tmp_path, num_repeats=2, events=events), log=io.StringIO())
    by_key = {}
    for event in _read(events):
        by_key.setdefault((event["task_index"], event["repeat_index"]), []).append(event)
    assert sorted(by_key) == _keys(tmp_path / "out.jsonl") == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for stream in by_key.values():
        assert [e["type"] for e in stream] == ["model_call", "verification", "rollout"]
        assert stream[0]["response"]["output"][0]["content"][0]["text"] in ("a", "b")
        assert stream[1]["reward"] == stream[2]["reward"] == 1.0
    await registry.close()


async def test_interrupting_the_collector_cancels_the_work_downstream(start, tmp_path):
    model, registry = await _servers(start, delay=30)
    _write_tasks(tmp_path / "tasks.jsonl", [f"t{i}" for i in range(10)])
    collecting = asyncio.ensure_future(collect(registry, _options(tmp_path), log=io.StringIO()))
    while model.active < 10:
        await asyncio.sleep(0.01)
    collecting.cancel()
    for _ in range(200):
        if model.cancelled == 10:
            break
        await asyncio.sleep(0.01)
    assert model.cancelled == 10 and model.active == 0
    await registry.close()


KIND = "failed with INTERNAL in agent"


@pytest.mark.parametrize("progress", [False, True])
async def test_failures_are_told_once_per_kind_not_once_each(start, tmp_path, progress):
    _, registry = await _servers(start)
    _write_tasks(tmp_path / "tasks.jsonl", ["fine"] + ["please fail"] * 40)
    options = _options(tmp_path, report_every=3600)
    options.progress = progress
    log = io.StringIO()
    summary = await collect(registry, options, log=log)
    assert summary.failed == 40 and summary.failure_counts == {KIND: 40}
    (told,) = [line for line in log.getvalue().splitlines() if KIND in line]
    assert "RuntimeError" in told  # the first one, with its message
    assert len(_read(failures_path(tmp_path / "out.jsonl"))) == 40  # the sidecar has every one
    await registry.close()


async def test_a_running_count_of_each_kind_is_told_as_failures_go_on(start, tmp_path):
    _, registry = await _servers(start)
    _write_tasks(tmp_path / "tasks.jsonl", ["please fail", "fine", "fail again", "fail once more"])
    log = io.StringIO()
    await collect(registry, _options(tmp_path, report_every=0, max_in_flight=1), log=log)
    first, *counts = log.getvalue().splitlines()
    assert first.startswith(f"task 0 repeat 0 {KIND}: agent 'agent' Run: INTERNAL: ")
    assert counts == [f"{KIND}: 2 so far", f"{KIND}: 3 so far"]
    await registry.close()


async def test_a_failures_sidecar_that_cannot_be_written_stops_the_run_keeping_every_row(start, tmp_path):
    """/dev/full answers every write with ENOSPC, as a full disk does (a real kernel error; no root needed)."""
    _, registry = await _servers(start)
    _write_tasks(tmp_path / "tasks.jsonl", ["one", "two", "please fail", "four", "five"])
    failures_path(tmp_path / "out.jsonl").symlink_to("/dev/full")
    with pytest.raises(errors.OutputError, match="out.failures.jsonl: No space left on device"):
        await collect(registry, _options(tmp_path, max_in_flight=1), log=io.StringIO())
    assert _keys(tmp_path / "out.jsonl") == [(0, 0), (1, 0)]
    await registry.close()


class FailsWhenOthersWait(EchoModel):
    """Fails a prompt with "fail" in it once three other calls are waiting (for `delay` s)."""

    async def create_response(self, params, session_id):
        if "fail" in message_text(input_items(params)[-1].message):
            for _ in range(2000):
                if self.active == 3:
                    break
                await asyncio.sleep(0.01)
            raise RuntimeError("engine exploded")
        return await super().create_response(params, session_id)


async def test_an_output_that_cannot_be_written_cancels_the_rollouts_in_flight(start, tmp_path):
    model, registry = await _servers(start, model=FailsWhenOthersWait(delay=30))
    _write_tasks(tmp_path / "tasks.jsonl", ["slow", "slow", "slow", "please fail"])
    failures_path(tmp_path / "out.jsonl").symlink_to("/dev/full")
    with pytest.raises(errors.OutputError):
        await asyncio.wait_for(collect(registry, _options(tmp_path), log=io.StringIO()), 20)
    for _ in range(2000):
        if model.cancelled == 3:
            break
        await asyncio.sleep(0.01)
    assert (model.cancelled, model.active) == (3, 0)
    await registry.close()


class GradingCalculator(Calculator):
    """An environment with metrics of its own: what it was sent, and a reward it would rather report."""

    async def aggregate_metrics(self, results):
        return {
            "results_seen": len(results),
            "tasks_seen": len({result.task_index for result in results}),
            "tool_calls_seen_total": sum(json.loads(result.fields_json)["tool_calls_seen"] for result in results),
            "reward": 123.0,
        }


class BrokenAggregator(Calculator):
    async def aggregate_metrics(self, results):
        raise RuntimeError("no metrics today")


async def _registry_service(start, env):
    """The servers behind a real registry service, which knows the agent's references (a static table does not)."""
    model = await start(EchoModel())
    resources = await start(env)
    agent = await start(
        SimpleAgent(
            {"model_server": "model", "resources_server": "calc"},
            name="agent",
            registry=static_registry(model=model, calc=resources),
        )
    )
    registry_app = RegistryServer()
    registry_app.servicer.add(reg.ServerInfo(name="calc", addresses=[resources.address]))
    registry_app.servicer.add(
        reg.ServerInfo(name="agent", addresses=[agent.address], references={"model": "model", "resources": "calc"})
    )
    return Registry((await start(registry_app)).address)


async def test_an_environments_own_metrics_join_its_agents_group(start, tmp_path):
    registry = await _registry_service(start, GradingCalculator())
    _write_tasks(tmp_path / "tasks.jsonl", ["one", "two", "three"])
    summary = await collect(registry, _options(tmp_path, num_repeats=2))
    metrics = summary.metrics["agent"]
    assert (metrics["results_seen"], metrics["tasks_seen"], metrics["tool_calls_seen_total"]) == (6, 3, 0)
    assert metrics["reward"] == 1.0  # the summary's own mean stands; the environment only adds
    await registry.close()


async def test_an_environment_that_cannot_aggregate_costs_a_warning_not_the_run(start, tmp_path):
    registry = await _registry_service(start, BrokenAggregator())
    _write_tasks(tmp_path / "tasks.jsonl", ["one", "two"])
    summary = await collect(registry, _options(tmp_path))
    assert summary.done == 2 and summary.metrics["agent"]["reward"] == 1.0
    assert any(w.startswith("agent: no metrics from its environment") for w in summary.warnings), summary.warnings
    await registry.close()


async def test_results_too_large_for_one_message_are_not_sent_and_say_so(start, tmp_path, monkeypatch):
    monkeypatch.setattr(collector, "AGGREGATE_LIMIT_BYTES", 10)  # less than one result
    registry = await _registry_service(start, GradingCalculator())
    _write_tasks(tmp_path / "tasks.jsonl", ["one", "two"])
    summary = await collect(registry, _options(tmp_path))
    assert "results_seen" not in summary.metrics["agent"]
    about_it = [w for w in summary.warnings if "environment" in w]
    assert about_it == ["agent: environment 'calc' not asked for its metrics: its results are more than 0 MiB"]
    await registry.close()
