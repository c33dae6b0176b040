"""Tokenizing only what a later turn adds (token_cuts.Cuts, LocalTemplate.added) gives the ids of
whole renders, or declines. Checked on real SentencePiece tokenizers, Mistral's own v1 and v3
models as the mistral-common package ships them (Apache-2.0), converted by transformers, in both of
its Llama conversions ("legacy", which writes a space before every piece, and not, which writes it
before the text's first piece only); and on the fake engine's byte-level BPE, alone and with added
tokens whose flags bear on a cut (`_with_flagged_tokens`). The Mistral-style
chat template is written here (the models ship none); a real byte-level one, SmolLM2's with its
own template, is checked against vLLM in tests/real_engine, which renders with verify_render."""

import json
import logging
import shutil
from array import array
from pathlib import Path

import mistral_common
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.vllm_model import templates, token_prompts
from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel
from gym_grpc.bundled.servers.models.vllm_model.token_cuts import Cuts
from gym_grpc.client.stubs import AgentClient
from gym_grpc.testing import Calculator, static_registry
from gym_grpc.testing import calculator_task as task
from gym_grpc.testing.fake_engine import Turn, write_tokenizer

MODELS = Path(mistral_common.__file__).parent / "data"
#: [INST] is plain text in v1's vocabulary, a control token in v3's.
V1, V3 = "tokenizer.model.v1", "mistral_instruct_tokenizer_240323.model.v3"

#: Mistral's instruct format with its v3 tool tokens: an assistant turn ends with </s>.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}[INST] {{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if m.tool_calls -%}[TOOL_CALLS] {{ m.tool_calls | map(attribute='function') | list | tojson }}"
    "{%- else -%} {{ m.content }}{%- endif -%}{{ eos_token }}"
    "{%- elif m.role == 'tool' -%}[TOOL_RESULTS] {{ m.content }}[/TOOL_RESULTS]"
    "{%- endif -%}{%- endfor -%}"
)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """mistral(model, legacy): a directory with Mistral's SentencePiece model, as a Llama tokenizer."""

    def make(model: str, legacy: bool) -> Path:
        directory = tmp_path_factory.mktemp(f"{model}-{legacy}")
        shutil.copy(MODELS / model, directory / "tokenizer.model")
        config = {"tokenizer_class": "LlamaTokenizer", "legacy": legacy, "chat_template": MISTRAL_TEMPLATE}
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        return directory

    return make


TOKENIZERS = [(V1, True), (V1, False), (V3, True), (V3, False), ("fake", None), ("flags", None)]


def _with_flagged_tokens(directory: Path) -> Path:
    """The fake engine's tokenizer with added tokens whose flags bear on a cut before them: one that
    strips the spaces to its left, one that must stand as a word, one that starts with a space
    beside one that strips the spaces to its right, and one whose end is `<|im_end|>` (a cut before
    that runs across it). Whether a cut was right is still the `tokenizers` library's own encoding."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_tokens(
        [
            AddedToken("<mask>", lstrip=True, normalized=False),
            AddedToken("[W]", single_word=True, normalized=False),
            AddedToken(" <sp>", normalized=False),
            AddedToken("<r>", rstrip=True, normalized=False),
            AddedToken("ab<|im_end|>", normalized=False),
        ]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module", params=TOKENIZERS, ids=lambda p: f"{p[0]}-legacy_{p[1]}" if p[1] is not None else p[0])
def tokenizer(request, mistral, tmp_path_factory):
    model, legacy = request.param
    if model in ("fake", "flags"):
        directory = write_tokenizer(tmp_path_factory.mktemp(model))
        return AutoTokenizer.from_pretrained(str(_with_flagged_tokens(directory) if model == "flags" else directory))
    return AutoTokenizer.from_pretrained(str(mistral(model, legacy)))


def _added(tokenizer) -> list[str]:
    """The tokenizer's added tokens (a dozen of v3's 771)."""
    return sorted({t.content for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values()})[:12]


def _pieces(tokenizer) -> list[str]:
    """Pieces texts are made of: the tokenizer's added tokens, their halves, words, spaces and
    characters that SentencePiece and byte-level BPE treat apart."""
    added = _added(tokenizer)
    halves = [token[: len(token) // 2] for token in added] + [token[len(token) // 2 :] for token in added]
    words = ["[INST]", "[/INST]", " hi", "there", "ab", " ", "  ", "\n", "\t", "é", "🙂", "▁x", "]", "<"]
    return [*added, *halves, *words]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_every_allowed_cut_just_before_an_added_token_tokenizes_apart_to_the_whole(tokenizer):
    """Every piece after a word or a space, then each added token, then every piece or nothing: cut
    before the token. (After a space, a token that must stand as a word can be one.)"""
    cuts = Cuts.of(tokenizer)
    assert cuts is not None
    allowed = 0
    for left in [f"{before}{piece}" for before in ("x", " ") for piece in _pieces(tokenizer)]:
        for token in _added(tokenizer):
            for right in ["", *_pieces(tokenizer)]:
                text, cut = f"{left}{token}{right}", len(left)
                if cuts.at(text, cut):
                    allowed += 1
                    assert _ids(tokenizer, text) == _ids(tokenizer, text[:cut]) + _ids(tokenizer, text[cut:]), text
    assert allowed > 0


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_cut_anywhere_is_allowed_only_where_the_halves_tokenized_apart_give_the_whole(tokenizer, data):
    cuts = Cuts.of(tokenizer)
    assert cuts is not None
    pieces = data.draw(st.lists(st.sampled_from(_pieces(tokenizer)), min_size=2, max_size=12))
    text = "".join(pieces)
    bounds = [len("".join(pieces[:k])) for k in range(1, len(pieces))]
    cut = data.draw(st.one_of(st.sampled_from(bounds), st.integers(0, len(text))))
    if cuts.at(text, cut):
        assert _ids(tokenizer, text) == _ids(tokenizer, text[:cut]) + _ids(tokenizer, text[cut:])


@pytest.mark.parametrize("legacy", [True, False])
def test_v1s_plain_text_inst_is_no_cut_where_alone_it_would_tokenize_otherwise_and_v3s_control_token_is(
    mistral, legacy
):
    text = "<s>[INST] Hi[/INST] Hello</s>[INST] And?[/INST]"
    cut = text.index("</s>") + len("</s>")
    v1 = AutoTokenizer.from_pretrained(str(mistral(V1, legacy)))
    v3 = AutoTokenizer.from_pretrained(str(mistral(V3, legacy)))
    whole = v1(text, add_special_tokens=False)["input_ids"]
    alone = v1(text[cut:], add_special_tokens=False)["input_ids"]
    if not legacy:  # alone, the text's first piece would be written with a space: ▁[ where the whole has [
        assert whole[-len(alone) :] != alone
    assert not Cuts.of(v1).at(text, cut)
    assert Cuts.of(v3).at(text, cut)


def _conversation(turns: int) -> list[dict]:
    """A question, `turns` assistant turns each calling a tool and its answer, then a user message."""
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    for n in range(turns):
        call = {"id": f"c{n}", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{n}", "content": f"Sunny, {20 + n} C"},
        ]
    return [*messages, {"role": "user", "content": "And tomorrow?"}]


async def _prompt(local: templates.LocalTemplate, messages: list[dict], with_extension: bool) -> list[int]:
    """token_prompts.build's prompt for the last turn of `messages`, its session's last prompt known,
    the earlier turns carrying the ids of whole renders (so the two builds start from the same ids)."""

    async def render(conversation, generation):
        return local.render(conversation, tools=None, template_kwargs=None, add_generation_prompt=generation)

    async def extension(through, whole, closing):
        return await local.extension(through, whole, tools=None, template_kwargs=None, closing=closing)

    at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    last_prompt = await render(messages[: at[-1]], True)
    generated = (await render(messages[: at[-1] + 1], False))[len(last_prompt) :]
    carriers = [None] * (len(at) - 1) + [token_prompts.Carrier(last_prompt, generated)]
    closing = await token_prompts.turn_closing(render)
    known = token_prompts.Known(b"d", array("I", last_prompt))
    prompt = await token_prompts.build(
        messages, carriers, render, closing, known, b"d", extension if with_extension else None
    )
    assert prompt.broken is None
    return prompt.ids


@pytest.mark.parametrize("model, extends", [(V1, False), (V3, True)])
@pytest.mark.parametrize("legacy", [True, False])
async def test_a_later_turns_prompt_from_its_added_text_alone_is_the_whole_renders_or_declined(
    mistral, model, extends, legacy, monkeypatch
):
    local = templates.LocalTemplate(mistral(model, legacy))
    for turns in (1, 3):
        messages = _conversation(turns)
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        whole = local.render(messages, tools=None, template_kwargs=None, add_generation_prompt=True)
        through = local.render(messages[: last + 1], tools=None, template_kwargs=None, add_generation_prompt=False)
        closing = [local.tokenizer.eos_token_id]
        added = local.added(messages[: last + 1], messages, tools=None, template_kwargs=None, closing=closing)
        assert (added is not None) == extends
        if extends:
            assert added == whole[len(through) :]
        assert await _prompt(local, messages, True) == await _prompt(local, messages, False)
    if not extends:  # refused once, the template's texts are not rendered again only to be refused

        def rendered(*args, **kwargs):
            raise AssertionError("rendered again")

        monkeypatch.setattr(local.tokenizer, "apply_chat_template", rendered)
        assert local.added(messages[:-1], messages, tools=None, template_kwargs=None, closing=[2]) is None


async def test_rendered_here_a_later_turn_tokenizes_only_what_it_adds(start, engine, tmp_path, monkeypatch, caplog):
    """The question, in every whole render of the conversation, is tokenized in the first turn only;
    the server says once that later turns go so."""
    caplog.set_level(logging.INFO)
    tokenized: list[str] = []
    ids = templates.LocalTemplate._ids

    def recording(self, text):
        tokenized.append(text)
        return ids(self, text)

    monkeypatch.setattr(templates.LocalTemplate, "_ids", recording)
    turns = 6
    fake = await engine([*(Turn(tool_calls=[("add", '{"a": 2, "b": %d}' % i)]) for i in range(turns - 1)), Turn("5")])
    settings = {"base_url": fake.base_url, "model": "p", "return_token_ids": True}
    model = await start(VLLMModel({**settings, "tokenizer_dir": str(write_tokenizer(tmp_path / "tok"))}, name="m"))
    calc = await start(Calculator())
    config = {"model_server": "m", "resources_server": "calc", "max_steps": turns}
    agent = await start(SimpleAgent(config, name="a", registry=static_registry(m=model, calc=calc)))
    client = AgentClient(static_registry(agent=agent), "agent")
    tokenized.clear()  # the start's own render
    rollout = await client.run(task("What is 2 + 3?", expected_answer=5))
    await client.registry.close()
    assert rollout.model_calls == turns and rollout.reward == 1.0
    with_question = [text for text in tokenized if "What is 2 + 3?" in text]
    assert len(with_question) == 1  # the first turn's prompt
    assert len([text for text in tokenized if text.startswith("<|im_start|>tool")]) == turns - 1
    assert caplog.text.count("later turns tokenize only the text they add") == 1
