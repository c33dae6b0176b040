"""A client that sends many runs on one RunMany call and never reads a result: for the test that an
agent stops reading a call it cannot answer into (tests/test_hostile_clients.py).

    python -m tests.programs.unread_run_many HOST:PORT RUNS

Sends RUNS weather runs, 500 a message, printing how many it has sent after each message, then
waits to be killed. A write that gRPC's flow control holds up blocks it, as it would any client.
"""

from __future__ import annotations

import asyncio
import json
import sys

import grpc

from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from gym_grpc.v1 import task_pb2

PER_MESSAGE = 500


async def main(address: str, runs: int) -> None:
    row = {"responses_create_params": {"input": "What is the weather in Oslo?"}, "expected_city": "Oslo"}
    task = task_pb2.Task(data_json=json.dumps({"expected_city": "Oslo"}))
    task.responses_create_params.input_text = row["responses_create_params"]["input"]
    async with grpc.aio.insecure_channel(address) as channel:
        call = agent_grpc.AgentServiceStub(channel).RunMany()
        sent = 0
        while sent < runs:
            items = [agent_pb.RunManyItem(id=sent + i, run=agent_pb.RunRequest(task=task)) for i in range(PER_MESSAGE)]
            await call.write(agent_pb.RunManyRequest(runs=items))
            sent += PER_MESSAGE
            print(sent, flush=True)
        await asyncio.Event().wait()  # read nothing, ever


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
