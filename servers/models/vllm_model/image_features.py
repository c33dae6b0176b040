"""Images on the token path: the features vLLM's /inference/v1/generate needs beside the prompt ids.

A prompt with images is its ids (each image a run of the model's image tokens, as the chat template
and the engine's processor expand it) and, for each image, its processed pixels. vLLM's
`/v1/chat/completions/render` gives both for a conversation: `token_ids`, and `features` (each
image's hash, its placeholder range in those ids, and its processed tensors, serialized). The
token path's prompt is not that rendering but the earlier turns' ids extended (token_prompts.py), so
the images' ranges are placed again in it: the i-th image's run of image tokens, found in order.

vLLM 0.32's generate takes a placeholder range as embeddings throughout (the render's `is_embed` mask
is not serialized), while a range from the render may hold tokens around the image (Idefics3 wraps its
image tokens in <fake_token_around_image> and <global-img>). So each range is narrowed to the run of
the token that fills it (the model's image token), which must be contiguous.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

MODALITY = "image"


def place(render: dict[str, Any], prompt: Sequence[int]) -> dict[str, Any]:
    """The features of `render` (a /v1/chat/completions/render answer for the same conversation) with each
    image's range placed in `prompt`; ValueError when an image's tokens cannot be found there."""
    features = render.get("features") or {}
    rendered = render.get("token_ids") or []
    ranges = (features.get("mm_placeholders") or {}).get(MODALITY) or []
    if set(features.get("mm_hashes") or {}) - {MODALITY}:
        raise ValueError(f"the conversation has inputs other than images: {sorted(features['mm_hashes'])}")
    placed = []
    start = 0
    for index, span in enumerate(ranges):
        token, length = _image_run(rendered[span["offset"] : span["offset"] + span["length"]], index)
        at = _find_run(prompt, token, length, start)
        if at < 0:
            raise ValueError(f"image {index + 1}: its {length} image tokens ({token}) are not in the prompt")
        placed.append({"offset": at, "length": length})
        start = at + length
    return {
        "mm_hashes": {MODALITY: list(features["mm_hashes"][MODALITY])},
        "mm_placeholders": {MODALITY: placed},
        "kwargs_data": {MODALITY: list((features.get("kwargs_data") or {})[MODALITY])},
    }


def _image_run(ids: Sequence[int], index: int) -> tuple[int, int]:
    """The token that fills an image's placeholder range, and how many times (one contiguous run)."""
    if not ids:
        raise ValueError(f"image {index + 1}: the render gave it no tokens")
    token, count = Counter(ids).most_common(1)[0]
    first = list(ids).index(token)
    if list(ids[first : first + count]) != [token] * count:
        raise ValueError(f"image {index + 1}: its image tokens are not one run, which vLLM's generate cannot place")
    return token, count


def _find_run(ids: Sequence[int], token: int, length: int, start: int) -> int:
    """Where the next run of exactly `length` `token`s begins in `ids` at or after `start`, or -1."""
    i = start
    while i < len(ids):
        if ids[i] != token:
            i += 1
            continue
        end = i
        while end < len(ids) and ids[end] == token:
            end += 1
        if end - i == length:
            return i
        i = end
    return -1
