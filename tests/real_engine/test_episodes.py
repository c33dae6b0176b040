"""Self-play on the real CPU vLLM: TextArena's TicTacToe as an episode with two roles, both played by
SmolLM2 behind one token-in/token-out model server (configs/vllm.yaml), through `gym-grpc run` +
`collect`.

The two players' turns interleave on one model server and one engine; each role has its own model
session, so each role's every turn must extend that role's own earlier ids (none of the other's), and
the training samples come out one per role. SmolLM2-135M plays badly (mostly invalid moves, which the
game judges) unless vLLM's structured outputs keep its answers in a move's form, as here; these check
the mechanics: whose items are whose, the rewards TextArena gives for the
moves the row records, and the token path per role.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_grpc.engines import local_vllm
from gym_grpc.training import build, read_rollouts
from servers.resources.textarena_duels.tests.test_textarena_duels import tictactoe_rewards
from tests.real_engine.gym_cli import REPO, VLLM, collect, rows, serving, tasks_file

pytestmark = pytest.mark.real_engine

DUELS = REPO / "servers" / "resources" / "textarena_duels"


def test_self_play_on_the_real_engine_keeps_each_roles_ids_its_own_and_samples_per_role(
    engine: local_vllm.Engine, tmp_path: Path
) -> None:
    examples = [json.loads(line) for line in (DUELS / "data" / "example.jsonl").read_text().splitlines()[:2]]
    for row in examples:  # vLLM's structured outputs keep SmolLM2's answer in a move's form ("[4]")
        constraint = {"structured_outputs": {"regex": r"\[[0-8]\]"}}
        row["responses_create_params"]["metadata"] = {"extra_body": json.dumps(constraint)}
    tasks = tasks_file(tmp_path / "duels.jsonl", examples)
    output = tmp_path / "duels_out.jsonl"
    with serving(engine, tmp_path, VLLM, DUELS / "config.yaml") as run:
        done = collect(run, "textarena_duel_agent", tasks, output, "--num-repeats", "2", "max_output_tokens=8")
        assert done.returncode == 0, done.stderr[-3000:] + run.log()[-3000:]
    written = rows(output)
    assert len(written) == 4
    for row in written:
        assert row["stop_reason"] == "episode_over" and row["finished"]
        output_items = row["response"]["output"]
        moves = []
        for role in row["roles"]:
            assert role["model_server"] == "policy_model"
            said = [output_items[i] for i in role["items"] if output_items[i].get("role") == "assistant"]
            assert len(said) == role["model_calls"] and all(item.get("generation_token_ids") for item in said)
            # The role's every turn extends its own earlier prompt and generation: its own model session.
            for earlier, turn in zip(said, said[1:], strict=False):
                sampled = earlier["prompt_token_ids"] + earlier["generation_token_ids"]
                assert turn["prompt_token_ids"][: len(sampled)] == sampled
            moves += [(i, role["name"]) for i in role["items"] if output_items[i].get("role") == "assistant"]
        played = [output_items[i]["content"][0]["text"].strip() for i, _ in sorted(moves)]
        rewards = tictactoe_rewards(row["textarena_seed"], played)
        assert {role["name"]: role["reward"] for role in row["roles"]} == {
            "player_0": rewards[0],
            "player_1": rewards[1],
        }
        assert sum(rewards.values()) == 0
    # One sample per role that moved (a game lost on its first player's invalid moves leaves the other
    # without a turn, and without ids); no role's turns were cut into several samples.
    samples, stats = build(read_rollouts(output))
    moved = [(row["task_index"], row["repeat_index"], role["name"]) for row in written for role in row["roles"]]
    assert stats.non_monotonic_turns == 0
    assert sorted((s.task_index, s.repeat_index, s.role) for s in samples) == sorted(
        key
        for key, row_role in zip(moved, [r for row in written for r in row["roles"]], strict=True)
        if row_role["model_calls"]
    )
    assert stats.without_ids == sum(1 for row in written for role in row["roles"] if not role["model_calls"])
    turns = [role["model_calls"] for row in written for role in row["roles"]]
    print("games:", [(row["moves"], row["reason"]) for row in written], "turns per role:", turns)
