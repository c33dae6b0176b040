"""Math with a real checker: the final answer is compared with math-verify.

The task gives `expected_answer` (a number or LaTeX). The model's last
message is parsed by math-verify (\\boxed{} first, then any expression) and
checked for mathematical equivalence, so 7/8, 0.875 and \\frac{7}{8} all
count. Parsing and checking are CPU work: they run in a CpuPool (worker
processes, or Ray with `ray_address`), never on the event loop, with
math-verify's own timeouts.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from gym_grpc import errors
from gym_grpc.cpu_pool import CpuPool, CpuPoolConfig
from gym_grpc.resources import ResourcesServer, Session, Verification
from gym_grpc.responses import final_text
from gym_grpc.v1 import responses_pb2 as r

#: Parsed expected answers, by (expected, timeout): a GRPO group checks the same answer once per
#: rollout, and parsing it is about a third of a check. Per checking process; bounded.
_GOLD: dict[tuple[str, int], list[Any]] = {}
_GOLD_MAX = 4096


def _gold(expected: str, timeout_seconds: int) -> list[Any]:
    from math_verify import parse

    key = (expected, timeout_seconds)
    gold = _GOLD.get(key)
    if gold is None:
        gold = parse(
            expected if "$" in expected or "\\" in expected else f"${expected}$", parsing_timeout=timeout_seconds
        )
        if gold:  # nothing parsed (maybe a time-out on a busy machine) is not kept: the next check tries again
            if len(_GOLD) >= _GOLD_MAX:
                _GOLD.pop(next(iter(_GOLD)))
            _GOLD[key] = gold
    return gold


def check_answer(expected: str, text: str, timeout_seconds: int) -> tuple[bool, str]:
    """Whether `text` states `expected`, and what answer was extracted from it."""
    from math_verify import parse, verify

    gold = _gold(expected, timeout_seconds)
    answer = parse(text, parsing_timeout=timeout_seconds)
    extracted = str(answer[1]) if len(answer) > 1 else (str(answer[0]) if answer else "")
    return bool(verify(gold, answer, timeout_seconds=timeout_seconds)), extracted


class MathConfig(CpuPoolConfig):
    timeout_seconds: int = Field(5, ge=1, description="math-verify's parse and verify timeout")


class MathEnv(ResourcesServer):
    Config = MathConfig
    config: MathConfig
    verifier_fields = {"extracted_answer": "the answer math-verify read from the final message ('' when none)"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pool = CpuPool.from_config(self.name, self.config)

    async def start(self) -> None:
        await self.pool.start()
        await self._check("1", "1")  # start a worker and import math-verify before the first rollout

    async def stop(self) -> None:
        self.pool.close()
        await super().stop()

    async def _check(self, expected: str, text: str) -> tuple[bool, str]:
        return await self.pool.run(check_answer, expected, text, self.config.timeout_seconds)

    async def verify(self, session: Session, response: r.Response) -> Verification:
        if "expected_answer" not in session.data:
            raise errors.TaskDataError("expected_answer", "is required")
        correct, extracted = await self._check(str(session.data["expected_answer"]), final_text(response))
        return Verification(reward=1.0 if correct else 0.0, fields={"extracted_answer": extracted})
