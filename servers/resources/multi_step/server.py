"""Multi-step tool use: a customer-support refund, where each tool's output feeds the next call.

The customer writes in with their email and a complaint. The model has to
find the customer (find_user: email -> user_id), list their orders
(list_orders: user_id -> orders with ids, items, totals and status) and
issue the refund (refund_order: order id, amount, reason). The store is a
small fixed database in this module, so rollouts are reproducible.

The task names the refund it expects in `expected_order_id` and
`expected_amount` (a full refund is the order's total, a partial one the
price of the items that went wrong). Reward 1.0 when the model's LAST
refund_order call names that order and that amount (to the cent); 0.0
otherwise. The fields and reward components give partial credit for the
steps on the way: the customer found, their orders listed, the right order,
the right amount.

The tools are pure functions of the database: a refund is checked and
acknowledged, never applied, so no rollout can change what another sees and
the environment is stateless (agents skip SeedSession and CloseSession).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Annotated, Any

from pydantic import Field

from gym_grpc import errors
from gym_grpc.data import json_input
from gym_grpc.resources import ResourcesServer, Session, Verification, tool
from gym_grpc.responses import function_calls, function_outputs
from gym_grpc.v1 import responses_pb2 as r

CUSTOMERS: dict[str, dict[str, str]] = {
    "u_1001": {"name": "Alice Nguyen", "email": "alice.nguyen@example.com"},
    "u_1002": {"name": "Bernard Okafor", "email": "b.okafor@example.net"},
    "u_1003": {"name": "Chen Wei", "email": "chen.wei@example.org"},
    "u_1004": {"name": "Dana Kowalski", "email": "dana.k@example.com"},
    "u_1005": {"name": "Emilio Ruiz", "email": "emilio.ruiz@example.com"},
}


def _order(order_id: str, user_id: str, placed: str, status: str, *items: tuple[str, float, int]) -> dict[str, Any]:
    lines = [{"name": name, "unit_price": price, "quantity": quantity} for name, price, quantity in items]
    total_cents = sum(round(price * 100) * quantity for _, price, quantity in items)
    return {
        "order_id": order_id,
        "user_id": user_id,
        "placed": placed,
        "status": status,
        "items": lines,
        "total": total_cents / 100,
    }


ORDERS: dict[str, dict[str, Any]] = {
    o["order_id"]: o
    for o in [
        _order("ORD-20417", "u_1001", "2024-05-03", "delivered", ("Wireless headphones", 89.99, 1)),
        _order("ORD-20588", "u_1001", "2024-06-11", "delivered", ("USB-C charging cable", 12.49, 2)),
        _order("ORD-21003", "u_1001", "2024-07-20", "shipped", ("Aluminium laptop stand", 34.00, 1)),
        _order(
            "ORD-19876", "u_1002", "2024-04-18", "delivered", ("Phone case", 14.99, 2), ("Screen protector", 9.99, 1)
        ),
        _order("ORD-20950", "u_1002", "2024-07-02", "cancelled", ("Phone charger", 24.99, 1)),
        _order("ORD-18002", "u_1003", "2024-02-27", "delivered", ("Burr coffee grinder", 64.50, 1)),
        _order(
            "ORD-20111",
            "u_1003",
            "2024-05-29",
            "delivered",
            ("French press", 29.95, 1),
            ("Coffee beans, 1 kg", 18.00, 1),
        ),
        _order("ORD-20770", "u_1003", "2024-06-30", "refunded", ("Milk frother", 22.00, 1)),
        _order("ORD-20333", "u_1004", "2024-06-05", "delivered", ("Countertop blender", 119.00, 1)),
        _order("ORD-21150", "u_1004", "2024-07-24", "shipped", ("Blender replacement jug", 25.00, 1)),
        _order(
            "ORD-19555",
            "u_1005",
            "2024-04-02",
            "delivered",
            ("Paperback: The Left Hand of Darkness", 18.50, 2),
            ("Bookmark set", 6.00, 1),
        ),
    ]
}

#: Why an order in each status other than "delivered" cannot be refunded.
NOT_REFUNDABLE = {
    "shipped": "has not been delivered yet",
    "cancelled": "was cancelled and never charged",
    "refunded": "has already been refunded",
}


def _cents(amount: float) -> int:
    """The amount in whole cents. ValueError for one that is no finite number: the model's arguments
    are read liberally, so 1e999 is infinity and NaN is taken."""
    try:
        return round(amount * 100)
    except (OverflowError, ValueError):
        raise ValueError(f"amount must be a finite number, not {amount}") from None


def _order_id(order_id: str) -> str:
    return order_id.strip().upper()


def find_customer(email: str) -> tuple[str, dict[str, str]] | None:
    """The (user id, record) of the customer with this email, case and spaces ignored."""
    wanted = email.strip().lower()
    return next(((uid, c) for uid, c in CUSTOMERS.items() if c["email"] == wanted), None)


def _load(text: str) -> dict[str, Any]:
    """A JSON object, or {} for anything else (a tool's error output, broken arguments)."""
    try:
        value = json_input.loads(text)
    except (ValueError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}


def grade(response: r.Response, expected_order_id: str, expected_amount: float) -> Verification:
    """Score a rollout: the last refund_order call decides the reward; the steps before it earn partial credit."""
    expected_order = ORDERS.get(_order_id(expected_order_id))
    if expected_order is None:
        raise errors.TaskDataError("expected_order_id", f"{expected_order_id!r} is not an order of the store")
    owner = expected_order["user_id"]
    calls = function_calls(response)
    outputs = function_outputs(response)

    def answered(call: r.FunctionCall) -> dict[str, Any]:
        return _load(outputs.get(call.call_id, ""))

    found_user = any(c.name == "find_user" and answered(c).get("user_id") == owner for c in calls)
    listed_orders = any(
        c.name == "list_orders" and answered(c).get("user_id") == owner and "orders" in answered(c) for c in calls
    )
    refunds = [c for c in calls if c.name == "refund_order"]
    last = _load(refunds[-1].arguments) if refunds else {}
    order_id, amount = last.get("order_id"), last.get("amount")
    right_order = isinstance(order_id, str) and _order_id(order_id) == expected_order["order_id"]
    right_amount = False
    if isinstance(amount, int | float) and not isinstance(amount, bool):
        with contextlib.suppress(ValueError):  # no finite number: a wrong amount
            right_amount = _cents(amount) == _cents(expected_amount)
    refund_issued = bool(refunds) and answered(refunds[-1]).get("status") == "refund_issued"
    parts = {
        "found_user": found_user,
        "listed_orders": listed_orders,
        "right_order": right_order,
        "right_amount": right_amount,
    }
    return Verification(
        reward=1.0 if right_order and right_amount else 0.0,
        fields={**parts, "refund_issued": refund_issued, "refund_calls": len(refunds), "steps": len(calls)},
        components={name: float(done) for name, done in parts.items()},
    )


class CustomerSupportEnv(ResourcesServer):
    verifier_fields = {
        "found_user": "find_user returned the customer who owns the expected order",
        "listed_orders": "list_orders returned that customer's orders",
        "right_order": "the last refund_order call names the expected order",
        "right_amount": "and the expected amount, to the cent",
        "refund_issued": "the store acknowledged that last refund",
        "refund_calls": "refund_order calls made",
        "steps": "tool calls made",
    }

    @tool
    async def find_user(
        self, email: Annotated[str, Field(description="The customer's email address, e.g. 'jo@example.com'.")]
    ) -> str:
        """Look a customer up by email address; returns their user_id and name."""
        found = find_customer(email)
        if found is None:
            raise ValueError(f"no customer has the email {email.strip()!r}")
        user_id, customer = found
        return json.dumps({"user_id": user_id, **customer})

    @tool
    async def list_orders(
        self, user_id: Annotated[str, Field(description="The customer's user_id, as find_user returned it.")]
    ) -> str:
        """List a customer's orders: order_id, date placed, status, items and total (in USD)."""
        user_id = user_id.strip()
        if user_id not in CUSTOMERS:
            raise ValueError(f"no customer has the user_id {user_id!r}; find it with find_user")
        orders = [{k: v for k, v in o.items() if k != "user_id"} for o in ORDERS.values() if o["user_id"] == user_id]
        return json.dumps({"user_id": user_id, "orders": orders})

    @tool
    async def refund_order(
        self,
        order_id: Annotated[str, Field(description="The order to refund, e.g. 'ORD-10001'.")],
        amount: Annotated[float, Field(description="Amount to refund in USD: the total, or part of it.")],
        reason: Annotated[str, Field(description="Short reason for the refund, in the customer's words.")],
    ) -> str:
        """Refund all or part of a delivered order to the customer's original payment method."""
        order = ORDERS.get(_order_id(order_id))
        if order is None:
            raise ValueError(f"no order has the id {order_id.strip()!r}")
        if order["status"] in NOT_REFUNDABLE:
            raise ValueError(f"order {order['order_id']} {NOT_REFUNDABLE[order['status']]}")
        if _cents(amount) <= 0:
            raise ValueError("amount must be positive")
        if _cents(amount) > _cents(order["total"]):
            raise ValueError(f"amount {amount:.2f} exceeds the order total {order['total']:.2f}")
        if not reason.strip():
            raise ValueError("reason must not be empty")
        digest = hashlib.sha256(f"{order['order_id']}:{_cents(amount)}".encode()).hexdigest()[:8]
        return json.dumps(
            {
                "refund_id": f"RF-{digest}",
                "order_id": order["order_id"],
                "amount": _cents(amount) / 100,
                "status": "refund_issued",
            }
        )

    async def verify(self, session: Session, response: r.Response) -> Verification:
        for key in ("expected_order_id", "expected_amount"):
            if key not in session.data:
                raise errors.TaskDataError(key, "is required")
        return grade(response, str(session.data["expected_order_id"]), float(session.data["expected_amount"]))
