"""An environment whose verify does no work, to measure everything else."""

from __future__ import annotations

from gym_grpc.resources import ResourcesServer, Session
from gym_grpc.v1 import responses_pb2 as r


class TrivialEnv(ResourcesServer):
    async def verify(self, session: Session, response: r.Response) -> float:
        return 1.0
