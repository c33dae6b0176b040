"""The model role: a server that answers Responses create calls."""

from __future__ import annotations

from typing import Any

import grpc

from gym_grpc.server import validation
from gym_grpc.server.serving import GymServer, rpc_method
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import model_service_pb2_grpc as model_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import responses_pb2 as r


class ModelServer(GymServer):
    """Base of a model server. Implement create_response."""

    role = reg.SERVER_ROLE_MODEL

    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        """One model call: the response to the conversation in `params`."""
        raise NotImplementedError(f"{type(self).__name__} must implement create_response")

    def add_services(self, server: grpc.aio.Server) -> list[str]:
        model_grpc.add_ModelServiceServicer_to_server(_ModelServicer(self), server)
        return [model_pb.DESCRIPTOR.services_by_name["ModelService"].full_name]


class _ModelServicer(model_grpc.ModelServiceServicer):
    def __init__(self, app: ModelServer) -> None:
        self.app = app

    @rpc_method
    async def CreateResponse(
        self, request: model_pb.CreateResponseRequest, context: Any
    ) -> model_pb.CreateResponseResponse:
        validation.check_params(request.params, "params")
        response = await self.app.create_response(request.params, request.session_id)
        return model_pb.CreateResponseResponse(response=response)
