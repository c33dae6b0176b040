"""Placing a render's image features in the token path's prompt (image_features.py). The render answers
here have the shape of vLLM 0.32's /v1/chat/completions/render for its Idefics3 model, whose placeholder
range wraps 4 image tokens (7) in <fake_token_around_image> (8) and <global-img> (9): as seen from the real
engine in tests/real_engine/test_vision.py."""

import pytest

from gym_grpc.bundled.servers.models.vllm_model.image_features import place

WRAPPED = [8, 9, 7, 7, 7, 7, 8]


def _render(ids: list[int], offsets: list[int]) -> dict:
    return {
        "token_ids": ids,
        "features": {
            "mm_hashes": {"image": [f"h{i}" for i in range(len(offsets))]},
            "mm_placeholders": {"image": [{"offset": o, "length": len(WRAPPED)} for o in offsets]},
            "kwargs_data": {"image": [f"k{i}" for i in range(len(offsets))]},
            "mm_metadata": {"image": [f"m{i}" for i in range(len(offsets))]},
        },
    }


def test_each_image_is_narrowed_to_its_image_tokens_and_found_where_the_prompt_has_them():
    rendered = [1, 2, *WRAPPED, 3, *WRAPPED, 4]
    # The prompt is the earlier turns' ids extended: two sampled ids more before the first image.
    prompt = [1, 2, 50, 51, *WRAPPED, 3, 60, *WRAPPED, 4, 5]
    features = place(_render(rendered, [2, 10]), prompt)
    assert features == {
        "mm_hashes": {"image": ["h0", "h1"]},
        "mm_placeholders": {"image": [{"offset": 6, "length": 4}, {"offset": 15, "length": 4}]},
        "kwargs_data": {"image": ["k0", "k1"]},
    }
    assert [prompt[p["offset"] : p["offset"] + p["length"]] for p in features["mm_placeholders"]["image"]] == [
        [7] * 4, [7] * 4,
    ]  # fmt: skip


def test_an_image_whose_tokens_the_prompt_lacks_or_splits_cannot_be_placed():
    with pytest.raises(ValueError, match="image 2: its 4 image tokens"):
        place(_render([*WRAPPED, *WRAPPED], [0, 7]), [*WRAPPED, 7, 7, 5, 7, 7])
    split = {"token_ids": [7, 7, 8, 7, 7], "features": {**_render([], [0])["features"]}}
    split["features"]["mm_placeholders"] = {"image": [{"offset": 0, "length": 5}]}
    with pytest.raises(ValueError, match="not one run"):
        place(split, [7, 7, 8, 7, 7])


def test_inputs_other_than_images_are_refused():
    other = _render(WRAPPED, [0])
    other["features"]["mm_hashes"]["audio"] = ["a"]
    with pytest.raises(ValueError, match="other than images"):
        place(other, WRAPPED)
