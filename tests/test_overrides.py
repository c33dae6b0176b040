"""collect's KEY=VALUE overrides: typos and impossible values refused once, NeMo Gym's spellings taken."""

import pytest

from gym_grpc.batch import overrides


def test_values_are_json_else_text_and_dotted_keys_nest():
    found = overrides.parse(["temperature=0.6", "reasoning.effort=high", "max_output_tokens=64"])
    assert found.params == {"temperature": 0.6, "reasoning.effort": "high", "max_output_tokens": 64}
    params: dict = {"input": "hi", "reasoning": {"summary": "auto"}}
    overrides.apply(params, found.params)
    assert params == {"input": "hi", "reasoning": {"summary": "auto", "effort": "high"}, "temperature": 0.6,
                      "max_output_tokens": 64}  # fmt: skip


def test_nemo_gym_spellings_are_taken():
    found = overrides.parse(["+responses_create_params.temperature=0.6", "+num_repeats=4", "+limit=10"])
    assert found.params == {"temperature": 0.6}
    assert found.options == {"num_repeats": 4, "limit": 10}


@pytest.mark.parametrize(
    ("pair", "said"),
    [
        ("temprature=0.6", "'temprature' is not a Responses create parameter; did you mean 'temperature'?"),
        ("max_output_token=5", "did you mean 'max_output_tokens'?"),
        ("temperature=7", "temperature=7: the Responses API takes 0 to 2"),
        ("max_output_tokens=-5", "max_output_tokens: expected a non-negative integer, got -5"),
        ("top_p=1.5", "top_p: must be between 0 and 1"),
        ("+num_repeats=0", "num_repeats takes a whole number"),
        ("temperature", "expected key=value"),
    ],
)
def test_a_mistake_is_refused_before_any_rollout_and_named(pair, said):
    with pytest.raises(overrides.OverrideError, match=None) as refused:
        overrides.parse([pair])
    assert said in str(refused.value)


def test_engine_parameters_pass_and_unknown_ones_pass_with_a_warning():
    found = overrides.parse(["top_k=20", "min_p=0.05", "guided_grammar=root ::= x"])
    assert found.params == {"top_k": 20, "min_p": 0.05, "guided_grammar": "root ::= x"}
    assert len(found.warnings) == 1 and "'guided_grammar' is not a Responses create parameter" in found.warnings[0]
