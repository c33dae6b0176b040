"""A weight update of a model server's engines (ModelService.UpdateWeights), over vLLM's RL control API.

vLLM serves the API only when started with `VLLM_SERVER_DEV_MODE=1` (`gym-grpc engine start`
does). Each engine, all at once:

    POST /pause?mode=keep|abort|wait    new requests wait; the ones in flight are frozen, aborted
                                        (answered with finish_reason "abort") or finished first
    POST /collective_rpc                the worker's reload_weights(weights_path=...): the
                                        checkpoint loaded in place (~1 s for SmolLM2-135M on CPU)
    POST /update_weight_version         the label vLLM puts on every token sampled from then on
                                        (its `weight_versions` spans): the version, as text

then, once every engine holds the weights, the model server serves the version, and every engine
paused is resumed (`POST /resume`) whatever happened, so that a failed or abandoned update never
leaves an engine paused. A failure names each engine and the step it failed at.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import aiohttp

from gym_grpc import errors
from gym_grpc.engines.http import Engine
from gym_grpc.v1 import model_service_pb2 as model_pb

#: vLLM's pause modes, by the protocol's.
PAUSE_MODES = {
    model_pb.PAUSE_MODE_UNSPECIFIED: "keep",
    model_pb.PAUSE_MODE_KEEP: "keep",
    model_pb.PAUSE_MODE_ABORT: "abort",
    model_pb.PAUSE_MODE_WAIT: "wait",
}
#: How long a resume may take, past the update's own deadline (an engine left paused serves nothing).
RESUME_SECONDS = 30.0


@dataclasses.dataclass
class _Progress:
    """One engine's part of an update: the step it is at, and what it took."""

    engine: Engine
    step: str = "pause"
    paused: bool = False
    update: model_pb.EngineUpdate = dataclasses.field(default_factory=model_pb.EngineUpdate)
    error: str | None = None


async def update(
    engines: list[Engine], version: int, checkpoint: str, mode: str, serve: Callable[[], object], timeout: float
) -> list[model_pb.EngineUpdate]:
    """Load `checkpoint` into every engine as `version` (pausing them in `mode`), call `serve` once all
    hold it, resume them all; within `timeout` seconds (the resumes have RESUME_SECONDS more)."""
    progress = [_Progress(e, update=model_pb.EngineUpdate(engine=e.base_url)) for e in engines]
    try:
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(_load(p, version, checkpoint, mode) for p in progress))
        except TimeoutError:
            late = [p for p in progress if p.error is None and p.step != "done"]
            for p in late:
                p.error = _late(timeout)
        failed = [p for p in progress if p.error is not None]
        if not failed:
            serve()  # before the resumes: what they generate from now on is this version
    finally:
        resumed = await asyncio.gather(*(_resume(p) for p in progress if p.paused))
    unresumed = [problem for problem in resumed if problem]
    if failed:
        what = "; ".join(f"engine {p.engine.base_url} at {p.step}: {p.error}" for p in failed)
        after = f"; and not resumed: {'; '.join(unresumed)}" if unresumed else "; every engine paused for it resumed"
        message = f"weight update to version {version} failed: {what}{after}"
        if all(p.step != "done" and p.error == _late(timeout) for p in failed):
            raise errors.DeadlineExceeded(message)
        raise errors.WeightUpdateFailed(message)
    if unresumed:
        raise errors.WeightUpdateFailed(f"weights of version {version} loaded, but not resumed: {'; '.join(unresumed)}")
    return [p.update for p in progress]


async def _load(p: _Progress, version: int, checkpoint: str, mode: str) -> None:
    try:
        start = time.monotonic()
        p.paused = True  # from the moment it is asked: an answer lost on the way still paused it
        await p.engine.control("/pause", mode=mode)
        p.update.pause_seconds = time.monotonic() - start
        p.step = "load"
        start = time.monotonic()
        await p.engine.control("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": checkpoint}})
        p.update.load_seconds = time.monotonic() - start
        p.step = "label"
        await p.engine.control("/update_weight_version", {"new_version": str(version)})
        p.step = "done"
    except (errors.GymError, aiohttp.ClientError, OSError) as e:
        p.error = _cause(e)


async def _resume(p: _Progress) -> str | None:
    """Resume a paused engine; what went wrong, or None."""
    try:
        async with asyncio.timeout(RESUME_SECONDS):
            await p.engine.control("/resume")
    except TimeoutError:
        return f"engine {p.engine.base_url}: no answer to /resume within {RESUME_SECONDS:g} s"
    except (errors.GymError, aiohttp.ClientError, OSError) as e:
        return f"engine {p.engine.base_url}: {_cause(e)}"
    return None


def _late(timeout: float) -> str:
    return f"no answer within {timeout:g} s"


def _cause(error: Exception) -> str:
    if isinstance(error, errors.GymError):
        return error.message
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
