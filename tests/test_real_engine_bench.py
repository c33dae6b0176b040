"""bench/real_engine.py's counting: which turns extend the earlier ids, and refused turns."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import script


def _call(prompt: list[int], generated: list[int]) -> dict:
    return {"type": "function_call", "prompt_token_ids": prompt, "generation_token_ids": generated}


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_a_turn_extends_only_when_its_prompt_begins_with_the_previous_prompt_and_generation():
    bench = script("bench/real_engine.py", "bench_real_engine")
    assert bench.extends([([1, 2], [3]), ([1, 2, 3, 4], [5]), ([1, 2, 3, 4, 5, 6], [7])]) == [True, True]
    # Re-tokenized history: the same text, other ids for the generated part.
    assert bench.extends([([1, 2], [3, 4]), ([1, 2, 9, 4, 5], [6])]) == [False]
    # A prompt shorter than the previous prompt + generation cannot extend it.
    assert bench.extends([([1, 2], [3]), ([1, 2], [4])]) == [False]
    assert bench.extends([([1], [2])]) == []


def test_refused_turns_count_as_not_extending_and_their_earlier_turns_come_from_the_events(tmp_path):
    bench = script("bench/real_engine.py", "bench_real_engine")
    out, events = tmp_path / "chat.jsonl", tmp_path / "chat.events.jsonl"
    done = {"task_index": 0, "repeat_index": 0, "model_calls": 2, "reward": 1.0, "stop_reason": "final_message"}
    done["response"] = {"output": [_call([1], [2]), {"type": "function_call_output"}, _call([1, 2, 3], [4])]}
    _write(out, [done])
    _write(
        events,
        [
            {
                "task_index": 0,
                "repeat_index": 0,
                "type": "model_call",
                "step": 0,
                "response": {"output": [_call([1], [2])]},
            },
            {
                "task_index": 0,
                "repeat_index": 0,
                "type": "model_call",
                "step": 1,
                "response": {"output": [_call([1, 2, 3], [4])]},
            },
            # Rollout 1: its second call extended, its third was refused.
            {
                "task_index": 1,
                "repeat_index": 0,
                "type": "model_call",
                "step": 0,
                "response": {"output": [_call([5], [6])]},
            },
            {
                "task_index": 1,
                "repeat_index": 0,
                "type": "model_call",
                "step": 1,
                "response": {"output": [_call([5, 6, 7], [8])]},
            },
        ],
    )
    refused = "engine x: this turn's prompt ids part from the earlier turns' ids at position 3 of 4; ..."
    _write(
        out.with_name("chat.failures.jsonl"),
        [{"task_index": 1, "repeat_index": 0, "error": {"code": "FAILED_PRECONDITION", "message": refused}}],
    )
    result = bench.analyse(out, events)
    assert result["prefix"]["from_rows"] == {"turns": 1, "extending": 1}
    assert result["prefix"]["with_refused"] == {"turns": 3, "extending": 2, "refused": 1, "share": round(2 / 3, 4)}
    assert result["rollouts"] == 1 and result["failed"] == 1
    assert result["rollouts_reaching_a_second_model_call"] == 2
    assert result["generated_tokens"] == 2 and result["generated_tokens_all_calls"] == 4
