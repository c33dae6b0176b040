"""The vLLM gRPC engine link (gym_grpc/engines/vllm_grpc.py): a request's fields as vLLM's gRPC sampling
parameters, and the tokenizer an engine sends, checked before it is used. The model server over it is
tested in servers/models/vllm_model/tests/test_grpc_engine.py; the real vLLM gRPC server in tests/real_engine."""

import hashlib
import io
import json
import logging
import zipfile

import pytest
from smg_grpc_proto.generated import common_pb2

from gym_grpc import errors
from gym_grpc.engines.settings import EngineSettings
from gym_grpc.engines.vllm_grpc import GrpcEngine, sampling_params
from gym_grpc.testing.fake_engine import FakeEngine, write_tokenizer
from gym_grpc.testing.fake_vllm_grpc import FakeGrpcEngine


def test_request_fields_become_the_sampling_parameters_vllm_takes():
    params = sampling_params(
        {
            "model": "p",
            "prompt": [1, 2],
            "temperature": 0.0,
            "top_p": 0.5,
            "top_k": -1,
            "max_tokens": 7,
            "seed": 3,
            "stop": "END",
            "stop_token_ids": [5],
            "logit_bias": {"5": 1.5},
            "logprobs": 0,
            "skip_special_tokens": False,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        }
    )
    assert params.HasField("temperature") and params.temperature == 0.0  # greedy, not "unset"
    assert (params.top_p, params.top_k, params.max_tokens, params.seed) == (0.5, 0, 7, 3)
    assert list(params.stop) == ["END"] and list(params.stop_token_ids) == [5] and dict(params.logit_bias) == {5: 1.5}
    assert params.HasField("logprobs") and params.logprobs == 0
    assert not params.skip_special_tokens and params.spaces_between_special_tokens  # vLLM's default kept
    assert json.loads(params.json_schema) == {"type": "object"}
    assert not sampling_params({}).HasField("temperature")  # unset: the engine's default


def test_a_structural_tag_goes_whole_and_two_constraints_are_refused():
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"]}}
    assert json.loads(sampling_params({"response_format": tag}).structural_tag) == tag
    assert list(sampling_params({"structured_outputs": {"choice": ["a", "b"]}}).choice.choices) == ["a", "b"]
    with pytest.raises(errors.InvalidArgument, match=r"constrains its output 2 ways \(json_object, regex\)"):
        sampling_params({"response_format": {"type": "json_object"}, "guided_regex": "a+"})


def test_a_field_of_the_wrong_type_is_refused_and_an_unknown_one_logged_once(caplog):
    with pytest.raises(errors.InvalidArgument, match="a sampling field has a value vLLM cannot take"):
        sampling_params({"max_tokens": "many"})
    caplog.set_level(logging.WARNING, logger="gym_grpc.engines.vllm_grpc")
    sampling_params({"best_of_three": 1})
    sampling_params({"best_of_three": 1})
    warned = [rec.getMessage() for rec in caplog.records if "best_of_three" in rec.getMessage()]
    assert warned == ["request field 'best_of_three' has no counterpart in vLLM's gRPC SamplingParams; it is not sent"]


class _Archive(FakeGrpcEngine):
    """Sends `data` as its tokenizer, announced with `sha`."""

    def __init__(self, fake, tokenizer_dir, data: bytes, sha: str) -> None:
        super().__init__(fake, tokenizer_dir)
        self.data, self.sha = data, sha

    async def GetTokenizer(self, request, context):  # noqa: N802
        yield common_pb2.GetTokenizerChunk(data=self.data, sha256=self.sha)


def _zip(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()


async def _fetch(tmp_path, face: FakeGrpcEngine):
    await face.start()
    link = GrpcEngine(face.base_url, EngineSettings(base_url=[face.base_url], model="p"))
    try:
        return await link.tokenizer_files(tmp_path / "cache")
    finally:
        await link.close()
        await face.stop()


async def test_the_tokenizer_is_fetched_once_per_content(tmp_path):
    tokenizer = write_tokenizer(tmp_path / "tok")
    face = FakeGrpcEngine(FakeEngine(), tokenizer)
    directory = await _fetch(tmp_path, face)
    assert (directory / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    assert directory == await _fetch(tmp_path, FakeGrpcEngine(FakeEngine(), tokenizer))


@pytest.mark.parametrize(
    ("files", "sha", "message"),
    [
        ({"tokenizer.json": "{}"}, "0" * 64, "the tokenizer's SHA-256 is .*, not the 0000"),
        ({"../escape.json": "{}"}, None, r"the tokenizer archive has paths in it \(\['../escape.json'\]\)"),
    ],
)
async def test_a_tokenizer_that_does_not_check_out_is_refused(tmp_path, files, sha, message):
    data = _zip(files)
    face = _Archive(FakeEngine(), tmp_path, data, sha or hashlib.sha256(data).hexdigest())
    with pytest.raises(errors.GymError, match=message):
        await _fetch(tmp_path, face)
    assert not (tmp_path / "cache").exists()  # nothing unpacked
