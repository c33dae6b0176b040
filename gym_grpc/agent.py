"""The agent role: a server that runs rollouts."""

from __future__ import annotations

from typing import Any

import grpc

from gym_grpc import errors
from gym_grpc.serving import GymServer, rpc_method
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import task_pb2


class AgentServer(GymServer):
    """Base of an agent. Implement run; reach other servers through self.registry."""

    role = reg.SERVER_ROLE_AGENT

    async def run(self, task: task_pb2.Task) -> task_pb2.Rollout:
        """Roll the task out to the end and return it verified."""
        raise NotImplementedError(f"{type(self).__name__} must implement run")

    def add_services(self, server: grpc.aio.Server) -> list[str]:
        agent_grpc.add_AgentServiceServicer_to_server(_AgentServicer(self), server)
        return [agent_pb.DESCRIPTOR.services_by_name["AgentService"].full_name]


class _AgentServicer(agent_grpc.AgentServiceServicer):
    def __init__(self, app: AgentServer) -> None:
        self.app = app

    @rpc_method
    async def Run(self, request: agent_pb.RunRequest, context: Any) -> agent_pb.RunResponse:
        if request.task.responses_create_params.WhichOneof("input") is None:
            raise errors.InvalidArgument(
                "task.responses_create_params.input is required", field="task.responses_create_params.input"
            )
        return agent_pb.RunResponse(rollout=await self.app.run(request.task))
