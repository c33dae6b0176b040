"""What the servers of a running configuration say about themselves (`gym-grpc status`, `gym-grpc profile`)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import SERVER_ROLES, Registry
from gym_grpc.rpc.security import Security
from gym_grpc.server import metrics
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import registry_service_pb2 as reg

#: What a call to a server that is not there fails with: it reads as down, not as an error.
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

_HEALTH = {
    health_pb2.HealthCheckResponse.SERVING: "serving",
    health_pb2.HealthCheckResponse.NOT_SERVING: "not serving",
}


def _workers(info: reg.ServerInfo, address: str) -> list[dict[str, Any]]:
    """The worker processes serving `address`, as the registry lists them."""
    for replica in info.replicas:
        if replica.address == address:
            return [
                {
                    "index": w.index,
                    "pid": w.pid,
                    "address": w.address,
                    "metrics_address": w.metrics_address,
                    "restarts": w.restarts,
                }
                for w in replica.workers
            ]
    return []


async def _one(info: reg.ServerInfo, address: str, interval: float, security: Security | None) -> dict[str, Any]:
    row: dict[str, Any] = {"name": info.name, "role": SERVER_ROLES.get(info.role, "?"), "address": address}
    row["workers"] = _workers(info, address)
    # Each worker counts its own calls: with a port of its own each (protocol 1.14), every one is
    # asked and the row has the server's totals; otherwise the figures are the answering worker's.
    own = [w["address"] for w in row["workers"]]
    channels = [transport.open_channel(a, security=security) for a in (own if len(own) > 1 and all(own) else [])]
    try:
        async with transport.open_channel(address, security=security) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
            row["health"] = _HEALTH.get(reply.status, "unknown")
            admin = admin_grpc.AdminServiceStub(channel)
            server = await admin.GetServerInfo(admin_pb.GetServerInfoRequest(), timeout=2.0)
            counted = [admin_grpc.AdminServiceStub(c) for c in channels] or [admin]
            before = await _counters(counted)
            await asyncio.sleep(interval)
            after = await _counters(counted)
    except grpc.aio.AioRpcError as e:
        row["health"] = "down" if e.code() in _GONE else (f"error: {e.code().name}")
        return row
    finally:
        for c in channels:
            await c.close()
    # A worker that does not answer at its own port (it died, and is not restarted) is left out of
    # the sums and named; the others, and the shared port, keep serving.
    pairs = [(a, b) for a, b in zip(before, after, strict=True) if a is not None and b is not None]
    if not pairs:
        row["health"] = "down"
        return row
    if channels and len(pairs) < len(channels):  # one counted reply per worker, in the workers' order
        row["workers_not_answering"] = [
            w["index"] for w, a, b in zip(row["workers"], before, after, strict=True) if a is None or b is None
        ]
    first, second = [a for a, _ in pairs], [b for _, b in pairs]
    total = _sum(second)
    row.update(
        pid=server.pid,
        worker=server.worker,
        metrics_address=server.metrics_address,
        uptime_seconds=round(server.uptime_seconds, 1),
        in_flight=total.in_flight,
        calls_per_second=round(
            sum(
                (b.calls_total - a.calls_total) / max(b.uptime_seconds - a.uptime_seconds, 1e-9)
                for a, b in zip(first, second, strict=True)
            ),
            1,
        ),
        calls_total=total.calls_total,
        retries=dict(total.retries),
        non_monotonic_histories=dict(total.non_monotonic_histories),
        turns_caught_by_update=dict(total.turns_caught_by_update),
        sessions_open=total.sessions_open,
        sessions_not_closed=total.sessions_not_closed,
        sandboxes=dict(total.sandboxes),
        sandbox_start_failures=total.sandbox_start_failures,
        engines=[_engine_row(load) for load in second[0].engines],  # the engines' own load, the same for each
        version=server.version,
        config_hash=server.config_hash,
        profiling=server.profiling,
        open_files=server.open_files,
        open_files_limit=server.open_files_limit,
    )
    return row


async def _counters(stubs: list[admin_grpc.AdminServiceStub]) -> list[admin_pb.GetCountersResponse | None]:
    """Each stub's GetCounters; None for one that is not there (UNAVAILABLE, DEADLINE_EXCEEDED)."""

    async def one(stub: admin_grpc.AdminServiceStub) -> admin_pb.GetCountersResponse | None:
        try:
            return await stub.GetCounters(admin_pb.GetCountersRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as e:
            if e.code() in _GONE:
                return None
            raise

    return list(await asyncio.gather(*map(one, stubs)))


def _sum(replies: list[admin_pb.GetCountersResponse]) -> admin_pb.GetCountersResponse:
    """The workers' counters added up (the figures `status` shows; stages and engines left out)."""
    total = admin_pb.GetCountersResponse()
    for reply in replies:
        total.in_flight += reply.in_flight
        total.calls_total += reply.calls_total
        total.sessions_open += reply.sessions_open
        total.sessions_not_closed += reply.sessions_not_closed
        total.sandbox_start_failures += reply.sandbox_start_failures
        for field in ("retries", "non_monotonic_histories", "turns_caught_by_update", "sandboxes"):
            into = getattr(total, field)
            for key, value in getattr(reply, field).items():
                into[key] += value
    return total


def _engine_row(load: admin_pb.EngineLoad) -> dict[str, Any]:
    if load.error:
        return {"url": load.url, "error": load.error}
    return {
        "url": load.url,
        "kv_cache_usage": round(load.kv_cache_usage, 4),
        "requests_running": load.requests_running,
        "requests_waiting": load.requests_waiting,
        "preemptions_total": load.preemptions_total,
    }


def _engine_line(engine: dict[str, Any]) -> str:
    """One engine of a model server, under its row: its load as the engine reports it."""
    if "error" in engine:
        return f"  engine {engine['url']}: load not read: {engine['error']}"
    return (
        f"  engine {engine['url']}: KV cache {100 * engine['kv_cache_usage']:.0f}% used, "
        f"{engine['requests_running']} running, {engine['requests_waiting']} waiting, "
        f"{engine['preemptions_total']} preemptions since it started"
    )


async def status(registry: Registry, interval: float = 1.0) -> list[dict[str, Any]]:
    """One row per address of every registered server: health, its worker processes (pid, own
    port, metrics address) as the registry lists them; in flight, calls/s, the retries of
    requests to engines by failure class and the sessions, added up over its workers; and from
    the worker that answered (`worker`, `pid`): uptime, open files, and a model server's
    engines' load (`engines`)."""
    servers = await registry.list()
    return list(await asyncio.gather(*(_one(s, a, interval, registry.security) for s in servers for a in s.addresses)))


def format_status(rows: list[dict[str, Any]]) -> str:
    header = f"{'server':<22} {'role':<10} {'address':<22} {'health':<12} {'pid':>7} {'uptime':>9} "
    header += f"{'in flight':>9} {'calls/s':>9} {'retries':>8} {'open files':>16}"
    lines = [header]
    for row in rows:
        if "pid" in row:
            files = f"{row['open_files']} of {row['open_files_limit'] or 'any'}"
            tail = (
                f"{row['pid']:>7} {row['uptime_seconds']:>8.0f}s {row['in_flight']:>9} {row['calls_per_second']:>9.1f}"
                f" {sum(row['retries'].values()):>8} {files:>16}"
            )
        else:
            tail = f"{'-':>7} {'-':>9} {'-':>9} {'-':>9} {'-':>8} {'-':>16}"
        lines.append(f"{row['name']:<22} {row['role']:<10} {row['address']:<22} {row['health']:<12} {tail}")
        workers = row.get("workers", [])
        if len(workers) > 1 or any(w["metrics_address"] for w in workers):
            lines.extend(_worker_line(worker, row) for worker in workers)
        lines.extend(_engine_line(engine) for engine in row.get("engines", []))
    return "\n".join(lines)


def _worker_line(worker: dict[str, Any], row: dict[str, Any]) -> str:
    """One worker process of a server, under its row: pid, its own port (where its sessions are
    called), metrics endpoint, restarts, whether it answered."""
    text = f"  worker {worker['index']}: pid {worker['pid']}"
    if worker["address"]:
        text += f", own port {worker['address']}"
    if worker["metrics_address"]:
        text += f", metrics http://{worker['metrics_address']}{metrics.PATH}"
    if worker["restarts"]:
        text += f", restarted {worker['restarts']}x"
    if "pid" in row and row["worker"] == worker["index"]:
        text += " (answered; its pid, uptime and open files are above)"
    if worker["index"] in row.get("workers_not_answering", ()):
        text += " (not answering at its own port: left out of the figures above)"
    return text


async def profiles(registry: Registry, names: list[str], limit: int) -> list[tuple[str, str, str]]:
    """(server, address, profile table or why there is none) for the named servers (all when none)."""
    servers = [s for s in await registry.list() if not names or s.name in names]
    unknown = sorted(set(names) - {s.name for s in servers})
    found = [(name, "-", "no such server") for name in unknown]
    for server in servers:
        for address in server.addresses:
            async with transport.open_channel(address, security=registry.security) as channel:
                try:
                    reply = await admin_grpc.AdminServiceStub(channel).GetProfile(
                        admin_pb.GetProfileRequest(limit=limit), timeout=10.0
                    )
                except grpc.aio.AioRpcError as e:
                    found.append((server.name, address, f"unreachable: {e.code().name}"))
                    continue
            text = reply.table if reply.enabled else "profiling is off (run with profiling_enabled=true)"
            found.append((server.name, address, text))
    return found
