"""The token ids on rows collected through vllm_model agree with the engine: as many
generated ids as log-probs as the response's output tokens, and the engine's own
/detokenize of the generated ids gives back the item's content.

How the text relates to the ids (SmolLM2 with gym_grpc/engines/local_vllm/hermes_tools.jinja):
a message's detokenized ids are its text followed by <|im_end|>, or its text alone when
the turn was cut at max_output_tokens, where the text may have lost the whitespace
around it (vllm_model's Chat Completions path strips it; the ids keep it); a tool call's begin with
"<tool_call>\\n" + JSON {"name", "arguments"} + "\\n</tool_call>", and its item carries
the name and the arguments re-serialised (json.dumps) by the engine's parser, so the
relation holds for the parsed JSON, not for the characters. Whatever the model writes
after </tool_call> is in the ids and in no item. Special tokens the model samples mid-text
(SmolLM2 writes <filename> or <gh_stars> in code-like text) are in the text as in the ids.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gym_grpc.engines import local_vllm
from tests.real_engine import gym_cli

pytestmark = pytest.mark.real_engine

END = "<|im_end|>"


def _detokenize(engine: local_vllm.Engine, ids: list[int]) -> str:
    root = engine.base_url.removesuffix("/v1")  # vLLM serves /detokenize outside /v1
    return gym_cli.post_json(f"{root}/detokenize", {"model": engine.model, "tokens": ids})["prompt"]


def _held_back(engine: local_vllm.Engine, ids: list[int], text: str) -> str:
    """The text vLLM's HTTP server shows for a turn cut after `ids` (whose text is `text`): that of
    the ids left once the last ones, whose text ends inside a character, are dropped."""
    while ids and text.endswith("\ufffd"):
        ids = ids[:-1]
        text = _detokenize(engine, ids) if ids else ""
    return text


def _check_rollout(engine: local_vllm.Engine, row: dict[str, Any]) -> list[str]:
    """Check every turn of a rollout; the types of the items that carried the ids."""
    response = row["response"]
    carriers = [item for item in response["output"] if item.get("generation_token_ids")]
    assert carriers, "no output item carries token ids"
    assert sum(len(item["generation_token_ids"]) for item in carriers) == response["usage"]["output_tokens"]
    for item in carriers:
        generated, log_probs = item["generation_token_ids"], item["generation_log_probs"]
        assert len(generated) == len(log_probs) and all(p <= 0.0 for p in log_probs)
        text = _detokenize(engine, generated)
        if item["type"] == "message":
            cut = item.get("status") == "incomplete"
            assert cut or text.endswith(END), text[-80:]
            # A turn cut at max_output_tokens may end inside a character (byte-level tokens): its
            # last ids decode to U+FFFD. vLLM's incremental detokenizer (tokenizers' DecodeStream)
            # holds back all of a token whose text ends inside a character, the whole characters
            # it begins with too, and at the cut never writes them; the model server decoding a gRPC
            # engine's ids itself drops only the U+FFFD.
            bodies = [text.removesuffix(END)]
            if cut:
                bodies = [text.rstrip("\ufffd"), _held_back(engine, generated, text)]
            # vllm_model's chat path strips the whitespace around a message's text
            # (the model often ends with "\n\n"); the ids keep it.
            shown = "".join(part["text"] for part in item["content"])
            assert shown in bodies or shown in [body.strip() for body in bodies], bodies
        else:
            # The ids cover the whole turn: any text the model wrote first, then its calls,
            # of which this item is the last.
            assert item["type"] == "function_call"
            calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.DOTALL)
            assert calls, text
            body = json.loads(calls[-1])
            assert body == {"name": item["name"], "arguments": json.loads(item["arguments"])}
            assert item["arguments"] == json.dumps(body["arguments"], ensure_ascii=False)
    return [item["type"] for item in carriers]


def test_generated_ids_log_probs_and_usage_agree_and_detokenize_to_the_items(
    engine: local_vllm.Engine, policy: local_vllm.Engine, tmp_path: Path
) -> None:
    """On vLLM's HTTP server and on its gRPC one (`policy`), whose text the model server decodes itself:
    both checked against the HTTP server's /detokenize."""
    sampled, greedy = tmp_path / "sampled.jsonl", tmp_path / "greedy.jsonl"
    with gym_cli.serving(policy, tmp_path, gym_cli.VLLM, gym_cli.WEATHER_CONFIG) as run:
        done = gym_cli.collect(
            run, "weather_agent", gym_cli.WEATHER_TASKS, sampled, "--num-repeats", "2",
            "temperature=1.0", "max_output_tokens=200",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    # Sampling may call no tool at all: task 3 alone and greedy calls it (with "Barcelona"),
    # so that a function_call item is checked too. No seed: a seeded request batched with
    # others crashes this CPU build's engine core. One model call: greedy, the model runs on
    # after </tool_call>, and a second turn's re-rendered history would not begin with the
    # ids it generated (the chat path fails that turn FAILED_PRECONDITION).
    overrides = ("servers.weather_agent.config.max_steps=1",)
    with gym_cli.serving(policy, tmp_path, gym_cli.VLLM, gym_cli.WEATHER_CONFIG, overrides=overrides) as run:
        task = gym_cli.rows(gym_cli.WEATHER_TASKS)[3]
        done = gym_cli.collect(
            run, "weather_agent", gym_cli.tasks_file(tmp_path / "task3.jsonl", [task]), greedy,
            "--max-in-flight", "1", "temperature=0", "max_output_tokens=200",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    rows = gym_cli.rows(sampled)
    assert len(rows) == 10
    for row in rows:
        _check_rollout(engine, row)
    [row] = gym_cli.rows(greedy)
    assert "function_call" in _check_rollout(engine, row)


@pytest.mark.parametrize("path", ["token_in_token_out", "grpc", "chat"])
def test_special_tokens_the_model_samples_stay_in_the_items_text(
    engine: local_vllm.Engine, tmp_path: Path, path: str, request: pytest.FixtureRequest
) -> None:
    """vLLM drops special tokens from its text unless asked; CI's sampled run once wrote <filename>
    mid-message and the item's text lost it. Here a logit bias makes the model write it. The chat
    path is tried without tools (math): with tools, vLLM's hermes parser keeps special tokens itself.
    Over gRPC (the token path) the model server decodes the ids itself."""
    filename = 6  # "<filename>" in SmolLM2's vocabulary, a special token
    config, tasks, agent = (
        (gym_cli.WEATHER_CONFIG, gym_cli.WEATHER_TASKS, "weather_agent")
        if path != "chat"
        else (gym_cli.MATH_CONFIG, gym_cli.MATH_TASKS, "math_agent")
    )
    task = gym_cli.rows(tasks)[0]
    task["responses_create_params"]["metadata"] = {"extra_body": json.dumps({"logit_bias": {str(filename): 100}})}
    overrides = () if path != "chat" else ("servers.policy_model.config.token_in_token_out=false",)
    output = tmp_path / "special.jsonl"
    policy = request.getfixturevalue("grpc_engine") if path == "grpc" else engine
    with gym_cli.serving(policy, tmp_path, gym_cli.VLLM, config, overrides=overrides) as run:
        one = gym_cli.tasks_file(tmp_path / "task.jsonl", [task])
        done = gym_cli.collect(run, agent, one, output, "temperature=0", "max_output_tokens=3")
        assert done.returncode == 0, done.stderr
    [row] = gym_cli.rows(output)
    [message] = row["response"]["output"]
    assert message["generation_token_ids"] == [filename] * 3
    assert message["content"][0]["text"] == "<filename>" * 3 == _detokenize(engine, message["generation_token_ids"])
