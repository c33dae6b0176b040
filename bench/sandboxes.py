"""What a sandbox per session costs on this machine: `python bench/run.py --only sandboxes`.

- start and destroy: a session's sandbox taken from a fleet with no warm pool (a bubblewrap start
  each time) and from one whose warm pool was refilled before each take; each sandbox destroyed
  after (p50, p99 over `starts` of each);
- idle sessions: `alive` sandboxes started at once, then their memory (PSS, so pages the
  sandboxes share are counted once) and the CPU they use while idle for `idle_seconds`;
- terminal rollouts: every bundled terminal task through a real TerminalEnv server, the task's
  own solution as the policy (SeedSession, WriteFile + Exec of solve.sh over SandboxService,
  Verify, CloseSession), `concurrency` at a time: rollouts/s and the mean reward (1.0 expected).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from gym_grpc.bundled.servers.resources.terminal.server import HERE as TERMINAL
from gym_grpc.bundled.servers.resources.terminal.server import TerminalEnv
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message
from gym_grpc.rpc.registry import Registry
from gym_grpc.rpc.transport import open_channel
from gym_grpc.sandboxes import SandboxFleet, SandboxSpec
from gym_grpc.sandboxes.bubblewrap import BubblewrapProvider
from gym_grpc.testing.servers import serving
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import sandbox_service_pb2 as sb_pb
from gym_grpc.v1 import sandbox_service_pb2_grpc as sb_grpc

SPEC = SandboxSpec(dirs=("/app", "/tmp"))
TICKS = os.sysconf("SC_CLK_TCK")


def _quantiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50_ms": round(1000 * statistics.median(ordered), 2),
        "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
    }


async def _starts(starts: int, warm: int) -> dict:
    fleet = SandboxFleet(BubblewrapProvider(), SPEC, warm_pool=warm, max_alive=warm + 2)
    await fleet.start()
    taken, destroyed = [], []
    try:
        for _ in range(starts):
            refilled_by = time.monotonic() + 120
            while len(fleet.warm) < warm:  # a warm take: the pool refilled first
                if time.monotonic() > refilled_by:
                    raise RuntimeError(
                        f"the warm pool did not refill within 120 s: {fleet.states()}, "
                        f"{fleet.start_failures} failed starts"
                    )
                await asyncio.sleep(0.005)
            began = time.perf_counter()
            sandbox = await fleet.acquire()
            taken.append(time.perf_counter() - began)
            fleet.in_use.discard(sandbox)  # destroyed here, timed, not by the fleet in the background
            began = time.perf_counter()
            await sandbox.destroy()
            destroyed.append(time.perf_counter() - began)
    finally:
        await fleet.close()
    return {"warm_pool": warm, "starts": starts, "take": _quantiles(taken), "destroy": _quantiles(destroyed)}


def _tree(pids: list[int]) -> list[int]:
    """The processes of these and of every descendant, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rfind(")") + 2 :].split()[1]), []).append(int(entry.name))
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _pss_and_cpu(pids: list[int]) -> tuple[int, float]:
    pss, ticks = 0, 0
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        pss += next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:")) << 10
        fields = stat[stat.rfind(")") + 2 :].split()
        ticks += int(fields[11]) + int(fields[12])
    return pss, ticks / TICKS


async def _idle(alive: int, idle_seconds: float) -> dict:
    provider = BubblewrapProvider()
    await provider.start()
    began = time.perf_counter()
    sandboxes = await asyncio.gather(*(provider.create(SPEC) for _ in range(alive)))
    started = time.perf_counter() - began
    try:
        pids = _tree([s.process.pid for s in sandboxes])  # type: ignore[attr-defined]
        pss, cpu_before = _pss_and_cpu(pids)
        await asyncio.sleep(idle_seconds)  # the measurement window: the sandboxes do nothing meanwhile
        _, cpu_after = _pss_and_cpu(pids)
    finally:
        await asyncio.gather(*(s.destroy() for s in sandboxes))
        await provider.close()
    return {
        "alive": alive,
        "started_in_seconds": round(started, 2),
        "processes_per_sandbox": round(len(pids) / alive, 1),
        "pss_mib_per_sandbox": round(pss / alive / 2**20, 2),
        "idle_cpu_ms_per_sandbox_per_second": round(1000 * (cpu_after - cpu_before) / alive / idle_seconds, 3),
    }


async def _terminal(rounds: int, concurrency: int) -> dict:
    task_rows = {row["task"]: row for row in map(json.loads, (TERMINAL / "data" / "example.jsonl").open())}
    done = r.Response(output=[assistant_message("done")])
    rewards: list[float] = []
    async with serving(TerminalEnv({"sandbox": {"max_alive": concurrency + 2}}, name="terminal")) as server:
        client = ResourcesClient(Registry(static={"terminal": server.address}), "terminal")
        async with open_channel(server.address) as channel:
            stub = sb_grpc.SandboxServiceStub(channel)
            slots = asyncio.Semaphore(concurrency)

            async def rollout(name: str, session: str) -> None:
                async with slots:
                    task = rows.task_from_row(task_rows[name])
                    await client.seed_session(session, task)
                    folder = TERMINAL / "tasks" / name / "solution"
                    for path in (p for p in folder.rglob("*") if p.is_file()):
                        request = sb_pb.WriteFileRequest(
                            session_id=session, path=f"/solution/{path.relative_to(folder)}", data=path.read_bytes()
                        )
                        await stub.WriteFile(request)
                    await stub.Exec(
                        sb_pb.ExecRequest(session_id=session, argv=["bash", "/solution/solve.sh"], cwd="/app")
                    )
                    rewards.append((await client.verify(session, task, done)).reward)
                    await client.close_session(session)

            began = time.perf_counter()
            await asyncio.gather(*(rollout(name, f"{name}-{i}") for i in range(rounds) for name in sorted(task_rows)))
            seconds = time.perf_counter() - began
        await client.registry.close()
    return {
        "rollouts": len(rewards),
        "concurrency": concurrency,
        "seconds": round(seconds, 2),
        "rollouts_per_second": round(len(rewards) / seconds, 2),
        "mean_reward": round(statistics.mean(rewards), 3),
    }


def bench_sandboxes(smoke: bool) -> dict:
    starts, alive, idle, rounds = (20, 32, 2.0, 1) if smoke else (300, 256, 10.0, 5)

    async def run() -> dict:
        print(f"sandboxes: {starts} starts and destroys, no warm pool, then a warm pool of 4 ...", file=sys.stderr)
        start_destroy = [await _starts(starts, 0), await _starts(starts, 4)]
        print(f"sandboxes: {alive} alive at once, {idle:g} s idle ...", file=sys.stderr)
        idle_sessions = await _idle(alive, idle)
        print(f"sandboxes: terminal tasks x{rounds}, solved by their own solutions ...", file=sys.stderr)
        terminal = await _terminal(rounds, 8)
        return {"start_destroy": start_destroy, "idle_sessions": idle_sessions, "terminal_scripted": terminal}

    return asyncio.run(run())
