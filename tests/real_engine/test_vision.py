"""A vision-language model on the real CPU vLLM, fed images by gym-grpc.

The model is SmolVLM's architecture (vLLM's Idefics3) around SmolLM2-135M's real weights, with a small
vision tower initialised at random, assembled by gym_grpc/engines/local_vllm/vision_model.py (no small
vision-language model ships in a registry package). Its answers about images mean nothing; the engine,
its image processor and the image tokens in its prompts are real. vllm_model gives it images by Chat
Completions (the token path takes text only for now, and says so).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel
from gym_grpc.client.stubs import ModelClient
from gym_grpc.engines import local_vllm
from gym_grpc.images import Image
from gym_grpc.responses import user_message
from gym_grpc.testing import call, static_registry
from gym_grpc.v1 import responses_pb2 as r
from tests.real_engine import gym_cli
from tests.support import start_run
from tests.test_images import png

pytestmark = pytest.mark.real_engine

BROWSER = gym_cli.REPO / "servers" / "resources" / "browser"


def _image_tokens() -> int:
    """What one image costs in the prompt, from the model's own processor config: its <image> tokens
    (image_seq_len), between two <fake_token_around_image> and after <global-img>, and the newline vLLM
    writes after each image's placeholder in a template that takes text content."""
    prepared = local_vllm.prepare(vision=True)
    config = json.loads((prepared.model_dir / "processor_config.json").read_text())
    return config["image_seq_len"] + 3 + 1


async def _prompt_tokens(model: ModelClient, items: list[r.Item]) -> int:
    params = r.CreateParams(max_output_tokens=4, temperature=0)
    params.input_items.items.extend(items)
    return (await model.create_response(params, "")).usage.input_tokens


def _with(text: str, *pictures: bytes) -> r.Item:
    parts = [r.ContentPart(input_text=r.InputText(text=text))] + [Image.from_bytes(p).part() for p in pictures]
    return r.Item(message=r.Message(role=r.ROLE_USER, parts=r.ContentList(items=parts)))


async def test_the_engine_gets_each_image_of_a_message_and_of_a_tool_output_as_its_image_tokens(
    start, vision_engine: local_vllm.Engine
) -> None:
    server = VLLMModel({"base_url": vision_engine.base_url, "model": vision_engine.model}, name="vision")
    model = ModelClient(static_registry(vision=await start(server)), "vision")
    red, blue = png(120, 90, (220, 30, 30)), png(120, 90, (40, 60, 220))
    per_image = _image_tokens()
    text_only = await _prompt_tokens(model, [user_message("What do you see?")])
    one = await _prompt_tokens(model, [_with("What do you see?", red)])
    two = await _prompt_tokens(model, [_with("What do you see?", red, blue)])
    assert (one - text_only, two - one) == (per_image, per_image)
    # A tool's images: in a user message after the tool's text (Chat's tool messages are text only).
    looked = call("screenshot", "{}")
    output = r.FunctionCallOutput(call_id=looked.function_call.call_id)
    output.output_parts.items.extend([Image.from_bytes(red).part()])
    shown = [user_message("Look."), looked, r.Item(function_call_output=output)]
    output_two = r.FunctionCallOutput(call_id=looked.function_call.call_id)
    output_two.output_parts.items.extend([Image.from_bytes(red).part(), Image.from_bytes(blue).part()])
    shown_two = [user_message("Look."), looked, r.Item(function_call_output=output_two)]
    assert await _prompt_tokens(model, shown_two) - await _prompt_tokens(model, shown) == per_image
    await model.registry.close()


async def test_on_the_token_path_image_turns_extend_the_sampled_ids_and_generate_as_the_chat_path(
    start, vision_engine: local_vllm.Engine
) -> None:
    """Token in, token out with images: the prompt ids hold each image's tokens, the images' features go
    beside them (vLLM's render, then generate), a later turn's prompt extends the earlier prompt and its
    sampled ids, and at temperature 0 the first turn generates what the engine's own chat path does for
    the same picture (so the picture reached the model, not only its placeholder)."""
    config = {"base_url": vision_engine.base_url, "model": vision_engine.model, "return_token_ids": True}
    tokens = ModelClient(static_registry(t=await start(VLLMModel(config, name="t"))), "t")
    chat = ModelClient(
        static_registry(c=await start(VLLMModel({**config, "token_in_token_out": False}, name="c"))), "c"
    )
    red, blue = png(120, 90, (220, 30, 30)), png(120, 90, (40, 60, 220))
    params = r.CreateParams(max_output_tokens=12, temperature=0)
    params.input_items.items.append(_with("What colour is this?", red))
    first = await tokens.create_response(params, "s")
    by_chat = await chat.create_response(params, "")
    turn = first.output[-1].message
    assert list(turn.generation_token_ids) == list(by_chat.output[-1].message.generation_token_ids)
    assert len(turn.prompt_token_ids) == await _prompt_tokens(chat, list(params.input_items.items))
    params.input_items.items.extend(first.output)
    params.input_items.items.append(_with("And this one?", blue))
    second = (await tokens.create_response(params, "s")).output[-1].message
    earlier = [*turn.prompt_token_ids, *turn.generation_token_ids]
    assert list(second.prompt_token_ids[: len(earlier)]) == earlier
    model_dir = local_vllm.prepare(vision=True).model_dir
    image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    per_image = json.loads((model_dir / "processor_config.json").read_text())["image_seq_len"]
    assert [list(ids).count(image_token) for ids in (turn.prompt_token_ids, second.prompt_token_ids)] == [
        per_image, 2 * per_image,
    ]  # fmt: skip
    assert second.generation_token_ids and len(second.generation_log_probs) == len(second.generation_token_ids)
    await tokens.registry.close()
    await chat.registry.close()


def test_browser_rollouts_through_the_vision_model_carry_token_ids_that_extend_across_image_turns(
    vision_engine: local_vllm.Engine, tmp_path: Path
) -> None:
    """Real `gym-grpc run` (the browser environment and configs/vllm.yaml on the token path) and
    `collect`, every turn a call of the screenshot tool (a named tool_choice: with `required`, the
    model's clicks and keys could all be refused, and no screenshot be taken; CI saw it once): every
    task page rolled out through the model, every later turn's prompt the earlier turn's ids
    extended, with the image tokens of the screenshot the turn before took. A call the model pads
    with whitespace past max_output_tokens (the grammar allows it; seen once at 48) is cut, and its
    rollout ends there, so not every rollout has a later turn."""
    env = tmp_path / "env.yaml"
    env.write_text(
        f"policy_base_url: {vision_engine.base_url}\npolicy_api_key: EMPTY\npolicy_model_name: {vision_engine.model}\n"
        f"policy_chat_template: {local_vllm.CHAT_TEMPLATE}\n"
    )
    output = tmp_path / "browser.jsonl"
    overrides = ("servers.browser_agent.config.max_steps=4", "servers.browser.config.screenshot_after_action=true")
    run = start_run("--env-file", str(env), *overrides, configs=(BROWSER / "config.yaml", gym_cli.VLLM))
    try:
        tasks = BROWSER / "data" / "example.jsonl"
        extra = ("max_output_tokens=200", "temperature=1.0", 'tool_choice={"type": "function", "name": "screenshot"}')
        done = gym_cli.collect(run, "browser_agent", tasks, output, *extra)
    finally:
        run.stop()
    assert done.returncode == 0, done.stderr
    written = gym_cli.rows(output)
    assert len(written) == len(tasks.read_text().splitlines()) and gym_cli.failures(output) == []
    image_token = json.loads((local_vllm.prepare(vision=True).model_dir / "config.json").read_text())["image_token_id"]
    later_turns = 0
    for row in written:
        turns = [item for item in row["response"]["output"] if item.get("generation_token_ids")]
        assert turns, row["response"]["output"]
        for before, after in zip(turns, turns[1:], strict=False):
            earlier = before["prompt_token_ids"] + before["generation_token_ids"]
            assert after["prompt_token_ids"][: len(earlier)] == earlier
            assert after["prompt_token_ids"].count(image_token) > before["prompt_token_ids"].count(image_token)
            later_turns += 1
    assert later_turns > 0, "no rollout went past its first turn"
