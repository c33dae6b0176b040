"""Engine-aware admission: how many rollouts to run at once, from the engines' own load.

A fixed window of rollouts in flight either starves a slow engine (too few requests to fill its
batch) or overflows its KV cache (too many: the scheduler evicts requests and computes them again,
preemptions). The right size moves with the prompts, the lengths generated and whatever else
shares the engine. `Controller` moves a window between a floor and a ceiling from what the engines
report (GetCountersResponse.engines: KV cache usage, requests running and waiting, preemptions,
read from vLLM's /metrics by the model servers in front of them), once per interval:

* **cut** (to 3/4, at least by one) when the engines preempted since the last read, or their KV
  cache is fuller than `kv_high`;
* **trim** (by the excess) when more requests wait in the engines than `waiting_allowance` of
  those running (a short queue keeps a batch full between steps; a long one is rollouts that only
  wait);
* **grow** when the KV cache is below `kv_target`, nothing waits and the window is full (as many
  in flight as it allows): until the engines first overflow (a cut or trim), halfway to the size
  the KV cache would be at `kv_target` if it grew in proportion to the window, at most doubling
  (from an empty KV cache: doubling, a slow start); after, by one once a window's worth of
  rollouts has ended since the last growth (a round trip, as TCP grows after a loss), since the
  KV cache shows what a larger window does only once the rollouts it admits have run;
* **hold** otherwise (between target and high mark; or the window is not full, since the engines'
  load then says nothing about a larger one; or the load could not be read).

A cut or trim takes effect only as rollouts end, while the KV cache goes on showing the rollouts
that were already running: after one, the next waits until the rollouts in flight are down to
the window (as TCP's congestion window is cut at most once per round trip), so one full KV cache
does not cut the window to its floor.

It is a client's controller: the window is of this client's rollouts (`gym-grpc collect
--admission engine`; a training loop's GymClients through `limiting_rollouts`, which moves the
process's limit, set_max_concurrent_rollouts).
Several clients on one engine each run their own and each backs off from the same signals.
Its decisions are the collector's to show (its progress line, summary and `--admission-log`);
the engines' load is the model servers' (`gym-grpc status`, their `gym_engine_*` metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from gym_grpc import errors
from gym_grpc.client import training
from gym_grpc.client.stubs import AdminClient
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import admin_service_pb2 as admin_pb

log = logging.getLogger("gym_grpc.client.admission")

#: The window's ceiling when none is given.
DEFAULT_CEILING = 256

#: Seconds a model server has to answer GetCounters (it reads its engines' load in half of them).
COUNTERS_TIMEOUT = 5.0

#: The reference under which an agent names its model server (gym_grpc.agent.Agent.references).
MODEL_REFERENCE = "model"


@dataclasses.dataclass(frozen=True)
class Limits:
    """Where the window may go, and the marks it steers by."""

    floor: int = 1
    ceiling: int = DEFAULT_CEILING
    #: Grow while the KV cache is less full than this (fraction, 0-1).
    kv_target: float = 0.75
    #: Cut when it is fuller than this.
    kv_high: float = 0.92
    #: Requests that may wait in the engines, as a fraction of those running (at least 1).
    waiting_allowance: float = 0.1
    #: Seconds between two reads of the load.
    interval: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError(f"admission needs 1 <= floor <= ceiling, got floor {self.floor}, ceiling {self.ceiling}")
        if not 0 < self.kv_target < self.kv_high <= 1:
            raise ValueError(f"admission needs 0 < kv_target < kv_high <= 1, got {self.kv_target}, {self.kv_high}")
        if self.waiting_allowance < 0 or self.interval <= 0:
            raise ValueError("admission needs waiting_allowance >= 0 and interval > 0")


#: The limits when none are given.
DEFAULT_LIMITS = Limits()


@dataclasses.dataclass(frozen=True)
class Load:
    """The engines' load, over every engine read: the fullest KV cache, the rest summed."""

    kv_cache_usage: float
    requests_running: int
    requests_waiting: int
    preemptions_total: int
    #: Engines whose load could not be read (they count for nothing above).
    unread: int = 0

    @classmethod
    def of(cls, engines: list[admin_pb.EngineLoad]) -> Load | None:
        """The load over `engines`, each URL once (several model servers may front one engine);
        None when none could be read."""
        read = {e.url: e for e in engines if not e.error}
        unread = len({e.url for e in engines if e.error} - read.keys())
        if not read:
            return None
        return cls(
            kv_cache_usage=max(e.kv_cache_usage for e in read.values()),
            requests_running=sum(e.requests_running for e in read.values()),
            requests_waiting=sum(e.requests_waiting for e in read.values()),
            preemptions_total=sum(e.preemptions_total for e in read.values()),
            unread=unread,
        )


@dataclasses.dataclass(frozen=True)
class Decision:
    """One step of the controller: the window it set, what it did and why, and what it saw."""

    window: int
    #: "start", "grow", "hold", "trim" or "cut".
    action: str
    reason: str
    in_flight: int
    load: Load | None
    #: Preemptions since the previous read.
    preempted: int = 0

    def to_json(self) -> dict[str, object]:
        row: dict[str, object] = {"window": self.window, "action": self.action, "reason": self.reason}
        row["in_flight"] = self.in_flight
        if self.load is not None:
            row.update(
                kv_cache_usage=round(self.load.kv_cache_usage, 4),
                requests_running=self.load.requests_running,
                requests_waiting=self.load.requests_waiting,
                preempted=self.preempted,
            )
        return row


class Controller:
    """The control rule (see the module's docstring): a window, moved by one `decide` per interval."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.window = limits.floor
        self._preemptions: int | None = None
        #: Set by a cut or trim: no other until the rollouts in flight are down to the window.
        self._settling = False
        #: Rollouts ended when the window last grew, once the engines have overflowed (a cut or
        #: trim): from then on it grows by one a round trip (see `decide`). None before.
        self._probing_since: int | None = None

    def decide(self, load: Load | None, in_flight: int, ended: int | None = None) -> Decision:
        """The window for the next interval, from the load just read, the rollouts in flight now and
        (`ended`) how many have ended so far, which paces growth once the engines have overflowed."""
        limits, window = self.limits, self.window
        if load is None:
            return Decision(window, "hold", "no engine's load could be read", in_flight, None)
        preempted = 0 if self._preemptions is None else max(0, load.preemptions_total - self._preemptions)
        self._preemptions = load.preemptions_total  # an engine restarted (the count fell): a new baseline
        if self._settling and in_flight <= window:
            self._settling = False
        allowance = max(1, int(limits.waiting_allowance * load.requests_running))
        kv = load.kv_cache_usage

        def hold(why: str) -> Decision:
            return Decision(window, "hold", why, in_flight, load, preempted)

        def step(action: str, new: int, reason: str) -> Decision:
            new = max(limits.floor, min(limits.ceiling, new))
            if action in ("cut", "trim"):
                if self._settling:
                    return hold(f"{reason}; the last cut has not taken effect yet")
                if new >= window:
                    return hold(f"{reason}; at the floor")
                self._settling = True
                self._probing_since = ended if ended is not None else 0
            elif new <= window:
                return hold(f"{reason}; at the ceiling")
            elif self._probing_since is not None and ended is not None:
                self._probing_since = ended
            self.window = new
            return Decision(new, action, reason, in_flight, load, preempted)

        if preempted:
            return step("cut", min(window * 3 // 4, window - 1), f"{preempted} preemptions since the last read")
        if kv > limits.kv_high:
            return step("cut", min(window * 3 // 4, window - 1), f"KV cache {kv:.0%} used, over {limits.kv_high:.0%}")
        if load.requests_waiting > allowance:
            excess = load.requests_waiting - allowance
            return step("trim", window - excess, f"{load.requests_waiting} requests waiting, over {allowance}")
        if kv >= limits.kv_target:
            return hold(f"KV cache {kv:.0%} used, at the target")
        if load.requests_waiting:
            return hold(f"{load.requests_waiting} requests waiting")
        if in_flight < window:
            return hold("the window is not full")
        if self._probing_since is not None:
            # The engines overflowed before: what a larger window does to the KV cache shows only
            # once the rollouts it admits have run, a round trip later. One more, once a window's
            # worth of rollouts ended since the last growth (as TCP after a loss), not a jump that
            # overshoots again before the cache can say so.
            if ended is not None and ended - self._probing_since < window:
                return hold("probing: one more once a window's worth of rollouts ended since the last growth")
            return step("grow", window + 1, f"KV cache {kv:.0%} used, under {limits.kv_target:.0%}, nothing waiting")
        if kv <= 0:
            wanted = 2 * window
        else:
            at_target = window * limits.kv_target / kv
            wanted = min(2 * window, window + max(1, round((at_target - window) / 2)))
        return step("grow", wanted, f"KV cache {kv:.0%} used, under {limits.kv_target:.0%}, nothing waiting")


class ModelServerLoads:
    """The engines' load as the model servers of some agents report it (GetCountersResponse.engines)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._agents: set[str] = set()
        self._servers: set[str] = set()

    async def watch(self, agent: str) -> None:
        """Read from now on the engines of `agent`'s model server (its `model` reference)."""
        if agent in self._agents:
            return
        self._agents.add(agent)
        model = (await self.registry.info(agent)).references.get(MODEL_REFERENCE)
        if not model:
            raise errors.InvalidArgument(
                f"agent {agent!r} names no model server (reference {MODEL_REFERENCE!r}): its engines' load "
                "cannot be read for admission",
                field="admission",
            )
        self._servers.add(model)

    async def read(self) -> Load | None:
        """The load now over the engines of every watched model server (every address of each);
        None when nothing could be read. A model server that does not answer is skipped (logged)."""
        engines: list[admin_pb.EngineLoad] = []
        for server in sorted(self._servers):
            try:
                addresses = (await self.registry.info(server)).addresses
            except errors.GymError as e:
                log.warning("admission: model server %r not found: %s", server, e)
                continue
            client = AdminClient(self.registry, server, timeout=COUNTERS_TIMEOUT)
            replies = await asyncio.gather(*(client.counters(a) for a in addresses), return_exceptions=True)
            for address, reply in zip(addresses, replies, strict=True):
                if isinstance(reply, errors.GymError):
                    log.warning("admission: model server at %s did not answer GetCounters: %s", address, reply.message)
                elif isinstance(reply, BaseException):
                    raise reply
                else:
                    engines.extend(reply.engines)
        return Load.of(engines)


class Admission:
    """Runs a Controller: every interval reads the load, decides, and sets the window through `apply`.

    `in_flight` says how many rollouts run now, `ended` how many have ended so far (without it,
    growth after an overflow is not paced); `record` is told every decision (a log, a summary).
    GymClient's is `limiting_rollouts`."""

    def __init__(
        self,
        controller: Controller,
        read_load: Callable[[], Awaitable[Load | None]],
        apply: Callable[[int], None],
        in_flight: Callable[[], int],
        record: Callable[[float, Decision], None] | None = None,
        ended: Callable[[], int] | None = None,
    ) -> None:
        self.controller = controller
        self.read_load = read_load
        self.apply = apply
        self.in_flight = in_flight
        self.record = record
        self.ended = ended
        self.started = time.monotonic()
        #: Decisions by action, and the smallest and largest window set.
        self.actions: dict[str, int] = {}
        self.smallest = self.largest = controller.window
        self.preempted = 0
        #: The engines' load at the last read that could be read.
        self.last_load: Load | None = None
        self._started = False

    def start(self) -> None:
        """Set the window to the floor (once; `run` does it when it was not done)."""
        if not self._started:
            self._started = True
            self.apply(self.controller.window)
            self._note(0.0, Decision(self.controller.window, "start", "the floor", self.in_flight(), None))

    async def run(self) -> None:
        """Until cancelled, from the floor."""
        self.start()
        while True:
            await asyncio.sleep(self.controller.limits.interval)
            try:
                load = await self.read_load()
            except errors.GymError as e:
                log.warning("admission: the engines' load could not be read: %s", e)
                load = None
            decision = self.controller.decide(load, self.in_flight(), None if self.ended is None else self.ended())
            self.apply(decision.window)
            self._note(time.monotonic() - self.started, decision)

    def _note(self, at: float, decision: Decision) -> None:
        self.actions[decision.action] = self.actions.get(decision.action, 0) + 1
        self.smallest = min(self.smallest, decision.window)
        self.largest = max(self.largest, decision.window)
        self.preempted += decision.preempted
        if decision.load is not None:
            self.last_load = decision.load
        if self.record is not None:
            self.record(at, decision)

    def summary(self) -> str:
        """One line for the end of a run: where the window went and what moved it."""
        limits = self.controller.limits
        moves = ", ".join(f"{count} {action}" for action, count in sorted(self.actions.items()) if action != "start")
        return (
            f"admission by engine load: window {self.controller.window} at the end, between {self.smallest} and "
            f"{self.largest} (floor {limits.floor}, ceiling {limits.ceiling}); {moves or 'no decisions'}; "
            f"{self.preempted} preemptions seen"
        )


@contextlib.asynccontextmanager
async def running(admission: Admission) -> AsyncIterator[Admission]:
    """Run `admission` for the duration of a block: the window is at the floor when it begins."""
    admission.start()
    task = asyncio.create_task(admission.run())
    try:
        yield admission
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def limiting_rollouts(
    registry: Registry,
    *agents: str,
    limits: Limits = DEFAULT_LIMITS,
    record: Callable[[float, Decision], None] | None = None,
) -> AsyncIterator[Admission]:
    """For a training loop: while the block runs, the process's limit of concurrent rollouts (the
    one every GymClient draws from, set_max_concurrent_rollouts) follows the engines of `agents`'
    model servers; the limit it had is set back after.

        async with limiting_rollouts(Registry("127.0.0.1:50050"), "math_agent", limits=Limits(4, 512)):
            async with GymClient("math_agent") as gym:
                ...
    """
    loads = ModelServerLoads(registry)
    for agent in agents:
        await loads.watch(agent)
    before = training.max_concurrent_rollouts()
    controller = Controller(limits)
    admission = Admission(
        controller,
        loads.read,
        training.set_max_concurrent_rollouts,
        training.rollouts_in_flight,
        record,
        training.rollouts_ended,
    )
    try:
        async with running(admission):
            yield admission
    finally:
        training.set_max_concurrent_rollouts(before)
