"""`gym-grpc collect`: a JSONL of tasks in, a JSONL of scored rollouts out.

Each task row runs `num_repeats` times through an agent, keyed by
(task_index, repeat_index), through a bounded window (see batch.py for
resume, the failures sidecar and the summary). A rollout row is the task row
(with an `agent_ref` naming the agent when it had none), then `response`,
`reward`, the verifier's fields and their names in `verifier_fields`,
`stop_reason`, `model_calls`, `timings`, `finished_at` and the key. With `skip_verify` the
rollouts are not verified: `reward` is a placeholder and
`verification_skipped` is true, for `gym-grpc reverify` to score them later.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import time
from array import array
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from gym_grpc import errors, tracing
from gym_grpc.batch import fingerprint, overrides, states
from gym_grpc.batch.jobs import BadInput, Batch, BatchSummary, Job, RunOptions
from gym_grpc.client import admission_metrics
from gym_grpc.client.admission import Admission, Controller, Decision, Limits, ModelServerLoads, running
from gym_grpc.client.run_many import RESUME_ATTEMPTS
from gym_grpc.client.stubs import AgentClient, ResourcesClient
from gym_grpc.data import jsonl, record, rows
from gym_grpc.data.jsonl import count_rows
from gym_grpc.data.rollout_stats import verified_reward
from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2


@dataclass
class CollectOptions(RunOptions):
    """What to collect and how."""

    #: Use only the first `limit` task rows.
    limit: int | None = None
    num_repeats: int = 1
    #: `responses_create_params` values that win over each row's, by dotted key.
    overrides: dict[str, Any] = field(default_factory=dict)
    #: Where to record each rollout's events (RunStream), if anywhere.
    events: Path | None = None
    #: Do not verify; write `placeholder_reward` and `verification_skipped: true`.
    skip_verify: bool = False
    placeholder_reward: float = 0.0
    #: Add to an output that holds rollouts of another run (see batch/fingerprint.py).
    force: bool = False
    #: Times a rollout lost with a server or engine is resumed (AgentClient.resume_attempts).
    resume_attempts: int = RESUME_ATTEMPTS
    #: Keep the durable rollouts in flight in the states file, to resume them after a stop (batch/states.py).
    keep_states: bool = True
    #: Set the window from the engines' load between these limits (client/admission.py); None:
    #: the window of `max_in_flight` (fixed, or deadline-based without it).
    admission: Limits | None = None
    #: Where to append each admission decision (JSONL), if anywhere.
    admission_log: Path | None = None
    #: A port (0: any free one) on 127.0.0.1 to serve the admission's Prometheus metrics on, if any.
    admission_metrics_port: int | None = None


@dataclass(frozen=True)
class _Task:
    row: dict[str, Any]
    task: task_pb2.Task


#: The most bytes a task row (a line of the input, and its task as a message) may have: what
#: one gRPC message carries between gym-grpc peers. A larger row is a bad row, not sent.
ROW_LIMIT_BYTES = transport.MAX_MESSAGE_BYTES


def _too_large(what: str, size: int) -> str:
    return (
        f"{what} is {size:,} bytes, over the {ROW_LIMIT_BYTES:,} bytes one gRPC message between gym-grpc "
        "peers carries: not sent"
    )


def _jobs(options: CollectOptions) -> Iterator[Job[_Task] | BadInput]:
    """The task rows of the input, overrides applied, each num_repeats times. A row too large to
    send is a bad row, read through without being held, so that it costs no other row."""
    task_index = -1
    with options.input.open("rb") as f:
        for line in jsonl.lines(f, ROW_LIMIT_BYTES):
            raw = line.raw
            if raw is not None and not raw.strip():
                continue
            task_index += 1
            if options.limit is not None and task_index >= options.limit:
                return
            if raw is None:
                yield BadInput(task_index, line.number, _too_large("the row", line.size), None, options.num_repeats)
                continue
            try:
                row = jsonl.parse_line(raw)
                if isinstance(row, dict) and isinstance(row.get(rows.PARAMS_KEY), dict) and options.overrides:
                    overrides.apply(row[rows.PARAMS_KEY], options.overrides)
                task = rows.task_from_row(row)
                agent = rows.agent_name(row, options.agent, " and no --agent was given")
                if task.ByteSize() > ROW_LIMIT_BYTES:
                    raise ValueError(_too_large("its task, as a gym.v1 message,", task.ByteSize()))
            except ValueError as e:
                yield BadInput(task_index, line.number, str(e), getattr(e, "field", None), jobs=options.num_repeats)
                continue
            if "agent_ref" not in row:  # say which agent ran it, for reverify and for readers
                row["agent_ref"] = {"name": agent}
            for repeat in range(options.num_repeats):
                yield Job(task_index, repeat, agent, _Task(row, task))


def _event_row(event: Any) -> dict[str, Any]:
    kind = event.WhichOneof("event")
    row: dict[str, Any] = {"sequence": event.sequence, "elapsed_seconds": event.elapsed_seconds, "type": kind}
    if kind == "model_call":
        e = event.model_call
        row.update(step=e.step, seconds=e.seconds, response=rows.response_to_json(e.response))
    elif kind == "tool_call":
        e = event.tool_call
        row.update(step=e.step, seconds=e.seconds, error=e.error)
        row["call"] = rows.item_to_json(r.Item(function_call=e.call))
        row["output"] = rows.item_to_json(r.Item(function_call_output=e.output))
    elif kind == "verification":
        e = event.verification
        row.update(reward=e.reward, fields=rows.json_field(e, "fields"), seconds=e.seconds)
        if e.reward_components:
            row["reward_components"] = dict(e.reward_components)
    elif kind == "rollout":
        row.update(
            reward=event.rollout.reward, stop_reason=record.STOP_REASONS.get(event.rollout.stop_reason, "unspecified")
        )
    return row


async def collect(registry: Registry, options: CollectOptions, *, log: TextIO = sys.stderr) -> BatchSummary:
    """Collect rollouts as `options` says; return what was done. Raises errors.OutputInUse when another
    run is writing the same output (batch/fingerprint.py)."""
    if options.num_repeats < 1:
        raise ValueError("num_repeats must be at least 1")
    run = fingerprint.of_run(
        options.input,
        agent=options.agent,
        overrides=options.overrides,
        num_repeats=options.num_repeats,
        skip_verify=options.skip_verify,
        placeholder_reward=options.placeholder_reward,
    )
    with fingerprint.claimed(options.output, run, force=options.force):
        return await _collect(registry, options, run, log)


async def _collect(registry: Registry, options: CollectOptions, run: dict[str, Any], log: TextIO) -> BatchSummary:
    clients: dict[str, AgentClient] = {}
    events = jsonl.Appender(options.events) if options.events is not None else None
    # RunStream's rollouts are not durable, and --resume-attempts 0 sends none durable: nothing to keep.
    states_file = None
    if options.keep_states and events is None and options.resume_attempts > 0:
        states_file = states.States.open(states.path_for(options.output), fingerprint.digest(run), log)
        if states_file.resumable:
            left = f"{states_file.resumable:,} rollouts were in flight when the last run stopped"
            log.write(f"{left}: those not in the output go on from {states_file.path}\n")

    loads = ModelServerLoads(registry) if options.admission is not None else None
    if loads is not None and options.agent:
        await loads.watch(options.agent)  # an agent without a model server fails the run here, not its rows

    async def rollout(job: Job[_Task]) -> task_pb2.Rollout:
        client = clients.get(job.group)
        if client is None:
            client = clients[job.group] = AgentClient(registry, job.group, resume_attempts=options.resume_attempts)
        if loads is not None:
            await loads.watch(job.group)
        task = job.payload.task
        if states_file is not None:
            return await _kept_rollout(client, job, states_file, options)
        if events is None:
            return await client.run(task, timeout=options.timeout, skip_verification=options.skip_verify)
        last = None
        stream = client.run_stream(task, timeout=options.timeout, skip_verification=options.skip_verify)
        async for event in stream:
            row = {"task_index": job.task_index, "repeat_index": job.repeat_index, **_event_row(event)}
            events.append(row)
            if event.WhichOneof("event") == "rollout":
                last = event.rollout
        if last is None:
            raise errors.GymError(f"agent {job.group!r} ended the event stream without a rollout")
        return last

    async def produce(job: Job[_Task]) -> dict[str, Any]:
        done = await rollout(job)
        tracing.sampled(done)
        return record.build(job.payload.row, done, options.placeholder_reward)

    batch_options = options.batch(count_rows(options.input, options.limit), options.num_repeats)
    if options.admission is not None:
        batch_options.max_in_flight = options.admission.ceiling
    batch: Batch[_Task] = Batch(batch_options, log)
    verified = _Verified()
    admitting = contextlib.nullcontext(None) if loads is None else _admission(batch, loads, options)
    finished = False
    try:
        async with admitting as admission:
            summary = await batch.run(
                _jobs(options),
                produce,
                visit=None if options.skip_verify else verified.add,
                settled=None if states_file is None else functools.partial(_settled, states_file),
            )
        finished = True
        if admission is not None:
            summary.admission = admission.summary()
        if states_file is not None and states_file.failed:
            summary.warnings.append(states_file.failed)
    finally:
        await asyncio.gather(*(client.close() for client in clients.values()))
        if events is not None:
            events.close()
        if states_file is not None:
            states_file.close(finished)
    if not options.skip_verify:
        await _add_environment_metrics(registry, summary, verified)
    return summary


async def _kept_rollout(
    client: AgentClient, job: Job[_Task], states_file: states.States, options: CollectOptions
) -> task_pb2.Rollout:
    """A rollout whose progress is kept in the states file as it goes (batch/states.py), resumed from
    what a stopped collector left of it there. When its session is gone by then (closed as that
    collector stopped, or past the environment's idle time-out), it starts again from its prompt.
    It ends in the file once its row or its failure is written (Batch.run's `settled`): a collector
    stopped before goes on with it next time."""
    key = (job.task_index, job.repeat_index)
    left = states_file.resume_of(key)
    run = functools.partial(
        client.run, job.payload.task, timeout=options.timeout, skip_verification=options.skip_verify
    )
    if left is None:
        return await run(progress=states_file.track(key))
    try:
        return await run(rollout_id=left.rollout_id, resume=left.state, progress=states_file.track(key))
    except errors.GymError as e:
        if e.reason not in (errors.Reason.SESSION_LOST, errors.Reason.RESUME_UNSUPPORTED):
            raise
        return await run(progress=states_file.track(key))


def _settled(states_file: states.States, job: Job[_Task]) -> None:
    """`job`'s row or failure is written: its rollout ends in the states file (and the agent, told it
    is kept, closes its session)."""
    states_file.end((job.task_index, job.repeat_index))


@contextlib.asynccontextmanager
async def _admission(batch: Batch[_Task], loads: ModelServerLoads, options: CollectOptions) -> AsyncIterator[Admission]:
    """The engine-aware controller sizing `batch`'s window while the block runs; its decisions on the
    progress bar and, with `admission_log`, in that file."""
    assert options.admission is not None
    controller = Controller(options.admission)
    decisions = jsonl.Appender(options.admission_log) if options.admission_log is not None else None

    def record(at: float, decision: Decision) -> None:
        batch.admission_window = decision.window
        if decisions is not None:
            decisions.append({"time": time.time(), "seconds": round(at, 3), **decision.to_json()})

    window = batch.window
    admission = Admission(controller, loads.read, window.resize, lambda: window.running, record, lambda: window.ended)
    endpoint = None
    if options.admission_metrics_port is not None:
        endpoint = admission_metrics.serve(admission, "127.0.0.1", options.admission_metrics_port)
        print(f"admission metrics: http://{endpoint.address}/metrics", file=sys.stderr, flush=True)
    try:
        async with running(admission):
            yield admission
    finally:
        if decisions is not None:
            decisions.close()
        if endpoint is not None:
            await endpoint.stop()


#: Results beyond this size are not sent to an environment's AggregateMetrics (a gRPC message).
AGGREGATE_LIMIT_BYTES = transport.MAX_MESSAGE_BYTES // 2


class _Verified:
    """Each agent's verified results, gathered as the end-of-run summary reads the output
    (one pass over it for both): what its environment's AggregateMetrics is sent. An
    agent's results stop being kept once they outgrow one message."""

    def __init__(self) -> None:
        self.groups: dict[str, PackedResults] = {}
        self.too_large: set[str] = set()

    def add(self, group: str, row: dict[str, Any]) -> None:
        if group in self.too_large or verified_reward(row) is None:
            return
        packed = self.groups.setdefault(group, PackedResults())
        packed.append(record.verification(row))
        if packed.size > AGGREGATE_LIMIT_BYTES:
            del self.groups[group]  # too large to send: keep nothing more of it
            self.too_large.add(group)


async def _add_environment_metrics(registry: Registry, summary: BatchSummary, verified: _Verified) -> None:
    """Ask each agent's environment (ResourcesService.AggregateMetrics) for its own metrics over
    the output's verified rollouts, and add those the summary does not have to the agent's group.
    An environment that cannot answer costs a warning, never the run."""
    environments: dict[str, str] = {}
    for group in summary.metrics:
        try:
            resources = (await registry.info(group)).references.get("resources")
        except errors.GymError as e:
            summary.warnings.append(_no_metrics(group, e))
            continue
        if resources:
            environments[group] = resources
    for group in sorted(verified.too_large & environments.keys()):
        summary.warnings.append(
            f"{group}: environment {environments[group]!r} not asked for its metrics: "
            f"its results are more than {AGGREGATE_LIMIT_BYTES / 2**20:,.0f} MiB"
        )
    for group, results in verified.groups.items():
        if group not in environments or not results:
            continue
        try:
            # One message at a time out of the packed bytes, into the request: a list of a
            # million messages would cost ~500 bytes each, the request itself ~80.
            metrics = await ResourcesClient(registry, environments[group]).aggregate_metrics(iter(results))
        except errors.GymError as e:
            summary.warnings.append(_no_metrics(group, e))
            continue
        own = summary.metrics[group]
        for name, value in rows.struct_to_dict(metrics).items():
            if isinstance(value, bool | int | float) and name not in own:
                own[name] = float(value)


class PackedResults:
    """VerificationResults kept serialized, back to back (~10 bytes each for a bare reward,
    where a message object costs ~500): what AggregateMetrics is sent at the end of a run."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._ends = array("I")  # 4 bytes an end: a group stops being kept past AGGREGATE_LIMIT_BYTES

    @property
    def size(self) -> int:
        """Serialized bytes of the results so far."""
        return len(self._data)

    def append(self, result: task_pb2.VerificationResult) -> None:
        self._data += result.SerializeToString()
        self._ends.append(len(self._data))

    def __len__(self) -> int:
        return len(self._ends)

    def __iter__(self) -> Iterator[task_pb2.VerificationResult]:
        start = 0
        view = memoryview(self._data)
        for end in self._ends:
            yield task_pb2.VerificationResult.FromString(bytes(view[start:end]))
            start = end


def _no_metrics(group: str, error: errors.GymError) -> str:
    if isinstance(error, errors.OutOfFiles):  # explained once already, with the failures it cost
        return f"{group}: no metrics from its environment: no file descriptor left to ask it"
    return f"{group}: no metrics from its environment: {error.message}"
