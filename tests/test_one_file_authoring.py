"""One-file authoring: examples/one_file_env.py and examples/one_file_agent.py, as docs/authoring.md shows them,
and examples/one_file_screen_env.py, the computer-use one of docs/browser.md.

Each is under 60 lines, passes the conformance kit in process, and runs in a
real `gym-grpc run` where `gym-grpc conformance` passes it and `collect`
earns rewards with the embedded model."""

from __future__ import annotations

import asyncio
import io
import json
import signal
import subprocess
import sys
from pathlib import Path

import PIL.Image
import pytest

from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.client.stubs import AgentClient, ResourcesClient
from gym_grpc.data.rows import task_from_row
from gym_grpc.server.entrypoints import load_entrypoint
from gym_grpc.testing import AgentConformance, ResourcesConformance, ScriptedModel, Servers, call, static_registry
from gym_grpc.v1 import responses_pb2 as r
from tests.support import REPO, eventually, gym, read_rows, start_run

EXAMPLES = REPO / "examples"
ENV_FILE, AGENT_FILE = EXAMPLES / "one_file_env.py", EXAMPLES / "one_file_agent.py"
TASKS = EXAMPLES / "one_file_tasks.jsonl"
OppositesEnv = load_entrypoint(f"{ENV_FILE}:OppositesEnv")
FirmAgent = load_entrypoint(f"{AGENT_FILE}:FirmAgent")
ROW = json.loads(TASKS.read_text().splitlines()[0])
SCREEN_FILE, SCREEN_TASKS = EXAMPLES / "one_file_screen_env.py", EXAMPLES / "one_file_screen_tasks.jsonl"
ScreenEnv = load_entrypoint(f"{SCREEN_FILE}:ScreenEnv")
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 60, 220), "yellow": (240, 210, 40)}


@pytest.mark.parametrize("path", [ENV_FILE, AGENT_FILE, SCREEN_FILE], ids=["env", "agent", "screen"])
def test_each_example_is_one_file_under_60_lines(path: Path):
    assert len(path.read_text().splitlines()) < 60


class TestOneFileEnvConformance(ResourcesConformance):
    task_row = ROW
    answer = "The opposite of hot is cold."

    def server(self):
        return OppositesEnv(name="opposites")


class TestOneFileAgentConformance(AgentConformance):
    task_row = ROW

    def dependencies(self):
        return {"policy_model": LocalPolicyModel(), "opposites": OppositesEnv()}

    def agent(self, registry):
        return FirmAgent({"model_server": "policy_model", "resources_server": "opposites"}, registry=registry)


async def test_the_agent_sends_its_system_prompt_and_forbids_tools_on_its_last_step():
    async with Servers() as servers:
        model = ScriptedModel([[call("opposite", '{"word": "hot"}')]])  # calls a tool forever
        deps = {"model": await servers.start(model), "env": await servers.start(OppositesEnv())}
        config = {"model_server": "model", "resources_server": "env", "max_steps": 3, "system_prompt": "Be brief."}
        agent = FirmAgent(config, registry=static_registry(**deps))
        client = AgentClient(static_registry(agent=await servers.start(agent)), "agent")
        rollout = await client.run(task_from_row(ROW), timeout=30)
    assert rollout.model_calls == 3
    first = model.requests[0].input_items.items[0].message
    assert (first.role, first.text) == (r.ROLE_SYSTEM, "Be brief.")
    modes = [request.tool_choice.mode for request in model.requests]
    assert modes == [r.TOOL_CHOICE_MODE_UNSPECIFIED] * 2 + [r.TOOL_CHOICE_MODE_NONE]


def test_the_pair_runs_in_gym_grpc_run_passes_conformance_and_earns_rewards(tmp_path):
    run = start_run(configs=(EXAMPLES / "one_file.yaml",))
    try:
        for name in ("opposites", "opposites_agent"):
            done = gym("conformance", run.servers[name], "--row", str(TASKS))
            assert done.returncode == 0, done.stdout + done.stderr
            assert "0 failed" in done.stdout
        output = tmp_path / "out.jsonl"
        args = [
            "--registry",
            run.registry,
            "--agent",
            "opposites_agent",
            "--input",
            str(TASKS),
            "--output",
            str(output),
        ]
        done = gym("collect", *args, "--no-progress", "temperature=0")
        assert done.returncode == 0, done.stderr
    finally:
        run.stop()
    written = read_rows(output)
    assert len(written) == 3 and all(row["reward"] == 1.0 and row["used_tool"] for row in written)


def test_the_env_file_serves_itself_and_gym_grpc_conformance_passes_it():
    server = subprocess.Popen([sys.executable, str(ENV_FILE)], stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().strip()
        assert address.startswith("127.0.0.1:"), address
        done = gym("conformance", address, "--row", str(TASKS))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "resources server 'opposites'" in done.stdout
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0


#: A one-file server whose start hangs (tests/programs/hanging_env.py), served as the examples serve theirs.
HANGING_FILE_SERVER = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from tests.programs.hanging_env import HangingEnv
from gym_grpc.server.serving import serve_until_signalled
config = {"started_file": sys.argv[2], "cancelled_file": sys.argv[3]}
asyncio.run(serve_until_signalled(HangingEnv(config, name="hanging")))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_one_file_server_signalled_while_it_starts_cancels_its_start_and_exits(tmp_path, sig):
    """A model that loads for minutes is stopped with `kill` (or Ctrl-C) before it serves: its start
    is cancelled, so that its own clean-up runs, and the process exits 0 at once. SIGTERM used to
    end it there and then, its clean-up not run; SIGINT, with a KeyboardInterrupt traceback."""
    started, cancelled = tmp_path / "started", tmp_path / "cancelled"
    command = [sys.executable, "-c", HANGING_FILE_SERVER, str(REPO), str(started), str(cancelled)]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        asyncio.run(eventually(started.exists, "the server's start began"))
        server.send_signal(sig)
        _, stderr = server.communicate(timeout=30)
    finally:
        server.kill()
    assert server.returncode == 0 and cancelled.exists(), stderr


class TestOneFileScreenEnvConformance(ResourcesConformance):
    task_row = json.loads(SCREEN_TASKS.read_text().splitlines()[0])
    answer = "Clicked."

    def server(self):
        return ScreenEnv(name="screen")


async def test_the_screen_env_shows_its_squares_and_a_click_on_the_named_one_scores_1():
    """The screenshot read back with Pillow (a decoder not written here): click the square whose pixels are
    the named colour and score 1; the square beside it scores 0."""
    async with Servers() as servers:
        client = ResourcesClient(static_registry(screen=await servers.start(ScreenEnv(name="screen"))), "screen")
        for line in SCREEN_TASKS.read_text().splitlines():
            row = json.loads(line)
            task = task_from_row(row)
            for offset, reward in ((0, 1.0), (40, 0.0)):
                await client.seed_session("s", task)
                shot = await client.call_tool("s", r.FunctionCall(name="screenshot", arguments="{}"))
                picture = PIL.Image.open(io.BytesIO(shot.parts[0].input_image.data)).convert("RGB")
                centres = [(x, y) for y in (20, 60) for x in (20, 60)]
                x, y = next(c for c in centres if picture.getpixel(c) == COLOURS[row["target"]])
                click = json.dumps({"x": (x + offset) % 80, "y": y})
                await client.call_tool("s", r.FunctionCall(name="click", arguments=click))
                verdict = await client.verify("s", task, r.Response())
                assert verdict.reward == reward, (row["target"], offset)
                await client.close_session("s")
        await client.registry.close()


def test_docs_authoring_shows_the_example_files_as_they_are():
    """Each Python block of docs/authoring.md that shows an example file is made of that file's lines."""
    doc = (REPO / "docs" / "authoring.md").read_text()
    blocks = doc.split("```python\n")[1:]
    shown = {
        path: next(b.split("```")[0] for b in blocks if f"class {cls}(" in b)
        for path, cls in [(ENV_FILE, "OppositesEnv"), (AGENT_FILE, "FirmAgent")]
    }
    for path, block in shown.items():
        lines = set(path.read_text().splitlines())
        missing = [line for line in block.splitlines() if line.strip() and line not in lines]
        assert missing == [], f"docs/authoring.md shows lines {path.name} does not have"
