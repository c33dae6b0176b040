"""Many rollout jobs through a bounded window, into an append-only JSONL, resumably.

Shared by `collect` and `reverify`. Each job has a key (task_index,
repeat_index); keys already in the output are skipped, so running the same
command again resumes. The window (window.py) says how many jobs run at once. A finished
row is written whole at once; a failed job (or an input line that cannot be
used) goes to the failures sidecar with its error's class, code and message,
and the rest goes on. The terminal gets the first failure of each kind and a
running count, not a line per failure. An output that cannot be written (a
full disk) stops the run with every row written before kept. A progress bar
shows rows/s, tokens/s, the running mean reward and the failures. The summary
at the end covers the whole output file.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TextIO, TypeVar

from tqdm import tqdm

from gym_grpc import errors, tracing
from gym_grpc.batch.summary import GroupIndex, RunStats, summarise_file
from gym_grpc.batch.window import Window
from gym_grpc.data import jsonl, record

#: What a job carries to the function that produces its row: collect's task, reverify's rollout.
P = TypeVar("P")


@dataclass(frozen=True)
class Job(Generic[P]):
    """One unit of work: its key, its group (for the summary) and what it needs."""

    task_index: int
    repeat_index: int
    group: str
    payload: P


@dataclass(frozen=True)
class BadInput:
    """An input line that cannot be used."""

    task_index: int
    line: int
    message: str
    field: str | None = None
    #: How many jobs the line stood for (a task row stands for all its repeats).
    jobs: int = 1


@dataclass
class BatchOptions:
    output: Path
    n_tasks: int
    repeats: int
    #: Jobs the progress bar expects; default n_tasks * repeats.
    total: int | None = None
    #: The most jobs at once; None: the window adapts, up to window.MOST (batch/window.py).
    max_in_flight: int | None = None
    #: Seconds one job may take (its deadline), which the window keeps jobs within (batch/window.py).
    timeout: float | None = None
    reward_range: tuple[float, float] = (0.0, 1.0)
    pass_threshold: float = 1.0
    progress: bool = True
    #: What the input was, for messages about bad lines.
    input_name: str = "input"
    #: Seconds between two lines that tell how many failures of a kind there were so far.
    report_every: float = 10.0
    #: The name of each job's root span, when tracing (docs/observability.md#traces).
    span: str = "rl.sample"


#: The default deadline of one rollout (collect) and of one verification (reverify): a verification
#: is part of a rollout in collect, so reverify gives it as long.
TIMEOUT_SECONDS = 3600.0


@dataclass
class RunOptions:
    """What collect and reverify share: the files, the window and how the summary judges."""

    input: Path
    output: Path
    #: Agent for rows that have no `agent_ref`.
    agent: str | None = None
    #: The most rollouts at once; None: the window adapts, up to window.MOST (batch/window.py).
    max_in_flight: int | None = None
    #: Seconds one job (a rollout, a verification) may take.
    timeout: float = TIMEOUT_SECONDS
    #: Rewards outside this range are reported.
    reward_range: tuple[float, float] = (0.0, 1.0)
    #: A rollout passes (for pass@k) when its reward is at least this.
    pass_threshold: float = 1.0
    progress: bool = True
    #: Seconds between two lines that tell how many failures of a kind there were so far.
    report_every: float = 10.0

    def batch(self, n_tasks: int, repeats: int, total: int | None = None) -> BatchOptions:
        return BatchOptions(
            output=self.output,
            n_tasks=n_tasks,
            repeats=repeats,
            total=total,
            max_in_flight=self.max_in_flight,
            timeout=self.timeout,
            reward_range=self.reward_range,
            pass_threshold=self.pass_threshold,
            progress=self.progress,
            input_name=str(self.input),
            report_every=self.report_every,
        )


@dataclass
class BatchSummary:
    """What a run did, and the metrics of everything in its output."""

    skipped: int = 0
    failed: int = 0
    bad_rows: int = 0
    #: From the start to the last row written (the summary of the output is not counted).
    seconds: float = 0.0
    run: RunStats = field(default_factory=RunStats)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    #: Failures and bad rows of this run, by kind ("failed with UNAVAILABLE in weather_agent").
    failure_counts: dict[str, int] = field(default_factory=dict)
    #: What the admission controller did, when one set the window (client/admission.py).
    admission: str | None = None

    @property
    def done(self) -> int:
        """Rollouts this run wrote."""
        return self.run.rollouts


Produce = Callable[[Job[P]], Awaitable[dict[str, Any]]]
#: Told of a job once its row, or its failure, is written.
Settled = Callable[[Job[P]], None]


class FailureTally:
    """Failures counted by kind, told without flooding the terminal.

    The first failure of a kind is told at once, with its message; after that
    a kind's count is told at most every `interval` seconds, and only when it
    grew. The failures sidecar keeps every record, and the summary the totals.
    """

    def __init__(self, tell: Callable[[str], None], interval: float) -> None:
        self.counts: dict[str, int] = {}
        self._tell = tell
        self._interval = interval
        self._told: dict[str, int] = {}
        self._last = time.monotonic()

    def add(self, kind: str, first: str) -> None:
        """Count one failure of `kind`; `first` is what to say when it is the first of its kind."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if kind not in self._told:
            self._told[kind] = 1
            self._tell(first)
        if time.monotonic() - self._last < self._interval:
            return
        self._last = time.monotonic()
        for name, count in self.counts.items():
            if count != self._told[name]:
                self._told[name] = count
                self._tell(f"{name}: {count:,} so far")


class Batch(Generic[P]):
    """Runs jobs through a bounded window into the output file, counting and reporting what fails."""

    def __init__(self, options: BatchOptions, log: TextIO) -> None:
        self.options = options
        self.log = log
        self.summary = BatchSummary()
        self.groups = GroupIndex(options.n_tasks)
        self.window = Window.sized(options.max_in_flight, options.timeout)
        self.bar: tqdm | None = None
        self.tally = FailureTally(self.report, options.report_every)
        self.failures: jsonl.Appender | None = None
        #: Why the run stopped early (an output that cannot be written).
        self._stop: errors.OutputError | None = None
        self._running: set[asyncio.Task] = set()
        self._started = time.monotonic()
        #: The window an admission controller set last (shown on the progress bar), if one runs.
        self.admission_window: int | None = None

    def report(self, message: str) -> None:
        if self.bar is not None and self.options.progress:
            self.bar.write(message, file=self.log)
        else:
            print(message, file=self.log)

    def _fail(self, record: dict[str, Any], kind: str, first: str) -> None:
        """Record a failure in the sidecar and count it; OutputError when the sidecar cannot be written."""
        assert self.failures is not None
        record["time"] = time.time()
        self.failures.append(record)
        self.tally.add(kind, first)
        self._progress()

    def _progress(self) -> None:
        assert self.bar is not None
        if not self.options.progress:  # no bar to show it on
            return
        run = self.summary.run
        elapsed = max(time.monotonic() - self._started, 1e-9)
        postfix = {"tok/s": f"{(run.input_tokens + run.output_tokens) / elapsed:,.0f}"}
        if run.reward.count:
            postfix["reward"] = f"{run.reward.mean('reward'):.3f}"
        if self.admission_window is not None:
            postfix["window"] = str(self.admission_window)
        if self.tally.counts:
            postfix["failed"] = f"{sum(self.tally.counts.values()):,}"
        self.bar.set_postfix(postfix, refresh=False)

    def _halt(self, error: errors.OutputError) -> None:
        """Stop the run: nothing more can be written, so every job in flight is cancelled."""
        if self._stop is None:
            self._stop = error
            for task in self._running:
                task.cancel()

    def _traced(self, job: Job[P], queued: int) -> contextlib.AbstractContextManager[Any]:
        """The job's root span when tracing; nothing built when not (this runs once per rollout)."""
        if not tracing.active():
            return tracing.OFF
        return tracing.rollout(
            queued,
            self.options.span,
            **{
                "gym_grpc.agent": job.group,
                "rl.sample.task.id": str(job.task_index),
                "gym_grpc.task_index": job.task_index,
                "gym_grpc.repeat_index": job.repeat_index,
            },
        )

    async def _one(
        self, job: Job[P], produce: Produce[P], out: jsonl.Appender, queued: int, settled: Settled[P] | None
    ) -> None:
        """Run `job`, asked for at `queued` (time.time_ns(): its wait for the window is in its trace);
        `settled` is told once its row or failure is written."""
        assert self.bar is not None
        began, past_deadline = time.monotonic(), False
        try:
            try:
                with self._traced(job, queued):
                    row = await produce(job)
                record.set_key(row, job.task_index, job.repeat_index)
                out.append(row)
            except errors.OutputError:
                raise
            except Exception as e:  # a failure costs this job, never the run
                failure = errors.Failure.of(e)
                past_deadline = failure.code == "DEADLINE_EXCEEDED"
                self._failed(job, failure)
                if settled is not None:
                    settled(job)
                return
            if settled is not None:
                settled(job)
            self.summary.run.add(row)
            self._progress()
        except errors.OutputError as e:
            self._halt(e)
        finally:
            self.bar.update(1)
            self.window.release(time.monotonic() - began, past_deadline)

    def _failed(self, job: Job[P], failure: errors.Failure) -> None:
        self.summary.failed += 1
        kind = f"failed with {failure.code} in {job.group}"
        self._fail(
            {
                "task_index": job.task_index,
                "repeat_index": job.repeat_index,
                "group": job.group,
                "error": failure.to_json(),
            },
            kind,
            f"task {job.task_index} repeat {job.repeat_index} {kind}: {failure.message}",
        )

    def _bad_input(self, bad: BadInput) -> None:
        assert self.bar is not None
        self.summary.bad_rows += 1
        self.bar.update(bad.jobs)
        failure = errors.Failure("RowError", "INVALID_ARGUMENT", bad.message, bad.field)
        name = self.options.input_name
        self._fail(
            {"task_index": bad.task_index, "line": bad.line, "error": failure.to_json()},
            f"bad rows in {name}",
            f"{name}:{bad.line}: {bad.message}",
        )

    async def run(
        self,
        jobs: Iterator[Job[P] | BadInput],
        produce: Produce[P],
        *,
        visit: Callable[[str, dict[str, Any]], None] | None = None,
        settled: Settled[P] | None = None,
    ) -> BatchSummary:
        """Run every job not already in the output; then summarise the output. `settled` is told of
        each job once its row, or its failure, is written (not of a job the run stopped first).

        Raises OutputError, after cancelling every job in flight, when the output
        or the sidecar cannot be written: every row written before is kept whole."""
        options = self.options
        self._started = time.monotonic()
        jsonl.repair_tail(options.output)
        done = jsonl.done_keys(options.output, options.n_tasks, options.repeats)
        options.output.parent.mkdir(parents=True, exist_ok=True)
        running = self._running
        self.bar = tqdm(
            total=options.total if options.total is not None else options.n_tasks * options.repeats,
            unit="rollout",
            disable=not options.progress,
            file=self.log,
            dynamic_ncols=True,
        )
        out = jsonl.Appender(options.output)
        # The sidecar is opened now, not at the first failure: that failure may be
        # running out of descriptors, and must still be recorded.
        self.failures = jsonl.Appender(jsonl.failures_path(options.output))
        try:
            for job in jobs:
                if isinstance(job, BadInput):
                    self._bad_input(job)
                    continue
                self.groups.set(job.task_index, job.group)
                if job.task_index * options.repeats + job.repeat_index in done:
                    self.summary.skipped += 1
                    self.bar.update(1)
                    continue
                queued = time.time_ns()
                await self.window.acquire()
                if self._stop is not None:
                    break
                task = asyncio.create_task(self._one(job, produce, out, queued, settled))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.wait(running)
        finally:
            for task in running:
                task.cancel()
            if running:  # interrupted, or stopped: the cancelled jobs end their calls first
                await asyncio.wait(running)
            self.bar.close()
            out.close()
            self.failures.close()
            if not self.failures.path.stat().st_size:
                self.failures.path.unlink()
        if self._stop is not None:
            raise self._stop
        self.summary.seconds = time.monotonic() - self._started
        self.summary.failure_counts = dict(self.tally.counts)
        file_summary = summarise_file(
            options.output,
            self.groups,
            options.repeats,
            reward_range=options.reward_range,
            pass_threshold=options.pass_threshold,
            visit=visit,
        )
        self.summary.metrics, self.summary.warnings = file_summary.metrics, file_summary.warnings
        note = self.window.note()
        if note is not None:
            self.summary.warnings.append(note)
        return self.summary
