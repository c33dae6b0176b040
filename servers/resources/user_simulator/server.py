"""A support desk with a simulated user: a second model plays the customer (docs/episodes.md).

    servers:
      support_desk:
        entrypoint: server.py:SupportDeskEnv
        config: {max_rounds: 4, stop_phrase: "###STOP###"}

An episode with two roles. The **assistant** is the policy being trained:
its conversation opens with the task's input (its instructions and the
`order_status` tool). The **user** is a simulator, played by another model
server (or the same one): its conversation opens with the row's
`user_instructions` as a system message, it is offered no tools, and what
each side says is shown to the other as a user message.

- The row's `user_first_message`, when given, opens the conversation as the
  user's (it is in the user's opening as its own message); otherwise the user
  speaks first.
- The user ends the conversation by saying `stop_phrase`; the episode also
  ends after `max_rounds` answers of the assistant.
- The tool `order_status(order_id)` reads the row's `orders` ({id: status}).
- Verify, from the session: the assistant's reward is 1 when one of its
  answers holds the row's `expected_answer` (case and spacing ignored); the
  user's is 1 when it ended the conversation itself (a simulator that
  follows its instructions). The episode's reward is the assistant's.
  Fields: `rounds`, `user_ended`, `told`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field

from gym_grpc import errors
from gym_grpc.resources import Episode, ResourcesConfig, ResourcesServer, Role, Session, Turn, Verification, tool
from gym_grpc.responses import assistant_message, final_text
from gym_grpc.v1 import responses_pb2 as r

USER, ASSISTANT = "user", "assistant"


class SupportDeskConfig(ResourcesConfig):
    max_rounds: int = Field(4, ge=1, description="the episode ends after this many answers of the assistant")
    stop_phrase: str = Field("###STOP###", min_length=1, description="the user says it to end the conversation")


@dataclass
class _Talk:
    """One conversation: what each side said, in order."""

    said: list[tuple[str, str]] = field(default_factory=list)
    user_ended: bool = False

    def rounds(self) -> int:
        return sum(1 for who, _ in self.said if who == ASSISTANT)


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().casefold()


class SupportDeskEnv(ResourcesServer):
    verifier_fields = {
        "rounds": "answers the assistant gave",
        "user_ended": "the simulated user ended the conversation (said stop_phrase)",
        "told": "an answer of the assistant held expected_answer",
    }

    Config = SupportDeskConfig
    config: SupportDeskConfig

    async def seed_session(self, session: Session) -> Episode:
        data = session.data
        instructions = data.get("user_instructions")
        if not isinstance(instructions, str) or not instructions.strip():
            raise errors.TaskDataError("user_instructions", "is required: what the simulated user wants, as text")
        if not isinstance(data.get("expected_answer"), str):
            raise errors.TaskDataError("expected_answer", "is required: what the assistant must tell the user")
        opening = [r.Item(message=r.Message(role=r.ROLE_SYSTEM, text=instructions))]
        first = data.get("user_first_message")
        talk = session.state["talk"] = _Talk()
        user = Role(USER, opening=opening, tools=False)
        if isinstance(first, str) and first:
            opening.append(assistant_message(first))  # the user's own first message, in its conversation
            talk.said.append((USER, first))
            return Episode([user, Role(ASSISTANT)], Turn(ASSISTANT, first))
        return Episode([user, Role(ASSISTANT)], Turn(USER, "Write your first message to the assistant."))

    async def end_turn(self, session: Session, role: str, response: r.Response) -> Turn | None:
        talk: _Talk = session.state["talk"]
        text = final_text(response)
        talk.said.append((role, text))
        if role == USER:
            if self.config.stop_phrase in text:
                talk.user_ended = True
                return None
            return Turn(ASSISTANT, text)
        if talk.rounds() >= self.config.max_rounds:
            return None
        return Turn(USER, text)

    @tool
    async def order_status(
        self, order_id: Annotated[str, Field(description="The order's id, e.g. 'A1042'.")], session: Session
    ) -> str:
        """Look an order up by its id: its status and delivery date."""
        orders = session.data.get("orders") or {}
        status = orders.get(order_id.strip()) if isinstance(orders, dict) else None
        if status is None:
            raise errors.ToolFailed(f"no order {order_id!r}")
        return f"Order {order_id.strip()}: {status}"

    async def verify(self, session: Session, response: r.Response) -> Verification:
        talk = session.state.get("talk")
        if not isinstance(talk, _Talk):
            raise errors.FailedPrecondition(
                f"session {session.id!r} is not open: a support desk conversation is scored from its session",
                field="session_id",
            )
        expected = _squash(str(session.data.get("expected_answer", "")))
        told = bool(expected) and any(who == ASSISTANT and expected in _squash(text) for who, text in talk.said)
        return Verification(
            reward=float(told),
            role_rewards={ASSISTANT: float(told), USER: float(talk.user_ended)},
            fields={"rounds": talk.rounds(), "user_ended": talk.user_ended, "told": told},
        )
