"""servers/models/vllm_model/generate.py: a /v1/completions body as vLLM's /inference/v1/generate
request, its answer back in the /v1/completions form, and its weight versions as policy versions.
The answer below is one the real CPU vLLM gave (trimmed to two tokens); the real-engine suite runs
the whole path."""

from gym_grpc.bundled.servers.models.vllm_model import generate

ANSWER = {
    "request_id": "generate-tokens-a55c846410783f21",
    "model": "SmolLM2-135M-Instruct",
    "usage": {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2},
    "output_mode": "text",
    "choices": [
        {
            "index": 0,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": [216, 34],
            "weight_versions": [{"version": "7", "start": 0, "end": 1}, {"version": "8", "start": 1, "end": 2}],
            "text": " 2",
            "logprobs": {
                "content": [
                    {"token": " ", "logprob": -4.115, "bytes": [32], "top_logprobs": []},
                    {"token": "2", "logprob": -1.026, "bytes": [50], "top_logprobs": []},
                ]
            },
        }
    ],
}


def test_a_completions_body_becomes_a_generate_request_with_its_sampling_and_its_constraint():
    body = {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_completion_tokens": 9,
        "temperature": 0.5,
        "seed": 3,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}},
    }
    request = generate.request(body)
    assert request["token_ids"] == [1, 2, 3] and request["model"] == "m" and request["output_mode"] == "text"
    sampling = request["sampling_params"]
    assert sampling == {
        "max_tokens": 9,
        "temperature": 0.5,
        "seed": 3,
        "logprobs": 0,
        "skip_special_tokens": False,
        "structured_outputs": {"structural_tag": '{"type": "structural_tag", "format": {"type": "triggered_tags"}}'},
    }
    schema = {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert generate.request({"prompt": [1], "response_format": fmt})["sampling_params"] == {
        "structured_outputs": {"json": schema}
    }


def test_an_answer_reads_as_a_completion_with_one_policy_version_per_span():
    completion = generate.as_completion(ANSWER)["choices"][0]
    assert completion["logprobs"] == {"token_logprobs": [-4.115, -1.026]} and completion["text"] == " 2"
    spans = generate.spans(completion)
    assert [(s.version, s.start, s.end) for s in spans] == [(7, 0, 1), (8, 1, 2)]
    assert generate.spans({"weight_versions": [{"version": "default", "start": 0, "end": 2}]}) == []
    assert generate.spans({}) == []
