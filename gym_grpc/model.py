"""The model role: a server that answers Responses create calls."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from gym_grpc import errors
from gym_grpc.images import ImageStore
from gym_grpc.policy_version import ServedVersion
from gym_grpc.rpc import transport
from gym_grpc.server import validation
from gym_grpc.server.serving import GymServer, rpc_method
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import model_service_pb2_grpc as model_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import responses_pb2 as r

log = logging.getLogger(__name__)

#: How long UpdateWeights may take when its call has no deadline.
UPDATE_TIMEOUT_SECONDS = 300.0
#: Of a deadline UpdateWeights is called with, what is kept (at most a fifth) to resume and answer.
REPLY_RESERVE_SECONDS = 2.0


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
        #: The images sessions sent, so that a later call may name them by hash (gym_grpc/images.py).
        self.images = ImageStore()

    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        """One model call: the response to the conversation in `params`."""
        raise NotImplementedError(f"{type(self).__name__} must implement create_response")

    async def update_weights(
        self, request: model_pb.UpdateWeightsRequest, timeout: float
    ) -> list[model_pb.EngineUpdate]:
        """Load the request's weights into the engines, within `timeout` seconds, and serve its
        version: `self.served_version.set(request.version)` once every engine holds them and before
        any resumes. Called one update at a time (across the server's worker processes too), and
        only for a version newer than the one served. Each engine's part, in order."""
        raise errors.WeightUpdateUnsupported(
            f"{type(self).__name__} cannot load weights into an engine: update the engine yourself and tell "
            "the server its version with SetPolicyVersion"
        )

    async def _update(self, request: model_pb.UpdateWeightsRequest, timeout: float) -> model_pb.UpdateWeightsResponse:
        start = time.monotonic()
        async with self.served_version.exclusive():
            served = self.served_version.get()
            answer = model_pb.UpdateWeightsResponse(previous=served)
            if served is not None and request.version < served:
                raise errors.FailedPrecondition(
                    f"the server serves policy version {served}: an update to the older version {request.version} "
                    "is refused (a trainer that went back to an older checkpoint says so with SetPolicyVersion)",
                    field="version",
                    reason=errors.Reason.POLICY_VERSION_BEHIND,
                    metadata={"served": str(served)},
                )
            if served == request.version:
                return answer  # a retried update: done already
            left = timeout - (time.monotonic() - start)
            answer.engines.extend(await self.update_weights(request, left))
            if self.served_version.get() != request.version:
                raise AssertionError(f"{type(self).__name__}.update_weights did not serve version {request.version}")
        answer.updated = True
        answer.seconds = time.monotonic() - start
        return answer

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
        self.app.images.resolve(request.params, request.session_id)  # create_response sees every image's bytes
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

    @rpc_method
    async def UpdateWeights(
        self, request: model_pb.UpdateWeightsRequest, context: Any
    ) -> model_pb.UpdateWeightsResponse:
        if not request.checkpoint_path:
            raise errors.InvalidArgument("say where the weights are (checkpoint_path)", field="checkpoint_path")
        if request.pause_mode not in model_pb.PauseMode.values():
            raise errors.InvalidArgument(f"pause_mode {request.pause_mode} is unknown here", field="pause_mode")
        left = transport.timeout_for(None)
        # Kept from the caller's deadline: the resumes and the answer, so that the caller hears which
        # engine did not follow rather than its own deadline.
        timeout = UPDATE_TIMEOUT_SECONDS if left is None else left - min(REPLY_RESERVE_SECONDS, left / 5)
        # Shielded: a caller that goes away (a trainer that died) does not leave the engines paused.
        update = asyncio.ensure_future(self.app._update(request, timeout))
        try:
            return await asyncio.shield(update)
        except asyncio.CancelledError:
            update.add_done_callback(_log_unheard)
            raise


def _stamp(response: r.Response, version: int) -> None:
    """Set `version` on the turn's last item the model wrote (the one that carries its token ids),
    unless the model server set one from what its engine said."""
    for item in reversed(response.output):
        kind = item.WhichOneof("item")
        if kind in _MODEL_ITEMS:
            inner = getattr(item, kind)
            if not inner.HasField("policy_version"):
                inner.policy_version = version
            return


#: The items a model writes, which have a policy_version.
_MODEL_ITEMS = frozenset({"message", "reasoning", "function_call", "custom_tool_call"})


def _log_unheard(update: asyncio.Future[model_pb.UpdateWeightsResponse]) -> None:
    """What became of an update whose caller had gone (its result would be lost otherwise)."""
    if not update.cancelled() and update.exception() is not None:
        log.warning("weight update (its caller gone) failed: %s", update.exception())
    elif not update.cancelled():
        log.info("weight update (its caller gone) done in %.1f s", update.result().seconds)
