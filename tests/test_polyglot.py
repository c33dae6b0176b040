"""Callers that are not Python: the Node.js client and the grpcurl recipes, against a live run."""

import json
import os
import re
import shutil
import subprocess

import pytest

from gym_grpc.rpc import protocol
from tests.support import BIN, QUICKSTART, REPO, start_run

NODE_CLIENT = REPO / "clients" / "node"
RECIPES = REPO / "clients" / "grpcurl"
MATH_TASKS = REPO / "configs" / "math_tasks.yaml"


@pytest.fixture(scope="module")
def live():
    """The quickstart with a task server over math's tasks, with room to draw until groups carry signal."""
    run = start_run("servers.math_tasks.config.max_draws_per_group=20", configs=(QUICKSTART, MATH_TASKS))
    yield run
    run.stop()


def test_the_node_client_runs_a_rollout_and_verifies_it(live):
    node = shutil.which("node")
    assert node, "Node.js is needed for the polyglot test"
    assert (NODE_CLIENT / "node_modules" / "@grpc" / "grpc-js").exists(), "run: npm ci --prefix clients/node"
    done = subprocess.run(
        [node, str(NODE_CLIENT / "rollout.js"), live.registry, "math_agent", "What is 6 times 7?", "42"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["protocol"] == "{}.{}".format(*protocol.VERSION)
    assert result["reward"] == 1 and result["reverified_reward"] == 1
    assert result["stop_reason"] == "STOP_REASON_FINAL_MESSAGE" and result["turns_with_token_ids"] == 1
    missing = subprocess.run(
        [node, str(NODE_CLIENT / "rollout.js"), live.registry, "nobody", "x", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr and "did you mean" in missing.stderr


def _recipe(name: str, *args: str) -> str:
    env = {**os.environ, "GRPCURL": str(BIN / "grpcurl")}
    done = subprocess.run(["bash", str(RECIPES / name), *args], capture_output=True, text=True, timeout=90, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_grpcurl_recipes_work_against_live_servers(live):
    servers = {s["name"]: s for s in json.loads(_recipe("servers.sh", live.registry))["servers"]}
    assert set(servers) == {"policy_model", "weather", "weather_agent", "math", "math_agent", "math_tasks"}
    math = servers["math"]["addresses"][0]
    assert "gym.v1.ResourcesService" in _recipe("list.sh", math).split()
    assert "rpc Verify" in _recipe("describe.sh", math)
    assert "message Task" in _recipe("describe.sh", math, "gym.v1.Task")
    right = json.loads(_recipe("verify.sh", math, "7/8", "So it is \\\\boxed{0.875}."))
    assert right["reward"] == 1
    wrong = json.loads(_recipe("verify.sh", math, "7/8", "It is \\\\boxed{3}."))
    assert wrong.get("reward", 0) == 0
    rollout = json.loads(_recipe("rollout.sh", servers["math_agent"]["addresses"][0], "What is 12 + 30?", "42"))
    assert rollout["rollout"]["reward"] == 1
    # Two runs over one RunMany call: grpcurl prints each reply (results as they finish) as it comes.
    many = _recipe("many.sh", servers["math_agent"]["addresses"][0], "What is 12 + 30?", "42", "What is 2 + 2?", "5")
    results = {result["id"]: result for reply in _json_values(many) for result in reply["results"]}
    assert sorted(results) == ["1", "2"]
    assert results["1"]["rollout"]["reward"] == 1 and "reward" not in results["2"]["rollout"]  # 0 is left out
    *groups, summary = _json_values(_recipe("batch.sh", servers["math_tasks"]["addresses"][0], "2", "4"))
    assert len(groups) == summary["summary"]["groups"] == 2
    assert all(len(g["group"]["members"]) == 4 and g["group"]["has_signal"] for g in groups)


def _json_values(text: str) -> list:
    """The JSON values written one after another in `text` (grpcurl's output of a stream)."""
    decoder, values, at = json.JSONDecoder(), [], _SPACE.match(text).end()
    while at < len(text):
        value, end = decoder.raw_decode(text, at)
        values.append(value)
        at = _SPACE.match(text, end).end()
    return values


_SPACE = re.compile(r"\s*")


WEATHER = REPO / "servers" / "resources" / "weather" / "data" / "example.jsonl"


def _steps(done: subprocess.CompletedProcess) -> list[dict]:
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def _centred(advantages: list[list[float]]) -> bool:
    """Each group's advantages sum to 0 (to rounding): rewards less the group's mean."""
    return all(abs(sum(group)) < 1e-2 for group in advantages)


def test_the_training_loop_examples_in_python_and_node_train_on_groups_under_moving_versions(live):
    """docs/training.md's loops, as a user runs them: two steps of three groups of three rollouts, with a
    weight update between (SetPolicyVersion), so the second step's turns carry version 1."""
    args = [live.registry, "weather_agent", "policy_model", str(WEATHER)]
    node = _steps(
        subprocess.run(
            [shutil.which("node"), str(NODE_CLIENT / "training_loop.js"), *args, "3", "2", "3"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    )
    assert [(s["step"], s["policy_version"], s["versions_seen"], s["rollouts"]) for s in node] == [
        (0, 0, [0], 9),
        (1, 1, [1], 9),
    ]
    assert all(s["trained_tokens"] > 0 and _centred(s["advantages"]) for s in node)
    python = _steps(
        subprocess.run(
            [
                str(BIN / "python"),
                str(REPO / "examples" / "training_loop.py"),
                "--registry",
                live.registry,
                "--agent",
                "weather_agent",
                "--tasks",
                str(WEATHER),
                "--limit",
                "3",
                "--group-size",
                "3",
                "--steps",
                "2",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=120,
        )
    )
    assert [(s["step"], s["policy_version"], s["versions_seen"], s["samples"]) for s in python] == [
        (0, 0, [0], 9),
        (1, 1, [1], 9),
    ]
    assert all(s["trained_tokens"] > 0 and _centred(s["advantages"]) for s in python)


def test_the_task_server_serves_groups_with_signal_to_node_and_to_the_python_training_loop(live):
    """docs/task-service.md's clients: Node.js over the .proto files, and examples/training_loop.py over
    GymClient.next_batch; two steps of two groups, each step under its own policy version."""
    done = subprocess.run(
        [shutil.which("node"), str(NODE_CLIENT / "task_batches.js"), live.registry, "math_tasks", "2", "4", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    *steps, pools = [json.loads(line) for line in done.stdout.splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    for step in steps:
        assert len(step["groups"]) == 2 and not step["short_reason"]
        assert step["rollouts_run"] == 4 * step["groups_tried"]
        for group in step["groups"]:
            assert len(set(group["rewards"])) == 2 and group["policy_versions"] == [step["step"]]
            assert group["dataset"] in ("example", "train") and group["pool"] in (
                "TASK_POOL_EASY",
                "TASK_POOL_LEARNING",
                "TASK_POOL_HARD",
            )
        assert _centred([g["advantages"] for g in step["groups"]])
    assert pools["total"] == 70 and pools["easy"] + pools["learning"] + pools["hard"] == 70
    python = _steps(
        subprocess.run(
            [
                str(BIN / "python"),
                str(REPO / "examples" / "training_loop.py"),
                "--registry",
                live.registry,
                "--agent",
                "math_agent",
                "--task-server",
                "math_tasks",
                "--limit",
                "2",
                "--group-size",
                "4",
                "--steps",
                "2",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=120,
        )
    )
    assert [(s["step"], s["versions_seen"], s["samples"], s["groups_with_signal"]) for s in python] == [
        (0, [0], 8, 2),
        (1, [1], 8, 2),
    ]
    assert all(s["rollouts_run"] == 4 * s["groups_tried"] and _centred(s["advantages"]) for s in python)
