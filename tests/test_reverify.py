"""Deferred verification, re-verification, token throughput and the slowest stage."""

import asyncio
import io
import json

import pytest

from gym_grpc import errors
from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.batch.reverify import ReverifyOptions, _scan, reverify
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.bundled.servers.resources.math.server import MathEnv
from gym_grpc.data import json_input
from gym_grpc.data.jsonl import failures_path, held
from gym_grpc.data.record import KEY, NEMO_KEY
from gym_grpc.resources import ResourcesServer, Session
from gym_grpc.responses import final_text
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import responses_pb2 as r
from tests.support import REPO, nested_json

MATH = REPO / "servers/resources/math/data/example.jsonl"


class Inverted(ResourcesServer):
    """A 'fixed' verifier that disagrees with the math one on every rollout."""

    async def verify(self, session: Session, response: r.Response) -> float:
        return 0.0 if "\\boxed{" + str(session.data["expected_answer"]) + "}" in final_text(response) else 1.0


class SlowVerifier(ResourcesServer):
    # Slower than any other stage can be on a loaded machine: CI ran this beside other
    # work at a load average of 30-50 and the model stage's median passed 50 ms.
    async def verify(self, session: Session, response: r.Response) -> float:
        await asyncio.sleep(1.0)
        return 1.0


async def _math_stack(start, env=None):
    model = await start(LocalPolicyModel(name="policy"))
    env = await start(env or MathEnv(name="math"))
    static = {"policy": model.address, "math": env.address}
    agent = await start(
        SimpleAgent(
            {"model_server": "policy", "resources_server": "math"}, name="agent", registry=Registry(static=static)
        )
    )
    return Registry(static={**static, "agent": agent.address}), agent


def _rows(path):
    return {(row["task_index"], row["repeat_index"]): row for row in map(json.loads, path.read_text().splitlines())}


def _collect_options(tmp_path, name, **kwargs):
    return CollectOptions(
        input=MATH,
        output=tmp_path / name,
        agent="agent",
        num_repeats=3,
        progress=False,
        overrides={"temperature": 0},
        **kwargs,
    )


async def test_skip_verify_then_reverify_gives_the_rewards_of_a_normal_collect(start, tmp_path):
    registry, agent = await _math_stack(start)
    normal = await collect(registry, _collect_options(tmp_path, "normal.jsonl"), log=io.StringIO())
    deferred = await collect(
        registry,
        _collect_options(tmp_path, "deferred.jsonl", skip_verify=True, placeholder_reward=-1.0),
        log=io.StringIO(),
    )
    assert deferred.metrics["agent"]["unverified"] == 18 and "reward" not in deferred.metrics["agent"]
    unverified = _rows(tmp_path / "deferred.jsonl")
    assert all(row["verification_skipped"] and row["reward"] == -1.0 for row in unverified.values())
    assert all(row["timings"]["verify"] == 0.0 for row in unverified.values())
    options = ReverifyOptions(
        input=tmp_path / "deferred.jsonl", output=tmp_path / "scored.jsonl", resources="math", progress=False
    )
    summary, changes = await reverify(registry, options, log=io.StringIO())
    assert (summary.done, summary.failed) == (18, 0)
    assert changes.compared == 0  # nothing had a verified reward before
    before, after = _rows(tmp_path / "normal.jsonl"), _rows(tmp_path / "scored.jsonl")
    assert before.keys() == after.keys()
    for key in before:
        assert after[key]["reward"] == before[key]["reward"]
        assert after[key]["extracted_answer"] == before[key]["extracted_answer"]
        same = [(i["type"], i.get("content"), i.get("generation_token_ids")) for i in after[key]["response"]["output"]]
        assert same == [
            (i["type"], i.get("content"), i.get("generation_token_ids")) for i in before[key]["response"]["output"]
        ]  # the policy was deterministic
        assert "verification_skipped" not in after[key]
    assert summary.metrics["agent"]["reward"] == normal.metrics["agent"]["reward"]
    assert summary.metrics["agent"]["pass@3"] == normal.metrics["agent"]["pass@3"]
    await registry.close()


async def test_reverify_after_a_verifier_change_reports_the_changed_rewards(start, tmp_path):
    registry, _ = await _math_stack(start)
    await collect(registry, _collect_options(tmp_path, "old.jsonl"), log=io.StringIO())
    fixed = await start(Inverted(name="fixed"))
    registry = Registry(static={"fixed": fixed.address})
    options = ReverifyOptions(
        input=tmp_path / "old.jsonl", output=tmp_path / "new.jsonl", resources="fixed", progress=False
    )
    summary, changes = await reverify(registry, options, log=io.StringIO())
    old, new = _rows(tmp_path / "old.jsonl"), _rows(tmp_path / "new.jsonl")
    assert changes.compared == 18 and changes.changed == 18
    assert changes.before == sum(row["reward"] for row in old.values())
    assert changes.after == sum(row["reward"] for row in new.values()) == 18 - changes.before
    assert "18 of 18 rewards changed" in changes.line()
    assert all("extracted_answer" not in row for row in new.values())  # the old verifier's fields are gone
    assert all(row["verifier_fields"] == [] for row in new.values())
    await registry.close()


async def test_reverify_resumes_and_reports_rows_that_are_not_rollouts(start, tmp_path):
    registry, _ = await _math_stack(start)
    await collect(registry, _collect_options(tmp_path, "old.jsonl"), log=io.StringIO())
    lines = (tmp_path / "old.jsonl").read_text().splitlines()
    (tmp_path / "old.jsonl").write_text("\n".join([*lines, '{"no": "response"}']) + "\n")
    options = ReverifyOptions(
        input=tmp_path / "old.jsonl", output=tmp_path / "new.jsonl", resources="math", progress=False
    )
    first, _ = await reverify(registry, options, log=(log := io.StringIO()))
    assert (first.done, first.bad_rows) == (18, 1) and "response: is required" in log.getvalue()
    again, _ = await reverify(registry, options, log=io.StringIO())
    assert (again.done, again.skipped) == (0, 18)
    await registry.close()


async def test_token_counts_in_the_summary_are_the_sum_of_the_rows_usage(start, tmp_path):
    registry, _ = await _math_stack(start)
    summary = await collect(registry, _collect_options(tmp_path, "out.jsonl"), log=io.StringIO())
    rows = _rows(tmp_path / "out.jsonl").values()
    assert summary.run.input_tokens == sum(row["response"]["usage"]["input_tokens"] for row in rows) > 0
    assert summary.run.output_tokens == sum(row["response"]["usage"]["output_tokens"] for row in rows) > 0
    lines = summary.run.lines(summary.seconds, 1000)
    assert "rollouts/s; tokens/s:" in lines[0] and f"({summary.run.input_tokens:,} + " in lines[0]
    assert lines[-1].startswith("at this rate 1,000 more rollouts take")
    await registry.close()


async def test_a_slow_verifier_is_named_the_slowest_stage(start, tmp_path):
    registry, _ = await _math_stack(start, SlowVerifier(name="math"))
    summary = await collect(registry, _collect_options(tmp_path, "out.jsonl"), log=io.StringIO())
    stage, median, p95 = summary.run.slowest_stage()
    assert stage == "verify" and 1.0 <= median <= p95
    assert any(line.startswith("slowest stage: verify (median") for line in summary.run.lines(summary.seconds, 0))
    await registry.close()


async def test_rows_keep_their_keys_a_row_without_one_gets_a_free_slot_and_a_wild_key_is_refused(start, tmp_path):
    registry, _ = await _math_stack(start)
    await collect(registry, _collect_options(tmp_path, "old.jsonl"), log=io.StringIO())
    old = [json.loads(line) for line in (tmp_path / "old.jsonl").read_text().splitlines()]
    assert _scan(tmp_path / "old.jsonl").n_tasks == 6  # 6 tasks x 3 repeats: slots for 18, not 18 x 3
    for row in old[:2]:
        for name in (*KEY, *NEMO_KEY):
            del row[name]
    old[2]["task_index"] = 10**12  # hand-edited: must not size anything
    (tmp_path / "old.jsonl").write_text("".join(json.dumps(row) + "\n" for row in old))
    options = ReverifyOptions(
        input=tmp_path / "old.jsonl", output=tmp_path / "new.jsonl", resources="math", progress=False
    )
    summary, _ = await reverify(registry, options, log=(log := io.StringIO()))
    assert (summary.done, summary.bad_rows) == (17, 1) and "task_index: the key is not" in log.getvalue()
    new = _rows(tmp_path / "new.jsonl")
    assert len(new) == 17  # no two rows share a key
    assert {(6, 0), (7, 0)} <= new.keys()  # the keyless rows, after the 6 keyed tasks
    await registry.close()


async def test_rows_nested_too_deep_are_reported_by_line_and_the_rest_re_verified(start, tmp_path):
    registry, _ = await _math_stack(start)
    await collect(registry, _collect_options(tmp_path, "old.jsonl"), log=io.StringIO())
    first, *rest = (tmp_path / "old.jsonl").read_text().splitlines()
    overflow = '{"response": {}, "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    too_deep = json.dumps({**json.loads(first), "deep": json.loads(nested_json(300))})  # keeps its key
    keyless = json.dumps({k: v for k, v in json.loads(first).items() if k not in (*KEY, *NEMO_KEY)})
    (tmp_path / "old.jsonl").write_text("".join(line + "\n" for line in [*rest, overflow, too_deep, keyless]))
    options = ReverifyOptions(
        input=tmp_path / "old.jsonl", output=tmp_path / "new.jsonl", resources="math", progress=False
    )
    summary, _ = await reverify(registry, options, log=(log := io.StringIO()))
    assert (summary.done, summary.failed, summary.bad_rows) == (18, 0, 2)
    # The terminal tells the first bad row at once; the sidecar has every one.
    assert f"old.jsonl:18: nested deeper than {json_input.MAX_DEPTH} levels" in log.getvalue()
    sidecar = [json.loads(line) for line in failures_path(tmp_path / "new.jsonl").read_text().splitlines()]
    assert sorted(f["line"] for f in sidecar) == [18, 19]
    assert len(_rows(tmp_path / "new.jsonl")) == 18  # the 17 keyed rows and the keyless one, each in its own slot
    await registry.close()


async def test_a_reverify_into_an_output_another_run_is_writing_stops_before_it_scores_anything(tmp_path):
    """Two at once would each write every row the output lacks. No server is needed: nothing is asked."""
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(json.dumps({"task_index": 0, "repeat_index": 0, "responses_create_params": {}}) + "\n")
    out = tmp_path / "scored.jsonl"
    options = ReverifyOptions(input=rollouts, output=out, resources="math", progress=False)
    with held(out):
        with pytest.raises(errors.OutputInUse, match=f"another run is writing {out}"):
            await reverify(Registry(static={}), options, log=io.StringIO())
    assert out.read_bytes() == b""
