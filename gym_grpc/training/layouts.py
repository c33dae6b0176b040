"""Samples written as the trainers read them: verl's and NeMo RL's column layouts, in JSONL or Parquet.

- `verl`: one row per sample in the fields of verl's `AgentLoopOutput`
  (`prompt_ids`, `response_ids`, `response_mask`, `response_logprobs`,
  `reward_score`, `num_turns`), with `uid` (the GRPO group, as verl groups
  by uid), `advantage` and `loss_multiplier`.
- `nemo-rl`: one row per sample with a `message_log` as NeMo RL's NeMo Gym
  environment builds it (`nemo_rl/environments/nemo_gym.py`): alternating
  `user` entries (the ids before each generation) and `assistant` entries
  (the generated ids with their `generation_logprobs`), each with
  `content` "" and `token_ids`; then `reward`, `advantage`,
  `loss_multiplier`, `idx` (the task) and `task_name` (the agent).

Every row also carries `agent`, `task_index`, `repeat_index`, `part`,
`policy_version` (the oldest turn's) and `lag`, and a failed rollout's row
its `failure`. Parquet needs pyarrow
(`pip install 'gym-grpc[training]'`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from gym_grpc.data import jsonl
from gym_grpc.errors import ConfigError
from gym_grpc.training.samples import Sample

Layout = Literal["verl", "nemo-rl"]
LAYOUTS: tuple[Layout, ...] = ("verl", "nemo-rl")


def _key(sample: Sample) -> dict[str, Any]:
    return {
        "agent": sample.agent,
        "task_index": sample.task_index,
        "repeat_index": sample.repeat_index,
        "part": sample.part,
        "failure": sample.failure,
        "policy_version": sample.policy_version,
        "lag": sample.lag,
        "role": sample.role,
    }


def verl_row(sample: Sample) -> dict[str, Any]:
    return {
        "uid": sample.group,
        "prompt_ids": sample.prompt_ids,
        "response_ids": sample.response_ids,
        "response_mask": sample.response_mask,
        "response_logprobs": sample.response_log_probs,
        "reward_score": sample.reward,
        "num_turns": sample.num_turns,
        "advantage": sample.advantage,
        "loss_multiplier": sample.loss_multiplier,
        **_key(sample),
    }


def _message_log(sample: Sample) -> list[dict[str, Any]]:
    """The sample as alternating user (not trained) and assistant (trained) entries."""
    log: list[dict[str, Any]] = []
    ids, mask, probs = sample.response_ids, sample.response_mask, sample.response_log_probs
    before = list(sample.prompt_ids)
    i = 0
    while i < len(ids):
        if not mask[i]:
            before.append(ids[i])
            i += 1
            continue
        end = i
        while end < len(ids) and mask[end]:
            end += 1
        log.append({"role": "user", "content": "", "token_ids": before, "generation_logprobs": None})
        log.append({"role": "assistant", "content": "", "token_ids": ids[i:end], "generation_logprobs": probs[i:end]})
        before, i = [], end
    if before and log:  # ids after the last generation (none when the sample ends with one)
        log.append({"role": "user", "content": "", "token_ids": before, "generation_logprobs": None})
    return log


def nemo_rl_row(sample: Sample) -> dict[str, Any]:
    return {
        "message_log": _message_log(sample),
        "reward": sample.reward,
        "advantage": sample.advantage,
        "loss_multiplier": sample.loss_multiplier,
        "idx": sample.task_index,
        "task_name": sample.agent,
        **_key(sample),
    }


def rows(samples: Sequence[Sample], layout: Layout) -> Iterator[dict[str, Any]]:
    to_row = verl_row if layout == "verl" else nemo_rl_row
    return (to_row(sample) for sample in samples)


def write_jsonl(samples: Sequence[Sample], layout: Layout, path: Path) -> None:
    with path.open("wb") as f:
        for row in rows(samples, layout):
            f.write(jsonl.dump_line(row))


def write_parquet(samples: Sequence[Sample], layout: Layout, path: Path) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("Parquet needs pyarrow: pip install 'gym-grpc[training]'") from None
    key = [
        ("agent", pa.string()),
        ("task_index", pa.int64()),
        ("repeat_index", pa.int64()),
        ("part", pa.int32()),
        ("failure", pa.string()),
        ("policy_version", pa.int64()),
        ("lag", pa.int64()),
    ]
    ids, probs = pa.list_(pa.int64()), pa.list_(pa.float64())
    if layout == "verl":
        fields = [
            ("uid", pa.string()),
            ("prompt_ids", ids),
            ("response_ids", ids),
            ("response_mask", pa.list_(pa.int8())),
            ("response_logprobs", probs),
            ("reward_score", pa.float64()),
            ("num_turns", pa.int32()),
        ]
    else:
        entry = pa.struct(
            [("role", pa.string()), ("content", pa.string()), ("token_ids", ids), ("generation_logprobs", probs)]
        )
        fields = [
            ("message_log", pa.list_(entry)),
            ("reward", pa.float64()),
            ("idx", pa.int64()),
            ("task_name", pa.string()),
        ]
    schema = pa.schema([*fields, ("advantage", pa.float64()), ("loss_multiplier", pa.float32()), *key])
    pq.write_table(pa.Table.from_pylist(list(rows(samples, layout)), schema=schema), path)


def write(samples: Sequence[Sample], layout: Layout, path: Path) -> None:
    """Write `samples` to `path`: Parquet when it ends with .parquet, else JSONL."""
    if path.suffix == ".parquet":
        write_parquet(samples, layout, path)
    else:
        write_jsonl(samples, layout, path)
