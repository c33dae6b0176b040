"""What a later turn's prompt costs the model server to render, by the turns before it: the
conversation through the last turn and all of it tokenized whole, beside only the text the second
adds (LocalTemplate.extension, where token_cuts allows it), in the same run.

    python bench/turn_render.py          # bench/results/<name>.json + .md
    python bench/turn_render.py --smoke  # a few builds a cell (a temp dir), to check it works

In this process, no engine: token_prompts.build() with the session's last prompt known, as the
vLLM model server calls it on each later turn, once without an extension (how every turn was
rendered before) and once with it, for a conversation of T - 1 weather tool calls and their answers
(the T-th turn's prompt). The two must give the same ids, or the run fails. Tokenizers: SmolLM2's with
the chat template the local engine serves it with (byte-level BPE; `python -m
gym_grpc.engines.local_vllm prepare` brings it), and the fake engine's (a byte a token). CPU is
time.process_time over --builds builds a cell, the two ways in turn for --rounds rounds; medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import real_engine  # noqa: E402  (the bench directory is not a package)

from gym_grpc.bundled.servers.models.vllm_model import templates, token_prompts  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def conversation(turns: int) -> list[dict[str, Any]]:
    """A question and turns - 1 tool calls with their answers: what the turns-th turn's prompt renders."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris? Check it often."}]
    for n in range(turns - 1):
        function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        call = {"id": f"c{n}", "type": "function", "function": function}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{n}", "content": "Sunny, 20 C in Paris, light wind."})
    return messages


async def cell(local: templates.LocalTemplate, turns: int, builds: int, rounds: int) -> dict[str, Any]:
    async def render(messages: list[dict[str, Any]], generation: bool) -> list[int]:
        return local.render(messages, tools=TOOLS, template_kwargs=None, add_generation_prompt=generation)

    async def extension(through: list[dict[str, Any]], whole: list[dict[str, Any]], closing: list[int]) -> Any:
        return await local.extension(through, whole, tools=TOOLS, template_kwargs=None, closing=closing)

    messages = conversation(turns)
    at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    last = await render(messages[: at[-1]], True)
    generated = (await render(messages[: at[-1] + 1], False))[len(last) :]
    carriers = [None] * (len(at) - 1) + [token_prompts.Carrier(last, generated)]
    closing = await token_prompts.turn_closing(render)
    known = token_prompts.Known(b"session", array("I", last))
    ms: dict[str, list[float]] = {"whole": [], "added": []}
    prompts: dict[str, list[int]] = {}
    for _ in range(rounds):
        for way, given in (("whole", None), ("added", extension)):
            start = time.process_time()
            for _ in range(builds):
                prompt = await token_prompts.build(messages, carriers, render, closing, known, b"session", given)
            ms[way].append((time.process_time() - start) / builds * 1000)
            prompts[way] = prompt.ids
    if prompts["whole"] != prompts["added"]:
        raise SystemExit(f"T = {turns}: the prompt of the added text alone is not the whole renders' one")
    whole, added = statistics.median(ms["whole"]), statistics.median(ms["added"])
    return {
        "turns": turns,
        "prompt_ids": len(prompts["added"]),
        "whole_ms": round(whole, 3),
        "added_ms": round(added, 3),
        "ratio": round(whole / added, 2),
        "whole_ms_rounds": [round(x, 3) for x in ms["whole"]],
        "added_ms_rounds": [round(x, 3) for x in ms["added"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", default="2,4,8,16,32", help="the turn whose prompt is built, comma-separated")
    parser.add_argument("--builds", type=int, default=200, help="builds a cell and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="5 builds, 2 rounds, T = 2 and 8; results in a temp dir")
    parser.add_argument("--name", default="turn_render")
    args = parser.parse_args()
    if args.smoke:
        args.turns, args.builds, args.rounds = "2,8", 5, 2
    from gym_grpc.engines import local_vllm
    from gym_grpc.testing.fake_engine import write_tokenizer

    prepared = local_vllm.prepare()
    load_start = [round(x, 2) for x in os.getloadavg()]
    tokenizers = {
        "SmolLM2-135M-Instruct": templates.LocalTemplate(prepared.model_dir, local_vllm.CHAT_TEMPLATE),
        "fake engine": templates.LocalTemplate(write_tokenizer(Path(tempfile.mkdtemp()) / "tok")),
    }
    results = {
        name: [asyncio.run(cell(local, t, args.builds, args.rounds)) for t in map(int, args.turns.split(","))]
        for name, local in tokenizers.items()
    }
    machine = {**real_engine.bench_run.machine(), "model": "SmolLM2-135M-Instruct"}
    report = {
        **real_engine.report_head("bench/turn_render.py", args, machine, load_start),
        "workload": {"turns": args.turns, "builds": args.builds, "rounds": args.rounds},
        "results": results,
    }
    lines = [
        f"# {args.name}",
        "",
        f"`{report['command']}`, {report['date']}, {machine['cpu']} ({machine['cores']} cores), load average "
        f"{load_start[0]} at the start. CPU ms to build the T-th turn's prompt, medians of {args.rounds} rounds "
        f"of {args.builds} builds.",
        "",
        "| tokenizer | T | prompt ids | tokenized whole | only the added text | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        for row in rows:
            lines.append(
                f"| {name} | {row['turns']} | {row['prompt_ids']} | {row['whole_ms']} | {row['added_ms']} "
                f"| {row['ratio']}x |"
            )
    real_engine.save(report, "\n".join(lines) + "\n", args.smoke)


if __name__ == "__main__":
    main()
