"""The browser environment in real headless Chromium (Debian's package, driven by Playwright): the scripted
policy solves every task page and the idle one scores 0, screenshots are real PNGs of the page, the cap
on browsers alive queues sessions, and what a bad row or a missing Chromium costs.

Marked `browser`: deselected unless pytest runs with --browser (CI installs Debian's chromium first)."""

import asyncio
import base64
import json
from pathlib import Path

import grpc
import pytest

from gym_grpc import errors, images
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.resources.browser import tasks
from gym_grpc.bundled.servers.resources.browser.policy import ScriptedBrowserPolicy
from gym_grpc.bundled.servers.resources.browser.server import BrowserEnv, find_chromium
from gym_grpc.client.stubs import AgentClient, ResourcesClient
from gym_grpc.data import rows
from gym_grpc.rpc.registry import Registry
from gym_grpc.testing import ResourcesConformance, static_registry
from gym_grpc.v1 import responses_pb2 as r
from tests.support import collect_args, gym, read_rows, start_run

pytestmark = pytest.mark.browser

HERE = Path(__file__).resolve().parent.parent
ROWS = [json.loads(line) for line in (HERE / "data" / "example.jsonl").read_text().splitlines()]


def test_the_example_rows_are_the_task_pages_and_there_are_at_least_ten():
    assert ROWS == BrowserEnv(name="browser").task_rows()
    assert len(ROWS) >= 10 and all(page.solution for page in tasks.pages())


async def _stack(start, act: bool, **env) -> AgentClient:
    policy = await start(ScriptedBrowserPolicy({"act": act}, name="policy"))
    browser = await start(BrowserEnv(env, name="browser"))
    static = {"policy": policy.address, "browser": browser.address}
    config = {"model_server": "policy", "resources_server": "browser", "max_steps": 24}
    agent = await start(SimpleAgent(config, name="agent", registry=Registry(static=static)))
    return AgentClient(Registry(static={**static, "agent": agent.address}), "agent")


async def test_the_scripted_policy_solves_every_task_and_the_idle_one_none(start):
    scripted, idle = await _stack(start, act=True), await _stack(start, act=False)
    solved = await asyncio.gather(*(scripted.run(rows.task_from_row(row)) for row in ROWS))
    untouched = await asyncio.gather(*(idle.run(rows.task_from_row(row)) for row in ROWS))
    assert {row["task"]: rollout.reward for row, rollout in zip(ROWS, solved, strict=True)} == {
        row["task"]: 1.0 for row in ROWS
    }
    assert [rollout.reward for rollout in untouched] == [0.0] * len(ROWS)
    for row, rollout in zip(ROWS, solved, strict=True):
        shots = [image for _, image in images.images_in(rollout.response.output)]
        steps = len(tasks.read_page(HERE / "tasks" / f"{row['task']}.html").solution)
        # A screenshot before each action: each by value at its first showing (a PNG), by hash after.
        assert len(shots) == steps and images.media_type_of(shots[0].data) == "image/png"
        assert all(images.media_type_of(i.data) == "image/png" or (not i.data and i.sha256) for i in shots)
        assert rows.json_field(rollout, "verifier_fields")["actions"] == steps


async def test_a_screenshot_is_a_png_of_the_page_and_shows_what_the_actions_did(start):
    running = await start(BrowserEnv(name="browser"))
    client = ResourcesClient(static_registry(browser=running), "browser")
    row = next(row for row in ROWS if row["task"] == "click-color")
    await client.seed_session("s", rows.task_from_row(row))
    shot = await client.call_tool("s", r.FunctionCall(name="screenshot", arguments="{}"))
    [part] = shot.parts
    data = part.input_image.data
    assert part.input_image.media_type == "image/png" and data[16:24] == (400).to_bytes(4) + (300).to_bytes(4)
    again = await client.call_tool("s", r.FunctionCall(name="screenshot", arguments="{}"))
    assert again.parts[0].input_image.data == data  # nothing changed on the page: the same bytes
    scrolled = await client.call_tool("s", r.FunctionCall(name="type_text", arguments='{"text": "x"}'))
    assert scrolled.output == 'typed "x"'
    outside = await client.call_tool("s", r.FunctionCall(name="click", arguments='{"x": 400, "y": 10}'))
    assert outside.error and "(400, 10) is outside the 400x300 screen" in outside.output
    bad_key = await client.call_tool("s", r.FunctionCall(name="key", arguments='{"name": "Hyper"}'))
    assert bad_key.error and "unknown key 'Hyper'" in bad_key.output
    await client.close_session("s")
    await client.registry.close()


async def test_sessions_past_max_browsers_wait_for_one_and_give_up_at_their_deadline(start):
    running = await start(BrowserEnv({"max_browsers": 1}, name="browser"))
    client = ResourcesClient(static_registry(browser=running), "browser")
    task = rows.task_from_row(ROWS[0])
    await client.seed_session("a", task)
    waiting = asyncio.ensure_future(client.seed_session("b", task))
    await asyncio.sleep(0.5)
    assert not waiting.done() and running.app.waiting == 1
    await client.close_session("a")  # its browser context goes to the one waiting
    await asyncio.wait_for(waiting, 30)
    hurried = ResourcesClient(client.registry, "browser", timeout=1.0)
    with pytest.raises(errors.DeadlineExceeded):
        await hurried.seed_session("c", task)
    await client.close_session("b")
    await client.registry.close()


async def test_a_row_naming_no_task_page_is_task_data_invalid(start):
    running = await start(BrowserEnv(name="browser"))
    client = ResourcesClient(static_registry(browser=running), "browser")
    for name in ("no-such-task", "../server"):
        row = {**ROWS[0], "task": name}
        with pytest.raises(errors.InvalidArgument) as bad:
            await client.seed_session(name, rows.task_from_row(row))
        assert bad.value.reason == errors.Reason.TASK_DATA_INVALID and "is not a task page" in bad.value.message
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
    await client.registry.close()


class TestBrowserConformance(ResourcesConformance):
    task_row = ROWS[0]
    answer = "Done."

    def server(self):
        return BrowserEnv(name="browser")


def test_a_missing_chromium_is_a_config_error_saying_what_to_install():
    with pytest.raises(errors.ConfigError, match=r"apt-get install chromium"):
        find_chromium("/nonexistent/chromium")


def test_gym_grpc_run_and_collect_score_the_scripted_policy_1_and_the_idle_one_0_with_each_screenshot_once(tmp_path):
    """Real `gym-grpc run` (the environment's config.yaml) and `gym-grpc collect` processes."""
    tasks_file = HERE / "data" / "example.jsonl"
    # browser_agent, which the run serves too, wants a model server named policy_model: the embedded one.
    with start_run(configs=(HERE / "config.yaml", HERE.parents[2] / "configs" / "local_policy.yaml")) as run:
        for agent, reward in (("browser_scripted_agent", 1.0), ("browser_idle_agent", 0.0)):
            output = tmp_path / f"{agent}.jsonl"
            done = gym(*collect_args(run.registry, agent, tasks_file, output), "--max-in-flight", "4")
            assert done.returncode == 0, done.stderr
            written = read_rows(output)
            assert sorted(row["task"] for row in written) == sorted(row["task"] for row in ROWS)
            assert [row["reward"] for row in written] == [reward] * len(ROWS), agent
    for row in read_rows(tmp_path / "browser_scripted_agent.jsonl"):
        urls = [
            part["image_url"]
            for item in row["response"]["output"]
            if item["type"] == "function_call_output" and isinstance(item["output"], list)
            for part in item["output"]
        ]
        by_value = [url for url in urls if url.startswith("data:image/png;base64,")]
        hashes = {images.Image.from_bytes(base64.b64decode(url.partition(",")[2])).sha256 for url in by_value}
        # Each picture once by value; a screen shown again (nothing changed yet) by its hash.
        assert len(hashes) == len(by_value) and all(
            url.removeprefix("sha256:") in hashes for url in urls if url not in by_value
        )


async def test_with_screenshot_after_action_each_action_shows_the_screen_it_left(start):
    running = await start(BrowserEnv({"screenshot_after_action": True}, name="browser"))
    client = ResourcesClient(static_registry(browser=running), "browser")
    row = next(row for row in ROWS if row["task"] == "enter-text")
    await client.seed_session("s", rows.task_from_row(row))
    before = (await client.call_tool("s", r.FunctionCall(name="screenshot", arguments="{}"))).parts[0]
    await client.call_tool("s", r.FunctionCall(name="click", arguments='{"x": 120, "y": 74}'))
    typed = await client.call_tool("s", r.FunctionCall(name="type_text", arguments='{"text": "hi"}'))
    assert typed.output == 'typed "hi"' and [p.WhichOneof("part") for p in typed.parts] == ["input_text", "input_image"]
    assert typed.parts[1].input_image.data != before.input_image.data  # the text box shows "hi" now
    await client.close_session("s")
    await client.registry.close()
