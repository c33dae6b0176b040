"""Real rows and real engine answers go through gym-grpc unchanged.

The data is other people's: NeMo Gym's example tasks and recorded rollouts
(from real OpenAI, vLLM and NIM models), read from its wheel at test time (see
tests/corpus.py). "Unchanged" is checked strictly: the same keys, the same
values and the same JSON types (`1.0` is not `1`), list order, and the key
order of free-form JSON such as a tool's parameter schema.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.openai_model.server import OpenAIModel
from gym_grpc.client.stubs import AgentClient, ModelClient
from gym_grpc.data import record, rows
from gym_grpc.testing.fake_engine import FakeEngine
from gym_grpc.v1 import responses_pb2 as r
from tests.corpus import nemo_gym_lines
from tests.support import Calculator, static_registry


def difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where `a` and `b` differ as JSON (types included, dict key order not), or None."""
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} {a!r:.80} != {type(b).__name__} {b!r:.80}"
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(a.keys() ^ b.keys())} differ"
        return next((d for k in a if (d := difference(a[k], b[k], f"{path}.{k}"))), None)
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} != {len(b)} entries"
        return next(
            (d for i, (x, y) in enumerate(zip(a, b, strict=True)) if (d := difference(x, y, f"{path}[{i}]"))), None
        )
    return None if a == b else f"{path}: {a!r:.80} != {b!r:.80}"


def _rows(suffix: str) -> list[tuple[str, dict]]:
    out = []
    for name, number, line in nemo_gym_lines(suffix):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # not JSON at all: rightly refused elsewhere, not a row
        if isinstance(row, dict) and isinstance(row.get(rows.PARAMS_KEY), dict):
            out.append((f"{name}:{number}", row))
    return out


@pytest.fixture(scope="module")
def task_rows() -> list[tuple[str, dict]]:
    return _rows("example.jsonl") + _rows("example_rollouts.jsonl")


@pytest.fixture(scope="module")
def responses() -> list[tuple[str, dict]]:
    return [(where, row["response"]) for where, row in _rows("example_rollouts.jsonl") if "response" in row]


def _as_written(params: dict) -> dict:
    """The create params as gym-grpc writes them: a message item always says its type."""
    out = dict(params)
    if isinstance(out.get("input"), list):
        out["input"] = [
            {"type": "message", **item} if isinstance(item, dict) and "type" not in item else item
            for item in out["input"]
        ]
    return out


def test_every_nemo_gym_task_row_loads_and_comes_back_unchanged(task_rows):
    assert len(task_rows) > 1500  # the corpus was read
    problems = []
    for where, row in task_rows:
        try:
            task = rows.task_from_row(row)
        except rows.RowError as e:
            problems.append(f"{where}: {e}")
            continue
        data = {k: v for k, v in row.items() if k != rows.PARAMS_KEY}
        found = difference(data, rows.task_data(task), "row") or difference(
            _as_written(row[rows.PARAMS_KEY]), rows.params_to_json(task.responses_create_params), rows.PARAMS_KEY
        )
        if found:
            problems.append(f"{where}: {found}")
    assert not problems, f"{len(problems)} of {len(task_rows)} rows:\n" + "\n".join(problems[:20])


def test_every_recorded_response_comes_back_unchanged(responses):
    assert len(responses) > 800
    problems = []
    for where, answer in responses:
        try:
            found = difference(answer, rows.response_to_json(rows.response_from_json(answer)), "response")
        except rows.RowError as e:
            found = str(e)
        if found:
            problems.append(f"{where}: {found}")
    assert not problems, f"{len(problems)} of {len(responses)} responses:\n" + "\n".join(problems[:20])


def test_tool_schemas_keep_their_key_order(task_rows):
    """A schema reordered per process changes the prompt the engine renders (and its prefix cache)."""
    checked = 0
    for where, row in task_rows:
        for i, tool in enumerate(row[rows.PARAMS_KEY].get("tools") or []):
            if tool.get("type") == "function" and tool.get("parameters"):
                loaded = rows.task_from_row(row).responses_create_params.tools[i].function
                assert json.dumps(rows.tool_parameters(loaded)) == json.dumps(tool["parameters"]), f"{where} tool {i}"
                checked += 1
    assert checked > 1000


# --- what the issue named, one by one -------------------------------------------------


def _params(**params: Any) -> dict:
    return {"input": [{"role": "user", "content": "hi"}], **params}


@pytest.mark.parametrize(
    "params",
    [
        _params(reasoning={"effort": "high", "generate_summary": "auto", "context": "all", "mode": "x"}),
        _params(
            tools=[
                {
                    "type": "function",
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"z": {}, "a": {}}},
                    "strict": None,
                    "defer_loading": True,
                    "output_schema": {"type": "string"},
                    "allowed_callers": ["model"],
                },
                {"type": "web_search_preview", "search_context_size": "low"},
                {"type": "custom", "name": "grammar", "format": {"type": "grammar", "syntax": "lark"}},
                {"type": "mcp", "server_label": "deepwiki", "server_url": "https://mcp.deepwiki.com/mcp"},
            ],
            tool_choice={"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}]},
        ),
        _params(tool_choice={"type": "custom", "name": "grammar"}),
        _params(
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "see"},
                        {"type": "input_file", "file_id": "file-1", "filename": "a.pdf"},
                        {"type": "input_video", "video_url": "https://example.com/v.mp4"},
                    ],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [
                        {
                            "type": "output_text",
                            "text": "ok",
                            "annotations": [],
                            "logprobs": [{"token": "ok", "logprob": -0.5, "bytes": [111, 107], "top_logprobs": []}],
                        }
                    ],
                    "phase": "final",
                    "routed_experts": [[1, 2], [3, 4]],
                },
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "namespace": "n"},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [{"type": "input_text", "text": "18 C"}, {"type": "input_image", "image_url": "u"}],
                },
                {"type": "custom_tool_call", "call_id": "c2", "name": "grammar", "input": "x + 1"},
                {"type": "custom_tool_call_output", "call_id": "c2", "output": "2"},
                {
                    "type": "mcp_call",
                    "id": "mcp_1",
                    "server_label": "deepwiki",
                    "name": "ask",
                    "arguments": "{}",
                    "output": "an answer",
                    "error": None,
                },
                {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
            ]
        ),
        _params(temperature=1.0, top_p=0.95, seed=2**60 + 1, metadata={"n": 1}, store=None, stream=False),
    ],
)
def test_what_the_schema_does_not_model_is_carried_unchanged(params):
    task = rows.task_from_row({rows.PARAMS_KEY: params, "score": 1.0, "big": 2**60 + 1})
    assert difference(_as_written(params), rows.params_to_json(task.responses_create_params)) is None
    assert rows.task_data(task) == {"score": 1.0, "big": 2**60 + 1}
    assert isinstance(rows.task_data(task)["score"], float)


def test_a_response_keeps_nulls_new_statuses_and_integer_times():
    answer = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1741476542,
        "status": None,
        "model": "m",
        "output": [
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None, "status": "searching"}
        ],
        "service_tier": "default",
        "truncation": "disabled",
        "store": True,
        "top_logprobs": 0,
        "temperature": 1,
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        "tools": [],
    }
    assert difference(answer, rows.response_to_json(rows.response_from_json(answer))) is None


def test_log_probs_keep_an_engines_float32_values_exactly():
    """generation_log_probs are float32 on the wire: an engine's float32 values come back
    exactly, and any other number within float32's precision (a relative 2**-24)."""
    import struct

    exact = [struct.unpack("f", struct.pack("f", v))[0] for v in (-0.1, -1e-7, -23.456789, 0.0)]
    other = [-0.1, -1e-7, -23.456789]
    item = {"type": "message", "role": "assistant", "content": "x", "generation_token_ids": [1, 2, 3, 4]}
    back = rows.item_to_json(rows.item_from_json({**item, "generation_log_probs": exact}))
    assert back["generation_log_probs"] == exact
    back = rows.item_to_json(rows.item_from_json({**item, "generation_log_probs": [*other, 0.0]}))
    for got, sent in zip(back["generation_log_probs"], other, strict=False):
        assert got != sent and abs(got - sent) <= abs(sent) * 2**-24


# --- property: unknown keys anywhere survive ---------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1.5,
    "model": "m",
    "status": "completed",
    "output": [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "t"}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": "{}", "status": "completed"},
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "hi", "annotations": []}],
        },
    ],
    "usage": {
        "input_tokens": 1,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 1,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 2,
    },
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"effort": "low"},
    "text": {"format": {"type": "text"}},
}


def _objects(value: Any) -> list[dict]:
    """Every JSON object in `value`, outermost first."""
    if isinstance(value, dict):
        return [value, *(o for v in value.values() for o in _objects(v))]
    if isinstance(value, list):
        return [o for v in value for o in _objects(v)]
    return []


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_unknown_keys_anywhere_in_a_response_survive(data):
    answer = copy.deepcopy(_RESPONSE)
    objects = _objects(answer)
    for _ in range(data.draw(st.integers(1, 4))):
        target = data.draw(st.sampled_from(objects))
        # Unknown for sure: a bare random name can be one the schema knows ("content" on a
        # reasoning item, drawn in a soak run), whose value is then rightly checked.
        key = "x-" + data.draw(st.text(min_size=1, max_size=8))
        if key not in target:
            target[key] = data.draw(_json)
    assert difference(answer, rows.response_to_json(rows.response_from_json(answer))) is None


# --- through the servers ------------------------------------------------------------


def _recorded_openai_answers() -> list[dict]:
    return [
        row["response"]
        for _, row in _rows("example_rollouts.jsonl")
        if str(row.get("response", {}).get("model", "")).startswith("gpt-4.1")
    ]


@pytest.mark.slow
async def test_every_recorded_answer_goes_through_the_model_server_unchanged(start, responses):
    """Every response in the corpus (OpenAI, vLLM, NIM...), as the engine's answer to openai_model."""
    answers = [answer for _, answer in responses]
    engine = FakeEngine()
    engine.recorded = copy.deepcopy(answers)
    await engine.start()
    settings = {"base_url": engine.base_url, "model": "gpt-4.1", "api_key": "sk-test", "backoff_seconds": 0.01}
    server = await start(OpenAIModel(settings, name="model"))
    model = ModelClient(static_registry(model=server), "model")
    params = rows.params_from_json({"input": "hi"})
    for answer in answers:
        response = await model.create_response(params, "s")
        assert difference(answer, rows.response_to_json(response)) is None
    await model.registry.close()
    await engine.stop()


async def test_a_one_turn_rollout_row_holds_the_engine_answer_unchanged(start):
    answer = next(a for a in _recorded_openai_answers() if all(item.get("type") == "message" for item in a["output"]))
    engine = FakeEngine()
    engine.recorded = [copy.deepcopy(answer)]
    await engine.start()
    settings = {"base_url": engine.base_url, "model": "gpt-4.1", "api_key": "sk-test"}
    model = await start(OpenAIModel(settings, name="model"))
    env = await start(Calculator())
    registry = static_registry(model=model, calc=env)
    agent = await start(SimpleAgent({"model_server": "model", "resources_server": "calc"}, name="a", registry=registry))
    client = AgentClient(static_registry(agent=agent), "agent")
    row = {rows.PARAMS_KEY: {"input": "What is 2 + 3?"}, "expected_answer": 5}
    rollout = await client.run(rows.task_from_row(row), timeout=30)
    assert difference(answer, record.scored(row, rollout)["response"]) is None
    await client.registry.close()
    await engine.stop()


def test_a_response_built_here_is_valid_for_the_openai_sdk_and_invents_nothing_on_reload():
    from openai.types.responses import Response as OpenAIResponse

    from gym_grpc.responses import assistant_message, new_response

    params = rows.params_from_json({"input": "hi", "temperature": 0.5, "tools": [_RESPONSE["tools"][0]]})
    response = new_response(params, "m")
    response.output.append(assistant_message("hello"))
    dumped = rows.response_to_json(response)
    parsed = OpenAIResponse.model_validate(dumped)
    assert parsed.temperature == 0.5 and parsed.tools[0].name == "f" and parsed.object == "response"
    assert difference(dumped, rows.response_to_json(rows.response_from_json(dumped))) is None
    assert r.Response.FromString(response.SerializeToString()) == response


def test_a_peer_that_still_sends_the_deprecated_structs_is_read():
    """A peer built before the *_json fields sends Structs: they are read when the text is empty."""
    from google.protobuf import struct_pb2

    from gym_grpc.v1 import task_pb2

    data = struct_pb2.Struct()
    data.update({"expected_answer": "4", "n": 3})
    task = task_pb2.Task(responses_create_params=rows.params_from_json({"input": "hi"}), data=data)
    assert rows.task_data(task) == {"expected_answer": "4", "n": 3}
    tool = r.FunctionTool(name="f")
    tool.parameters.update({"type": "object"})
    assert rows.tool_parameters(tool) == {"type": "object"}
    assert rows.params_to_json(r.CreateParams(input_text="hi", tools=[r.Tool(function=tool)]))["tools"] == [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}
    ]
    result = task_pb2.VerificationResult(reward=1.0)
    result.fields.update({"correct": True})
    assert rows.json_field(result, "fields") == {"correct": True}
