"""What the collector keeps while it runs: compact per key, constant per rollout, and still exact
where the features need it (resume by key, stage quantiles, the environment's own metrics)."""

import math
import random

import pytest

from gym_grpc.batch.collector import PackedResults
from gym_grpc.batch.summary import RunStats
from gym_grpc.data import jsonl, record
from gym_grpc.data.rollout_stats import Quantiles
from gym_grpc.v1 import task_pb2


def test_key_bits_hold_exactly_the_slots_added():
    bits = jsonl.KeyBits(1001)
    added = {0, 7, 8, 9, 500, 1000}
    for slot in added:
        bits.add(slot)
    bits.add(7)  # twice is once
    assert {slot for slot in range(1001) if slot in bits} == added
    assert len(bits) == len(added)
    assert -1 not in bits and 1001 not in bits
    with pytest.raises(IndexError):
        bits.add(1001)


def test_done_keys_are_the_keys_of_the_file_under_either_name(tmp_path):
    out = tmp_path / "out.jsonl"
    rows = [{"task_index": 2, "repeat_index": 1}, {"_ng_task_index": 0, "_ng_rollout_index": 0}]
    rows += [{"task_index": 9, "repeat_index": 0}, {"no": "key"}]  # outside the input; none
    out.write_text("".join(f"{jsonl.json.dumps(row)}\n" for row in rows))
    done = jsonl.done_keys(out, n_tasks=3, repeats=2)
    assert [slot for slot in range(6) if slot in done] == [0, 5]


@pytest.mark.parametrize("spread", [0.001, 10.0])
def test_quantiles_are_within_half_a_percent_of_the_exact_ones(spread):
    rng = random.Random(18)
    values = [rng.expovariate(1 / spread) for _ in range(20_001)] + [0.0] * 50
    quantiles = Quantiles()
    for value in values:
        quantiles.add(value)
    ordered = sorted(values)
    assert quantiles.count == len(values)
    for q in (0.5, 0.95, 0.99):
        exact = ordered[math.ceil(q * len(ordered)) - 1]
        assert quantiles.quantile(q) == pytest.approx(exact, rel=0.005)
    assert (quantiles.quantile(0.0), quantiles.quantile(1.0)) == (0.0, ordered[-1])


def test_quantiles_of_one_value_are_that_value_and_of_none_nan():
    quantiles = Quantiles()
    assert math.isnan(quantiles.quantile(0.5))
    quantiles.add(0.25)
    assert quantiles.quantile(0.5) == quantiles.quantile(0.95) == 0.25


def test_quantiles_are_exact_up_to_the_values_they_keep():
    values = [i / 1000 for i in range(Quantiles.EXACT, 0, -1)]
    quantiles = Quantiles()
    for value in values:
        quantiles.add(value)
    ordered = sorted(values)
    assert quantiles.median() == (ordered[len(values) // 2 - 1] + ordered[len(values) // 2]) / 2
    assert quantiles.quantile(0.95) == ordered[math.ceil(0.95 * len(values)) - 1]


def test_the_slowest_stage_is_named_with_its_median_and_p95():
    stats = RunStats()
    for i in range(1, 101):
        stats.add({"timings": {"model": i / 1000, "tools": 0.0, "verify": 0.01}})
    stage, median, p95 = stats.slowest_stage()
    assert stage == "model"
    assert (median, p95) == (0.0505, 0.095)


def test_packed_results_give_back_every_result_in_order():
    results = [
        task_pb2.VerificationResult(task_index=i, reward=i / 7, fields_json='{"n": %d}' % i if i % 2 else "")
        for i in range(1000)
    ]
    results[3].reward_components["format"] = 0.5
    results.append(task_pb2.VerificationResult())  # all defaults: zero bytes serialized
    packed = PackedResults()
    for result in results:
        packed.append(result)
    assert len(packed) == len(results)
    assert packed.size == sum(result.ByteSize() for result in results)
    assert list(packed) == results


def test_a_record_verification_packs_and_comes_back_whole():
    row = {"task_index": 4, "reward": 0.5, "verifier_fields": ["hits"], "hits": 3, "reward_components": {"a": 1}}
    packed = PackedResults()
    packed.append(record.verification(row))
    (back,) = packed
    assert (back.task_index, back.reward, back.fields_json, dict(back.reward_components)) == (
        4,
        0.5,
        '{"hits":3}',
        {"a": 1.0},
    )


@pytest.mark.parametrize(
    "row",
    [
        {"text": 'é ☃ \u2028 "q" \\ \n\t\x00', "n": [0, -1, 2**63 - 1], "f": [0.1, 1e-05, 1e16, -0.0, 1.0]},
        {"nested": {"a": [{"b": None}]}, "empty": {}, "list": [], "flag": True},
        {"nan": math.nan, "inf": [math.inf, -math.inf]},  # orjson would write null: json writes them
        {"big": 2**70, "neg": -(2**80)},  # beyond orjson's 64 bits
        {"text": "null is a word"},
    ],
)
def test_a_dumped_line_reads_back_as_the_row_json_writes(row):
    line = jsonl.dump_line(row)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    back = jsonl.json.loads(line)
    assert jsonl.json.dumps(back, sort_keys=True) == jsonl.json.dumps(row, sort_keys=True)
    assert list(back) == list(row)  # key order kept


def test_rows_appended_read_back_whole(tmp_path):
    path = tmp_path / "out.jsonl"
    out = jsonl.Appender(path)
    rows = [{"task_index": i, "reward": i / 3, "nan": math.nan if i == 2 else 0.0} for i in range(5)]
    for row in rows:
        out.append(row)
    out.close()
    back = list(jsonl.iter_rows(path))
    assert [r["reward"] for r in back] == [r["reward"] for r in rows] and math.isnan(back[2]["nan"])


def test_fast_loads_reads_what_json_reads_or_falls_back_to_it():
    assert jsonl.loads_fast('{"a": [1, 2.5, null, true], "b": "é"}') == {"a": [1, 2.5, None, True], "b": "é"}
    assert math.isnan(jsonl.loads_fast('{"r": NaN}')["r"])
    big = jsonl.loads_fast('{"big": 123456789012345678901234567890, "near": 18446744073709551615}')
    assert big == {"big": 123456789012345678901234567890, "near": 2**64 - 1}
    assert isinstance(big["big"], int)
    with pytest.raises(ValueError):
        jsonl.loads_fast('{"torn": ')


def test_a_built_record_is_the_scored_row_then_the_runs_fields():
    from gym_grpc.data import rows

    response = rows.response_from_json(
        {"id": "r", "output": [{"type": "message", "role": "assistant", "content": "42"}], "object": "response"}
    )
    rollout = task_pb2.Rollout(response=response, reward=0.5, model_calls=2, verifier_fields_json='{"hits": 3}')
    rollout.reward_components["format"] = 1.0
    rollout.timings.model_seconds = 0.25
    task_row = {"responses_create_params": {"input": "q"}, "reward": "theirs", "hits": 0, "expected": "42"}
    built = record.build(task_row, rollout)
    assert list(built.items())[: len(record.scored(task_row, rollout))] == list(
        record.scored(task_row, rollout).items()
    )
    assert built["reward"] == 0.5 and built["hits"] == 3 and built["verifier_fields"] == ["hits"]
    assert built["reward_components"] == {"format": 1.0} and built["model_calls"] == 2
    assert built["timings"] == {"model": 0.25, "tools": 0.0, "verify": 0.0, "total": 0.0}
    assert list(built)[:2] == ["responses_create_params", "reward"]  # a task key keeps its place


def test_the_run_lines_give_attempted_and_succeeded_rates_small_ones_readable():
    stats = RunStats()
    for _ in range(45):
        stats.add({"response": {"usage": {"input_tokens": 100, "output_tokens": 20}}, "reward": 1.0})
    # 45 of 200 rollouts succeeded in 100 s: 0.45 rollouts/s succeeded, 2 attempted
    line = stats.lines(100.0, 0, failed=155)[0]
    assert line.startswith("0.45 rollouts/s succeeded, 2 attempted (155 of 200 failed); tokens/s: 45.0 input, 9 output")
    assert stats.lines(100.0, 0, tokens=False)[0] == "0.45 rollouts/s"
    assert stats.lines(10_000.0, 0)[0].startswith("0.0045 rollouts/s;")
    assert RunStats().lines(5.0, 10, failed=3) == ["0 rollouts/s succeeded, 0.6 attempted (3 of 3 failed)"]
