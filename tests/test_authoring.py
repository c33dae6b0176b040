"""An environment author's workflow: init-env, test, run and collect, prepare-data."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from gym_grpc.data import json_input
from gym_grpc.data.dataset_stats import approx_tokens, differences, statistics
from gym_grpc.data.rows import task_from_row
from tests.support import REPO, gym, nested_json, read_rows, start_run, tool

LOCAL_POLICY = REPO / "configs" / "local_policy.yaml"
MATH_CONFIG = REPO / "servers" / "resources" / "math" / "config.yaml"
WEATHER_CONFIG = REPO / "servers" / "resources" / "weather" / "config.yaml"


@pytest.fixture(scope="module")
def scaffold(tmp_path_factory) -> Path:
    """`gym-grpc init-env capital_quiz` in an empty directory outside the repository."""
    where = tmp_path_factory.mktemp("authoring")
    done = gym("init-env", "capital_quiz", "--dir", str(where), cwd=where)
    assert done.returncode == 0, done.stderr
    assert f"gym-grpc test {where / 'capital_quiz'}" in done.stdout
    return where / "capital_quiz"


def test_init_env_writes_a_server_config_data_and_tests(scaffold):
    files = sorted(
        str(p.relative_to(scaffold)) for p in scaffold.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )
    assert files == [
        "__init__.py",
        "config.yaml",
        "data/example.jsonl",
        "data/example.stats.json",
        "server.py",
        "tests/__init__.py",
        "tests/test_capital_quiz.py",
    ]
    assert len(read_rows(scaffold / "data" / "example.jsonl")) == 5


def test_the_scaffolds_own_tests_pass_untouched(scaffold):
    done = gym("test", str(scaffold), "-p", "no:cacheprovider", cwd=scaffold.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "16 passed" in done.stdout  # its five tests and the eleven of the conformance kit


def test_the_scaffold_is_lint_clean(scaffold):
    for check in (["check"], ["format", "--check"]):
        done = subprocess.run([tool("ruff"), *check, str(scaffold)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout


def test_the_scaffold_runs_with_the_embedded_model_and_earns_rewards(scaffold, tmp_path):
    run = start_run(configs=(LOCAL_POLICY, scaffold / "config.yaml"))
    try:
        output = tmp_path / "out.jsonl"
        done = gym(
            "collect",
            "--registry",
            run.registry,
            "--agent",
            "capital_quiz_agent",
            "--input",
            str(scaffold / "data" / "example.jsonl"),
            "--output",
            str(output),
            "--num-repeats",
            "2",
            "--no-progress",
            "temperature=0",  # greedy: the embedded policy does not slip
        )
        assert done.returncode == 0, done.stderr
    finally:
        run.stop()
    written = read_rows(output)
    assert len(written) == 10 and all(row["reward"] == 1.0 and row["used_tool"] for row in written)


def test_a_scaffold_with_a_bad_name_or_over_an_existing_directory_is_refused(scaffold):
    done = gym("init-env", "Capital-Quiz", "--dir", str(scaffold.parent))
    assert done.returncode != 0 and "lower-case letters" in done.stderr
    done = gym("init-env", "capital_quiz", "--dir", str(scaffold.parent))
    assert done.returncode != 0 and "already exists" in done.stderr


def test_gym_grpc_test_reports_a_failing_server(scaffold, tmp_path):
    broken = tmp_path / "broken_quiz"
    shutil.copytree(scaffold, broken, ignore=shutil.ignore_patterns("__pycache__"))
    server = broken / "server.py"
    server.write_text(server.read_text().replace("reward=1.0 if answered else 0.0", "reward=0.0"))
    done = gym("test", str(broken), "-p", "no:cacheprovider", cwd=tmp_path)
    assert done.returncode == 1
    assert "test_naming_the_expected_answer_earns_the_reward" in done.stdout


@pytest.mark.slow
def test_gym_grpc_test_all_runs_every_servers_tests(tmp_path, scaffold):
    servers = tmp_path / "servers" / "resources"
    shutil.copytree(scaffold, servers / "quiz_one", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(scaffold, servers / "quiz_two", ignore=shutil.ignore_patterns("__pycache__"))
    for copy in ("quiz_one", "quiz_two"):  # distinct test module names
        tests = servers / copy / "tests"
        (tests / "test_capital_quiz.py").rename(tests / f"test_{copy}.py")
    done = gym("test", "--all", "-p", "no:cacheprovider", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "32 passed" in done.stdout  # 16 in each copy
    assert "testing 2 server(s)" in done.stderr


def test_gym_grpc_test_needs_a_path_or_all():
    done = gym("test")
    assert done.returncode == 2 and "give a server's directory, or --all" in done.stderr


# --- prepare-data ---------------------------------------------------------------


def _prepare(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return gym("prepare-data", *args, cwd=cwd)


def test_prepare_data_validates_the_repositorys_examples(tmp_path):
    done = _prepare(
        str(WEATHER_CONFIG), str(MATH_CONFIG), "--mode", "example-validation", "--output-dir", "out", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    collated = read_rows(tmp_path / "out" / "example.jsonl")
    weather = read_rows(WEATHER_CONFIG.parent / "data" / "example.jsonl")
    math = read_rows(MATH_CONFIG.parent / "data" / "example.jsonl")
    assert collated == [{**row, "agent_ref": {"name": "weather_agent"}} for row in weather] + [
        {**row, "agent_ref": {"name": "math_agent"}} for row in math
    ]
    assert "wrote statistics" not in done.stdout  # the committed statistics match


def test_prepare_data_collates_train_and_validation_with_repeats(tmp_path):
    # NeMo Gym's spelling of the mode (train_preparation) works as ours does
    done = _prepare(str(MATH_CONFIG), "--mode", "train_preparation", "--output-dir", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    train = read_rows(tmp_path / "out" / "train.jsonl")
    source = read_rows(MATH_CONFIG.parent / "data" / "train.jsonl")
    assert len(train) == 2 * len(source)  # num_repeats: 2
    assert train[0] == train[1] == {**source[0], "agent_ref": {"name": "math_agent"}}
    assert len(read_rows(tmp_path / "out" / "validation.jsonl")) == 16
    assert "train: 128 rows" in done.stdout


def _author_config(directory: Path, rows: list[str], **dataset) -> Path:
    (directory / "data").mkdir(exist_ok=True)
    (directory / "data" / "example.jsonl").write_text("".join(line + "\n" for line in rows))
    spec = {"name": "example", "type": "example", "jsonl_fpath": "data/example.jsonl", **dataset}
    config = {"servers": {"quiz_agent": {"entrypoint": "agent.py:Agent", "datasets": [spec]}}}
    (directory / "config.yaml").write_text(json.dumps(config))
    return directory / "config.yaml"


GOOD = json.dumps({"responses_create_params": {"input": "What is 2 + 2?"}, "expected_answer": "4"})


def test_every_malformed_row_is_reported_with_file_line_and_field_and_nothing_is_written(tmp_path):
    config = _author_config(
        tmp_path,
        [
            GOOD,
            '{"responses_create_params": {"input": "x"}, "x": 1, "x": 2}',
            "{not json",
            json.dumps({"expected_answer": "4"}),
            json.dumps({"responses_create_params": {"input": [{"role": "pirate", "content": "arr"}]}}),
            "",
            json.dumps({"responses_create_params": {"input": ""}}),
            json.dumps({"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "quiz_agnt"}}),
            '{"responses_create_params": {"input": "hi"}, "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
            '{"responses_create_params": {"input": "hi"}, "x": ' + nested_json(300) + "}",
        ],
    )
    done = _prepare(str(config), "--mode", "example-validation", "--output-dir", "out", cwd=tmp_path)
    assert done.returncode == 1
    data = tmp_path / "data" / "example.jsonl"
    for expected in (
        "8 problem(s) in the data; nothing was written",
        f"{data}:2: duplicate key 'x'",
        f"{data}:3: not JSON",
        f"{data}:4: responses_create_params: is required",
        f"{data}:5: responses_create_params.input[0].role: expected one of",
        f"{data}:7: responses_create_params.input: is empty",
        f"{data}:8: agent_ref.name: no server 'quiz_agnt' in the configuration; did you mean 'quiz_agent'?",
        f"{data}:9: nested deeper than {json_input.MAX_DEPTH} levels",
        f"{data}:10: nested deeper than {json_input.MAX_DEPTH} levels",
    ):
        assert expected in done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "data" / "example.stats.json").exists()


def test_changed_data_fails_against_its_committed_statistics_until_accepted(tmp_path):
    config = _author_config(tmp_path, [GOOD, GOOD.replace("2 + 2", "3 + 3")])
    first = _prepare(str(config), "--mode", "example-validation", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    stats = tmp_path / "data" / "example.stats.json"
    assert f"wrote statistics {stats}" in first.stdout
    assert json.loads(stats.read_text())["rows"] == 2

    longer = json.dumps({"responses_create_params": {"input": "What is 2 + 2, twice over?", "temperature": 0.7}})
    _author_config(tmp_path, [GOOD, longer, GOOD])
    changed = _prepare(str(config), "--mode", "example-validation", cwd=tmp_path)
    assert changed.returncode == 1
    assert "no longer matches its committed statistics" in changed.stderr
    assert f"{stats}: rows: committed 2, now 3" in changed.stderr
    assert "sampling.temperature: committed null" in changed.stderr
    assert json.loads(stats.read_text())["rows"] == 2  # not overwritten

    accepted = _prepare(str(config), "--mode", "example-validation", "--update-stats", cwd=tmp_path)
    assert accepted.returncode == 0, accepted.stderr
    assert json.loads(stats.read_text())["rows"] == 3


def test_a_mode_without_its_datasets_or_a_missing_file_is_a_clear_error(tmp_path):
    config = _author_config(tmp_path, [GOOD])
    done = _prepare(str(config), "--mode", "train-preparation", cwd=tmp_path)
    assert done.returncode == 1 and "lists no train or validation datasets" in done.stderr
    missing = _author_config(tmp_path, [GOOD], jsonl_fpath="data/nowhere.jsonl")
    done = _prepare(str(missing), "--mode", "example-validation", cwd=tmp_path)
    assert done.returncode == 1
    assert "nowhere.jsonl: dataset 'example' of quiz_agent does not exist" in done.stderr


def test_training_data_needs_a_license(tmp_path):
    config = _author_config(tmp_path, [GOOD], type="train")
    done = _prepare(str(config), "--mode", "train-preparation", cwd=tmp_path)
    assert done.returncode == 1 and "train data needs a license" in done.stderr


def test_statistics_count_tools_tokens_turns_params_and_messages():
    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}
    rows = [
        {"responses_create_params": {"input": "a b c", "tools": [tool, {**tool, "name": "g"}], "temperature": 0.2}},
        {
            "responses_create_params": {
                "input": [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "x"}],
                "temperature": 1.0,
            }
        },
        {"responses_create_params": {"input": [{"role": "user", "content": "q"}, {"role": "user", "content": "r"}]}},
    ]
    stats = statistics(task_from_row(row) for row in rows)
    assert stats["rows"] == 3
    assert stats["tools_per_row"] == {"avg": round(2 / 3, 4), "min": 0, "max": 2}
    assert stats["user_turns"] == {"avg": round(4 / 3, 4), "min": 1, "max": 2}
    assert stats["unique_create_params"] == 3
    assert stats["unique_user_messages"] == 2  # "a b c" twice
    assert stats["sampling"] == {"temperature": {"rows": 2, "min": 0.2, "max": 1.0}}
    assert stats["input_tokens_approx"]["min"] == 2 and stats["input_tokens_approx"]["max"] > 10  # tools count
    assert approx_tokens("Hello, world!") == 4
    assert differences({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {"c": 3}}) == ["b.c: committed 2, now 3"]


@pytest.mark.slow
def test_the_collated_files_feed_collect(tmp_path):
    """The example file prepare-data writes is a valid input of `gym-grpc collect`: agent_ref routes each row."""
    done = _prepare(
        str(WEATHER_CONFIG), str(MATH_CONFIG), "--mode", "example-validation", "--output-dir", "out", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    run = start_run()
    try:
        output = tmp_path / "rollouts.jsonl"
        args = ["--registry", run.registry, "--input", str(tmp_path / "out" / "example.jsonl"), "--output", str(output)]
        done = gym("collect", *args, "--no-progress")
        assert done.returncode == 0, done.stderr
    finally:
        run.stop()
    agents = [row["agent_ref"]["name"] for row in read_rows(output)]
    assert sorted(agents) == ["math_agent"] * 6 + ["weather_agent"] * 5


def test_the_example_statistics_in_the_repository_are_current():
    """Each committed example.stats.json matches its data (prepare-data would fail otherwise)."""
    for stats in sorted(REPO.glob("servers/*/*/data/*.stats.json")):
        data = stats.with_name(stats.name.replace(".stats.json", ".jsonl"))
        current = statistics(task_from_row(json.loads(line)) for line in data.read_text().splitlines() if line.strip())
        assert differences(json.loads(stats.read_text()), current) == [], stats
