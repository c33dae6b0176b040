"""The task server: serves TaskService (task_service.proto) over datasets of task rows.

Each NextBatch call draws tasks from the sampler (sampler.py), rolls each out `group_size` times
through its agent, and sends the groups that carry signal as they complete. While dynamic sampling
is on, a group whose finished rollouts all have one reward is dropped and another task drawn in its
place; the call keeps as many groups in flight as it still needs, and tries at most
`max_draws_per_group` times the groups asked for. Every group's rewards go to the sampler, sent or
dropped, so that what the trainer is served is what moves a task between pools.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from pydantic import Field, field_validator

from gym_grpc import errors
from gym_grpc.client.stubs import AgentClient
from gym_grpc.data import jsonl, rows
from gym_grpc.rpc import transport
from gym_grpc.server.serving import GymServer, ServerConfig, rpc_method
from gym_grpc.tasks.sampler import EASY, HARD, LEARNING, Pool, PoolRule, TaskSampler
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import task_pb2
from gym_grpc.v1 import task_service_pb2 as tasks_pb
from gym_grpc.v1 import task_service_pb2_grpc as tasks_grpc

log = logging.getLogger("gym_grpc.tasks")

#: Why no task can be drawn.
_NONE_LEFT = "every task is retired (max_groups_per_task), held by a batch, or in a pool whose share is 0"

SERVICE = tasks_pb.DESCRIPTOR.services_by_name["TaskService"].full_name


class DatasetConfig(ServerConfig):
    """One dataset of a task server."""

    name: str = Field(description="the dataset's name, as groups and stats name it")
    jsonl_fpath: str = Field(description="its tasks JSONL; a relative path is relative to the YAML file")
    weight: float = Field(1.0, ge=0, description="its share of draws, against the other datasets' weights")


class PoolsConfig(ServerConfig):
    """Difficulty pools: a task's recent pass rate puts it in one."""

    easy_at: float = Field(1.0, ge=0, le=1, description="pass rate at or above which a task is easy")
    hard_at: float = Field(0.0, ge=0, le=1, description="pass rate at or below which a task is hard")
    easy: float = Field(0.05, ge=0, description="share of draws from the easy pool")
    learning: float = Field(0.9, ge=0, description="share of draws from the learning pool (and unseen tasks)")
    hard: float = Field(0.05, ge=0, description="share of draws from the hard pool")
    history: int = Field(16, ge=1, description="finished rollouts remembered per task")


class TaskServerConfig(ServerConfig):
    agent: str | None = Field(None, description="the agent that runs a row without an agent_ref")
    datasets: list[DatasetConfig] = Field(min_length=1, description="the task datasets to draw from")
    group_size: int = Field(8, ge=2, description="rollouts per group when a request gives none")
    pass_threshold: float = Field(1.0, description="a reward at or above it is a pass")
    pools: PoolsConfig | None = Field(
        default_factory=PoolsConfig, description="difficulty pools; null: none, every task drawn alike"
    )
    dynamic_sampling: bool = Field(True, description="drop and replace groups whose rewards are all equal")
    max_draws_per_group: int = Field(
        4, ge=1, description="a batch of N groups rolls out at most N times this many groups, then ends short"
    )
    max_groups_per_task: int | None = Field(
        None, ge=1, description="groups a task is served in the server's life before it is retired; null: no cap"
    )
    max_in_flight: int = Field(256, ge=1, description="rollouts running at once, over every batch")
    rollout_timeout_seconds: float = Field(600.0, gt=0, description="seconds a rollout may take, unless asked")
    seed: int | None = Field(None, description="seed of the draws, for a reproducible order")

    @field_validator("datasets")
    @classmethod
    def _distinct(cls, datasets: list[DatasetConfig]) -> list[DatasetConfig]:
        names = [d.name for d in datasets]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"dataset names must differ: {', '.join(twice)} given twice")
        return datasets


def add_summary(total: tasks_pb.BatchSummary, summary: tasks_pb.BatchSummary) -> None:
    """Add one batch's counts and seconds to a running total (the server's life, a collect's batches)."""
    for name in ("groups", "groups_tried", "groups_without_signal", "groups_failed", "rollouts", "rollouts_failed"):
        setattr(total, name, getattr(total, name) + getattr(summary, name))
    total.seconds += summary.seconds


class TaskServer(GymServer):
    """Serves TaskService over the datasets of its config (see the module's doc)."""

    role = reg.SERVER_ROLE_TASKS
    Config = TaskServerConfig
    one_process = "its draws, pools and in-flight limit are one, over every batch"
    config: TaskServerConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.names = [d.name for d in self.config.datasets]
        #: Each dataset's rows, and their tasks and agents.
        self.rows: list[list[dict[str, Any]]] = []
        self.tasks: list[list[task_pb2.Task]] = []
        self.agents: list[list[str]] = []
        for dataset in self.config.datasets:
            self._load(dataset)
        pools = self.config.pools
        rule = (
            PoolRule(
                pass_threshold=self.config.pass_threshold,
                easy_at=pools.easy_at,
                hard_at=pools.hard_at,
                proportions={EASY: pools.easy, LEARNING: pools.learning, HARD: pools.hard},
                history=pools.history,
            )
            if pools is not None
            else PoolRule(pass_threshold=self.config.pass_threshold, pools=False)
        )
        self.sampler = TaskSampler(
            [len(t) for t in self.tasks],
            [d.weight for d in self.config.datasets],
            rule,
            max_groups=self.config.max_groups_per_task,
            seed=self.config.seed,
        )
        self.served = tasks_pb.BatchSummary()
        self._slots = asyncio.Semaphore(self.config.max_in_flight)
        self._clients: dict[str, AgentClient] = {}

    def _load(self, dataset: DatasetConfig) -> None:
        """Read a dataset's rows; a row that is not a task stops the server, named by file and line."""
        path = Path(dataset.jsonl_fpath)
        if not path.is_file():
            raise errors.ConfigError(f"task server {self.name!r}: dataset {dataset.name!r}: no file {path}")
        loaded: list[dict[str, Any]] = []
        tasks: list[task_pb2.Task] = []
        agents: list[str] = []
        with path.open("rb") as f:
            for line in jsonl.lines(f, transport.MAX_MESSAGE_BYTES):
                where = f"task server {self.name!r}: dataset {dataset.name!r}: {path}:{line.number}"
                if line.raw is None:
                    raise errors.ConfigError(f"{where}: over the {transport.MAX_MESSAGE_BYTES:,} bytes a task may have")
                if not line.raw.strip():
                    continue
                try:
                    row = jsonl.parse_line(line.raw)
                    task = rows.task_from_row(row)
                    agent = rows.agent_name(row, self.config.agent, " and the task server has no `agent`")
                except ValueError as e:
                    raise errors.ConfigError(f"{where}: {e}") from None
                loaded.append(row)
                tasks.append(task)
                agents.append(agent)
        if not tasks:
            raise errors.ConfigError(f"task server {self.name!r}: dataset {dataset.name!r}: {path} has no task rows")
        self.rows.append(loaded)
        self.tasks.append(tasks)
        self.agents.append(agents)

    def references(self) -> dict[str, str]:
        names = sorted({agent for per_dataset in self.agents for agent in per_dataset})
        return {f"agent{i or ''}": name for i, name in enumerate(names)}  # agent, agent1, ...: one name each

    def add_services(self, server: grpc.aio.Server) -> list[str]:
        tasks_grpc.add_TaskServiceServicer_to_server(_TaskServicer(self), server)
        return [SERVICE]

    async def stop(self) -> None:
        for client in self._clients.values():
            await client.close()
        await super().stop()

    def _agent(self, name: str) -> AgentClient:
        client = self._clients.get(name)
        if client is None:
            client = self._clients[name] = AgentClient(self.registry, name)
        return client

    async def _member(
        self, agent: AgentClient, task: task_pb2.Task, repeat: int, timeout: float, version: int | None
    ) -> tasks_pb.GroupMember:
        member = tasks_pb.GroupMember(repeat_index=repeat)
        async with self._slots:
            try:
                member.rollout.CopyFrom(await agent.run(task, timeout, policy_version=version))
            except errors.GymError as e:
                member.error.CopyFrom(agent_pb.RunError.FromString(e.status_proto().SerializeToString()))
        return member

    async def _group(
        self, dataset: int, index: int, pool: Pool, size: int, timeout: float, version: int | None
    ) -> tasks_pb.TaskGroup:
        agent = self.agents[dataset][index]
        task = self.tasks[dataset][index]
        client = self._agent(agent)
        members = await asyncio.gather(
            *(self._member(client, task, repeat, timeout, version) for repeat in range(size))
        )
        return tasks_pb.TaskGroup(
            dataset=self.names[dataset], task_index=index, task=task, agent=agent, pool=pool, members=members
        )

    async def batch(self, request: tasks_pb.NextBatchRequest) -> AsyncIterator[tasks_pb.NextBatchResponse]:
        """The groups of one NextBatch call as they complete, then its summary."""
        if request.groups < 1:
            raise errors.InvalidArgument("groups: ask for at least 1", field="groups")
        size = request.group_size or self.config.group_size
        if size < 2:
            raise errors.InvalidArgument("group_size: a group needs at least 2 rollouts", field="group_size")
        timeout = request.rollout_timeout_seconds or self.config.rollout_timeout_seconds
        version = request.policy_version if request.HasField("policy_version") else None
        began = time.monotonic()
        summary = tasks_pb.BatchSummary()
        budget = request.groups * self.config.max_draws_per_group
        running: dict[asyncio.Task[tasks_pb.TaskGroup], tuple[int, int]] = {}
        held: list[tuple[int, int]] = []
        try:
            while summary.groups < request.groups:
                while len(running) < request.groups - summary.groups and summary.groups_tried < budget:
                    drawn = self.sampler.draw()
                    if drawn is None:
                        break
                    dataset, index, pool = drawn
                    held.append((dataset, index))
                    summary.groups_tried += 1
                    future = asyncio.ensure_future(self._group(dataset, index, pool, size, timeout, version))
                    running[future] = (dataset, index)
                if not running:
                    if summary.groups_tried == 0:
                        raise errors.FailedPrecondition(
                            f"task server {self.name!r}: no task left to draw: {_NONE_LEFT}",
                            reason=errors.Reason.TASKS_EXHAUSTED,
                        )
                    summary.short_reason = self._short_reason(summary, budget)
                    break
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    dataset, index = running.pop(future)
                    group = future.result()
                    finished = [m.rollout.reward for m in group.members if m.HasField("rollout")]
                    if finished:
                        group.reward_mean = sum(finished) / len(finished)
                    group.has_signal = len(set(finished)) > 1
                    self.sampler.observe(dataset, index, finished)
                    summary.rollouts += len(group.members)
                    summary.rollouts_failed += len(group.members) - len(finished)
                    if len(finished) < 2:
                        summary.groups_failed += 1
                    elif self.config.dynamic_sampling and not group.has_signal:
                        summary.groups_without_signal += 1
                    else:
                        summary.groups += 1
                        yield tasks_pb.NextBatchResponse(group=group)
            summary.seconds = time.monotonic() - began
            add_summary(self.served, summary)
            yield tasks_pb.NextBatchResponse(summary=summary)
        finally:
            for future in running:
                future.cancel()
            for dataset, index in held:
                self.sampler.release(dataset, index)

    def _short_reason(self, summary: tasks_pb.BatchSummary, budget: int) -> str:
        if summary.groups_tried >= budget:
            return (
                f"{summary.groups_tried} groups tried (max_draws_per_group {self.config.max_draws_per_group} "
                f"times the groups asked): {summary.groups_without_signal} had one reward for all, "
                f"{summary.groups_failed} too few finished rollouts"
            )
        return (
            "no task left to draw (every task is retired, held by this or another batch, or in a pool whose share is 0)"
        )

    def stats(self, limit: int) -> tasks_pb.GetTaskStatsResponse:
        sizes = self.sampler.pool_sizes()
        answer = tasks_pb.GetTaskStatsResponse(
            easy=sizes[EASY],
            learning=sizes[LEARNING],
            hard=sizes[HARD],
            retired=self.sampler.retired,
            total=sum(len(t) for t in self.tasks),
            served=self.served,
        )
        seen = sorted(self.sampler.seen(), key=lambda record: (-record.groups, record.dataset, record.index))
        for record in seen[:limit] if limit else seen:
            recent = record.recent
            answer.tasks.add(
                dataset=self.names[record.dataset],
                task_index=record.index,
                pool=self.sampler.pool_of(record.dataset, record.index),
                groups=record.groups,
                recent_rollouts=len(recent),
                recent_pass_rate=record.pass_rate,
                recent_reward_mean=sum(recent) / len(recent) if recent else 0.0,
            )
        return answer


class _TaskServicer(tasks_grpc.TaskServiceServicer):
    def __init__(self, app: TaskServer) -> None:
        self.app = app

    @rpc_method
    async def NextBatch(
        self, request: tasks_pb.NextBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tasks_pb.NextBatchResponse]:
        async for reply in self.app.batch(request):
            yield reply

    @rpc_method
    async def GetTaskStats(
        self, request: tasks_pb.GetTaskStatsRequest, context: grpc.aio.ServicerContext
    ) -> tasks_pb.GetTaskStatsResponse:
        return self.app.stats(request.limit)
