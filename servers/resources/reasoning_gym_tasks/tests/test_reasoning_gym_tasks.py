"""reasoning-gym's datasets served by configuration, scored by reasoning-gym's own scorers (the real package)."""

import asyncio
import json
import re
from pathlib import Path

import pytest
import reasoning_gym
import yaml
from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

from gym_grpc import errors
from gym_grpc.bundled.servers.resources.reasoning_gym_tasks.server import ReasoningGymEnv, extract
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message
from gym_grpc.testing import ResourcesConformance, example_rows, static_registry
from gym_grpc.testing.fake_engine import FakeEngine, Turn
from gym_grpc.v1 import responses_pb2 as r
from tests.support import REPO, collect_args, gym, start_run

HERE = Path(__file__).resolve().parent.parent
CONFIG = HERE / "config.yaml"
EXAMPLES = HERE / "data" / "example.jsonl"
MIX = {
    "size": 40,
    "seed": 7,
    "datasets": [
        {"name": "leg_counting"},
        {"name": "basic_arithmetic", "weight": 2, "config": {"min_terms": 2, "max_terms": 3}},
        {"name": "spell_backward"},
    ],
}


def _reference(config: dict) -> CompositeDataset:
    """reasoning-gym's own composite for a server config, built here with reasoning-gym's classes."""
    specs = [
        DatasetSpec(name=d["name"], weight=d.get("weight", 1.0), config=d.get("config", {})) for d in config["datasets"]
    ]
    return CompositeDataset(CompositeConfig(size=config["size"], seed=config["seed"], datasets=specs))


def _answer(text: str) -> r.Response:
    return r.Response(output=[assistant_message(text)])


@pytest.fixture
async def served(start):
    server = await start(ReasoningGymEnv(MIX, name="rg"))
    client = ResourcesClient(static_registry(rg=server), "rg")
    yield client, server.app
    await client.registry.close()


# --- the answer in the final message ------------------------------------------------


@pytest.mark.parametrize(
    ("how", "text", "found"),
    [
        ("answer_tag", "thinking... <answer>41</answer> then <answer> 42 </answer>", "42"),  # the last, stripped
        ("answer_tag", "The answer is \\boxed{42}.", None),
        ("answer_tag_or_boxed", "The answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("answer_tag_or_boxed", "<answer>7</answer> \\boxed{8}", "7"),
        ("final_text", "  42  ", "42"),
        ("final_text", "", None),
    ],
)
def test_the_answer_is_taken_as_configured(how, text, found):
    assert extract(text, how) == found


# --- scoring with reasoning-gym's scorers ------------------------------------------


async def test_a_right_answer_scores_one_and_a_wrong_one_zero_as_reasoning_gym_scores_them(served):
    client, env = served
    reference = _reference(MIX)
    task_rows = env.task_rows()
    assert len(task_rows) == 40 and {row["reasoning_gym_dataset"] for row in task_rows} == {
        "leg_counting",
        "basic_arithmetic",
        "spell_backward",
    }
    for index, row in enumerate(task_rows[:12]):
        entry = reference[index]
        assert row["reasoning_gym_index"] == index and row["expected_answer"] == entry["answer"]
        assert row["responses_create_params"]["input"][-1]["content"] == entry["question"]
        task = rows.task_from_row(row)
        right = await client.verify(
            f"s{index}", task, _answer(f"Let me work it out. <answer>{entry['answer']}</answer>")
        )
        wrong = await client.verify(f"w{index}", task, _answer("<answer>certainly not this</answer>"))
        assert right.reward == reference.score_answer(entry["answer"], entry) == 1.0
        assert wrong.reward == reference.score_answer("certainly not this", entry)
        # spell_backward's scorer gives partial credit for letters in place; the others all or nothing
        assert wrong.reward < 1.0 if row["reasoning_gym_dataset"] == "spell_backward" else wrong.reward == 0.0
        fields = rows.json_field(right, "fields")
        assert fields["extracted_answer"] == entry["answer"]
        assert fields["source_dataset"] == entry["metadata"]["source_dataset"] == row["reasoning_gym_dataset"]
        assert fields["source_index"] == entry["metadata"]["source_index"]
        assert fields["difficulty"] == json.loads(json.dumps(entry["metadata"]["difficulty"]))


async def test_an_answer_without_the_tag_is_no_answer_unless_configured_otherwise(start):
    row = ReasoningGymEnv(MIX, name="rg").task_rows(1)[0]
    bare = f"The result is {row['expected_answer']}."
    for extraction, reward in (("answer_tag", 0.0), ("final_text", None)):
        server = await start(ReasoningGymEnv({**MIX, "answer_extraction": extraction}, name="rg"))
        client = ResourcesClient(static_registry(rg=server), "rg")
        verdict = await client.verify("s", rows.task_from_row(row), _answer(bare))
        entry = _reference(MIX)[0]
        expected = reward if reward is not None else _reference(MIX).score_answer(bare, entry)
        assert verdict.reward == expected  # reasoning-gym's partial credit for the answer inside a sentence
        await client.registry.close()
    assert 0.0 < expected < 1.0


async def test_the_whole_metadata_is_recorded_when_asked(start):
    server = await start(ReasoningGymEnv({**MIX, "record_metadata": True}, name="rg"))
    client = ResourcesClient(static_registry(rg=server), "rg")
    row = server.app.task_rows(1)[0]
    verdict = await client.verify("s", rows.task_from_row(row), _answer("<answer>x</answer>"))
    metadata = rows.json_field(verdict, "fields")["metadata"]
    assert metadata == json.loads(json.dumps(_reference(MIX)[0]["metadata"]))
    await client.registry.close()


async def test_a_row_written_from_another_configuration_is_refused_naming_the_key(served):
    client, _ = served
    other = ReasoningGymEnv({**MIX, "seed": 8}, name="rg").task_rows(3)
    mismatched = next(
        row for row in other if row["expected_answer"] != _reference(MIX)[row["reasoning_gym_index"]]["answer"]
    )
    with pytest.raises(errors.InvalidArgument, match="written from another configuration") as raised:
        await client.verify("s", rows.task_from_row(mismatched), _answer("<answer>1</answer>"))
    assert raised.value.field in ("task.data.expected_answer", "task.data.reasoning_gym_dataset")


@pytest.mark.parametrize(
    ("fields", "key", "says"),
    [
        ({}, "reasoning_gym_index", "is required"),
        ({"reasoning_gym_index": 40}, "reasoning_gym_index", "is not a task of this server (size 40)"),
        ({"reasoning_gym_index": 1.5}, "reasoning_gym_index", "must be a whole number"),
        ({"metadata": {"source_dataset": "leg_countin"}}, "metadata.source_dataset", "no dataset 'leg_countin'"),
    ],
)
async def test_a_bad_row_is_invalid_argument_naming_its_key(served, fields, key, says):
    client, _ = served
    task = rows.task_from_row({"responses_create_params": {"input": "?"}, **fields})
    with pytest.raises(errors.InvalidArgument, match=re.escape(says)) as raised:
        await client.verify("s", task, _answer("<answer>1</answer>"))
    assert raised.value.field == f"task.data.{key}"


async def test_a_nemo_gym_row_is_scored_by_its_source_datasets_scorer(served):
    client, _ = served
    entry = reasoning_gym.create_dataset("leg_counting", size=1, seed=3)[0]
    row = {
        "responses_create_params": {"input": [{"role": "user", "content": entry["question"]}]},
        "question": entry["question"],
        "answer": entry["answer"],
        "metadata": json.loads(json.dumps(entry["metadata"])),
    }
    right = await client.verify("s", rows.task_from_row(row), _answer(f"<answer>{entry['answer']}</answer>"))
    wrong = await client.verify("s", rows.task_from_row(row), _answer("<answer>-1</answer>"))
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    assert rows.json_field(right, "fields")["source_dataset"] == "leg_counting"


# --- configuration mistakes ----------------------------------------------------------


def test_an_unknown_dataset_is_a_config_error_naming_the_server_key_and_dataset():
    config = {"datasets": [{"name": "leg_counting"}, {"name": "leg_countng"}]}
    with pytest.raises(errors.ConfigError) as raised:
        ReasoningGymEnv.checked_config(config, "rg")
    message = str(raised.value)
    assert message.startswith("server 'rg': config.datasets.1.name: ")
    assert "reasoning-gym has no dataset 'leg_countng' (did you mean 'leg_counting'?)" in message


@pytest.mark.parametrize(
    ("config", "where", "says"),
    [
        ({"datasets": [{"name": "leg_counting", "config": {"min_animalz": 2}}]}, "datasets.0", "min_animalz"),
        ({"datasets": [{"name": "leg_counting", "config": {"min_animals": 0}}]}, "datasets.0", "LegCountingConfig"),
        ({"datasets": []}, "datasets", "at least 1 item"),
        ({"datasets": [{"name": "leg_counting"}] * 2}, "datasets", "datasets repeat: leg_counting"),
        ({"datasets": [{"name": "leg_counting"}], "system_prompt": "terse"}, "system_prompt", "no system prompt"),
        ({"datasets": [{"name": "leg_counting"}], "answer_extraction": "xml"}, "answer_extraction", "answer_tag"),
        ({"datasets": [{"name": "leg_counting", "wieght": 2}]}, "datasets.0.wieght", "Extra inputs"),
    ],
)
def test_a_config_that_reasoning_gym_would_refuse_is_a_config_error(config, where, says):
    with pytest.raises(errors.ConfigError, match=f"server 'rg': config.{where}") as raised:
        ReasoningGymEnv.checked_config(config, "rg")
    assert says in str(raised.value)


def test_gym_grpc_run_refuses_an_unknown_dataset_naming_it():
    done = gym(
        "run",
        str(REPO / "configs" / "local_policy.yaml"),
        str(CONFIG),
        "--registry",
        "127.0.0.1:0",
        "servers.reasoning_gym.config.datasets=[{name: no_such_dataset}]",
    )
    assert done.returncode != 0
    assert "server 'reasoning_gym'" in done.stderr
    assert "config.datasets.0.name: Value error, reasoning-gym has no dataset 'no_such_dataset'" in done.stderr


# --- task rows: the example file and prepare-data ----------------------------------


def test_the_example_rows_are_what_the_configured_server_writes():
    config = yaml.safe_load(CONFIG.read_text())["servers"]["reasoning_gym"]["config"]
    written = ReasoningGymEnv(config, name="reasoning_gym").task_rows(5)
    assert example_rows(EXAMPLES, ReasoningGymEnv) == written
    assert json.loads(json.dumps(written)) == written


def test_prepare_data_generates_the_rows_from_the_servers_configuration(tmp_path):
    data = tmp_path / "rg.jsonl"
    config = tmp_path / "rg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "servers": {
                    "rg": {"entrypoint": str(HERE / "server.py") + ":ReasoningGymEnv", "config": MIX},
                    "rg_agent": {
                        "entrypoint": str(REPO / "servers/agents/simple_agent/agent.py") + ":SimpleAgent",
                        "config": {"model_server": "policy_model", "resources_server": "rg"},
                        "datasets": [
                            {
                                "name": "train",
                                "type": "train",
                                "license": "Apache-2.0",
                                "jsonl_fpath": str(data),
                                "generated_by": {"server": "rg"},
                            }
                        ],
                    },
                }
            }
        )
    )
    out = tmp_path / "prepared"
    missing = gym("prepare-data", str(config), "--mode", "train-preparation", "--output-dir", str(out))
    assert missing.returncode != 0 and "pass --generate to write it with server 'rg'" in missing.stderr
    done = gym("prepare-data", str(config), "--mode", "train-preparation", "--output-dir", str(out), "--generate")
    assert done.returncode == 0, done.stderr
    assert "generated 40 rows of train with rg" in done.stderr
    written = [json.loads(line) for line in data.read_text().splitlines()]
    assert written == ReasoningGymEnv(MIX, name="rg").task_rows()
    prepared = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert [row["reasoning_gym_index"] for row in prepared] == list(range(40))
    assert all(row["agent_ref"] == {"name": "rg_agent"} for row in prepared)
    again = gym("prepare-data", str(config), "--mode", "train-preparation", "--output-dir", str(out), "--generate")
    assert again.returncode == 0, again.stderr  # the same tasks again: the statistics still match


def test_prepare_data_refuses_a_generator_that_is_no_server_of_the_configuration(tmp_path):
    config = tmp_path / "rg.yaml"
    agent = {
        "entrypoint": str(REPO / "servers/agents/simple_agent/agent.py") + ":SimpleAgent",
        "config": {"model_server": "policy_model", "resources_server": "rg"},
        "datasets": [
            {"name": "example", "type": "example", "jsonl_fpath": "x.jsonl", "generated_by": {"server": "rgg"}}
        ],
    }
    rg = {"entrypoint": str(HERE / "server.py") + ":ReasoningGymEnv", "config": MIX}
    config.write_text(yaml.safe_dump({"servers": {"rg": rg, "rg_agent": agent}}))
    done = gym("prepare-data", str(config), "--mode", "example-validation", "--generate", cwd=tmp_path)
    assert done.returncode != 0
    assert "dataset 'example' of rg_agent: generated_by.server: no server 'rgg' in the configuration" in done.stderr


# --- a user's run: gym-grpc run + gym-grpc collect -----------------------------------


def _oracle(reference: CompositeDataset, size: int):
    """A scripted policy on the engine's Responses endpoint: the right answer to even tasks, a wrong one to odd."""
    by_question = {reference[i]["question"]: i for i in range(size)}

    def answer(body: dict) -> Turn:
        user = [item for item in body["input"] if item.get("role") == "user"][-1]
        content = user["content"] if isinstance(user["content"], str) else user["content"][0]["text"]
        index = by_question[content]
        said = reference[index]["answer"] if index % 2 == 0 else "no idea"
        return Turn(content=f"Step by step, done.\n<answer>{said}</answer>")

    return answer


@pytest.mark.slow
async def test_gym_grpc_run_and_collect_score_each_rollout_as_reasoning_gym_does(tmp_path):
    config = yaml.safe_load(CONFIG.read_text())["servers"]["reasoning_gym"]["config"]
    reference = _reference(config)
    engine = FakeEngine(_oracle(reference, config["size"]))
    base_url = await engine.start()
    output = tmp_path / "rollouts.jsonl"
    try:
        with start_run(
            f"policy_base_url={base_url}",
            "policy_api_key=none",
            "policy_model_name=scripted",
            configs=(REPO / "configs" / "openai.yaml", CONFIG),
        ) as run:
            collected = await asyncio.to_thread(
                gym, *collect_args(run.registry, "reasoning_gym_agent", EXAMPLES, output), "--num-repeats", "2"
            )
            assert collected.returncode == 0, collected.stderr
    finally:
        await engine.stop()
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(written) == 5 * 2
    for row in written:
        index = row["reasoning_gym_index"]
        entry = reference[index]
        extracted = reasoning_gym.utils.extract_answer(row["response"]["output"][-1]["content"][0]["text"])
        assert row["extracted_answer"] == extracted
        assert row["reward"] == reference.score_answer(extracted, entry) == (1.0 if index % 2 == 0 else 0.0)
        assert row["source_dataset"] == entry["metadata"]["source_dataset"]


class TestReasoningGymConformance(ResourcesConformance):
    task_row = json.loads(EXAMPLES.read_text().splitlines()[0])
    answer = f"<answer>{task_row['expected_answer']}</answer>"

    def server(self) -> ReasoningGymEnv:
        return ReasoningGymEnv(yaml.safe_load(CONFIG.read_text())["servers"]["reasoning_gym"]["config"])
