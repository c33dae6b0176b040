"""The LLM judge: verdicts read in each format, the judge's prompt and its output in the row, a judge
without a verdict or that fails, the bound on judge calls, and a rollout judged end to end."""

import asyncio
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from gym_grpc import errors
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.resources.llm_judge.server import LLMJudgeEnv
from gym_grpc.client.stubs import AgentClient, ResourcesClient
from gym_grpc.data import rows
from gym_grpc.judge import read
from gym_grpc.model import ModelServer
from gym_grpc.responses import assistant_message, final_text, input_items, message_text, new_response
from gym_grpc.rpc import transport
from gym_grpc.testing import ResourcesConformance, ScriptedModel, Servers, example_rows, say, static_registry
from gym_grpc.testing.checks import Probe
from gym_grpc.v1 import responses_pb2 as r
from tests.support import eventually

EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "example.jsonl"

ROW = {
    "responses_create_params": {"input": [{"role": "user", "content": "What is the capital of Australia?"}]},
    "expected_answer": "Canberra",
}


def _task(row=None):
    return rows.task_from_row(row or ROW)


def _answer(text: str) -> r.Response:
    return r.Response(output=[assistant_message(text)])


async def _judged(start, judge: ModelServer, answer: str = "It is Canberra.", row=None, **config):
    """Verify `answer` on an LLMJudgeEnv whose judge is `judge`: the reward and the fields."""
    model = await start(judge)
    env = await start(LLMJudgeEnv({"judge_model_server": "judge_model", **config}, registry=_registry(model)))
    client = ResourcesClient(static_registry(llm_judge=env), "llm_judge")
    try:
        reply = await client.verify("s", _task(row), _answer(answer))
    finally:
        await client.registry.close()
    return reply.reward, rows.json_field(reply, "fields")


def _registry(model):
    return static_registry(judge_model=model)


# --- the verdict formats ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value, reward",
    [
        ("The answer names Canberra.\n[[A]]", "[[A]]", 1.0),
        ("It says Sydney.\n\n[[B]]", "[[B]]", 0.0),
        ("I must answer [[A]] or [[B]]. It is wrong: [[B]]", "[[B]]", 0.0),  # the labels named first, then its own
        ("Verdict [[A]].", "[[A]]", 1.0),
    ],
)
def test_the_label_format_reads_the_label_written_last(text, value, reward):
    verdict = read(text, "label")
    assert (verdict.value, verdict.reward, verdict.problem) == (value, reward, None)


def test_labels_of_nemo_gym_and_overlapping_labels_are_told_apart():
    labels = {"[[A=B]]": 1.0, "[[A!=B]]": 0.0}
    assert read("They differ. [[A!=B]]", "label", labels).value == "[[A!=B]]"
    assert read("Same. [[A=B]]", "label", labels).value == "[[A=B]]"
    words = {"correct": 1.0, "incorrect": 0.0}
    assert read("This is incorrect", "label", words).value == "incorrect"  # not the "correct" inside it


@pytest.mark.parametrize(
    "text, value",
    [
        ("Reasoning...\nVerdict: correct", "correct"),
        ("**Verdict:** Incorrect.", "incorrect"),
        ("verdict = CORRECT", "correct"),
        ("Verdict: incorrect\nOn reflection:\nVerdict: correct", "correct"),
    ],
)
def test_the_verdict_format_reads_the_last_verdict_line_without_case(text, value):
    verdict = read(text, "verdict")
    assert verdict.value == value and verdict.reward == (1.0 if value == "correct" else 0.0)


@pytest.mark.parametrize(
    "text, score",
    [
        ("Good answer. Score: 7", 7.0),
        ("Rating: [[8.5]]", 8.5),
        ("[[3]]", 3.0),
        ("It computes 3/4 correctly. I give it 9/10.", 9.0),  # 3/4 is no score: 4 is not the top of the range
        ("**Score**: 10", 10.0),
    ],
)
def test_the_score_format_reads_the_last_score_scaled_to_the_range(text, score):
    verdict = read(text, "score", score_range=(0.0, 10.0))
    assert verdict.value == score and verdict.reward == score / 10


@pytest.mark.parametrize(
    "text, format, problem",
    [
        ("I think it is right.", "label", "none of the labels '[[A]]', '[[B]]' is in the judge's output"),
        ("Verdict: maybe", "verdict", "the verdict 'maybe' is none of 'correct', 'incorrect'"),
        ("Looks fine to me.", "verdict", "no line 'Verdict: ...'"),
        ("Score: 12", "score", "the score 12 is outside score_range [0, 10]"),
        ("No number here.", "score", "no score"),
        ("", "label", "none of the labels"),
    ],
)
def test_text_without_a_verdict_is_a_problem_said_not_an_exception(text, format, problem):
    verdict = read(text, format)
    assert verdict.value is None and verdict.reward is None
    assert verdict.problem is not None and verdict.problem.startswith(problem)


# --- judging over gRPC with a scripted judge ---------------------------------------------------------


async def test_a_correct_verdict_earns_the_reward_and_the_row_records_the_judges_output(start):
    judge = ScriptedModel([say("The answer names Canberra, as the reference does.\n[[A]]")])
    reward, fields = await _judged(start, judge)
    assert reward == 1.0
    assert fields == {
        "judge_model": "scripted",
        "judge_verdict": "[[A]]",
        "judge_unparsable": 0,
        "judge_problem": None,
        "judgements": [{"output": "The answer names Canberra, as the reference does.\n[[A]]", "verdict": "[[A]]"}],
    }


async def test_the_judge_is_asked_with_the_question_the_reference_and_the_answer(start):
    judge = ScriptedModel([say("[[B]]")])
    template = "Q: {question}\nRef: {expected_answer}\nA: {generated_answer}\nAnswer [[A]] or [[B]]. {notes}"
    reward, fields = await _judged(
        start,
        judge,
        "Sydney, I believe. {question}",
        judge_prompt_template=template,
        judge_system_message="You are a strict grader.",
        judge_temperature=0.0,
        judge_max_output_tokens=64,
    )
    assert reward == 0.0 and fields["judge_verdict"] == "[[B]]"
    (params,) = judge.requests
    system, user = input_items(params)
    assert system.message.role == r.ROLE_SYSTEM and message_text(system.message) == "You are a strict grader."
    # The answer's own "{question}" is left as written, and so is a brace the template uses for itself.
    assert message_text(user.message) == (
        "Q: What is the capital of Australia?\nRef: Canberra\nA: Sydney, I believe. {question}\n"
        "Answer [[A]] or [[B]]. {notes}"
    )
    assert params.temperature == 0.0 and params.max_output_tokens == 64 and not params.tools


@pytest.mark.parametrize(
    "config, said, verdict, reward",
    [
        ({"verdict_format": "verdict"}, "It matches.\nVerdict: Correct", "correct", 1.0),
        ({"verdict_format": "score", "score_range": [1, 5]}, "Mostly right. Score: 4", 4.0, 0.75),
        ({"verdict_labels": {"[[A=B]]": 1.0, "[[A!=B]]": -1.0}}, "Different. [[A!=B]]", "[[A!=B]]", -1.0),
    ],
)
async def test_each_format_and_its_rewards_reach_the_row(start, config, said, verdict, reward):
    got, fields = await _judged(start, ScriptedModel([say(said)]), **config)
    assert (got, fields["judge_verdict"]) == (reward, verdict)


async def test_a_judgement_without_a_verdict_scores_zero_and_says_why(start):
    reward, fields = await _judged(start, ScriptedModel([say("Hard to say; it might be right.")]))
    assert reward == 0.0
    assert fields["judge_verdict"] is None and fields["judge_unparsable"] == 1
    assert fields["judge_problem"] == "none of the labels '[[A]]', '[[B]]' is in the judge's output"
    assert fields["judgements"] == [
        {"output": "Hard to say; it might be right.", "verdict": None, "problem": fields["judge_problem"]}
    ]


async def test_a_judgement_without_a_verdict_fails_the_verify_when_configured_to(start):
    with pytest.raises(errors.GymError) as caught:
        await _judged(start, ScriptedModel([say("Hard to say.")]), unparsable_verdict="fail")
    assert caught.value.code == grpc.StatusCode.INTERNAL
    assert caught.value.reason == errors.Reason.JUDGE_VERDICT_UNPARSABLE
    assert "the judge 'judge_model' gave no verdict: none of the labels" in caught.value.message
    assert caught.value.metadata["judge"] == "judge_model"


async def test_several_judgements_take_the_majority_label(start):
    judge = ScriptedModel([say("[[A]]"), say("[[B]]"), say("no idea"), say("[[A]]")])
    reward, fields = await _judged(start, judge, judge_judgements=4)
    assert len(judge.requests) == 4
    assert reward == 1.0 and fields["judge_verdict"] == "[[A]]" and fields["judge_unparsable"] == 1
    assert sorted(str(j["verdict"]) for j in fields["judgements"]) == ["None", "[[A]]", "[[A]]", "[[B]]"]


async def test_a_tie_of_judgements_goes_to_the_lower_reward_and_scores_are_averaged(start):
    reward, fields = await _judged(start, ScriptedModel([say("[[A]]"), say("[[B]]")]), judge_judgements=2)
    assert (reward, fields["judge_verdict"]) == (0.0, "[[B]]")
    scored = ScriptedModel([say("Score: 6"), say("Score: 9")])
    reward, fields = await _judged(start, scored, verdict_format="score", judge_judgements=2)
    assert (reward, fields["judge_verdict"]) == (0.75, 7.5)


SWAP_TEMPLATE = "Q: {question}\nA: {expected_answer}\nB: {response}\nSame? [[A]] yes, [[B]] no."


async def test_the_swap_check_asks_again_with_the_texts_exchanged_and_a_verdict_that_agrees_stands(start):
    judge = ScriptedModel([say("Same. [[A]]"), say("Still the same. [[A]]")])
    reward, fields = await _judged(start, judge, "Canberra.", judge_prompt_template=SWAP_TEMPLATE, swap_check=True)
    assert reward == 1.0 and fields["judge_verdict"] == "[[A]]" and fields["judge_swap_verdict"] == "[[A]]"
    assert fields["swapped_judgements"] == [{"output": "Still the same. [[A]]", "verdict": "[[A]]"}]
    first, second = (message_text(input_items(params)[0].message) for params in judge.requests)
    assert "A: Canberra\nB: Canberra." in first and "A: Canberra.\nB: Canberra\n" in second


@pytest.mark.parametrize("second", ["Different. [[B]]", "Cannot tell."])
async def test_a_swap_check_that_disagrees_or_says_nothing_gives_reward_if_swap_fails(start, second):
    judge = ScriptedModel([say("Same. [[A]]"), say(second)])
    config = {"judge_prompt_template": SWAP_TEMPLATE, "swap_check": True, "reward_if_swap_fails": -1.0}
    reward, fields = await _judged(start, judge, "Sydney.", **config)
    assert reward == -1.0 and fields["judge_verdict"] == "[[A]]"
    assert fields["judge_swap_verdict"] == ("[[B]]" if "[[B]]" in second else None)


async def test_a_verdict_below_the_best_is_not_swap_checked(start):
    judge = ScriptedModel([say("Different. [[B]]")])
    reward, fields = await _judged(start, judge, "Sydney.", judge_prompt_template=SWAP_TEMPLATE, swap_check=True)
    assert reward == 0.0 and len(judge.requests) == 1 and "judge_swap_verdict" not in fields


async def test_a_response_without_a_final_message_scores_zero_without_asking_the_judge(start):
    judge = ScriptedModel([say("[[A]]")])
    reward, fields = await _judged(start, judge, answer="")
    assert reward == 0.0 and judge.requests == []
    assert fields["judge_problem"] == "the response has no final message to judge" and fields["judgements"] == []


async def test_a_task_without_the_expected_answer_the_template_uses_is_invalid(start):
    row = {"responses_create_params": {"input": "What is the capital of Australia?"}}
    with pytest.raises(errors.InvalidArgument) as caught:
        await _judged(start, ScriptedModel([say("[[A]]")]), row=row)
    assert caught.value.reason == errors.Reason.TASK_DATA_INVALID
    assert caught.value.field == "task.data.expected_answer" and "{expected_answer}" in caught.value.message


async def test_a_template_without_the_expected_answer_judges_tasks_that_have_none(start):
    row = {"responses_create_params": {"input": "Write a haiku about rain."}}
    judge = ScriptedModel([say("Five, seven, five: yes. [[A]]")])
    template = "Task: {question}\nPoem: {response}\nIs it a haiku? [[A]] yes, [[B]] no."
    reward, _ = await _judged(start, judge, "Rain on the roof...", row=row, judge_prompt_template=template)
    assert reward == 1.0
    assert message_text(input_items(judge.requests[0])[0].message).startswith("Task: Write a haiku about rain.\n")


class _FailingJudge(ModelServer):
    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        raise errors.GymError("the engine fell over", reason=errors.Reason.ENGINE_FAILED)


async def test_a_failing_judge_fails_the_verify_with_its_status_naming_the_judge(start):
    with pytest.raises(errors.GymError) as caught:
        await _judged(start, _FailingJudge(name="judge_model"))
    assert caught.value.code == grpc.StatusCode.INTERNAL and caught.value.reason == errors.Reason.ENGINE_FAILED
    assert "the judge failed: model server 'judge_model' CreateResponse: INTERNAL: the engine fell over" in (
        caught.value.message
    )
    assert caught.value.metadata["judge"] == "judge_model"


async def test_a_judge_that_is_gone_fails_the_verify_unavailable(start):
    async with Servers() as servers:
        gone = await servers.start(ScriptedModel([say("[[A]]")]))
    env = await start(LLMJudgeEnv({"judge_model_server": "judge_model"}, registry=_registry(gone)))
    client = ResourcesClient(static_registry(llm_judge=env), "llm_judge")
    with pytest.raises(errors.GymError) as caught:
        await client.verify("s", _task(), _answer("Canberra."))
    await client.registry.close()
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert caught.value.message.startswith("resources server 'llm_judge' Verify: UNAVAILABLE: the judge failed:")
    assert caught.value.metadata["judge"] == "judge_model"


class _GatedJudge(ModelServer):
    """Holds every call until released; counts the calls it holds."""

    def __init__(self) -> None:
        super().__init__(name="judge_model")
        self.active = 0
        self.peak = 0
        self.release = asyncio.Event()

    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await self.release.wait()
        finally:
            self.active -= 1
        response = new_response(params, "gated")
        response.output.append(assistant_message("[[A]]"))
        return response


async def test_judge_calls_in_flight_never_exceed_max_concurrent_judgements(start):
    gate = _GatedJudge()
    model = await start(gate)
    config = {"judge_model_server": "judge_model", "max_concurrent_judgements": 2}
    env_running = await start(LLMJudgeEnv(config, registry=_registry(model)))
    env: LLMJudgeEnv = env_running.app
    client = ResourcesClient(static_registry(llm_judge=env_running), "llm_judge")
    verifies = [asyncio.ensure_future(client.verify(f"s{i}", _task(), _answer("Canberra."))) for i in range(10)]
    try:
        # Until every Verify has reached the judge: held by the model, or waiting for a slot.
        await eventually(lambda: gate.active + env.judge.waiting == 10, "every Verify at the judge", seconds=120)
        assert (gate.active, env.judge.waiting) == (2, 8)
        gate.release.set()
        replies = await asyncio.gather(*verifies)
    finally:
        gate.release.set()
        await asyncio.gather(*verifies, return_exceptions=True)
        await client.registry.close()
    assert [reply.reward for reply in replies] == [1.0] * 10
    assert gate.peak == 2 and env.judge.waiting == 0


def test_config_mistakes_are_config_errors_naming_the_server_and_key():
    def refused(**config):
        with pytest.raises(errors.ConfigError) as caught:
            LLMJudgeEnv({"judge_model_server": "judge_model", **config}, name="llm_judge")
        return str(caught.value)

    with pytest.raises(errors.ConfigError, match="server 'llm_judge': config.judge_model_server: Field required"):
        LLMJudgeEnv({}, name="llm_judge")
    assert "config.judge_prompt_template" in refused(judge_prompt_template="Grade: {question}")
    assert "must contain {response}" in refused(judge_prompt_template="Grade: {question}")
    assert "{questoin} is no placeholder; did you mean {question}?" in refused(
        judge_prompt_template="{questoin} {response}"
    )
    assert "config.verdict_labels" in refused(verdict_format="score", verdict_labels={"[[A]]": 1})
    assert "config.verdict_labels.[[A]]: Input should be a finite number" in refused(verdict_labels={"[[A]]": "inf"})
    assert "config.score_range" in refused(verdict_format="score", score_range=[10, 0])
    assert "config.verdict_format" in refused(verdict_format="stars")
    assert "(did you mean 'judge_prompt_template'?)" in refused(judge_promt_template="x")
    assert "config.max_concurrent_judgements" in refused(max_concurrent_judgements=0)
    assert "config.swap_check: Value error, the score format" in refused(verdict_format="score", swap_check=True)
    assert "must use {expected_answer}" in refused(swap_check=True, judge_prompt_template="{question} {response}")


def test_the_server_names_its_judge_as_a_reference_for_the_runner():
    assert LLMJudgeEnv({"judge_model_server": "grader"}).references() == {"model": "grader"}


def test_the_example_rows_are_tasks_with_an_expected_answer():
    examples = example_rows(EXAMPLES, LLMJudgeEnv)
    assert len(examples) == 5 and all(row["expected_answer"] for row in examples)


async def test_a_rollout_through_the_simple_agent_is_judged_and_carries_the_judgement():
    async with Servers() as servers:
        policy = await servers.start(ScriptedModel([say("The capital of Australia is Canberra.")], name="policy"))
        judge = await servers.start(ScriptedModel([say("Canberra matches. [[A]]")], name="judge"))
        env = await servers.start(LLMJudgeEnv({"judge_model_server": "judge_model"}, registry=_registry(judge)))
        agent = await servers.start(
            SimpleAgent(
                {"model_server": "policy_model", "resources_server": "llm_judge", "max_steps": 1},
                registry=static_registry(policy_model=policy, llm_judge=env),
            )
        )
        client = AgentClient(static_registry(agent=agent), "agent")
        rollout = await client.run(_task())
        await client.registry.close()
    assert rollout.reward == 1.0
    fields = rows.json_field(rollout, "verifier_fields")
    assert fields["judge_verdict"] == "[[A]]" and fields["judgements"][0]["output"] == "Canberra matches. [[A]]"
    asked = message_text(input_items(judge.app.requests[0])[0].message)
    assert "The capital of Australia is Canberra." in asked and final_text(rollout.response) in asked


class TestLLMJudgeConformance(ResourcesConformance):
    task_row = ROW
    answer = "Canberra."

    def server(self) -> LLMJudgeEnv:
        return LLMJudgeEnv({"judge_model_server": "judge_model"})

    @pytest_asyncio.fixture
    async def served(self):
        """The environment with a scripted judge it can reach."""
        async with Servers() as servers:
            judge = await servers.start(ScriptedModel([say("[[A]]")]))
            running = await servers.start(LLMJudgeEnv({"judge_model_server": "judge_model"}, registry=_registry(judge)))
            async with transport.open_channel(running.address) as channel:
                yield running, Probe(channel, self.task_row, self.answer)
