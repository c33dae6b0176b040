"""`gym-grpc report` on files real runs wrote (the collector against servers in this process) and on
NeMo Gym's recorded rollouts from its wheel (tests/corpus.py). Its pass@k is checked against NeMo
Gym's own code in tests/test_nemo_interop.py."""

import io
import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.cli.app import main
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import record
from gym_grpc.data.jsonl import failures_path
from gym_grpc.report import stats, text
from tests.corpus import nemo_gym_file, nemo_gym_files
from tests.support import Calculator, EchoModel, static_registry, task


async def _stack(start, env=None):
    model = await start(EchoModel(0.0))
    env = env or await start(Calculator())
    agent = await start(
        SimpleAgent(
            {"model_server": "model", "resources_server": "calc"},
            name="agent",
            registry=static_registry(model=model, calc=env),
        )
    )
    return env, static_registry(agent=agent)


def _tasks(path: Path, prompts: list[str]) -> Path:
    rows = [{"responses_create_params": {"input": p}, "expected_answer": p} for p in prompts]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _report(*args: str) -> str:
    done = CliRunner().invoke(main, ["report", *args], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    return done.output


async def test_failures_a_later_run_made_good_are_not_counted_and_the_rest_are_by_their_last_reason(start, tmp_path):
    """Run 1: the environment's only session is held, every rollout fails RESOURCE_EXHAUSTED. Run 2:
    two of three tasks succeed, "please fail" fails INTERNAL. One rollout is missing, for its last
    reason; two were made good."""
    env = await start(Calculator({"max_sessions": 1}))
    env, registry = await _stack(start, env)
    holder = ResourcesClient(static_registry(calc=env), "calc")
    await holder.seed_session("held", task("x"))
    options = CollectOptions(
        input=_tasks(tmp_path / "tasks.jsonl", ["one", "please fail", "three"]),
        output=tmp_path / "out.jsonl",
        agent="agent",
        max_in_flight=1,  # one session at a time
        progress=False,
    )
    assert (await collect(registry, options, log=io.StringIO())).failed == 3
    await holder.close_session("held")
    assert (await collect(registry, options, log=io.StringIO())).failed == 1
    await holder.registry.close()
    await registry.close()
    assert len(failures_path(options.output).read_text().splitlines()) == 4

    [agent] = json.loads(_report(str(options.output), "--json"))["files"][0]["agents"].values()
    assert agent["failures"] == {"GymError (INTERNAL)": 1}
    assert agent["metrics"]["rollouts"] == 2 and agent["metrics"]["failed"] == 1
    assert json.loads(_report(str(options.output), "--json"))["files"][0]["recovered"] == 2
    assert "2 rollouts failed once and were written by a later run" in _report(str(options.output))


async def test_two_runs_side_by_side_show_each_and_the_change(start, tmp_path):
    _, registry = await _stack(start)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    tasks = _tasks(tmp_path / "tasks.jsonl", ["one", "two", "please fail"])
    for output, repeats in ((first, 2), (second, 4)):
        options = CollectOptions(input=tasks, output=output, agent="agent", num_repeats=repeats, progress=False)
        await collect(registry, options, log=io.StringIO())
    await registry.close()
    text = _report(str(first), str(second), "--tasks")
    header, *lines = text.splitlines()
    assert header.split() == ["agent", "first.jsonl", "second.jsonl", "change"]
    rows = {line[:30].strip(): line[30:].split() for line in lines if line.strip()}
    assert rows["rollouts"] == ["4", "8", "+4"]
    assert rows["failed, not made good"] == ["2", "4", "+2"]
    assert rows["pass@2"] == ["1", "1", "0"]  # the echo answers every task but the failing one
    assert rows["pass@4"] == ["-", "1"]  # only the second run has four repeats
    per_task = json.loads(_report(str(first), str(second), "--json"))
    counts = [
        {index: task["rollouts"] for index, task in file["agents"]["agent"]["tasks"].items()}
        for file in per_task["files"]
    ]
    assert counts == [{"0": 2, "1": 2}, {"0": 4, "1": 4}]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


async def test_plots_are_written_as_png_files_and_in_one_html_page(start, tmp_path):
    _, registry = await _stack(start)
    output = tmp_path / "out.jsonl"
    options = CollectOptions(
        input=_tasks(tmp_path / "tasks.jsonl", ["a", "b"]), output=output, agent="agent", num_repeats=3, progress=False
    )
    await collect(registry, options, log=io.StringIO())
    await registry.close()
    _report(str(output), "--png", str(tmp_path / "plots"), "--html", str(tmp_path / "report.html"))
    written = sorted(path.name for path in (tmp_path / "plots").iterdir())
    assert written == ["pass_at_k.png", "reward_histogram.png", "throughput.png"]
    assert all(_png_size(tmp_path / "plots" / name) == (700, 400) for name in written)
    page = (tmp_path / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 3
    assert "pass@3" in page and "agent task" in page  # the text report with every task


def test_every_row_of_nemo_gyms_recorded_rollouts_is_counted_once_for_its_agent(tmp_path):
    """Every example_rollouts.jsonl of NeMo Gym's wheel (real models; rows with and without keys, without
    agent_ref, negative and continuous rewards): each row counted once, for its agent, its reward in the mean."""
    names = nemo_gym_files("example_rollouts.jsonl")
    assert len(names) > 50
    keyless = placeholders = 0
    for number, name in enumerate(names):
        lines = [line for line in nemo_gym_file(name).decode().splitlines() if line.strip()]
        path = tmp_path / f"{number}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        rows = [json.loads(line) for line in lines if line.startswith("{")]
        file = text.to_json([stats.read(path)], 1.0)["files"][0]
        assert file["unreadable"] == len(lines) - len(rows), name  # some files hold "<PLACEHOLDER ROW>" lines
        agents = file["agents"]
        assert sum(agent["metrics"]["rollouts"] for agent in agents.values()) + file["duplicates"] == len(rows), name
        expected = {(row.get("agent_ref") or {}).get("name") or record.NO_AGENT for row in rows}
        assert set(agents) == expected, name
        if not file["duplicates"]:
            rewards = sum(row["reward"] for row in rows if isinstance(row.get("reward"), int | float))
            means = [(a["metrics"]["reward_mean"] or 0.0) * a["metrics"]["rollouts"] for a in agents.values()]
            assert sum(means) == pytest.approx(rewards), name
        without_key = sum(1 for row in rows if row.get("_ng_task_index") is None and row.get("task_index") is None)
        assert sum(agent["keyless"] for agent in agents.values()) == without_key, name
        keyless += without_key
        placeholders += file["unreadable"]
    assert keyless and placeholders  # rows without a key, and lines that are not rows, were among them
