"""What a turn of the token path asks of the engine: one generation, and nothing that grows with the
turns before it. Rendered here (`tokenizer_dir`): no /tokenize at all; rendered by the engine: two a
turn, the session's last prompt kept. Against the fake vLLM, whose tokenizer and chat template
`write_tokenizer` gives as files (the real engine's own are checked in tests/real_engine)."""

from collections import Counter

import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.vllm_model import templates
from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel
from gym_grpc.client.stubs import AgentClient
from gym_grpc.testing import Calculator, static_registry
from gym_grpc.testing import calculator_task as task
from gym_grpc.testing.fake_engine import FakeEngine, Turn, write_tokenizer


async def _rollout(
    start, fake: FakeEngine, turns: int, base_url: str | None = None, **config
) -> tuple[Counter, list[list[int]]]:
    """A rollout of `turns` model calls (a tool call each, then the right answer) through a token-path
    VLLMModel with `config` on `base_url` (the fake's HTTP face by default): the engine's calls by path
    or RPC, and every turn's prompt ids, in order."""
    settings = {"base_url": base_url or fake.base_url, "model": "p", "return_token_ids": True, **config}
    model = await start(VLLMModel(settings, name="m"))
    calc = await start(Calculator())
    registry = static_registry(m=model, calc=calc)
    agent_config = {"model_server": "m", "resources_server": "calc", "max_steps": turns}
    agent = await start(SimpleAgent(agent_config, name="a", registry=registry))
    client = AgentClient(static_registry(agent=agent), "agent")
    before = Counter(fake.calls)
    rollout = await client.run(task("What is 2 + 3?", expected_answer=5))
    await client.registry.close()
    carriers = [item for item in rollout.response.output if item.WhichOneof("item") in ("function_call", "message")]
    prompts = [list(getattr(item, item.WhichOneof("item")).prompt_token_ids) for item in carriers]
    assert rollout.model_calls == turns and rollout.reward == 1.0
    return Counter(fake.calls) - before, [p for p in prompts if p]


def _script(turns: int) -> list[Turn]:
    return [*(Turn(tool_calls=[("add", '{"a": 2, "b": %d}' % i)]) for i in range(turns - 1)), Turn(content="5")]


@pytest.mark.parametrize("turns", [4, 12])
async def test_rendered_here_a_turn_costs_the_engine_one_request(start, engine, tmp_path, turns):
    fake = await engine(_script(turns))
    calls, _ = await _rollout(start, fake, turns, tokenizer_dir=str(write_tokenizer(tmp_path / "tok")))
    # The context length, asked once; /inference/v1/generate, asked once (this engine serves /v1/completions only).
    assert calls == {"/inference/v1/generate": 1, "/v1/completions": turns, "/v1/models": 1}


_HALF_A_CHARACTER = [Turn(tool_calls=[("add", '{"a": "x\\ud8ca", "b": 1}')]), Turn(content="5")]


@pytest.mark.parametrize("where", ["here", "engine"])
async def test_a_call_with_an_escaped_half_character_renders_and_the_next_turn_extends_it(
    start, engine, tmp_path, where
):
    """Seen on the real engine (CI, 2026-12-06): the model wrote a JSON escape of a lone surrogate in a
    call's arguments. Decoded for the template, no tokenizer can encode it: rendered here, the next turn
    failed INTERNAL (the tokenizer's TypeError); rendered by vLLM, its /tokenize answers 400, as the fake
    engine's does. The call goes to the template as {}, and the turn's ids stay the sampled ones."""
    fake = await engine(_HALF_A_CHARACTER)
    config = {"tokenizer_dir": str(write_tokenizer(tmp_path / "tok"))} if where == "here" else {}
    _, prompts = await _rollout(start, fake, 2, **config)
    assert len(prompts) == 2 and prompts[1][: len(prompts[0])] == prompts[0]


async def test_on_the_chat_path_a_call_with_an_escaped_half_character_goes_back_without_its_arguments(start, engine):
    """vLLM's chat path renders the history as its /tokenize does, and answers 400 for such a call."""
    fake = await engine(_HALF_A_CHARACTER)
    await _rollout(start, fake, 2, return_token_ids=False)
    call = fake.requests[-1]["messages"][1]["tool_calls"][0]["function"]
    assert call == {"name": "add", "arguments": "{}"}


@pytest.mark.parametrize("turns", [4, 12])
async def test_rendered_by_the_engine_a_turn_costs_two_tokenize_however_many_came_before(start, engine, turns):
    fake = await engine(_script(turns))
    calls, _ = await _rollout(start, fake, turns)
    # The template's turn closing, once (2); the first turn (1); then the conversation through the
    # new turn and all of it (2 a turn), where checking every earlier turn again took 2 for each.
    assert calls == {"/inference/v1/generate": 1, "/v1/completions": turns, "/tokenize": 2 + 1 + 2 * (turns - 1)}


async def test_forgetting_the_session_checks_the_whole_history_and_gives_the_same_prompts(start, engine):
    fake = await engine(_script(6))
    remembered, prompts = await _rollout(start, fake, 6)
    fake = await engine(_script(6))
    forgot, same = await _rollout(start, fake, 6, session_memory=0)
    assert same == prompts
    assert forgot["/tokenize"] == 2 + 1 + sum(2 * k + 1 for k in range(1, 6)) > remembered["/tokenize"]


async def test_rendered_here_and_by_the_engine_the_prompts_are_the_same_ids(start, engine, tmp_path):
    fake = await engine(_script(5))
    _, by_engine = await _rollout(start, fake, 5)
    fake = await engine(_script(5))
    _, here = await _rollout(start, fake, 5, tokenizer_dir=str(write_tokenizer(tmp_path / "tok")), verify_render=True)
    assert here == by_engine


async def test_verify_render_fails_a_local_template_that_renders_otherwise_naming_where(start, engine, tmp_path):
    fake = await engine(_script(3))
    other = tmp_path / "other.jinja"
    other.write_text("{%- for message in messages -%}{{ message.content or '' }}{%- endfor -%}")
    config = {"tokenizer_dir": str(write_tokenizer(tmp_path / "tok")), "chat_template": str(other)}
    with pytest.raises(errors.GymError, match=r"the local chat template renders .* apart from position 0"):
        await _rollout(start, fake, 3, verify_render=True, **config)


async def test_render_local_without_a_tokenizer_is_a_config_error_at_start():
    server = VLLMModel({"base_url": "http://127.0.0.1:1/v1", "model": "p", "render": "local"}, name="m")
    with pytest.raises(errors.ConfigError, match="render is 'local' but no tokenizer_dir"):
        await server.start()


async def test_a_chat_template_that_cannot_render_is_a_config_error_at_start_naming_it(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{%- for message in messages -%}{{ message.content.missing.field }}{%- endfor -%}")
    config = {"tokenizer_dir": str(write_tokenizer(tmp_path / "tok")), "chat_template": str(broken)}
    server = VLLMModel({"base_url": "http://127.0.0.1:1/v1", "model": "p", "render": "local", **config}, name="m")
    with pytest.raises(errors.ConfigError, match=r"chat_template '.*broken.jinja': its chat template cannot render"):
        await server.start()


def test_messages_become_what_vllm_hands_its_template():
    """Text parts joined by newlines, tool-call arguments as objects ({} for what is not one), an
    empty list of calls dropped; a conversation with an image is left to the engine."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "g", "arguments": "[1]"}}]},
        {"role": "assistant", "content": "done", "tool_calls": []},
        {"role": "tool", "tool_call_id": "c", "content": "5"},
    ]
    assert templates.conversation(messages, "string") == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "g", "arguments": {}}}]},
        {"role": "assistant", "content": "done"},
        {"role": "tool", "content": "5", "tool_call_id": "c"},
    ]
    assert templates.conversation(messages[:1], "openai") == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    assert templates.conversation([image], "string") is None
