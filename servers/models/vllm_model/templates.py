"""The engine's chat template and tokenizer, in this process: a conversation to the prompt ids vLLM's
/tokenize gives for it, with no request to the engine.

vLLM renders a chat request in two steps, and this module makes both as it does:

1. the messages become a "conversation" (vllm/renderers/chat_utils.py): each message's content is
   its text parts joined by newlines ("string" format; or kept as `{"type": "text"}` parts in the
   "openai" format, for templates that loop over parts); an assistant's tool calls are kept, their
   JSON arguments parsed into objects ({} when they are not an object), an empty list of them
   dropped; a tool message keeps its `tool_call_id`; each tool is what vLLM's request model dumps
   (`type`, then `function` with `name`, `description`, `parameters` and, when set, `strict`);
2. the tokenizer's `apply_chat_template` (transformers) renders the conversation with the tools and
   the chat template the engine was started with, and tokenizes the text without special tokens.

A later turn needs only what its conversation adds to the one through the turn before: `added`
renders both as text and tokenizes only the added text, where token_cuts.py says that gives the
ids of tokenizing the whole.

Images and other parts that are not text have no local rendering here: such a conversation is
rendered by the engine (`LocalTemplate.renders` says which). The model server's `verify_render`
renders every conversation both ways and fails on a difference; the real-engine tests run so.
`transformers` (`pip install 'gym-grpc[render]'`) and the model's tokenizer files are needed.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import orjson

from gym_grpc.errors import ConfigError

from . import token_cuts

JSON = dict[str, Any]
ContentFormat = Literal["string", "openai"]

#: Renders kept by their input, the most recent: a GRPO group's rollouts, and its retries, start
#: from one conversation, which is then rendered once, not once per rollout.
RENDERS_KEPT = 256

#: A conversation up to this size (its messages, tools and options as JSON) is rendered on the event
#: loop's thread; a larger one in a thread, so that the loop is not held while it renders. A render
#: takes about 0.3 us of CPU per byte of that JSON (0.2 ms at 600 bytes, 2 ms at 6,000, 8 ms at
#: 22,000, with the fake engine's byte-level tokenizer), and a hop to a thread and back about 0.1 ms
#: more when nothing else runs, a good deal more beside a busy loop (the GIL changes hands twice): on
#: the peer benchmark's token path rendered here, a hop for every render cost about a seventh of a
#: rollout's CPU (docs/performance.md#the-engine-link-one-request-a-turn). With that tokenizer, the
#: loop is held for at most about 2.5 ms.
INLINE_BYTES = 8192


def _texts(content: Any) -> list[str] | None:
    """The text parts of a message's content, or None when it has a part that is not text."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            texts.append(str(part.get("text", "")))
        else:
            return None
    return texts


def _arguments(arguments: Any) -> JSON:
    """A tool call's arguments as templates get them from vLLM: an object ({} for anything else;
    arguments that hold half a character come as {} already, chat.to_messages)."""
    if isinstance(arguments, dict):
        return arguments
    if not arguments:
        return {}
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def conversation(messages: list[JSON], content_format: ContentFormat) -> list[JSON] | None:
    """Chat Completions messages as vLLM hands them to a chat template; None when one holds a part
    that is not text (an image), which only the engine renders."""
    out = []
    for message in messages:
        texts = _texts(message.get("content"))
        if texts is None:
            return None
        role = message["role"]
        content: Any = [{"type": "text", "text": t} for t in texts] if content_format == "openai" else "\n".join(texts)
        result: JSON = {"role": role, "content": content}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls:
                result["tool_calls"] = copy.deepcopy(list(calls))
                for call in result["tool_calls"]:
                    function = call.get("function")
                    if isinstance(function, dict):
                        function["arguments"] = _arguments(function.get("arguments"))
            if message.get("reasoning") is not None:
                result["reasoning"] = result["reasoning_content"] = message["reasoning"]
        elif role == "tool" and "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            result["name"] = message["name"]
        out.append(result)
    return out


def tool(spec: JSON) -> JSON:
    """A Chat Completions tool as vLLM's request model dumps it for the template (keys in its order)."""
    function = spec.get("function") or {}
    dumped: JSON = {
        "name": function.get("name"),
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    if function.get("strict") is not None:
        dumped["strict"] = function["strict"]
    return {"type": spec.get("type", "function"), "function": dumped}


class LocalTemplate:
    """A model's tokenizer and chat template, loaded from the directory the engine serves it from."""

    def __init__(
        self,
        tokenizer_dir: str | Path,
        chat_template: str | Path | None = None,
        content_format: ContentFormat = "string",
    ) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError(
                "rendering prompts in the model server needs transformers: pip install 'gym-grpc[render]' "
                "(or render: engine, which asks the engine's /tokenize)"
            ) from None
        directory = Path(tokenizer_dir).expanduser()
        if not (directory / "tokenizer_config.json").is_file():
            raise ConfigError(f"tokenizer_dir {str(directory)!r}: no tokenizer_config.json there")
        self.tokenizer = AutoTokenizer.from_pretrained(str(directory))
        self.template: str | None = None
        if chat_template is not None:
            path = Path(chat_template).expanduser()
            if not path.is_file():
                raise ConfigError(f"chat_template {str(path)!r}: no such file")
            self.template = path.read_text(encoding="utf-8")
        elif not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                f"tokenizer_dir {str(directory)!r}: its tokenizer has no chat template; give chat_template"
            )
        self.content_format = content_format
        # Where a rendered text can be cut and its end tokenized alone (None: nowhere, or a cut this
        # template needs was refused once), and the text
        # of each turn closing asked for (None: it does not tokenize back to its ids).
        self._cuts = token_cuts.Cuts.of(self.tokenizer)
        self._closings: dict[tuple[int, ...], str | None] = {}
        # A template that reads the clock (Llama 3's "Today Date", through transformers' strftime_now)
        # renders differently from one day to the next: its renders are not kept.
        source = self.template if self.template is not None else self.tokenizer.chat_template
        self._renders: OrderedDict[bytes, asyncio.Future[array[int]]] | None = (
            None if "strftime_now" in str(source) else OrderedDict()
        )
        # One render now, while the server starts: transformers compiles a template at its first use
        # (about 10 ms of CPU, once per thread that misses its cache at the same moment, so up to once per
        # thread of the pool the first rollouts render in), and a template that cannot render even a
        # one-message conversation is a configuration error, better said at start than in every rollout.
        try:
            self.render(
                [{"role": "user", "content": "1"}], tools=None, template_kwargs=None, add_generation_prompt=True
            )
        except Exception as e:
            where = f"chat_template {str(chat_template)!r}" if chat_template else f"tokenizer_dir {str(directory)!r}"
            raise ConfigError(f"{where}: its chat template cannot render a one-message conversation: {e}") from None

    def renders(self, messages: list[JSON]) -> bool:
        """Whether this conversation can be rendered here (text only)."""
        return conversation(messages, self.content_format) is not None

    def text(
        self,
        messages: list[JSON],
        *,
        tools: list[JSON] | None,
        template_kwargs: JSON | None,
        add_generation_prompt: bool,
    ) -> str:
        """`messages` as the chat template writes them (ValueError when a part is not text)."""
        parsed = conversation(messages, self.content_format)
        if parsed is None:
            raise ValueError("a message has a part that is not text: only the engine renders it")
        text = self.tokenizer.apply_chat_template(
            parsed,
            tools=None if tools is None else [tool(t) for t in tools],
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(template_kwargs or {}),
        )
        assert isinstance(text, str)
        return text

    def render(
        self,
        messages: list[JSON],
        *,
        tools: list[JSON] | None,
        template_kwargs: JSON | None,
        add_generation_prompt: bool,
    ) -> list[int]:
        """The ids of `messages` as the engine's /tokenize gives them (ValueError when a part is not text)."""
        text = self.text(
            messages, tools=tools, template_kwargs=template_kwargs, add_generation_prompt=add_generation_prompt
        )
        return self._ids(text)

    def _ids(self, text: str) -> list[int]:
        """The ids of a rendered text, tokenized as transformers' apply_chat_template does."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def added(
        self,
        through: list[JSON],
        whole: list[JSON],
        *,
        tools: list[JSON] | None,
        template_kwargs: JSON | None,
        closing: Sequence[int],
    ) -> list[int] | None:
        """The ids the chat template adds after `through` (a conversation that ends with an assistant
        turn) to render `whole` (one that goes on from it) with its generation prompt: both rendered as
        text, and only the added text tokenized, so that the cost of tokenizing does not grow with the
        turns before. None when that is not certain to give the ids of whole renders (token_cuts.py),
        or the texts do not extend each other, or `through`'s does not end with `closing`: the caller
        then renders both whole, and says what is wrong."""
        if self._cuts is None:
            return None
        end = self._closing_text(tuple(closing))
        if end is None:
            return None
        start = self.text(through, tools=tools, template_kwargs=template_kwargs, add_generation_prompt=False)
        full = self.text(whole, tools=tools, template_kwargs=template_kwargs, add_generation_prompt=True)
        cut = len(start)
        if not (full.startswith(start) and start.endswith(end)):
            return None
        if not self._cuts.at(full, cut):
            # What decides this cut is the template's turn closing and the start it writes for the next
            # message, not the conversation's words: once refused, later turns are tokenized whole
            # without their text rendered here first, which would render each conversation twice.
            self._cuts = None
            return None
        if not self._cuts.at(start, cut - len(end)):  # the turn's own words may run into its closing
            return None
        return self._ids(full[cut:])

    def _closing_text(self, closing: tuple[int, ...]) -> str | None:
        """The text of a turn's closing ids, when it tokenizes back to them."""
        if closing not in self._closings:
            text = self.tokenizer.decode(list(closing), skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self._closings[closing] = text if self._ids(text) == list(closing) else None
        return self._closings[closing]

    async def extension(
        self,
        through: list[JSON],
        whole: list[JSON],
        *,
        tools: list[JSON] | None,
        template_kwargs: JSON | None,
        closing: Sequence[int],
    ) -> list[int] | None:
        """added(), on the loop's thread up to INLINE_BYTES of `whole`, else in a thread."""
        added = functools.partial(
            self.added, through, whole, tools=tools, template_kwargs=template_kwargs, closing=closing
        )
        try:
            inline = len(orjson.dumps([whole, tools, template_kwargs])) <= INLINE_BYTES
        except TypeError:  # not JSON (orjson.JSONEncodeError)
            inline = False
        return added() if inline else await asyncio.to_thread(added)

    async def render_shared(
        self,
        messages: list[JSON],
        *,
        tools: list[JSON] | None,
        template_kwargs: JSON | None,
        add_generation_prompt: bool,
    ) -> list[int]:
        """render(), once for the same input however many rollouts ask for it at once or in turn
        (RENDERS_KEPT); on the loop's thread up to INLINE_BYTES, else in a thread. To be called from
        one event loop: the renders kept are that loop's."""

        render = functools.partial(
            self.render,
            messages,
            tools=tools,
            template_kwargs=template_kwargs,
            add_generation_prompt=add_generation_prompt,
        )
        renders = self._renders
        try:
            key: bytes | None = orjson.dumps([messages, tools, template_kwargs, add_generation_prompt])
        except TypeError:  # not JSON (orjson.JSONEncodeError): rendered in a thread, not kept
            key = None
        inline = key is not None and len(key) <= INLINE_BYTES
        if key is None or renders is None:
            return render() if inline else await asyncio.to_thread(render)  # not kept: its list as it is
        kept = renders.get(key)
        if kept is not None:
            renders.move_to_end(key)
            # shielded: one caller cancelled does not cancel the render the others wait for
            return list(await asyncio.shield(kept))
        if inline:  # done before another caller can ask for it, and kept only when it succeeded
            ids = render()
            kept = asyncio.get_running_loop().create_future()
            kept.set_result(array("I", ids))
        else:
            kept = asyncio.ensure_future(asyncio.to_thread(lambda: array("I", render())))
            kept.add_done_callback(functools.partial(_forget_failed, renders, key))
        renders[key] = kept
        if len(renders) > RENDERS_KEPT:
            renders.popitem(last=False)
        return ids if inline else list(await asyncio.shield(kept))


def _forget_failed(
    renders: OrderedDict[bytes, asyncio.Future[array[int]]], key: bytes, done: asyncio.Future[array[int]]
) -> None:
    """A render that failed is not kept: the next caller tries again (and hears its own error)."""
    if (done.cancelled() or done.exception() is not None) and renders.get(key) is done:
        del renders[key]
