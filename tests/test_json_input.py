"""How deep outside JSON may nest: brackets inside strings neither count nor hide real depth."""

import json

import pytest

from gym_grpc.data import json_input


def test_brackets_inside_strings_do_not_count():
    text = json.dumps({"a": "[" * 1_000, "b": '\\"{' * 1_000, "c": [[["deep enough"]]]})
    assert json_input.loads(text) == json.loads(text)


def test_closing_brackets_inside_a_string_do_not_hide_the_depth():
    text = '{"a": "' + "]" * 1_000 + '", "b": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(json_input.TooDeep, match=f"nested deeper than {json_input.MAX_DEPTH} levels"):
        json_input.loads(text)


def test_the_limit_counts_the_outermost_container_as_level_one():
    at_the_limit = "[" * json_input.MAX_DEPTH + "]" * json_input.MAX_DEPTH
    assert json_input.loads(at_the_limit) == json.loads(at_the_limit)
    with pytest.raises(json_input.TooDeep):
        json_input.loads("[" + at_the_limit + "]")
