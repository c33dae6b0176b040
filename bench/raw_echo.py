"""The raw gRPC limit: grpc.aio unary round trips with an empty handler.

    python bench/raw_echo.py server PORT_FILE [PAYLOAD]    # serves until killed
    python bench/raw_echo.py client ADDRESS CALLS IN_FLIGHT [PAYLOAD]

PAYLOAD "rollout" (the default) is rollout-sized: a 2 KB text with 512 token
ids and 512 log-probs, in gym.v1 messages, both ways. "small" is one short
message both ways (about 60 bytes on the wire), the size of most calls of a
single-tool-call rollout. The handler returns a prebuilt response and
does nothing else; no gym-grpc code runs on either side, only the stubs and
the transport options. The client prints {"calls": N, "seconds": S, "errors": E}.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc

from gym_grpc.rpc import transport
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import model_service_pb2_grpc as model_grpc
from gym_grpc.v1 import responses_pb2 as r


def payload(kind: str = "rollout") -> r.Response:
    if kind == "small":
        text = r.ContentList(items=[r.ContentPart(output_text=r.OutputText(text="It is 21 C in Paris."))])
        message = r.Message(role=r.ROLE_ASSISTANT, parts=text)
        return r.Response(id="resp_bench", output=[r.Item(message=message)], status=r.RESPONSE_STATUS_COMPLETED)
    item = r.Item(
        message=r.Message(
            role=r.ROLE_ASSISTANT,
            parts=r.ContentList(items=[r.ContentPart(output_text=r.OutputText(text="x" * 2048))]),
            prompt_token_ids=list(range(512)),
            generation_token_ids=list(range(512)),
            generation_log_probs=[-0.5] * 512,
        )
    )
    return r.Response(id="resp_bench", output=[item], status=r.RESPONSE_STATUS_COMPLETED)


class Echo(model_grpc.ModelServiceServicer):
    def __init__(self, kind: str) -> None:
        self.reply = model_pb.CreateResponseResponse(response=payload(kind))

    async def CreateResponse(self, request, context):
        return self.reply


async def serve(port_file: str, kind: str) -> None:
    server = grpc.aio.server(options=transport.server_options())
    model_grpc.add_ModelServiceServicer_to_server(Echo(kind), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    with open(port_file, "w") as f:
        f.write(str(port))
    await server.wait_for_termination()


async def client(address: str, calls: int, in_flight: int, kind: str) -> None:
    request = model_pb.CreateResponseRequest(params=r.CreateParams(input_items=r.ItemList(items=payload(kind).output)))
    async with transport.open_channel(address) as channel:
        stub = model_grpc.ModelServiceStub(channel)
        await stub.CreateResponse(request)  # connect before timing
        errors = 0
        remaining = calls

        async def worker() -> None:
            nonlocal errors, remaining
            while remaining > 0:
                remaining -= 1
                try:
                    await stub.CreateResponse(request, timeout=60)
                except grpc.aio.AioRpcError:
                    errors += 1

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(in_flight)))
        seconds = time.perf_counter() - began
    print(json.dumps({"calls": calls, "seconds": seconds, "errors": errors}))


if __name__ == "__main__":
    if sys.argv[1] == "server":
        asyncio.run(serve(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "rollout"))
    else:
        asyncio.run(
            client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "rollout")
        )
