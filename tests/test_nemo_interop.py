"""NeMo Gym's own files through gym-grpc, keyed by NeMo Gym's `_ng_task_index` / `_ng_rollout_index`.

The files are NeMo Gym's recorded rollouts (real models) and example tasks,
read from its wheel at test time (tests/corpus.py), never committed.
"""

import io
import json
import subprocess
from pathlib import Path

import pytest

from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.batch.reverify import ReverifyOptions, reverify
from gym_grpc.batch.summary import GroupIndex, summarise_file
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.bundled.servers.resources.math.server import MathEnv
from gym_grpc.bundled.servers.resources.mcqa.server import MCQAEnv
from gym_grpc.data import record
from gym_grpc.data.record import KEY, NEMO_KEY
from gym_grpc.report import stats as report_stats
from gym_grpc.rpc.registry import Registry
from tests.corpus import nemo_gym_file
from tests.nemo_gym import nemo_gym_python, python313
from tests.support import REPO

#: Our own math tasks.
MATH = REPO / "servers/resources/math/data/example.jsonl"
#: A math environment whose verifier, like ours, is math-verify; its rows are out of key order.
PI_MATH = "environments/pi_math/data/"
#: The pi_math task whose answer holds (2+sqrt(3))^2016: math-verify may time out comparing it on a loaded machine.
HUGE_ANSWER = 1
#: Multiple-choice questions in the shape of our mcqa environment's rows.
BUNSEN = "resources_servers/bunsenbench_chemistry_mcq/data/"


def _nemo_lines(name: str) -> list[str]:
    return [line for line in nemo_gym_file(name).decode().splitlines() if line.strip()]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _by_key(path: Path, names: tuple[str, str]) -> dict[tuple[int, int], dict]:
    found = {}
    for row in map(json.loads, path.read_text().splitlines()):
        key = (row[names[0]], row[names[1]])
        assert key not in found, f"{key} twice in {path}"
        found[key] = row
    return found


@pytest.mark.slow
async def test_a_nemo_gym_rollouts_file_reverifies_under_its_own_keys(start, tmp_path):
    env = await start(MathEnv(name="math"))
    registry = Registry(static={"math": env.address})
    nemo = _write(tmp_path / "nemo.jsonl", _nemo_lines(PI_MATH + "example_rollouts.jsonl"))
    options = ReverifyOptions(input=nemo, output=tmp_path / "scored.jsonl", resources="math", progress=False)
    summary, changes = await reverify(registry, options, log=io.StringIO())
    assert (summary.done, summary.failed, summary.bad_rows) == (5, 0, 0)
    recorded, scored = _by_key(nemo, NEMO_KEY), _by_key(options.output, KEY)
    assert scored.keys() == recorded.keys() == {(t, 0) for t in range(5)}
    for key, row in scored.items():
        assert (row["_ng_task_index"], row["_ng_rollout_index"]) == key  # NeMo Gym's own key, kept
        assert row["expected_answer"] == recorded[key]["expected_answer"]  # each key still holds its own task
        if key[0] != HUGE_ANSWER:
            assert row["reward"] == recorded[key]["reward"]  # NeMo Gym's math-verify score, reproduced
    assert changes.compared == 5
    await registry.close()


@pytest.mark.slow
async def test_reverify_of_a_nemo_gym_file_resumes_where_it_stopped(start, tmp_path):
    env = await start(MathEnv(name="math"))
    registry = Registry(static={"math": env.address})
    nemo = _write(tmp_path / "nemo.jsonl", _nemo_lines(PI_MATH + "example_rollouts.jsonl"))
    options = ReverifyOptions(input=nemo, output=tmp_path / "scored.jsonl", resources="math", progress=False)
    await reverify(registry, options, log=io.StringIO())
    _write(options.output, options.output.read_text().splitlines()[:2])  # a run stopped after two rows
    summary, _ = await reverify(registry, options, log=io.StringIO())
    assert (summary.skipped, summary.done) == (2, 3)
    scored = _by_key(options.output, NEMO_KEY)
    assert scored.keys() == _by_key(nemo, NEMO_KEY).keys()
    assert all((row["task_index"], row["repeat_index"]) == key for key, row in scored.items())
    await registry.close()


async def test_a_slice_of_a_nemo_gym_run_keeps_its_high_task_indices(start, tmp_path):
    env = await start(MCQAEnv(name="mcqa"))
    registry = Registry(static={"mcqa": env.address})
    lines = _nemo_lines(BUNSEN + "example_rollouts.jsonl")
    wild = {**json.loads(lines[0]), "_ng_task_index": -1}
    nemo = _write(tmp_path / "slice.jsonl", [*lines[3:], json.dumps(wild)])  # tasks 3 and 4 of NeMo's run
    options = ReverifyOptions(input=nemo, output=tmp_path / "scored.jsonl", resources="mcqa", progress=False)
    summary, changes = await reverify(registry, options, log=(log := io.StringIO()))
    assert (summary.done, summary.bad_rows) == (2, 1)
    assert "_ng_task_index: the key is not" in log.getvalue()
    assert _by_key(options.output, KEY).keys() == {(3, 0), (4, 0)}
    assert changes.compared == 2
    await registry.close()


async def _math_stack(start) -> Registry:
    """The embedded policy, our math environment and an agent named "agent" over them."""
    model = await start(LocalPolicyModel(name="policy"))
    env = await start(MathEnv(name="math"))
    static = {"policy": model.address, "math": env.address}
    agent = await start(
        SimpleAgent(
            {"model_server": "policy", "resources_server": "math"}, name="agent", registry=Registry(static=static)
        )
    )
    return Registry(static={**static, "agent": agent.address})


@pytest.mark.slow
async def test_collect_resumes_an_output_that_nemo_gym_began(start, tmp_path):
    registry = await _math_stack(start)
    tasks = _write(tmp_path / "tasks.jsonl", _nemo_lines(PI_MATH + "example.jsonl"))
    began = _nemo_lines(PI_MATH + "example_rollouts.jsonl")[:2]  # NeMo Gym's rollouts of tasks 2 and 4
    output = _write(tmp_path / "rollouts.jsonl", began)
    options = CollectOptions(input=tasks, output=output, agent="agent", progress=False, overrides={"temperature": 0})
    summary = await collect(registry, options, log=io.StringIO())
    assert (summary.skipped, summary.done, summary.failed) == (2, 3, 0)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(record.row_key(row) for row in rows) == [(t, 0) for t in range(5)]
    for row in rows[2:]:  # ours carry both names of the key
        assert (row["task_index"], row["repeat_index"]) == (row["_ng_task_index"], row["_ng_rollout_index"])
    assert summary.metrics["agent"]["rollouts"] == 5  # the summary covers NeMo Gym's rows too
    await registry.close()


def test_the_summary_counts_a_repeated_nemo_gym_key_once(tmp_path):
    lines = _nemo_lines(PI_MATH + "example_rollouts.jsonl")
    path = _write(tmp_path / "nemo.jsonl", [*lines, lines[0]])
    groups = GroupIndex(5)
    for t in range(5):
        groups.set(t, "pi_math_agent")
    summary = summarise_file(path, groups, 1)
    recorded = [json.loads(line)["reward"] for line in lines]
    assert summary.metrics["pi_math_agent"]["rollouts"] == 5
    assert summary.metrics["pi_math_agent"]["reward"] == sum(recorded) / 5
    assert any("1 rows repeat a key" in warning for warning in summary.warnings)


#: Run in NeMo Gym's virtualenv: validate every row of a rollouts file with NeMo Gym's own
#: model of a verified rollout, then aggregate them as NeMo Gym's /aggregate_metrics does.
NEMO_GYM_CHECK = """
import json, sys
from nemo_gym.base_resources_server import BaseVerifyResponse
from nemo_gym.reward_profile import compute_aggregate_metrics, compute_pass_majority_metrics

rows = [json.loads(line) for line in open(sys.argv[1])]
for row in rows:
    BaseVerifyResponse.model_validate(row)
tasks = [[r for r in rows if r["_ng_task_index"] == t] for t in sorted({r["_ng_task_index"] for r in rows})]
print(json.dumps({
    "aggregate": compute_aggregate_metrics(rows).model_dump(mode="json"),
    "pass": compute_pass_majority_metrics(tasks)[0],
}))
"""


@pytest.mark.slow
async def test_nemo_gyms_own_models_and_aggregation_read_our_rollouts(start, tmp_path):
    interpreter = python313()
    if interpreter is None:
        pytest.skip("no Python 3.13 to install NeMo Gym in (set GYM_GRPC_PYTHON313)")
    nemo_python = nemo_gym_python(interpreter)
    registry = await _math_stack(start)
    output = tmp_path / "rollouts.jsonl"
    options = CollectOptions(input=MATH, output=output, agent="agent", num_repeats=2, progress=False)
    summary = await collect(registry, options, log=io.StringIO())
    await registry.close()
    assert summary.done == 12
    checked = subprocess.run([nemo_python, "-c", NEMO_GYM_CHECK, output], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr[-3000:]
    nemo = json.loads(checked.stdout)
    metrics = nemo["aggregate"]
    assert metrics["agent_metrics"]["num_repeats"] == 2
    assert metrics["agent_metrics"]["mean/reward"] == pytest.approx(summary.metrics["agent"]["reward"])
    assert [group["_ng_task_index"] for group in metrics["group_level_metrics"]] == list(range(6))
    assert all(group["num_rollouts"] == 2 for group in metrics["group_level_metrics"])
    # `gym-grpc report`'s pass@k is NeMo Gym's (in percent there) on the same rows.
    [agent] = report_stats.read(output).agents.values()
    ours = agent.pass_curve(threshold=1.0)
    assert list(ours) == [1, 2]
    for k, value in ours.items():
        assert 100 * value == pytest.approx(nemo["pass"][f"pass@{k}/accuracy"])
