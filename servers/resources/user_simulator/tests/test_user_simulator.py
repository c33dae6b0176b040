"""The support desk with a simulated user: a second model plays the customer, turn about with the
assistant; the conversation ends when the user says so or after max_rounds; each role is rewarded."""

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from gym_grpc import errors
from gym_grpc.bundled.servers.resources.user_simulator.server import SupportDeskEnv
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message
from gym_grpc.testing import static_registry
from gym_grpc.testing.fake_engine import FakeEngine, Turn
from gym_grpc.training import build, read_rollouts
from gym_grpc.v1 import responses_pb2 as r
from tests.support import REPO, collect_args, gym, one_server_config, start_run

HERE = Path(__file__).resolve().parent.parent
CONFIG = HERE / "config.yaml"
EXAMPLES = HERE / "data" / "example.jsonl"
ROWS = [json.loads(line) for line in EXAMPLES.read_text().splitlines()]


def _said(text: str) -> r.Response:
    return r.Response(output=[assistant_message(text)])


@pytest.fixture
async def desk(start):
    server = await start(SupportDeskEnv({"max_rounds": 2}, name="desk"))
    client = ResourcesClient(static_registry(desk=server), "desk")
    yield client
    await client.registry.close()


async def test_the_users_first_message_opens_and_the_user_ends_the_conversation_with_the_stop_phrase(desk):
    task = rows.task_from_row(ROWS[0])
    episode = await desk.seed_session("s", task)
    user, assistant = episode.roles
    assert (user.name, user.without_tools, assistant.name, assistant.without_tools) == (
        "user",
        True,
        "assistant",
        False,
    )
    assert [i.WhichOneof("item") for i in user.opening] == ["message", "message"]  # instructions, its own words
    assert episode.turn.role == "assistant" and "A1042" in episode.turn.input[0].message.text
    turn = await desk.end_turn("s", "assistant", _said("It was shipped on Monday and arrives Thursday."))
    assert turn.role == "user" and "arrives Thursday" in turn.input[0].message.text
    assert await desk.end_turn("s", "user", _said("Thank you! ###STOP###")) is None
    verdict = await desk.verify("s", task, r.Response())
    assert dict(verdict.role_rewards) == {"assistant": 1.0, "user": 1.0} and verdict.reward == 1.0
    assert json.loads(verdict.fields_json) == {"rounds": 1, "user_ended": True, "told": True}


async def test_without_a_first_message_the_user_speaks_first_and_max_rounds_ends_the_episode(desk):
    task = rows.task_from_row(ROWS[2])
    episode = await desk.seed_session("s", task)
    assert episode.turn.role == "user"
    turn = await desk.end_turn("s", "user", _said("When does D58 come?"))
    turn = await desk.end_turn("s", turn.role, _said("Let me see."))
    turn = await desk.end_turn("s", turn.role, _said("Well?"))
    assert await desk.end_turn("s", turn.role, _said("I do not know.")) is None  # the second answer: max_rounds 2
    verdict = await desk.verify("s", task, r.Response())
    assert dict(verdict.role_rewards) == {"assistant": 0.0, "user": 0.0}


async def test_a_row_without_user_instructions_cannot_seed_naming_the_key(desk):
    row = {k: v for k, v in ROWS[0].items() if k != "user_instructions"}
    with pytest.raises(errors.GymError) as caught:
        await desk.seed_session("s", rows.task_from_row(row))
    assert caught.value.reason == errors.Reason.TASK_DATA_INVALID and "user_instructions" in caught.value.message


def test_the_config_serves_the_desk_with_the_episode_agent():
    servers = yaml.safe_load(CONFIG.read_text())["servers"]
    assert servers["support_desk_agent"]["entrypoint"].endswith("episode_agent/agent.py:EpisodeAgent")
    SupportDeskEnv(servers["support_desk"]["config"], name="support_desk")


# --- a user's run: gym-grpc run + collect, the user played by a second model server -----------------


def _customer(body: dict) -> Turn:
    """A scripted customer behind the user's model server: thanks and stops once the assistant's words
    (shown to it as a user message) say when the order arrives, else asks about the order its
    instructions name."""
    assert not body.get("tools"), "the simulated user must be offered no tools"
    assert body["input"][0]["role"] == "system"  # its instructions open its conversation
    shown = [item for item in body["input"] if item.get("role") == "user"]
    if shown and "arrives" in str(shown[-1]["content"]):
        return Turn(content="Great, thank you! ###STOP###")
    order = next(word for word in str(body["input"][0]["content"]).split() if word[0].isupper() and word[-1].isdigit())
    return Turn(content=f"Hello, can you tell me when my order {order} arrives?")


@pytest.mark.slow
async def test_collect_with_the_user_on_its_own_model_server_rewards_each_role(tmp_path):
    engine = FakeEngine(_customer)
    base_url = await engine.start()
    user_model = one_server_config(
        tmp_path,
        "user_model",
        "servers/models/openai_model/server.py:OpenAIModel",
        {"base_url": base_url, "api_key": "none", "model": "customer"},
    )
    output = tmp_path / "rollouts.jsonl"
    try:
        with start_run(
            "servers.support_desk_agent.config.role_model_servers={user: user_model}",
            "servers.policy_model.config.error_rate=0",  # no slips: every order is looked up right the first time
            configs=(REPO / "configs" / "local_policy.yaml", user_model, CONFIG),
        ) as run:
            args = [*collect_args(run.registry, "support_desk_agent", EXAMPLES, output), "--num-repeats", "2"]
            collected = await asyncio.to_thread(gym, *args)
            assert collected.returncode == 0, collected.stderr
    finally:
        await engine.stop()
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(written) == 6
    for row in written:
        roles = {role["name"]: role for role in row["roles"]}
        assert roles["user"]["model_server"] == "user_model" and roles["assistant"]["model_server"] == "policy_model"
        # The embedded policy looked the order up and told it; the customer then ended the conversation.
        assert row["told"] and row["user_ended"] and row["rounds"] == 1 and row["stop_reason"] == "episode_over"
        assert roles["assistant"]["reward"] == 1.0 and roles["user"]["reward"] == 1.0
        output_items = row["response"]["output"]
        assistant_kinds = [output_items[i]["type"] for i in roles["assistant"]["items"]]
        assert assistant_kinds == ["message", "function_call", "function_call_output", "message"]
        spoke_first = roles["user"]["model_calls"] == 2  # no first message in the row: the user wrote one
        assert spoke_first == ("user_first_message" not in row)
    samples, _ = build(read_rollouts(output))
    assert {sample.role for sample in samples} == {"assistant"}  # the customer's engine sends no token ids
    assert all(sample.reward == 1.0 and sample.num_turns == 2 for sample in samples)
