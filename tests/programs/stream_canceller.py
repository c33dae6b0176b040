"""A client that gives up on streaming calls: run as its own process by the tests.

    python -m tests.programs.stream_canceller AGENT_ADDRESS TASKS_JSONL COUNT SEED [RunStream|RunMany]

Opens COUNT RunStream calls (50 at a time), or RunMany calls carrying one to
four runs each, each either cancelled by the client at a random moment
(0-300 ms) or given a random deadline (1 ms to 2 s); on a RunMany call, one
run in three is also cancelled by id first. Then makes one Run that must
succeed. Prints a JSON line: how the calls ended.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import random
import sys

import grpc

from gym_grpc.data import rows
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc


async def main(address: str, tasks: str, count: int, seed: int, method: str) -> None:
    rng = random.Random(seed)
    with open(tasks) as f:
        task_rows = [rows.task_from_row(json.loads(line)) for line in f if line.strip()]
    ended: collections.Counter[str] = collections.Counter()
    window = asyncio.Semaphore(50)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = agent_grpc.AgentServiceStub(channel)

        async def one() -> None:
            task = rng.choice(task_rows)
            by_deadline = rng.random() < 0.5
            timeout = math.exp(rng.uniform(math.log(0.001), math.log(2.0))) if by_deadline else None
            async with window:
                if method == "RunStream":
                    call = stub.RunStream(agent_pb.RunStreamRequest(task=task), timeout=timeout)

                    async def read() -> int:
                        return len([event async for event in call])

                else:
                    call = stub.RunMany(timeout=timeout)
                    runs = [
                        agent_pb.RunManyItem(id=i, run=agent_pb.RunRequest(task=rng.choice(task_rows)))
                        for i in range(rng.randint(1, 4))
                    ]
                    cancelled = [run.id for run in runs if rng.random() < 1 / 3]

                    async def send() -> None:
                        await call.write(agent_pb.RunManyRequest(runs=runs))
                        await call.write(agent_pb.RunManyRequest(cancel_ids=cancelled))

                    async def read() -> int:
                        # Written from a task of its own, as grpc.aio's write can wait forever for
                        # a call that ended before its headers went out; ended with the call.
                        sender = asyncio.ensure_future(send())
                        sender.add_done_callback(lambda done: done.cancelled() or done.exception())
                        try:
                            return len([reply async for reply in call])
                        finally:
                            sender.cancel()

                reader = asyncio.ensure_future(read())
                if not by_deadline:
                    await asyncio.sleep(rng.uniform(0.0, 0.3))
                    call.cancel()
                try:
                    await reader
                    ended["completed"] += 1
                except asyncio.CancelledError:
                    ended["CANCELLED"] += 1
                except grpc.aio.AioRpcError as e:
                    ended[e.code().name] += 1

        await asyncio.gather(*(one() for _ in range(count)))
        reply = await stub.Run(agent_pb.RunRequest(task=task_rows[0]), timeout=30)
        ended["final_run_ok"] = int(reply.rollout.response.status != 0)
    print(json.dumps(dict(ended)), flush=True)


if __name__ == "__main__":
    method = sys.argv[5] if len(sys.argv) > 5 else "RunStream"
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), method))
