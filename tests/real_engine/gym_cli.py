"""The `gym-grpc` command against the real engine, as a user runs it: an env file that
points a config at the engine, `gym-grpc run` in the background, `gym-grpc collect`.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gym_grpc.engines import local_vllm
from gym_grpc.engines.settings import GRPC_SCHEME
from gym_grpc.testing.processes import GymRun
from tests.support import REPO, start_run, tool
from tests.support import read_rows as rows  # the real-engine tests' name for it

VLLM = REPO / "configs" / "vllm.yaml"
OPENAI = REPO / "configs" / "openai.yaml"
WEATHER_CONFIG = REPO / "servers" / "resources" / "weather" / "config.yaml"
MATH_CONFIG = REPO / "servers" / "resources" / "math" / "config.yaml"
WEATHER_TASKS = REPO / "servers" / "resources" / "weather" / "data" / "example.jsonl"
MATH_TASKS = REPO / "servers" / "resources" / "math" / "data" / "example.jsonl"


def is_grpc(engine: local_vllm.Engine) -> bool:
    return engine.base_url.startswith(GRPC_SCHEME)


def env_file(engine: local_vllm.Engine, directory: Path) -> Path:
    """An env.yaml that points configs/vllm.yaml or configs/openai.yaml at `engine`, with the tokenizer
    and chat template it serves (configs/vllm.yaml then renders prompts in the model server). A gRPC
    engine's tokenizer is not given: the model server fetches it from the engine."""
    path = directory / "env.yaml"
    tokenizer = "" if is_grpc(engine) else f"policy_tokenizer_dir: {local_vllm.prepare().model_dir}\n"
    path.write_text(
        f"policy_base_url: {engine.base_url}\npolicy_api_key: EMPTY\npolicy_model_name: {engine.model}\n"
        f"{tokenizer}policy_chat_template: {local_vllm.CHAT_TEMPLATE}\n"
    )
    return path


@contextlib.contextmanager
def serving(
    engine: local_vllm.Engine, directory: Path, *configs: Path, overrides: tuple[str, ...] = ()
) -> Iterator[GymRun]:
    """`gym-grpc run CONFIGS --env-file ENV` (port 0 registry) until the block ends. With configs/vllm.yaml,
    every prompt rendered in the model server is checked against the engine's /tokenize (verify_render):
    the proof, on every conversation of these tests, that local rendering gives the engine's ids (a gRPC
    engine has no /tokenize: the tests compare with the HTTP engine's instead)."""
    if VLLM in configs and not is_grpc(engine):
        overrides = ("servers.policy_model.config.verify_render=true", *overrides)
    run = start_run("--env-file", str(env_file(engine, directory)), *overrides, configs=configs)
    try:
        yield run
    finally:
        run.stop()


def collect_args(run: GymRun, agent: str, tasks: Path, output: Path, *extra: str) -> list[str]:
    """The `gym-grpc collect` command line (extra: more options, then KEY=VALUE overrides)."""
    return [
        tool("gym-grpc"),
        "collect",
        "--registry",
        run.registry,
        "--agent",
        agent,
        "--input",
        str(tasks),
        "--output",
        str(output),
        "--no-progress",
        *extra,
    ]


def collect(run: GymRun, agent: str, tasks: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run `gym-grpc collect` to its end. The time-out only bounds a hang: a slow, shared
    2-core machine may take many minutes."""
    return subprocess.run(collect_args(run, agent, tasks, output, *extra), capture_output=True, text=True, timeout=3600)


def failures(output: Path) -> list[dict[str, Any]]:
    """The failures sidecar of a collect output (empty when there is none)."""
    sidecar = output.with_suffix(".failures.jsonl")
    return rows(sidecar) if sidecar.exists() else []


def tasks_file(path: Path, rows_: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows_))
    return path


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST JSON to the engine; its JSON answer, or an AssertionError quoting the HTTP error."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"POST {url} -> {e.code}: {e.read().decode(errors='replace')[:2000]}") from None


def carriers(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The items of a rollout row that carry a turn's token ids, in order."""
    return [item for item in row["response"]["output"] if item.get("generation_token_ids")]


def extension_share(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """(turns whose prompt begins with the previous turn's prompt + generated ids, turns after a first)."""
    extending = later = 0
    for row in rows:
        turns = carriers(row)
        for earlier, turn in zip(turns, turns[1:], strict=False):
            sampled = earlier["prompt_token_ids"] + earlier["generation_token_ids"]
            later += 1
            extending += turn["prompt_token_ids"][: len(sampled)] == sampled
    return extending, later
