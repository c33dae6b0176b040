"""A resources server whose start never ends, for the tests of a run stopped while its servers start
(entrypoint `tests/programs/hanging_env.py:HangingEnv`): a model that loads for minutes, an engine
that does not answer. It creates `started_file` once its start has begun, so that a test knows its
process is past its own set-up (its signal handlers installed) and waiting in the start, and
`cancelled_file` (when given) if its start is cancelled, as a server's clean-up of what its start
began would run."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pydantic import Field

from gym_grpc.resources import ResourcesConfig, ResourcesServer, Session
from gym_grpc.v1 import responses_pb2 as r


class HangingConfig(ResourcesConfig):
    started_file: str = Field(description="created once the start has begun")
    cancelled_file: str = Field("", description="created if the start is cancelled")


class HangingEnv(ResourcesServer):
    Config = HangingConfig
    config: HangingConfig

    async def start(self) -> None:
        Path(self.config.started_file).touch()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if self.config.cancelled_file:
                Path(self.config.cancelled_file).touch()
            raise

    async def verify(self, session: Session, response: r.Response) -> float:
        return 0.0
