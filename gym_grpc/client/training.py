"""A client for training loops: rollouts from a running gym-grpc.

    set_max_concurrent_rollouts(512)          # once, for the whole process
    async with GymClient("math_agent") as gym:
        result = await gym.run(row)            # a NeMo Gym-style row or a Task
        group = await gym.run_group(row, 8)    # GRPO: 8 rollouts of one task, every one returned
        if result.ok:
            result.reward, result.turns[0].generation_token_ids, result.turns[0].generation_log_probs
        else:
            result.failure.code, result.failure.message   # mask it out: it is no sample

A rollout that fails (a server down, a deadline, a verifier that raised) is
returned, marked with its failure, never raised and never given a reward: a
trainer masks it out instead of training on it.

Every rollout of every client in the process draws from one limit, so that
baseline evaluation, training rollouts and periodic evaluation together never
exceed it, whichever threads and event loops they run on. A client itself
belongs to the event loop it is first used on (its gRPC channels do).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from gym_grpc import errors, tracing
from gym_grpc.client.run_many import RESUME_ATTEMPTS, run_error_as_call
from gym_grpc.client.stubs import AgentClient, ModelClient, TaskClient
from gym_grpc.data import record, rows
from gym_grpc.rpc.registry import Registry
from gym_grpc.rpc.security import Security
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2
from gym_grpc.v1 import task_service_pb2 as tasks_pb

log = logging.getLogger("gym_grpc.client.training")

#: The limit when none was set.
DEFAULT_MAX_CONCURRENT_ROLLOUTS = 1024


class _ProcessLimit:
    """A counting limit shared by every caller in the process, across threads and event loops."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._limit: int | None = None
        self._in_use = 0
        self._ended = 0
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()

    @property
    def limit(self) -> int:
        with self._lock:
            return self._limit_locked()

    @property
    def in_use(self) -> int:
        with self._lock:
            return self._in_use

    def _limit_locked(self) -> int:
        if self._limit is None:
            self._set_locked(DEFAULT_MAX_CONCURRENT_ROLLOUTS)
        assert self._limit is not None
        return self._limit

    def _set_locked(self, limit: int) -> None:
        self._limit = limit
        log.info("[Concurrency] Set max concurrent rollouts to %d", limit)
        while self._waiters and self._in_use < limit:
            self._grant_locked()

    def set(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max concurrent rollouts must be at least 1, got {limit}")
        with self._lock:
            if limit != self._limit:
                self._set_locked(limit)

    def _grant_locked(self) -> None:
        loop, future = self._waiters.popleft()
        self._in_use += 1
        loop.call_soon_threadsafe(_resolve, future)

    async def acquire(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._in_use < self._limit_locked():
                self._in_use += 1
                return
            future: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, future))
        try:
            await future
        except asyncio.CancelledError:
            with self._lock:
                if (loop, future) in self._waiters:
                    self._waiters.remove((loop, future))
                    raise
            self.release()  # the slot was granted as we were cancelled: pass it on
            raise

    @property
    def ended(self) -> int:
        with self._lock:
            return self._ended

    def release(self) -> None:
        with self._lock:
            self._in_use -= 1
            self._ended += 1
            if self._waiters and self._in_use < self._limit_locked():
                self._grant_locked()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_LIMIT = _ProcessLimit()


def set_max_concurrent_rollouts(limit: int) -> None:
    """Set the one limit of concurrent rollouts that every client in this process shares."""
    _LIMIT.set(limit)


def max_concurrent_rollouts() -> int:
    """The limit in force (the default is set, and logged, on first use)."""
    return _LIMIT.limit


def rollouts_in_flight() -> int:
    """How many rollouts hold a slot of the limit now, in this process."""
    return _LIMIT.in_use


def rollouts_ended() -> int:
    """How many rollouts have given back their slot of the limit so far, in this process."""
    return _LIMIT.ended


class RolloutSlot:
    """One rollout's share of the process's limit, for a rollout that `GymClient` does not run
    (a trainer's own loop driving an environment's session, as the tinker-cookbook adapter does).
    `release` gives it back; a second release does nothing."""

    def __init__(self) -> None:
        self._held = True

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        if self._held:
            self._held = False
            _LIMIT.release()


async def acquire_rollout_slot() -> RolloutSlot:
    """Wait for a free slot under `max_concurrent_rollouts`, the same limit `GymClient` draws from."""
    await _LIMIT.acquire()
    return RolloutSlot()


@dataclass(frozen=True)
class TokenTurn:
    """The token information of one model call of a rollout."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    #: The policy version that generated the turn (see GymClient.weights_updated), None without one.
    policy_version: int | None = None


def _token_turns(items: Iterable[r.Item]) -> list[TokenTurn]:
    """The token turns among `items`: one per model call that reported token ids, in order."""
    found = []
    for item in items:
        kind = item.WhichOneof("item")
        inner = getattr(item, kind) if kind is not None and kind != "function_call_output" else None
        if inner is not None and inner.generation_token_ids:
            found.append(
                TokenTurn(
                    list(inner.prompt_token_ids),
                    list(inner.generation_token_ids),
                    list(inner.generation_log_probs),
                    inner.policy_version if inner.HasField("policy_version") else None,
                )
            )
    return found


@dataclass(frozen=True)
class RolloutResult:
    """One rollout's outcome: the rollout when it finished (`ok`), else its `failure`.

    A failed rollout is no sample: its reward, response, turns and row raise
    `errors.RolloutFailed` rather than stand in for one."""

    rollout: task_pb2.Rollout | None
    failure: errors.Failure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def _finished(self) -> task_pb2.Rollout:
        if self.failure is not None:
            raise errors.RolloutFailed(self.failure)
        assert self.rollout is not None
        return self.rollout

    @property
    def reward(self) -> float:
        return self._finished().reward

    @property
    def response(self) -> r.Response:
        return self._finished().response

    @property
    def turns(self) -> list[TokenTurn]:
        """One entry per model call that reported token ids, in order (of every role, in an episode with
        several: see `role_turns`)."""
        return _token_turns(self.response.output)

    def role_turns(self) -> dict[str, tuple[float, list[TokenTurn]]]:
        """In an episode with several roles: each role's reward and token turns, by name (empty otherwise)."""
        rollout = self._finished()
        output = rollout.response.output
        return {role.name: (role.reward, _token_turns(output[i] for i in role.items)) for role in rollout.roles}

    def to_row(self, task_row: dict[str, Any]) -> dict[str, Any]:
        """The rollout row (task row + response, reward, verifier fields, ...), as `collect` writes it."""
        return record.build(task_row, self._finished())


@dataclass(frozen=True)
class TaskGroup:
    """A group a task server served (TaskService.NextBatch): one task's rollouts, failed ones marked."""

    dataset: str
    task_index: int
    #: The task as its row gives it (the row without the rollout's fields).
    task_row: dict[str, Any]
    agent: str
    #: The difficulty pool it was drawn from: "easy", "learning" or "hard".
    pool: str
    results: list[RolloutResult]
    has_signal: bool

    def rows(self) -> list[dict[str, Any]]:
        """The rollout rows of the members that finished, as `collect` writes them."""
        return [result.to_row(self.task_row) for result in self.results if result.ok]


@dataclass(frozen=True)
class TaskBatch:
    """The groups of one TaskService.NextBatch call, and what they cost (BatchSummary)."""

    groups: list[TaskGroup]
    summary: tasks_pb.BatchSummary


def task_group(group: tasks_pb.TaskGroup) -> TaskGroup:
    """A TaskService group as Python values."""
    results = []
    for member in group.members:
        if member.HasField("rollout"):
            results.append(RolloutResult(member.rollout))
        else:
            error = errors.from_rpc_error(run_error_as_call(member.error), f"agent {group.agent!r}")
            results.append(RolloutResult(None, errors.Failure.of(error)))
    pool = tasks_pb.TaskPool.Name(group.pool).removeprefix("TASK_POOL_").lower()
    task_row = rows.task_to_row(group.task)
    task_row.setdefault("agent_ref", {"name": group.agent})  # as collect writes it: which agent ran it
    return TaskGroup(group.dataset, group.task_index, task_row, group.agent, pool, results, group.has_signal)


class _Pacing:
    """Staleness bounded before work (AReaL's rule): the n-th rollout (from 0, in the order they
    start) starts only once the trainer's version, counted from the first, is at least
    n // rollouts_per_version - max_lag. A trainer that takes `rollouts_per_version` rollouts per
    step, in the order they started, then trains on none more than `max_lag` versions old; the
    collection waits for it instead of producing samples it would throw away."""

    def __init__(self, max_lag: int, rollouts_per_version: int, first: int) -> None:
        self.max_lag, self.per_version, self.first = max_lag, rollouts_per_version, first
        self.started = 0
        self.version = first
        self._moved = asyncio.Condition()

    def _allowed(self) -> int:
        return (self.version - self.first + self.max_lag + 1) * self.per_version

    async def admit(self, rollouts: int) -> None:
        if rollouts > (self.max_lag + 1) * self.per_version:
            raise ValueError(
                f"a group of {rollouts} never fits a pace of {self.per_version} rollouts a version with max_lag "
                f"{self.max_lag}: raise rollouts_per_version or max_lag"
            )
        async with self._moved:
            await self._moved.wait_for(lambda: self.started + rollouts <= self._allowed())
            self.started += rollouts

    async def moved(self, version: int) -> None:
        async with self._moved:
            self.version = version
            self._moved.notify_all()


class GymClient:
    """Runs rollouts through one agent of a running `gym-grpc run`.

    `policy_version`: the version rollouts are asked under (see docs/training.md#async-training).
    `max_lag` with `rollouts_per_version` (the rollouts one optimizer step takes) paces the
    rollouts: one starts only while it can be trained on within `max_lag` versions (_Pacing);
    `run` waits for `weights_updated` or `update_weights` otherwise. `resume_attempts`: times a
    rollout lost with its agent replica, model server or engine goes on from its last turn
    boundary (docs/durable-rollouts.md); 0: it fails instead."""

    def __init__(
        self,
        agent: str,
        registry: str | Registry = "127.0.0.1:50050",
        *,
        timeout: float = 3600.0,
        security: Security | None = None,
        policy_version: int | None = None,
        max_lag: int | None = None,
        rollouts_per_version: int | None = None,
        resume_attempts: int = RESUME_ATTEMPTS,
    ) -> None:
        self._registry = registry if isinstance(registry, Registry) else Registry(registry, security=security)
        self._owns_registry = not isinstance(registry, Registry)
        self._agent = AgentClient(self._registry, agent, resume_attempts=resume_attempts)
        self._tasks: dict[str, TaskClient] = {}
        self.timeout = timeout
        #: The version every rollout is asked under (None: none); `weights_updated` moves it.
        self.policy_version = policy_version
        self._pacing: _Pacing | None = None
        if max_lag is not None or rollouts_per_version is not None:
            if max_lag is None or rollouts_per_version is None or policy_version is None:
                raise ValueError("pacing needs max_lag, rollouts_per_version and a policy_version")
            if max_lag < 0 or rollouts_per_version < 1:
                raise ValueError(
                    f"pacing needs max_lag >= 0 and rollouts_per_version >= 1, got {max_lag}, {rollouts_per_version}"
                )
            self._pacing = _Pacing(max_lag, rollouts_per_version, policy_version)
        _LIMIT.limit  # noqa: B018 - the limit is set (and logged) when the first client starts
        tracing.configure("gym-grpc-client")  # when OTEL_TRACES_EXPORTER says so and the program set up none

    async def weights_updated(self, version: int, *model_servers: str) -> None:
        """After a weight update: ask later rollouts under `version`, and tell `model_servers` (every
        replica and worker of each) that their engines serve it, so turns they generate from now
        on, in rollouts already running too, are stamped with it."""
        self.policy_version = version
        for name in model_servers:
            await ModelClient(self._registry, name).set_policy_version(version)
        if self._pacing is not None:
            await self._pacing.moved(version)

    async def update_weights(
        self, version: int, checkpoint_path: str, *model_servers: str, pause_mode: str = "keep"
    ) -> None:
        """Load a checkpoint into the engines of `model_servers` (every replica of each) as `version`,
        pausing them in `pause_mode` ("keep", "abort" or "wait"; ModelService.UpdateWeights), then ask
        later rollouts under it. Rollouts in flight go on; their turns say which version made them."""
        for name in model_servers:
            await ModelClient(self._registry, name).update_weights(version, checkpoint_path, pause_mode)
        self.policy_version = version
        if self._pacing is not None:
            await self._pacing.moved(version)

    async def run(self, task: task_pb2.Task | dict[str, Any]) -> RolloutResult:
        """One rollout of a task (a Task, or a row such as a line of a tasks JSONL). A failed
        rollout comes back marked with its failure; a row that cannot be a task raises, and so
        does an agent that speaks another major version of the protocol (IncompatibleServer)."""
        if isinstance(task, dict):
            task = rows.task_from_row(task)
        if self._pacing is not None:
            await self._pacing.admit(1)
        return await self._run(task)

    async def _run(self, task: task_pb2.Task) -> RolloutResult:
        queued = time.time_ns()  # its wait for the limit is in its trace
        await _LIMIT.acquire()
        try:
            with tracing.rollout(queued, **{"gym_grpc.agent": self._agent.name}):
                rollout = await self._agent.run(task, timeout=self.timeout, policy_version=self.policy_version)
                tracing.sampled(rollout)
            return RolloutResult(rollout)
        except errors.IncompatibleServer:
            raise  # the setup is wrong, not this rollout
        except errors.GymError as e:
            return RolloutResult(None, errors.Failure.of(e))
        finally:
            _LIMIT.release()

    async def run_group(self, task: task_pb2.Task | dict[str, Any], group_size: int) -> list[RolloutResult]:
        """`group_size` rollouts of one task (a GRPO group), in the order they were asked for:
        every member, failed ones marked. Cancelling the group cancels every member."""
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        if isinstance(task, dict):
            task = rows.task_from_row(task)
        if self._pacing is not None:
            await self._pacing.admit(group_size)  # a group as one: a group half admitted could wait for itself
        members = [asyncio.ensure_future(self._run(task)) for _ in range(group_size)]
        try:
            return list(await asyncio.gather(*members))
        finally:
            for member in members:  # a member that raised (a bug) leaves none of the others running
                member.cancel()

    async def next_batch(self, task_server: str, groups: int, group_size: int = 0) -> TaskBatch:
        """`groups` groups of `group_size` rollouts (0: the server's default) that a task server chose and
        ran (docs/task-service.md): with dynamic sampling on, every one carries signal. Its rollouts run
        through the task server's agents under this client's `policy_version` and `timeout`, not under
        `max_concurrent_rollouts` or pacing: the task server has its own limit. An empty batch is no
        error: its summary says why (`short_reason`)."""
        client = self._tasks.get(task_server)
        if client is None:
            client = self._tasks[task_server] = TaskClient(self._registry, task_server)
        found: list[TaskGroup] = []
        summary = tasks_pb.BatchSummary()
        async for reply in client.next_batch(
            groups, group_size, policy_version=self.policy_version, rollout_timeout=self.timeout
        ):
            if reply.HasField("group"):
                found.append(task_group(reply.group))
            else:
                summary = reply.summary
        return TaskBatch(found, summary)

    async def close(self) -> None:
        await self._agent.close()
        if self._owns_registry:
            await self._registry.close()

    async def __aenter__(self) -> GymClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
