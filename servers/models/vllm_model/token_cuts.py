"""Where a text can be cut so that tokenizing its two halves apart gives the whole text's ids.

A later turn's prompt needs only the ids of what the chat template adds after the turn before it
(token_prompts.py). Tokenizing that added text alone is exact only at some cuts. A tokenizer of
Hugging Face's `tokenizers` library (every "fast" one transformers loads) encodes a text in steps:

1. its added tokens that are matched before normalization (`normalized=False`, such as ChatML's
   `<|im_start|>`) are found in the text, leftmost and longest first, and cut out of it;
2. every piece between them is normalized, split on the added tokens matched after
   normalization, pre-tokenized and tokenized by the model, on its own.

So a cut just before such an added token is a piece boundary of the whole text, and each piece
goes through step 2 as it would alone, with one exception this module also avoids: a pre-tokenizer
that treats the text's first piece apart (SentencePiece's Metaspace with `prepend_scheme: first`
writes a space before the piece at offset 0 only) sees the pieces after the cut at offsets past 0
either way, since the half after the cut starts with the added token. The cut is refused when:

- the text after it does not start with such an added token (Mistral v1's `[INST]` is plain text:
  alone, its first piece would be written `▁[`, in the whole `[`);
- the longest added token at the cut strips whitespace to its left (`lstrip`) or must stand as a
  word (`single_word`): both look at the text before the cut;
- the text before the cut ends with an added token that must stand as a word: in the whole text it
  is followed by the token at the cut (`[W]` before `ab<|im_end|>` is no word), alone by nothing;
- an added token's text runs across the cut (the whole text would match it there instead);
- the tokenizer splits no added tokens out (`encode_special_tokens`), or is not of that library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Cuts:
    """A tokenizer's added tokens, as far as cutting texts goes."""

    #: the added tokens matched before normalization, by their first character, longest first
    by_first: dict[str, tuple[str, ...]]
    #: of those, the ones a cut may be made just before
    starts: frozenset[str]
    #: of those, the ones a cut may not be made just after (`single_word`)
    words: tuple[str, ...]
    #: each pair of adjacent characters in those tokens, to the tokens that hold it: a token whose
    #: text runs across a cut holds the two characters around it
    by_pair: dict[str, tuple[str, ...]]

    @classmethod
    def of(cls, tokenizer: Any) -> Cuts | None:
        """The cuts of a transformers tokenizer; None when it is not backed by `tokenizers` or splits
        no added tokens out."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not getattr(tokenizer, "is_fast", False) or backend is None or backend.encode_special_tokens:
            return None
        raw = [t for t in backend.get_added_tokens_decoder().values() if not t.normalized and t.content]
        if not raw:
            return None
        by_first: dict[str, list[str]] = {}
        by_pair: dict[str, set[str]] = {}
        for token in sorted({t.content for t in raw}, key=len, reverse=True):
            by_first.setdefault(token[0], []).append(token)
            for i in range(len(token) - 1):
                by_pair.setdefault(token[i : i + 2], set()).add(token)
        return cls(
            {first: tuple(tokens) for first, tokens in by_first.items()},
            frozenset(t.content for t in raw if not (t.lstrip or t.single_word)),
            tuple(sorted({t.content for t in raw if t.single_word})),
            {pair: tuple(tokens) for pair, tokens in by_pair.items()},
        )

    def at(self, text: str, cut: int) -> bool:
        """Whether `text[:cut]` and `text[cut:]`, tokenized apart, give the ids of `text`, in order."""
        if not 0 < cut < len(text):
            return False
        # The added token matched at the cut: the longest one the text there starts with.
        first = next((t for t in self.by_first.get(text[cut], ()) if text.startswith(t, cut)), None)
        if first is None or first not in self.starts or text.endswith(self.words, 0, cut):
            return False
        for token in self.by_pair.get(text[cut - 1 : cut + 1], ()):
            found = text.find(token, max(0, cut - len(token) + 1), cut + len(token) - 1)
            if 0 <= found < cut:  # it runs across the cut
                return False
        return True
