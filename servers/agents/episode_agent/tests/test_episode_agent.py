"""The episode agent: several roles, each with its own conversation and model server, taking the turns
the environment gives them, a tool loop within a turn, and a reward per role."""

import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.agents.episode_agent.agent import EpisodeAgent
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.client.stubs import AgentClient
from gym_grpc.client.training import RolloutResult
from gym_grpc.data import record, rows
from gym_grpc.resources import Episode, ResourcesServer, Role, Session, Turn, Verification, tool, user_message
from gym_grpc.responses import final_text, message_text
from gym_grpc.testing import Calculator, ScriptedModel, call, say, static_registry
from gym_grpc.training import SampleStats, TrainingRollout, samples_of
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

QUESTION = "What is the capital of France?"


class Interview(ResourcesServer):
    """Two roles: the asker (an opening of its own) asks once, the answerer (the task's input) may look
    things up with a tool and answers; then the episode is over."""

    async def seed_session(self, session: Session) -> Episode:
        session.state["said"] = []
        asker = Role("asker", opening=[user_message("You ask one question about geography.")])
        return Episode([asker, Role("answerer")], Turn("asker", "Ask your question."))

    async def end_turn(self, session: Session, role: str, response: r.Response) -> Turn | None:
        session.state["said"].append((role, final_text(response)))
        return Turn("answerer", final_text(response)) if role == "asker" else None

    @tool
    async def lookup(self, q: str) -> str:
        """Look a country up."""
        return "France: capital Paris."

    async def verify(self, session: Session, response: r.Response) -> Verification:
        answer = dict(session.state.get("said", []))
        right = "Paris" in answer.get("answerer", "")
        return Verification(reward=float(right), role_rewards={"answerer": float(right), "asker": 0.5})


def _task() -> task_pb2.Task:
    return rows.task_from_row({"responses_create_params": {"input": "You answer questions."}})


async def _episode(start, env, models: dict, **config):
    servers = {name: await start(model) for name, model in models.items()}
    env_server = await start(env)
    settings = {"model_server": "answerer_model", "resources_server": "env", **config}
    agent = EpisodeAgent(settings, name="agent", registry=static_registry(env=env_server, **servers))
    a = await start(agent)
    client = AgentClient(static_registry(agent=a), "agent")
    try:
        return await client.run(_task(), timeout=30)
    finally:
        await client.registry.close()


def _texts(params: r.CreateParams) -> list[str]:
    return [message_text(i.message) for i in params.input_items.items if i.HasField("message")]


async def test_each_role_plays_its_turns_on_its_own_model_and_conversation_and_gets_its_reward(start):
    asker = ScriptedModel([say(QUESTION)], name="asker_model")
    answerer = ScriptedModel([[call("lookup", '{"q": "France"}')], say("Paris.")], name="answerer_model")
    env = Interview(name="env")
    rollout = await _episode(
        start, env, {"asker_model": asker, "answerer_model": answerer}, role_model_servers={"asker": "asker_model"}
    )
    assert rollout.stop_reason == task_pb2.STOP_REASON_EPISODE_OVER and rollout.model_calls == 3
    assert rollout.reward == 1.0
    roles = {role.name: role for role in rollout.roles}
    assert [role.name for role in rollout.roles] == ["asker", "answerer"]
    assert (roles["asker"].model_server, roles["asker"].reward, roles["asker"].model_calls) == ("asker_model", 0.5, 1)
    assert (roles["answerer"].model_server, roles["answerer"].reward, roles["answerer"].model_calls) == (
        "answerer_model",
        1.0,
        2,
    )
    # Each role saw its own conversation: its opening (or the task's input), what it was shown, its turns.
    assert _texts(asker.requests[0]) == ["You ask one question about geography.", "Ask your question."]
    assert _texts(answerer.requests[0]) == ["You answer questions.", QUESTION]
    assert [i.WhichOneof("item") for i in answerer.requests[1].input_items.items][-2:] == [
        "function_call",
        "function_call_output",
    ]
    assert not any("lookup" in str(p) for p in asker.requests)  # the answerer's tool call is not the asker's
    # The rollout's output holds every item once, in order, and each role names its own.
    output = rollout.response.output
    assert sorted([*roles["asker"].items, *roles["answerer"].items]) == list(range(len(output)))
    kinds = [output[i].WhichOneof("item") for i in roles["answerer"].items]
    assert kinds == ["message", "function_call", "function_call_output", "message"]
    assert message_text(output[roles["answerer"].items[-1]].message) == "Paris."
    assert env.sessions == {}  # closed
    row = record.build({"responses_create_params": {"input": "You answer questions."}}, rollout)
    assert [(x["name"], x["reward"], x["items"]) for x in row["roles"]] == [
        ("asker", 0.5, list(roles["asker"].items)),
        ("answerer", 1.0, list(roles["answerer"].items)),
    ]
    assert [t.role for t in TrainingRollout.per_role(row)] == ["asker", "answerer"]


async def test_the_episode_ends_at_max_steps_and_is_verified_as_it_stands(start):
    answerer = ScriptedModel([[call("lookup", '{"q": "France"}')]], name="answerer_model")  # never answers
    rollout = await _episode(start, Interview(name="env"), {"answerer_model": answerer}, max_steps=3)
    assert rollout.stop_reason == task_pb2.STOP_REASON_MAX_STEPS and rollout.model_calls == 3
    assert {role.name: role.reward for role in rollout.roles} == {"asker": 0.5, "answerer": 0.0}


class _AskedLimits(LocalPolicyModel):
    """The local policy, recording the max_output_tokens of each call (None: not set)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[int | None] = []

    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        self.asked.append(params.max_output_tokens if params.HasField("max_output_tokens") else None)
        return await super().create_response(params, session_id)


async def test_each_roles_trajectory_has_its_own_token_budget(start):
    """The local policy writes 34 tokens for each role's one turn. A budget of 34 per role fits both (each
    call capped at 34, the episode plays out); 33 cuts the asker's turn and ends the episode, verified."""
    policy = _AskedLimits({"error_rate": 0.0}, name="answerer_model")
    rollout = await _episode(start, Interview(name="env"), {"answerer_model": policy}, max_rollout_tokens=34)
    assert rollout.stop_reason == task_pb2.STOP_REASON_EPISODE_OVER and policy.asked == [34, 34]
    assert rollout.response.usage.output_tokens == 68

    policy = _AskedLimits({"error_rate": 0.0}, name="answerer_model")
    rollout = await _episode(start, Interview(name="env"), {"answerer_model": policy}, max_rollout_tokens=33)
    assert rollout.stop_reason == task_pb2.STOP_REASON_TOKEN_BUDGET and policy.asked == [33]
    assert rollout.response.incomplete_details.reason == r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS
    assert [(role.name, role.model_calls, role.reward) for role in rollout.roles] == [
        ("asker", 1, 0.5),
        ("answerer", 0, 0.0),
    ]
    assert record.build({}, rollout)["stop_reason"] == "token_budget"


async def test_a_turn_that_keeps_calling_tools_ends_after_max_steps_per_turn(start):
    asker = ScriptedModel([[call("lookup", '{"q": "x"}')]], name="answerer_model")  # plays both, never answers
    rollout = await _episode(start, Interview(name="env"), {"answerer_model": asker}, max_steps_per_turn=2)
    # Each role's turn ended after two calls; the environment then ended the episode.
    assert rollout.stop_reason == task_pb2.STOP_REASON_EPISODE_OVER
    assert [role.model_calls for role in rollout.roles] == [2, 2]


async def test_a_role_model_server_for_a_role_the_episode_lacks_fails_the_rollout_naming_it(start):
    answerer = ScriptedModel([say("Paris.")], name="answerer_model")
    with pytest.raises(errors.GymError) as caught:
        await _episode(
            start, Interview(name="env"), {"answerer_model": answerer}, role_model_servers={"judge": "answerer_model"}
        )
    assert caught.value.reason == errors.Reason.EPISODE_TURN_INVALID and "'judge'" in caught.value.message


async def test_the_episode_agent_refuses_an_environment_of_one_agent(start):
    model = ScriptedModel([say("5")], name="answerer_model")
    with pytest.raises(errors.GymError) as caught:
        await _episode(start, Calculator(name="env"), {"answerer_model": model})
    assert caught.value.reason == errors.Reason.EPISODE_TURN_INVALID and "simple agent" in caught.value.message


async def test_the_simple_agent_refuses_an_environment_of_several_roles_naming_the_episode_agent(start):
    model = await start(ScriptedModel([say("Paris.")], name="model"))
    env = await start(Interview(name="env"))
    agent = SimpleAgent(
        {"model_server": "model", "resources_server": "env"},
        name="agent",
        registry=static_registry(model=model, env=env),
    )
    a = await start(agent)
    client = AgentClient(static_registry(agent=a), "agent")
    try:
        with pytest.raises(errors.GymError) as caught:
            await client.run(_task(), timeout=30)
    finally:
        await client.registry.close()
    assert caught.value.reason == errors.Reason.EPISODE_TURN_INVALID
    assert "episode agent" in caught.value.message and "asker, answerer" in caught.value.message


async def test_a_trainers_result_parts_into_one_trajectory_per_role_with_its_own_reward(start):
    policy = LocalPolicyModel({"error_rate": 0.0}, name="answerer_model")  # token ids for every turn
    rollout = await _episode(start, Interview(name="env"), {"answerer_model": policy})
    per_role = TrainingRollout.per_role_result(RolloutResult(rollout), "agent", 0, 0)
    assert [(t.role, t.reward, len(t.turns)) for t in per_role] == [
        (role.name, role.reward, role.model_calls) for role in rollout.roles
    ]
    stats = SampleStats()
    samples = [sample for t in per_role for sample in samples_of(t, "refuse", stats)]
    assert [(s.role, s.group) for s in samples] == [("asker", "agent/0/asker"), ("answerer", "agent/0/answerer")]
    assert stats.non_monotonic_turns == 0  # "refuse" would have raised on a trajectory of mixed roles
