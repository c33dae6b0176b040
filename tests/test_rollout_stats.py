"""The statistics of a rollouts file (gym_grpc/data/rollout_stats.py): the pass@k estimator, and
`collect`'s end-of-run summary and `gym-grpc report` giving the same numbers for a file with failed
and unverified rollouts, because both read that one module."""

import io
import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.batch.summary import GroupIndex, summarise_file
from gym_grpc.cli.app import main
from gym_grpc.data.jsonl import failures_path
from gym_grpc.data.rollout_stats import TaskScores, pass_at_k
from tests.support import static_registry


def test_pass_at_k_is_the_chance_that_one_of_k_drawn_without_replacement_passes():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 3, 2) == 1.0  # one failure cannot fill two draws
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)


@pytest.mark.parametrize("n, k", [(1, 1), (4, 1), (4, 4), (7, 3)])
def test_pass_at_k_of_a_task_that_never_passed_is_0_and_of_one_that_always_did_is_1(n, k):
    assert pass_at_k(n, 0, k) == 0.0
    assert pass_at_k(n, n, k) == 1.0


@pytest.mark.parametrize("n, c, k", [(3, 1, 4), (0, 0, 1), (4, 5, 1), (4, 1, 0)])
def test_pass_at_k_refuses_what_it_cannot_estimate(n, c, k):
    with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)


def _scores(rewards_per_task: list[list[float]], threshold: float = 1.0) -> TaskScores:
    scores = TaskScores(threshold)
    for rewards in rewards_per_task:
        slot = scores.new_slot()
        for reward in rewards:
            scores.add(slot, reward)
    return scores


def test_a_task_with_fewer_than_k_verified_rollouts_is_left_out_of_pass_at_k_not_counted_as_a_fail():
    scores = _scores([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0], [1.0]])
    at = scores.at_k([1, 2, 4])
    assert at[1].tasks == 3 and at[1].pass_at == pytest.approx((1 / 4 + 0 + 1) / 3)
    assert at[2].tasks == 2 and at[2].pass_at == pytest.approx((1 - 3 / 6 + 0) / 2)
    assert at[4].tasks == 1 and at[4].pass_at == 1.0
    assert at[4].mean_at == 0.25 and at[2].mean_at == pytest.approx((0.25 + 0.0) / 2)
    assert scores.pass_curve() == {k: at.pass_at for k, at in scores.at_k([1, 2, 3, 4]).items()}
    assert list(scores.pass_curve()) == [1, 2, 3, 4]
    empty = scores.at_k([5])[5]
    assert empty.tasks == 0 and math.isnan(empty.pass_at) and math.isnan(empty.mean_at)


def test_tasks_that_never_or_always_passed_give_0_and_1_and_are_told_apart():
    scores = _scores([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, 1.0, 0.0], [1.0], []])
    assert [scores.at_k([1, 2, 3], [slot]) for slot in (0, 1)] == [
        {k: (1, 0.0, 0.0) for k in (1, 2, 3)},  # c = 0
        {k: (1, 1.0, 1.0) for k in (1, 2, 3)},  # c = n
    ]
    # task 2 passed once in three: pass@1 = 1/3, pass@2 = 1 - C(2,2)/C(3,2) = 2/3, pass@3 = 1
    assert scores.at_k([3])[3] == (3, pytest.approx((0 + 1 + 1) / 3), pytest.approx((0 + 1 + 0.5) / 3))
    assert scores.at_k([1])[1] == (4, pytest.approx((0 + 1 + 1 / 3 + 1) / 4), pytest.approx((0 + 1 + 0.5 + 1) / 4))
    assert scores.kinds() == {"never": 1, "always": 1, "mixed": 1}  # one rollout, or none: no kind
    mixed = scores.task(2)
    assert (mixed.rollouts, mixed.passed, mixed.mean) == (3, 1, 0.5)
    assert mixed.std == pytest.approx(math.sqrt(((0.5 - 0.5) ** 2 + 0.5**2 + 0.5**2) / 3))
    assert scores.task(4).rollouts == 0 and scores.task(4).kind is None


def test_a_reward_passes_from_the_threshold_up():
    assert _scores([[0.5, 0.49, 2.0]], threshold=0.5).task(0).passed == 2


def _row(task: int, repeat: int, reward: float, **extra) -> dict:
    return {
        "responses_create_params": {"input": f"question {task}"},
        "agent_ref": {"name": "agent"},
        "response": {
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]}]
        },
        "reward": reward,
        "task_index": task,
        "repeat_index": repeat,
        **extra,
    }


def _file_with_failures(tmp_path: Path) -> tuple[Path, Path]:
    """2 tasks x 4 repeats. Task 0: four verified rollouts, rewards 0, 1, 0, 0. Task 1: repeat 0 verified
    (reward 1), repeat 1 collected with --skip-verify (its placeholder reward 0 is no reward), repeats 2
    and 3 failed (in the failures sidecar, no row)."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(json.dumps({"responses_create_params": {"input": f"question {t}"}}) + "\n" for t in (0, 1))
    )
    rows = [_row(0, k, x) for k, x in enumerate([0.0, 1.0, 0.0, 0.0])]
    rows += [_row(1, 0, 1.0), _row(1, 1, 0.0, verification_skipped=True)]
    output = tmp_path / "out.jsonl"
    output.write_text("".join(json.dumps(row) + "\n" for row in rows))
    error = {"class": "GymError", "code": "DEADLINE_EXCEEDED", "message": "rollout took longer than 3600 s"}
    failed = [{"task_index": 1, "repeat_index": k, "group": "agent", "error": error} for k in (2, 3)]
    failures_path(output).write_text("".join(json.dumps(entry) + "\n" for entry in failed))
    return tasks, output


async def test_collect_and_report_give_the_same_numbers_for_a_file_with_failed_and_unverified_rollouts(tmp_path):
    tasks, output = _file_with_failures(tmp_path)
    # By hand. Verified: task 0 has n = 4, c = 1; task 1 has n = 1, c = 1. The unverified rollout and the
    # two failures are in no number but their own counts.
    reward_mean = (0 + 1 + 0 + 0 + 1) / 5
    pass_1 = (1 / 4 + 1 / 1) / 2  # each task's pass rate, over both tasks
    pass_2 = 1 - 3 / 6  # 1 - C(3,2)/C(4,2), task 0 alone: task 1 has one verified rollout
    pass_3 = 1 - 1 / 4  # 1 - C(3,3)/C(4,3)
    pass_4 = 1.0  # task 0 passed once in its four
    mean_4 = 1 / 4  # task 0's mean reward

    # collect with every key done but the two failed ones, which fail again (no agent is served): its
    # summary covers the whole file, as at the end of any run.
    registry = static_registry()
    options = CollectOptions(input=tasks, output=output, agent="agent", num_repeats=4, progress=False)
    summary = await collect(registry, options, log=io.StringIO())
    await registry.close()
    assert (summary.skipped, summary.done, summary.failed) == (6, 0, 2)
    assert summary.metrics["agent"] == {
        "rollouts": 6,
        "reward": pytest.approx(reward_mean),
        "unverified": 1,
        "failed": 2,
        "complete_tasks": 1,
        "pass@1": pytest.approx(pass_1),
        "pass@4": pytest.approx(pass_4),
        "mean@4": pytest.approx(mean_4),
    }
    assert "agent: 1 rollouts are not verified yet (gym-grpc reverify)" in summary.warnings

    done = CliRunner().invoke(main, ["report", str(output), "--json"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)["files"][0]["agents"]["agent"]
    metrics = report["metrics"]
    assert {k: metrics[k] for k in ("rollouts", "unverified", "failed", "tasks")} == {
        "rollouts": 6,
        "unverified": 1,
        "failed": 2,
        "tasks": 2,
    }
    assert report["failures"] == {"Unavailable (UNAVAILABLE)": 2}  # the last reason of each failed key
    assert metrics["reward_mean"] == pytest.approx(reward_mean)
    assert {k: v for k, v in metrics.items() if k.startswith("pass@")} == {
        "pass@1": pytest.approx(pass_1),
        "pass@2": pytest.approx(pass_2),
        "pass@3": pytest.approx(pass_3),
        "pass@4": pytest.approx(pass_4),
    }
    # The same numbers, not merely close ones: one module computed both.
    collected = summary.metrics["agent"]
    assert (metrics["reward_mean"], metrics["pass@1"], metrics["pass@4"]) == (
        collected["reward"],
        collected["pass@1"],
        collected["pass@4"],
    )
    assert report["tasks"]["1"]["rollouts"] == 1 and report["tasks"]["0"]["rollouts"] == 4


def test_the_summary_counts_a_failed_key_once_and_not_when_a_later_run_wrote_it(tmp_path):
    """Task 0: repeat 0 failed twice (two runs), repeat 1 failed once then was written. Task 1 (another
    agent): both repeats failed, no row. A failure of a task beyond the input is not counted."""
    output = tmp_path / "out.jsonl"
    output.write_text(json.dumps(_row(0, 1, 1.0)) + "\n")
    error = {"class": "GymError", "code": "UNAVAILABLE"}
    keys = [(0, 0, "agent"), (0, 1, "agent"), (0, 0, "agent"), (1, 0, "other"), (1, 1, "other"), (5, 0, "agent")]
    failures_path(output).write_text(
        "".join(json.dumps({"task_index": t, "repeat_index": k, "group": g, "error": error}) + "\n" for t, k, g in keys)
    )
    groups = GroupIndex(2)
    groups.set(0, "agent")
    groups.set(1, "other")
    summary = summarise_file(output, groups, 2)
    assert summary.metrics["agent"]["failed"] == 1 and summary.metrics["agent"]["rollouts"] == 1
    assert summary.metrics["other"] == {"rollouts": 0, "failed": 2}  # every rollout failed: still shown
