"""The model role: a server that answers Responses create calls."""

from __future__ import annotations

from typing import Any

import grpc

from gym_grpc.policy_version import ServedVersion
from gym_grpc.server import validation
from gym_grpc.server.serving import GymServer, rpc_method
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import model_service_pb2_grpc as model_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import responses_pb2 as r


class ModelServer(GymServer):
    """Base of a model server. Implement create_response.

    Every turn it answers is stamped with a policy version when there is one
    (gym_grpc/policy_version.py): the version a trainer told it with
    SetPolicyVersion, else the one the rollout was asked under."""

    role = reg.SERVER_ROLE_MODEL
    #: The version the engine serves, as the trainer told it (shared by the workers of one server).
    served_version: ServedVersion

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.served_version = ServedVersion()

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
        version = self.app.served_version.get()
        if version is None and request.HasField("policy_version"):
            version = request.policy_version
        if version is not None:
            _stamp(response, version)
        return model_pb.CreateResponseResponse(response=response)

    @rpc_method
    async def SetPolicyVersion(
        self, request: model_pb.SetPolicyVersionRequest, context: Any
    ) -> model_pb.SetPolicyVersionResponse:
        previous = self.app.served_version.set(request.version)
        return model_pb.SetPolicyVersionResponse(previous=previous)


def _stamp(response: r.Response, version: int) -> None:
    """Set `version` on the turn's last item the model wrote (the one that carries its token ids)."""
    for item in reversed(response.output):
        kind = item.WhichOneof("item")
        if kind in _MODEL_ITEMS:
            getattr(item, kind).policy_version = version
            return


#: The items a model writes, which have a policy_version.
_MODEL_ITEMS = frozenset({"message", "reasoning", "function_call", "custom_tool_call"})
