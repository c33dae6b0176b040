"""Many rollout jobs through a bounded window, into an append-only JSONL, resumably.

Shared by `collect` and `reverify`. Each job has a key (task_index,
repeat_index); keys already in the output are skipped, so running the same
command again resumes. At most `max_in_flight` jobs run at once. A finished
row is appended and flushed at once; a failed job (or an input line that
cannot be used) goes to the failures sidecar with its error's class, code and
message, and the rest goes on. A progress bar shows rows/s, tokens/s and the
running mean reward. The summary at the end covers the whole output file.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from gym_grpc import errors, jsonl, open_files
from gym_grpc.summary import GroupIndex, RunStats, summarise_file


@dataclass(frozen=True)
class Job:
    """One unit of work: its key, its group (for the summary) and what it needs."""

    task_index: int
    repeat_index: int
    group: str
    payload: Any


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
    max_in_flight: int = 4096
    reward_range: tuple[float, float] = (0.0, 1.0)
    pass_threshold: float = 1.0
    progress: bool = True
    #: What the input was, for messages about bad lines.
    input_name: str = "input"


@dataclass
class RunOptions:
    """What collect and reverify share: the files, the window and how the summary judges."""

    input: Path
    output: Path
    #: Agent for rows that have no `agent_ref`.
    agent: str | None = None
    max_in_flight: int = 4096
    #: Rewards outside this range are reported.
    reward_range: tuple[float, float] = (0.0, 1.0)
    #: A rollout passes (for pass@k) when its reward is at least this.
    pass_threshold: float = 1.0
    progress: bool = True

    def batch(self, n_tasks: int, repeats: int, total: int | None = None) -> BatchOptions:
        return BatchOptions(
            output=self.output,
            n_tasks=n_tasks,
            repeats=repeats,
            total=total,
            max_in_flight=self.max_in_flight,
            reward_range=self.reward_range,
            pass_threshold=self.pass_threshold,
            progress=self.progress,
            input_name=str(self.input),
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

    @property
    def done(self) -> int:
        """Rollouts this run wrote."""
        return self.run.rollouts


Produce = Callable[[Job], Awaitable[dict[str, Any]]]


class Batch:
    def __init__(self, options: BatchOptions, log: TextIO) -> None:
        if options.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.options = options
        self.log = log
        self.summary = BatchSummary()
        self.groups = GroupIndex(options.n_tasks)
        self.window = asyncio.Semaphore(options.max_in_flight)
        self.bar: tqdm | None = None
        self.failures: TextIO | None = None
        self._failures_path = jsonl.failures_path(options.output)
        self._started = time.monotonic()

    def report(self, message: str) -> None:
        if self.bar is not None and self.options.progress:
            self.bar.write(message, file=self.log)
        else:
            print(message, file=self.log)

    def _fail(self, record: dict[str, Any], message: str | None) -> None:
        assert self.failures is not None
        record["time"] = time.time()
        self.failures.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.failures.flush()
        if message is not None:
            self.report(message)

    def _progress(self) -> None:
        assert self.bar is not None
        run = self.summary.run
        elapsed = max(time.monotonic() - self._started, 1e-9)
        postfix = {"tok/s": f"{(run.input_tokens + run.output_tokens) / elapsed:,.0f}"}
        if run.reward.count:
            postfix["reward"] = f"{run.reward.mean('reward'):.3f}"
        self.bar.set_postfix(postfix, refresh=False)

    async def _one(self, job: Job, produce: Produce, out: TextIO) -> None:
        assert self.bar is not None
        try:
            row = await produce(job)
            row["task_index"] = job.task_index
            row["repeat_index"] = job.repeat_index
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            out.flush()
        except Exception as e:  # a failure costs this job, never the run
            self.summary.failed += 1
            failure = errors.Failure.of(e)
            quiet = isinstance(e, errors.OutOfFiles) and not open_files.time_to_say()
            self._fail(
                {
                    "task_index": job.task_index,
                    "repeat_index": job.repeat_index,
                    "group": job.group,
                    "error": failure.to_json(),
                },
                None if quiet else f"task {job.task_index} repeat {job.repeat_index} failed: {failure.message}",
            )
            return
        finally:
            self.bar.update(1)
            self.window.release()
        self.summary.run.add(row)
        self._progress()

    async def run(self, jobs: Iterator[Job | BadInput], produce: Produce) -> BatchSummary:
        """Run every job not already in the output; then summarise the output."""
        options = self.options
        self._started = time.monotonic()
        jsonl.repair_tail(options.output)
        done = jsonl.done_keys(options.output, options.n_tasks, options.repeats)
        options.output.parent.mkdir(parents=True, exist_ok=True)
        running: set[asyncio.Task] = set()
        self.bar = tqdm(
            total=options.total if options.total is not None else options.n_tasks * options.repeats,
            unit="rollout",
            disable=not options.progress,
            file=self.log,
            dynamic_ncols=True,
        )
        # The sidecar is opened now, not at the first failure: that failure may be
        # running out of descriptors, and must still be recorded.
        self.failures = self._failures_path.open("a", encoding="utf-8")
        try:
            with options.output.open("a", encoding="utf-8") as out:
                for job in jobs:
                    if isinstance(job, BadInput):
                        self.summary.bad_rows += 1
                        self.bar.update(job.jobs)
                        error = errors.Failure("RowError", "INVALID_ARGUMENT", job.message, job.field)
                        self._fail(
                            {"task_index": job.task_index, "line": job.line, "error": error.to_json()},
                            f"{options.input_name}:{job.line}: {job.message}",
                        )
                        continue
                    self.groups.set(job.task_index, job.group)
                    if done[job.task_index * options.repeats + job.repeat_index]:
                        self.summary.skipped += 1
                        self.bar.update(1)
                        continue
                    await self.window.acquire()
                    task = asyncio.create_task(self._one(job, produce, out))
                    running.add(task)
                    task.add_done_callback(running.discard)
                if running:
                    await asyncio.gather(*running)
            self.summary.seconds = time.monotonic() - self._started
        finally:
            for task in running:
                task.cancel()
            self.bar.close()
            self.failures.close()
            if not self._failures_path.stat().st_size:
                self._failures_path.unlink()
        file_summary = summarise_file(
            options.output,
            self.groups,
            options.repeats,
            reward_range=options.reward_range,
            pass_threshold=options.pass_threshold,
        )
        self.summary.metrics, self.summary.warnings = file_summary.metrics, file_summary.warnings
        return self.summary
