"""A resources server that crashes as it starts while its crash file says so, for the
tests of `gym-grpc run` (entrypoint `tests/programs/crashing_env.py:CrashingEnv`).

`crash_file` holds how many more starts crash; a start that finds a positive count
writes it back one lower, logs a line and dies with code 3 (`os._exit`: a crash,
not an error the worker could report). No file, or 0: it starts and serves.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pydantic import Field

from gym_grpc.resources import ResourcesConfig, ResourcesServer, Session
from gym_grpc.v1 import responses_pb2 as r


class CrashingConfig(ResourcesConfig):
    crash_file: str = Field(description="holds how many more starts crash")


class CrashingEnv(ResourcesServer):
    Config = CrashingConfig
    config: CrashingConfig

    async def start(self) -> None:
        path = Path(self.config.crash_file)
        left = int(path.read_text()) if path.exists() else 0
        if left > 0:
            path.write_text(str(left - 1))
            logging.getLogger("crashing_env").error("crashing on purpose, %d more crashes to come", left - 1)
            os._exit(3)

    async def verify(self, session: Session, response: r.Response) -> float:
        return 1.0
