"""LocalTemplate.render_shared: a conversation that several rollouts start from (a GRPO group's prompt)
is rendered once, whether they ask at the same moment or one after the other, and what one caller does
with its ids, its cancellation or a failed render does not reach the others; a short conversation is
rendered on the event loop's thread, a long one in another. Each test runs both ways (INLINE_BYTES),
on the fake engine's tokenizer files (`write_tokenizer`) and real transformers."""

import asyncio
import threading

import pytest

from gym_grpc.bundled.servers.models.vllm_model import templates
from gym_grpc.testing.fake_engine import write_tokenizer

PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]


def _counting(local: templates.LocalTemplate, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make `local`'s tokenizer count its renders; the count (a one-item list)."""
    calls = [0]
    real = local.tokenizer.apply_chat_template

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(local.tokenizer, "apply_chat_template", counting)
    return calls


@pytest.fixture(params=["inline", "in_a_thread"])
def where(request, monkeypatch) -> str:
    """Where the tests' short conversations are rendered: on the loop's thread, or in another."""
    if request.param == "in_a_thread":
        monkeypatch.setattr(templates, "INLINE_BYTES", 0)
    return request.param


@pytest.fixture
def counted(tmp_path, monkeypatch, where):
    """A LocalTemplate whose tokenizer counts its renders, and the count."""
    local = templates.LocalTemplate(write_tokenizer(tmp_path / "tok"))
    return local, _counting(local, monkeypatch)


def _shared(local: templates.LocalTemplate, messages=PROMPT, generation: bool = True):
    return local.render_shared(messages, tools=None, template_kwargs=None, add_generation_prompt=generation)


async def test_a_groups_prompt_asked_at_once_is_rendered_once_and_is_the_render(counted):
    local, calls = counted
    results = await asyncio.gather(*(_shared(local) for _ in range(8)))
    expected = local.render(PROMPT, tools=None, template_kwargs=None, add_generation_prompt=True)
    assert calls[0] == 1 + 1  # the eight's, then render()'s own
    assert all(ids == expected for ids in results)


async def test_a_prompt_asked_again_later_is_not_rendered_again_and_each_caller_has_its_own_list(counted):
    local, calls = counted
    first = await _shared(local)
    first.append(-1)  # a caller changing its ids
    second = await _shared(local)
    assert calls[0] == 1 and second == first[:-1]


async def test_another_conversation_or_generation_prompt_is_another_render(counted):
    local, calls = counted
    with_prompt = await _shared(local)
    without = await _shared(local, generation=False)
    other = await _shared(local, [{"role": "user", "content": "What is 2 + 4?"}])
    assert calls[0] == 3 and len({tuple(with_prompt), tuple(without), tuple(other)}) == 3


async def test_only_the_most_recent_renders_are_kept(counted, monkeypatch):
    local, calls = counted
    monkeypatch.setattr(templates, "RENDERS_KEPT", 2)
    conversations = [[{"role": "user", "content": f"{n}"}] for n in range(3)]
    for messages in conversations:
        await _shared(local, messages)
    await _shared(local, conversations[2])  # kept
    await _shared(local, conversations[0])  # dropped when the third came
    assert calls[0] == 4


async def test_a_failed_render_is_not_kept_and_the_next_caller_renders_anew(counted, monkeypatch, where):
    local, calls = counted
    real = local.tokenizer.apply_chat_template

    def failing(*args, **kwargs):
        calls[0] += 1
        raise ValueError("the template raised")

    monkeypatch.setattr(local.tokenizer, "apply_chat_template", failing)
    results = await asyncio.gather(_shared(local), _shared(local), return_exceptions=True)
    assert all(isinstance(e, ValueError) and "the template raised" in str(e) for e in results)
    # In a thread the two callers wait on one render; inline the first has failed before the second asks.
    renders = 1 if where == "in_a_thread" else 2
    assert calls[0] == renders
    monkeypatch.setattr(local.tokenizer, "apply_chat_template", real)
    ids = await _shared(local)
    assert calls[0] == renders + 1
    assert ids == local.render(PROMPT, tools=None, template_kwargs=None, add_generation_prompt=True)


async def test_a_cancelled_caller_leaves_the_render_to_the_others_in_a_thread(tmp_path, monkeypatch):
    # (inline, a render is done before its caller could be cancelled)
    monkeypatch.setattr(templates, "INLINE_BYTES", 0)
    local = templates.LocalTemplate(write_tokenizer(tmp_path / "tok"))
    calls = _counting(local, monkeypatch)
    first = asyncio.ensure_future(_shared(local))
    second = asyncio.ensure_future(_shared(local))
    await asyncio.sleep(0)  # both waiting on the one render
    first.cancel()
    ids = await second
    assert first.cancelled() and calls[0] == 1
    assert ids == local.render(PROMPT, tools=None, template_kwargs=None, add_generation_prompt=True)


async def test_a_template_that_reads_the_clock_is_rendered_every_time(tmp_path, monkeypatch, where):
    dated = tmp_path / "dated.jinja"
    dated.write_text("{{ strftime_now('%d %b %Y') }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    local = templates.LocalTemplate(write_tokenizer(tmp_path / "tok"), dated)
    calls = _counting(local, monkeypatch)
    await _shared(local)
    await _shared(local)
    assert calls[0] == 2


async def test_a_short_conversation_is_rendered_on_the_loops_thread_and_a_long_one_in_another(tmp_path, monkeypatch):
    local = templates.LocalTemplate(write_tokenizer(tmp_path / "tok"))
    threads = []
    real = local.tokenizer.apply_chat_template

    def recording(*args, **kwargs):
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(local.tokenizer, "apply_chat_template", recording)
    long = [{"role": "user", "content": "x" * templates.INLINE_BYTES}]
    short_ids, long_ids = await _shared(local), await _shared(local, long)
    assert threads[0] == threading.get_ident() and threads[1] != threading.get_ident()
    assert short_ids == real(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(long_ids) > templates.INLINE_BYTES
