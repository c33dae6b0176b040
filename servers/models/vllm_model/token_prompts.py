"""Token in, token out: a turn's prompt is the ids the model already saw, extended.

Rendering a conversation as text and tokenizing it again does not give back
the ids the model sampled (the sampler picks token splits the tokenizer never
makes; an engine re-serialises tool-call arguments; a template drops earlier
reasoning). So after the first turn the prompt is never rendered whole:

    prompt(turn n) = prompt(n-1) + generated(n-1) + tail + ids of what came after

where `tail` is what the chat template writes to close an assistant turn
(ChatML: `<|im_end|>` and a newline) less what the model already generated of
it (its end-of-turn token), and the rest is the template's rendering of only
the messages after turn n-1 (tool outputs, a user message, the generation
prompt). Both come from the model's own chat template (`render`, the engine's
/tokenize): the closing from two one-turn conversations that differ only in
the assistant's words, the rest from rendering the conversation through turn
n-1 and all of it and taking the difference. A turn cut at max_output_tokens
is closed the same way.

How many renders a turn costs does not grow with the turns before it: the prompt a session's
last turn was built from is kept (`Known`), and when the next call's conversation is that one
with the turn's answer and what followed (the caller's digests of the two agree), and the turn
carries the ids that prompt was, the earlier turns are known to extend each other already; only
the conversation through the new turn and all of it are rendered (two renders a turn, where
checking every earlier turn took two for each). A renderer that can (`Extension`: the model
server's own, templates.py) renders the two as text and tokenizes only what the second adds, when
that is certain to give the same ids (token_cuts.py). Any other history is checked whole, as below.

The history a caller sends back is checked against the ids its turns carry:
every earlier turn's prompt must be either the conversation before it as the
template renders it (a sample starts there) or the turn before it extended as
above. A history that is not (a caller that edited or dropped an earlier
message: cause "edited"; a template that renders earlier turns differently
once later ones follow, as Qwen3's drops earlier reasoning: "template") is
reported as `Prompt.broken` with its cause, and the model server's policy
decides: start a new sample (the whole conversation rendered) or refuse.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: (messages, add_generation_prompt) -> the ids of the conversation as the chat template renders it.
Render = Callable[[list[dict[str, Any]], bool], Awaitable[list[int]]]
#: (through, whole, closing) -> the ids that rendering `whole` with its generation prompt adds after
#: `through` (a conversation ending with an assistant turn that `closing` ends), found without
#: tokenizing `through` (templates.LocalTemplate.added); None when it cannot say for certain.
Extension = Callable[[list[dict[str, Any]], list[dict[str, Any]], list[int]], Awaitable[list[int] | None]]


@dataclass(frozen=True)
class Carrier:
    """The ids of one assistant turn: its prompt and what the model generated."""

    prompt: Sequence[int]
    generated: Sequence[int]


@dataclass(frozen=True)
class Known:
    """What a session's last prompt was built from: the caller's digest of the conversation (with
    the ids its turns carry), and the prompt ids (4 bytes an id: a session may keep tens of
    thousands)."""

    digest: bytes
    prompt: array


@dataclass(frozen=True)
class Prompt:
    """The prompt of the next turn. `broken`: why the history does not extend the
    earlier turns' ids (then `ids` is the whole conversation rendered, a new sample),
    with `cause` "edited" or "template"; None when it does."""

    ids: list[int]
    broken: str | None = None
    cause: str | None = None


class _NotExtending(Exception):
    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause


@dataclass(frozen=True)
class _Done:
    """A turn with ids, and the conversation through it as the template renders it."""

    carrier: Carrier
    through: list[int]
    number: int  # 1-based, among the assistant turns


def _extend(done: _Done, before_next: list[int], closing: list[int]) -> list[int]:
    """The prompt of the turn after `done`: its ids, the rest of the template's turn
    `closing`, then what `before_next` (the conversation before the next turn,
    rendered) adds to the conversation through `done`."""
    through = done.through
    if before_next[: len(through)] != through or through[-len(closing) :] != closing:
        raise _NotExtending(
            "template",
            f"the chat template renders the conversation through assistant turn {done.number} differently "
            "once later messages follow it (does it drop earlier reasoning?)",
        )
    return _joined(done.carrier, closing, before_next[len(through) :])


def _joined(carrier: Carrier, closing: list[int], added: list[int]) -> list[int]:
    """The turn's prompt and generated ids, the rest of the template's turn `closing`, then `added`."""
    generated = list(carrier.generated)
    written = next(k for k in range(len(closing), -1, -1) if k == 0 or generated[-k:] == closing[:k])
    return [*carrier.prompt, *generated, *closing[written:], *added]


def _extends(done: _Done | None, before: list[int], closing: list[int], prompt: Sequence[int]) -> bool:
    """Whether `prompt` is the turn `done` extended by the conversation up to `before`."""
    if done is None:
        return False
    try:
        return _extend(done, before, closing) == list(prompt)
    except _NotExtending:
        return False


async def turn_closing(render: Render) -> list[int]:
    """The ids a chat template writes after an assistant's words to close the turn (ChatML:
    `<|im_end|>` and a newline): where two one-turn conversations that differ only in
    those words end alike."""
    a, b = await asyncio.gather(
        *(render([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": word}], False) for word in "AB")
    )
    common = 0
    while common < min(len(a), len(b)) and a[-1 - common] == b[-1 - common]:
        common += 1
    if common == 0:
        raise ValueError("the chat template writes nothing after an assistant's turn: its end cannot be found")
    return a[len(a) - common :]


async def build(
    messages: list[dict[str, Any]],
    carriers: Sequence[Carrier | None],
    render: Render,
    closing: list[int],
    known: Known | None = None,
    earlier: bytes | None = None,
    extension: Extension | None = None,
) -> Prompt:
    """The prompt ids of the next turn of `messages` (Chat Completions messages).

    `carriers` holds, for each assistant message in order, the ids its turn
    carries (None for a turn without ids, such as a few-shot example);
    `closing` is the template's turn_closing(); `known`, what the session's last
    prompt was built from (see the module's docstring), and `earlier` the digest of
    this conversation before its last assistant turn, made as `known.digest` was; `extension`, when
    the renderer can find what a conversation adds without tokenizing what came before. Raises
    ValueError when the last assistant turn has no ids although an earlier one has."""
    at = [i for i, message in enumerate(messages) if message.get("role") == "assistant"]
    if len(at) != len(carriers):
        raise ValueError(f"{len(carriers)} carriers for {len(at)} assistant messages")
    last = carriers[-1] if carriers else None
    if known is not None and last is not None and earlier == known.digest and array("I", last.prompt) == known.prompt:
        added = None if extension is None else await extension(messages[: at[-1] + 1], messages, closing)
        if added is not None:
            return Prompt(_joined(last, closing, added))
        through_last, all_of_it = await asyncio.gather(render(messages[: at[-1] + 1], False), render(messages, True))
        try:
            return Prompt(_extend(_Done(last, through_last, len(carriers)), all_of_it, closing))
        except _NotExtending as e:
            return Prompt(all_of_it, str(e), e.cause)
    first = next((n for n, carrier in enumerate(carriers) if carrier is not None), None)
    if first is None:
        return Prompt(await render(messages, True))
    if carriers[-1] is None:
        raise ValueError(
            "the last assistant turn of the input has no token ids although an earlier one has: "
            "the prompt cannot be built on the ids the model generated"
        )
    turns = range(first, len(carriers))
    # Every render at once: the conversation before each turn, through each turn, and all of it.
    rendered = await asyncio.gather(
        *(render(messages[: at[n]], True) for n in turns),
        *(render(messages[: at[n] + 1], False) for n in turns),
        render(messages, True),
    )
    before, through, whole = rendered[: len(turns)], rendered[len(turns) : -1], rendered[-1]
    done: _Done | None = None
    for k, n in enumerate(turns):
        carrier = carriers[n]
        if carrier is None:
            done = None
            continue
        if list(carrier.prompt) != before[k] and not _extends(done, before[k], closing, carrier.prompt):
            return Prompt(
                whole,
                f"assistant turn {n + 1}: its prompt ids are neither the conversation before it as the chat "
                "template renders it nor the earlier turns' ids extended by it: a message before it was "
                "changed or removed",
                "edited",
            )
        done = _Done(carrier, through[k], n + 1)
    assert done is not None  # the last turn has ids
    try:
        return Prompt(_extend(done, whole, closing))
    except _NotExtending as e:
        return Prompt(whole, str(e), e.cause)
