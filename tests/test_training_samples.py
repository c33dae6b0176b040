"""Training samples from real rollouts: the embedded policy (real token ids from its byte-level tokenizer
and template) through the simple agent and real environments, in this process.

The policy's multi-turn tool rollouts extend their ids turn by turn, so each is one sample whose
generated ids and log-probs are exactly the turns'. A policy that fails every other call shows failed
rollouts as masked group members, never reward-0 samples."""

import io
import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from gym_grpc import training
from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.bundled.servers.resources.math.server import MathEnv
from gym_grpc.bundled.servers.resources.multi_step.server import CustomerSupportEnv
from gym_grpc.cli.app import main
from gym_grpc.client import GymClient, TokenTurn
from gym_grpc.rpc.registry import Registry
from gym_grpc.training import TrainingRollout
from tests.support import REPO

MULTI_STEP = REPO / "servers/resources/multi_step/data/example.jsonl"
MATH = REPO / "servers/resources/math/data/example.jsonl"


class EveryOtherCallFails(LocalPolicyModel):
    """The embedded policy, whose 2nd, 4th, ... model calls fail (a flaky engine)."""

    calls = 0

    async def create_response(self, params, session_id):
        self.calls += 1
        if self.calls % 2 == 0:
            raise RuntimeError("the engine dropped the request")
        return await super().create_response(params, session_id)


async def _stack(start, env, model=None, max_steps=None) -> Registry:
    policy = await start(model or LocalPolicyModel(name="policy"))
    env = await start(env)
    static = {"policy": policy.address, "env": env.address}
    config = {"model_server": "policy", "resources_server": "env"}
    if max_steps:
        config["max_steps"] = max_steps
    agent = await start(SimpleAgent(config, name="agent", registry=Registry(static=static)))
    return Registry(static={**static, "agent": agent.address})


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_a_multi_turn_tool_rollout_is_one_sample_whose_mask_covers_exactly_the_generated_ids(start, tmp_path):
    registry = await _stack(start, CustomerSupportEnv(name="env"), max_steps=8)
    output = tmp_path / "rollouts.jsonl"
    options = CollectOptions(input=MULTI_STEP, output=output, agent="agent", num_repeats=2, progress=False)
    await collect(registry, options, log=io.StringIO())
    await registry.close()
    rows = _rows(output)
    rollouts = [TrainingRollout.from_row(row) for row in rows]
    assert max(len(rollout.turns) for rollout in rollouts) >= 2  # a tool was called, then the model again
    samples, stats = training.build(rollouts)
    assert stats.non_monotonic_turns == 0 and stats.samples == len(rows) == len(samples)
    for rollout, sample in zip(rollouts, samples, strict=True):
        turns = rollout.turns
        last = turns[-1]
        # The whole sequence is what the last call saw, then what it generated.
        assert sample.prompt_ids + sample.response_ids == last.prompt_token_ids + last.generation_token_ids
        assert sample.prompt_ids == turns[0].prompt_token_ids
        generated = [i for i, m in zip(sample.response_ids, sample.response_mask, strict=True) if m]
        assert generated == [i for turn in turns for i in turn.generation_token_ids]
        probs = [p for p, m in zip(sample.response_log_probs, sample.response_mask, strict=True) if m]
        assert probs == [p for turn in turns for p in turn.generation_log_probs]
        assert all(p == 0.0 for p, m in zip(sample.response_log_probs, sample.response_mask, strict=True) if not m)
        assert sample.num_turns == len(turns) and sample.reward == rollout.reward
    # Between two generations, the ids of the tool's output (as the template wrapped it) are not trained on.
    assert any(0 in sample.response_mask for sample in samples)


def test_a_history_that_does_not_extend_its_ids_splits_or_is_refused():
    turns = [
        TokenTurn([1, 2, 3], [4, 5], [-0.1, -0.2]),
        TokenTurn([1, 2, 3, 4, 5, 6, 7], [8], [-0.3]),  # extends: 6, 7 came between
        TokenTurn([1, 2, 9, 9], [10], [-0.4]),  # an edited history: parts at position 2
    ]
    rollout = TrainingRollout("agent", 0, 0, 1.0, turns)
    [first, second], stats = training.build([rollout])
    assert stats.non_monotonic_turns == 1
    assert (first.prompt_ids, first.response_ids, first.response_mask) == ([1, 2, 3], [4, 5, 6, 7, 8], [1, 1, 0, 0, 1])
    assert first.response_log_probs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert (second.part, second.prompt_ids, second.response_ids, second.response_mask) == (1, [1, 2, 9, 9], [10], [1])
    assert first.reward == second.reward == 1.0
    with pytest.raises(training.NonMonotonic, match="turn 2's prompt .* part at position 2 of 8"):
        training.build([rollout], non_monotonic="refuse")


async def test_failed_rollouts_of_a_group_are_masked_members_never_reward_zero_samples(start):
    registry = await _stack(start, MathEnv(name="env"), model=EveryOtherCallFails(name="policy"))
    task = _rows(MATH)[0]
    async with GymClient("agent", registry) as gym:
        results = await gym.run_group(task, 4)
    assert sum(not result.ok for result in results) == 2  # single-turn: one model call per rollout
    rollouts = [TrainingRollout.from_result(result, "agent", 0, k) for k, result in enumerate(results)]
    samples, stats = training.build(rollouts)
    [group] = training.assign_advantages(samples)
    assert (stats.failed, group.rollouts, group.failed) == (2, 4, 2)
    for result, sample in zip(results, samples, strict=True):
        if result.ok:
            assert sample.loss_multiplier == 1.0 and sample.reward == result.reward and sample.response_ids
        else:
            assert sample.loss_multiplier == 0.0 and sample.reward is None and sample.advantage == 0.0
            assert not sample.response_ids and "INTERNAL" in sample.failure and "RuntimeError" in sample.failure
    finished = [s.reward for s in samples if s.reward is not None]
    assert group.mean == pytest.approx(sum(finished) / 2)


async def test_the_samples_command_writes_verl_and_nemo_rl_layouts_with_the_failures_sidecars_rollouts(start, tmp_path):
    registry = await _stack(start, MathEnv(name="env"), model=EveryOtherCallFails(name="policy"))
    output = tmp_path / "rollouts.jsonl"
    options = CollectOptions(input=MATH, output=output, agent="agent", num_repeats=4, max_in_flight=1, progress=False)
    summary = await collect(registry, options, log=io.StringIO())
    await registry.close()
    assert (summary.done, summary.failed) == (12, 12)
    runner = CliRunner()
    verl = runner.invoke(main, ["samples", str(output), "--output", str(tmp_path / "verl.parquet")])
    assert verl.exit_code == 0, verl.output
    assert "24 rollouts -> 24 samples (12 failed rollouts masked" in verl.output
    table = pq.read_table(tmp_path / "verl.parquet").to_pylist()
    assert len(table) == 24 and sum(row["loss_multiplier"] == 0 for row in table) == 12
    for row in table:
        assert len(row["response_ids"]) == len(row["response_mask"]) == len(row["response_logprobs"])
        assert row["uid"] == f"agent/{row['task_index']}"
        if row["loss_multiplier"]:
            assert row["reward_score"] in (0.0, 1.0) and sum(row["response_mask"]) == len(row["response_ids"])
        else:
            assert row["reward_score"] is None and row["failure"].startswith("GymError (INTERNAL)")
    nemo = runner.invoke(
        main, ["samples", str(output), "--output", str(tmp_path / "nemo.jsonl"), "--layout", "nemo-rl"]
    )
    assert nemo.exit_code == 0, nemo.output
    nemo_rows = _rows(tmp_path / "nemo.jsonl")
    by_key = {(row["task_index"], row["repeat_index"]): row for row in table}
    for row in nemo_rows:
        if not row["loss_multiplier"]:
            assert row["message_log"] == []
            continue
        user, assistant = row["message_log"]
        verl_row = by_key[(row["idx"], row["repeat_index"])]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert user["token_ids"] == verl_row["prompt_ids"] and assistant["token_ids"] == verl_row["response_ids"]
        assert assistant["generation_logprobs"] == verl_row["response_logprobs"]
    bad = runner.invoke(main, ["samples", str(output), "--output", str(tmp_path / "x.jsonl"), "--layout", "verl2"])
    assert bad.exit_code == 2 and "'verl'" in bad.output


def test_turns_whose_ids_and_log_probs_disagree_name_the_rollout_and_turn():
    rollout = TrainingRollout("agent", 3, 1, 1.0, [TokenTurn([1], [2, 3], [-0.1])])
    with pytest.raises(ValueError, match=r"rollout \('agent', 3, 1\): turn 0 has 2 generated ids but 1 log-probs"):
        training.build([rollout])
