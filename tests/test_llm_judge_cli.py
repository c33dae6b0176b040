"""The LLM judge's bundled config as a user runs it: `gym-grpc run` with the embedded policy as
policy and judge, then `gym-grpc collect`; and a judge named wrong is refused at start."""

import json
import subprocess

import pytest

from gym_grpc.launch.config import check_servers, load_config
from tests.support import REPO, gym, read_rows, start_run, tool

LOCAL_POLICY = REPO / "configs" / "local_policy.yaml"
JUDGE_CONFIG = REPO / "servers" / "resources" / "llm_judge" / "config.yaml"
JUDGE_TASKS = REPO / "servers" / "resources" / "llm_judge" / "data" / "example.jsonl"
OPENAI_JUDGE = REPO / "configs" / "openai_judge.yaml"


@pytest.mark.slow
def test_collect_through_the_bundled_config_records_each_judgement(tmp_path):
    run = start_run(configs=(LOCAL_POLICY, JUDGE_CONFIG))
    try:
        listing = json.loads(
            subprocess.run(
                [tool("grpcurl"), "-plaintext", run.registry, "gym.v1.RegistryService/ListServers"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout
        )
        output = tmp_path / "judged.jsonl"
        args = ["--registry", run.registry, "--agent", "llm_judge_agent", "--input", str(JUDGE_TASKS)]
        done = gym("collect", *args, "--output", str(output), "--no-progress")
        assert done.returncode == 0, done.stderr
    finally:
        run.stop()
    judge = next(s for s in listing["servers"] if s["name"] == "llm_judge")
    assert judge["references"] == {"model": "policy_model"}
    written = read_rows(output)
    assert sorted(row["task_index"] for row in written) == list(range(5))
    for row in written:
        # The embedded policy is no language model: as a judge it writes text without a verdict.
        assert row["judge_model"] == "local-policy"
        (judgement,) = row["judgements"]
        assert judgement["output"] and judgement["verdict"] is None
        assert row["judge_problem"] == "none of the labels '[[A]]', '[[B]]' is in the judge's output"
        assert row["reward"] == 0.0 and row["judge_unparsable"] == 1


@pytest.mark.slow
def test_a_judge_that_is_not_in_the_configuration_is_refused_at_start():
    done = subprocess.run(
        [
            tool("gym-grpc"),
            "run",
            str(LOCAL_POLICY),
            str(JUDGE_CONFIG),
            "--registry",
            "127.0.0.1:0",
            "servers.llm_judge.config.judge_model_server=judge_modle",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "server 'llm_judge' calls model server 'judge_modle', which is not in the configuration" in done.stderr


def test_a_judge_of_its_own_from_the_openai_judge_config_validates_with_its_env_keys(tmp_path):
    env = tmp_path / "env.yaml"
    env.write_text(
        "policy_base_url: http://gpu:8000/v1\npolicy_api_key: EMPTY\npolicy_model_name: Qwen/Qwen3-4B\n"
        "judge_base_url: https://api.openai.com/v1\njudge_api_key: sk-x\njudge_model_name: gpt-4.1-mini\n"
    )
    configs = [REPO / "configs" / "vllm.yaml", OPENAI_JUDGE, JUDGE_CONFIG]
    config = load_config(configs, ["servers.llm_judge.config.judge_model_server=judge_model"], env_file=env)
    check_servers(config)  # every config block against its server class, as the server processes will
    judge = config.servers["judge_model"].config
    assert judge["base_url"] == "https://api.openai.com/v1" and judge["model"] == "gpt-4.1-mini"
    assert config.servers["llm_judge"].config["judge_model_server"] == "judge_model"
    assert config.servers["llm_judge_agent"].config["model_server"] == "policy_model"
