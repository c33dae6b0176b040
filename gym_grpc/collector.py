"""`gym-grpc collect`: a JSONL of tasks in, a JSONL of scored rollouts out.

Each task row runs `num_repeats` times through an agent, each run keyed by
(task_index, repeat_index); at most `max_in_flight` run at once. A finished
rollout is appended to the output at once (and flushed): the task row, then
`response`, `reward`, the verifier's fields, `stop_reason`, `model_calls`,
`timings` and the key. A failure goes to `<stem>.failures.jsonl` with its
error's class and message. Running the same command again skips every key
already in the output and retries the rest, so a killed collection resumes
with nothing lost and nothing twice.

The summary at the end is computed from the output file, so it covers every
run that wrote to it: per agent, the mean of every numeric field the rollouts
produced, pass@k and mean@k when there are repeats, and warnings for the
usual signs of a broken verifier or data set.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc
from tqdm import tqdm

from gym_grpc import errors, rows
from gym_grpc.clients import AgentClient
from gym_grpc.metrics import Means
from gym_grpc.registry import Registry
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

STOP_REASONS = {
    task_pb2.STOP_REASON_FINAL_MESSAGE: "final_message",
    task_pb2.STOP_REASON_MAX_STEPS: "max_steps",
    task_pb2.STOP_REASON_INCOMPLETE: "incomplete",
}
#: Fields the collector adds to each rollout row (besides response and reward).
COLLECTOR_FIELDS = frozenset({"response", "stop_reason", "model_calls", "timings", "task_index", "repeat_index"})


@dataclass
class CollectOptions:
    """What to collect and how."""

    input: Path
    output: Path
    #: Agent for rows that have no `agent_ref`.
    agent: str | None = None
    #: Use only the first `limit` task rows.
    limit: int | None = None
    num_repeats: int = 1
    max_in_flight: int = 4096
    #: Seconds one rollout may take before it fails.
    timeout: float = 3600.0
    #: `responses_create_params` values that win over each row's, by dotted key.
    overrides: dict[str, Any] = field(default_factory=dict)
    #: Where to record each rollout's events (RunStream), if anywhere.
    events: Path | None = None
    #: Rewards outside this range are reported.
    reward_range: tuple[float, float] = (0.0, 1.0)
    #: A rollout passes (for pass@k) when its reward is at least this.
    pass_threshold: float = 1.0
    progress: bool = True


@dataclass
class CollectSummary:
    """What a collection did, and the metrics of everything in the output."""

    collected: int = 0
    skipped: int = 0
    failed: int = 0
    bad_rows: int = 0
    #: From the start to the last rollout finished (the summary of the output is not counted).
    seconds: float = 0.0
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def failures_path(output: Path) -> Path:
    """The failures sidecar of an output file: `<stem>.failures.jsonl` next to it."""
    return output.with_name(f"{output.stem}.failures.jsonl")


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs (value read as JSON, else taken as text) as a dict by dotted key."""
    overrides = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"override {pair!r}: expected key=value, such as temperature=0.7")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw
    return overrides


def apply_overrides(params: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Set each dotted key of `overrides` in a responses_create_params dict."""
    for key, value in overrides.items():
        *parents, last = key.split(".")
        node = params
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[last] = value


@dataclass(frozen=True)
class _Job:
    task_index: int
    row: dict[str, Any]
    task: task_pb2.Task
    agent: str


@dataclass(frozen=True)
class _BadRow:
    task_index: int
    line: int
    message: str
    field: str | None = None


class _Interned:
    """Small ids for values that repeat a lot (a row's key set, an agent's name)."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self._ids: dict[Any, int] = {}

    def id(self, value: Any) -> int:
        if value not in self._ids:
            self._ids[value] = len(self.values)
            self.values.append(value)
        return self._ids[value]


class _TaskIndex:
    """Per task index: the keys of its row and its agent; enough to summarise the output."""

    def __init__(self) -> None:
        self.key_sets = _Interned()
        self.agents = _Interned()
        self.key_set_of = array("I")
        self.agent_of = array("i")

    def add(self, row: dict[str, Any] | None, agent: str | None) -> None:
        self.key_set_of.append(self.key_sets.id(frozenset(row or ())))
        self.agent_of.append(self.agents.id(agent) if agent else -1)


def _tasks(options: CollectOptions, index: _TaskIndex) -> Iterator[_Job | _BadRow]:
    """The task rows of the input, overrides applied; a row that cannot be used is a _BadRow."""
    task_index = -1
    with options.input.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            task_index += 1
            if options.limit is not None and task_index >= options.limit:
                return
            row = agent = None
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                index.add(None, None)
                yield _BadRow(task_index, line_no, f"not UTF-8 (byte {e.start}): {raw[:80]!r}")
                continue
            try:
                row = json.loads(line)
                if isinstance(row, dict) and isinstance(row.get(rows.PARAMS_KEY), dict) and options.overrides:
                    apply_overrides(row[rows.PARAMS_KEY], options.overrides)
                task = rows.task_from_row(row)
                agent_ref = row.get("agent_ref")
                agent = (agent_ref.get("name") if isinstance(agent_ref, dict) else None) or options.agent
                if not agent:
                    raise rows.RowError("agent_ref.name", "the row names no agent and no --agent was given")
            except json.JSONDecodeError as e:
                index.add(None, None)
                yield _BadRow(task_index, line_no, f"not JSON: {e}")
                continue
            except rows.RowError as e:
                index.add(row if isinstance(row, dict) else None, None)
                yield _BadRow(task_index, line_no, str(e), e.field)
                continue
            index.add(row, agent)
            yield _Job(task_index, row, task, agent)


def _count_rows(path: Path, limit: int | None) -> int:
    with path.open("rb") as f:
        count = sum(1 for line in f if line.strip())
    return count if limit is None else min(count, limit)


def _iter_output(path: Path) -> Iterator[dict[str, Any]]:
    """The complete rows of an output file, one at a time."""
    if not path.exists():
        return
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                yield row


def _key(row: dict[str, Any], n_tasks: int, repeats: int) -> int | None:
    """The slot of a row's key in [0, n_tasks * repeats), or None."""
    t, k = row.get("task_index"), row.get("repeat_index")
    if not (isinstance(t, int) and isinstance(k, int) and 0 <= t < n_tasks and 0 <= k < repeats):
        return None
    return t * repeats + k


def _repair_tail(path: Path) -> None:
    """Cut a torn last line (a collector killed mid-write) so that appending stays valid JSONL."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("r+b") as f:
        f.seek(-1, 2)
        if f.read(1) == b"\n":
            return
        size = f.seek(0, 2)
        position = size
        while position > 0:
            step = min(65536, position)
            position -= step
            f.seek(position)
            chunk = f.read(step)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                f.truncate(position + cut + 1)
                return
        f.truncate(0)


def _done_keys(path: Path, n_tasks: int, repeats: int) -> bytearray:
    """One byte per key slot: 1 when the output already holds that rollout."""
    done = bytearray(n_tasks * repeats)
    for row in _iter_output(path):
        slot = _key(row, n_tasks, repeats)
        if slot is not None:
            done[slot] = 1
    return done


def _numbers(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, bool | int | float) and not (isinstance(value, float) and math.isnan(value)):
        out[prefix] = float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _numbers(f"{prefix}.{k}", v, out)


def _has_answer(response: Any) -> bool:
    """Whether a dumped response holds any assistant text or tool call."""
    for item in response.get("output", []) if isinstance(response, dict) else []:
        if item.get("type") == "function_call":
            return True
        if item.get("type") == "message" and item.get("role") == "assistant":
            content = item.get("content")
            texts = [content] if isinstance(content, str) else [p.get("text", "") for p in content or []]
            if any(t.strip() for t in texts):
                return True
    return False


def summarise(options: CollectOptions, index: _TaskIndex) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Metrics and warnings per agent over every rollout in the output file."""
    n_tasks, repeats = len(index.key_set_of), options.num_repeats
    rewards = array("d", [math.nan]) * (n_tasks * repeats)
    means: dict[int, Means] = {}
    empty: dict[int, int] = {}
    outside: dict[int, list[float]] = {}
    duplicates = 0
    low, high = options.reward_range
    for row in _iter_output(options.output):
        slot = _key(row, n_tasks, repeats)
        if slot is None or not isinstance(row.get("reward"), int | float):
            continue
        if not math.isnan(rewards[slot]):
            duplicates += 1
            continue
        t = slot // repeats
        agent = index.agent_of[t]
        if agent < 0:  # the task row is bad now; its old rollouts are not counted
            continue
        task_keys = index.key_sets.values[index.key_set_of[t]]
        reward = float(row["reward"])
        rewards[slot] = reward
        produced: dict[str, float] = {}
        for key, value in row.items():
            if key not in task_keys and key not in COLLECTOR_FIELDS:
                _numbers(key, value, produced)
        _numbers("model_calls", row.get("model_calls"), produced)
        _numbers("timings", row.get("timings"), produced)
        means.setdefault(agent, Means()).add(produced)
        if not _has_answer(row.get("response")):
            empty[agent] = empty.get(agent, 0) + 1
        if not low <= reward <= high:
            outside.setdefault(agent, []).append(reward)

    metrics: dict[str, dict[str, float]] = {}
    warnings = []
    for agent, m in sorted(means.items(), key=lambda item: index.agents.values[item[0]]):
        name = index.agents.values[agent]
        metrics[name] = {"rollouts": m.count, **m.means()}
        if repeats > 1:
            metrics[name].update(_group_metrics(rewards, index.agent_of, agent, repeats, options.pass_threshold))
        lowest, highest = m.min("reward"), m.max("reward")
        if m.count > 1 and lowest == highest:
            warnings.append(f"{name}: all {m.count} rewards are {lowest:g}: is the verifier or the data broken?")
        if empty.get(agent):
            warnings.append(f"{name}: {empty[agent]} of {m.count} rollouts have no assistant text or tool call")
        if outside.get(agent):
            bad = outside[agent]
            warnings.append(
                f"{name}: {len(bad)} rewards outside [{low:g}, {high:g}] (from {min(bad):g} to {max(bad):g})"
            )
    if duplicates:
        warnings.append(f"{duplicates} rows repeat a key already in {options.output}; each key was counted once")
    return metrics, warnings


def _group_metrics(rewards: array, agent_of: array, agent_id: int, repeats: int, threshold: float) -> dict[str, float]:
    """pass@1, pass@k and mean@k over the tasks of one agent whose k repeats are all in."""
    complete = passed_any = 0
    pass_one = mean_k = 0.0
    for t, owner in enumerate(agent_of):
        if owner != agent_id:
            continue
        group = rewards[t * repeats : (t + 1) * repeats]
        if any(math.isnan(x) for x in group):
            continue
        complete += 1
        passes = sum(x >= threshold for x in group)
        passed_any += passes > 0
        pass_one += passes / repeats
        mean_k += sum(group) / repeats
    if not complete:
        return {}
    return {
        "complete_tasks": complete,
        "pass@1": pass_one / complete,
        f"pass@{repeats}": passed_any / complete,
        f"mean@{repeats}": mean_k / complete,
    }


def _event_row(job: _Job, repeat: int, event: Any) -> dict[str, Any]:
    kind = event.WhichOneof("event")
    row: dict[str, Any] = {
        "task_index": job.task_index,
        "repeat_index": repeat,
        "sequence": event.sequence,
        "elapsed_seconds": event.elapsed_seconds,
        "type": kind,
    }
    if kind == "model_call":
        e = event.model_call
        row.update(step=e.step, seconds=e.seconds, response=rows.response_to_json(e.response))
    elif kind == "tool_call":
        e = event.tool_call
        call, output = r.Item(function_call=e.call), r.Item(function_call_output=e.output)
        row.update(step=e.step, seconds=e.seconds, error=e.error, call=rows.item_to_json(call))
        row["output"] = rows.item_to_json(output)
    elif kind == "verification":
        e = event.verification
        row.update(reward=e.reward, fields=rows.struct_to_dict(e.fields), seconds=e.seconds)
    elif kind == "rollout":
        row.update(reward=event.rollout.reward, stop_reason=STOP_REASONS.get(event.rollout.stop_reason))
    return row


class _Collection:
    """One run of `collect`: the window, the files, the counts."""

    def __init__(self, registry: Registry, options: CollectOptions, log: TextIO) -> None:
        self.registry = registry
        self.options = options
        self.log = log
        self.summary = CollectSummary()
        self.clients: dict[str, AgentClient] = {}
        self.window = asyncio.Semaphore(options.max_in_flight)
        self.running = Means()
        self.bar: tqdm | None = None
        self.out: TextIO | None = None
        self.failures: TextIO | None = None
        self.events: TextIO | None = None

    def report(self, message: str) -> None:
        if self.bar is not None and self.options.progress:
            self.bar.write(message, file=self.log)
        else:
            print(message, file=self.log)

    def fail(self, record: dict[str, Any], message: str) -> None:
        if self.failures is None:
            self.failures = failures_path(self.options.output).open("a", encoding="utf-8")
        record["time"] = time.time()
        self.failures.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.failures.flush()
        self.report(message)

    async def _rollout(self, job: _Job, repeat: int) -> task_pb2.Rollout:
        client = self.clients.get(job.agent)
        if client is None:
            client = self.clients[job.agent] = AgentClient(self.registry, job.agent)
        if self.events is None:
            return await client.run(job.task, timeout=self.options.timeout)
        rollout = None
        async for event in client.run_stream(job.task, timeout=self.options.timeout):
            self.events.write(json.dumps(_event_row(job, repeat, event), ensure_ascii=False) + "\n")
            if event.WhichOneof("event") == "rollout":
                rollout = event.rollout
        self.events.flush()
        if rollout is None:
            raise errors.GymError(f"agent {job.agent!r} ended the event stream without a rollout")
        return rollout

    async def run_one(self, job: _Job, repeat: int) -> None:
        assert self.out is not None and self.bar is not None
        try:
            rollout = await self._rollout(job, repeat)
            row = rows.rollout_row(job.row, rollout)
            t = rollout.timings
            row["stop_reason"] = STOP_REASONS.get(rollout.stop_reason, "unspecified")
            row["model_calls"] = rollout.model_calls
            row["timings"] = {
                "model": t.model_seconds,
                "tools": t.tools_seconds,
                "verify": t.verify_seconds,
                "total": t.total_seconds,
            }
            row["task_index"] = job.task_index
            row["repeat_index"] = repeat
            self.out.write(json.dumps(row, ensure_ascii=False) + "\n")
            self.out.flush()
        except Exception as e:  # a failure costs this rollout, never the collection
            self.summary.failed += 1
            code = e.code.name if isinstance(e, errors.GymError) else grpc.StatusCode.UNKNOWN.name
            message = e.message if isinstance(e, errors.GymError) else f"{type(e).__name__}: {e}"
            self.fail(
                {
                    "task_index": job.task_index,
                    "repeat_index": repeat,
                    "agent": job.agent,
                    "error": {"class": type(e).__name__, "code": code, "message": message},
                },
                f"task {job.task_index} repeat {repeat} failed: {message}",
            )
            return
        finally:
            self.bar.update(1)
            self.window.release()
        self.summary.collected += 1
        self.running.add({"reward": rollout.reward})
        self.bar.set_postfix(reward=f"{self.running.mean('reward'):.3f}", refresh=False)

    async def run(self) -> CollectSummary:
        options = self.options
        started = time.monotonic()
        n_tasks = _count_rows(options.input, options.limit)
        _repair_tail(options.output)
        done = _done_keys(options.output, n_tasks, options.num_repeats)
        index = _TaskIndex()
        options.output.parent.mkdir(parents=True, exist_ok=True)
        tasks: set[asyncio.Task] = set()
        self.bar = tqdm(
            total=n_tasks * options.num_repeats,
            unit="rollout",
            disable=not options.progress,
            file=self.log,
            dynamic_ncols=True,
        )
        try:
            with options.output.open("a", encoding="utf-8") as self.out:
                if options.events is not None:
                    self.events = options.events.open("a", encoding="utf-8")
                for job in _tasks(options, index):
                    if isinstance(job, _BadRow):
                        self.summary.bad_rows += 1
                        self.bar.update(options.num_repeats)
                        error = {"class": "RowError", "message": job.message, "field": job.field}
                        self.fail(
                            {"task_index": job.task_index, "line": job.line, "error": error},
                            f"{options.input}:{job.line}: {job.message}",
                        )
                        continue
                    for repeat in range(options.num_repeats):
                        if done[job.task_index * options.num_repeats + repeat]:
                            self.summary.skipped += 1
                            self.bar.update(1)
                            continue
                        await self.window.acquire()
                        task = asyncio.create_task(self.run_one(job, repeat))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*tasks)
            self.summary.seconds = time.monotonic() - started
        finally:
            for task in tasks:
                task.cancel()
            self.bar.close()
            for f in (self.failures, self.events):
                if f is not None:
                    f.close()
        self.summary.metrics, self.summary.warnings = summarise(options, index)
        return self.summary


async def collect(registry: Registry, options: CollectOptions, *, log: TextIO = sys.stderr) -> CollectSummary:
    """Collect rollouts as `options` says; return what was done."""
    if options.num_repeats < 1:
        raise ValueError("num_repeats must be at least 1")
    if options.max_in_flight < 1:
        raise ValueError("max_in_flight must be at least 1")
    return await _Collection(registry, options, log).run()
