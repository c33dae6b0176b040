"""Session state: a grocery shopping cart that lives on the server for one rollout.

SeedSession opens a cart holding the task's `initial_cart` ({sku: quantity},
may be empty). The model changes it with add_item, remove_item and
checkout, reads it with view_cart, and finds SKUs with search_products; the
catalogue (names, prices, how many of a product one cart may hold) is fixed
in this module. Each rollout has its own cart; CloseSession releases it, and
so does the idle time-out when an agent never closes its session.

The task names the final state it wants: `expected_cart` ({sku: quantity})
and `expect_checkout` (default false). Reward 1.0 when the cart, as the
server holds it at Verify, has exactly those quantities and was checked out
if and only if the task asks for it; 0.0 otherwise. The components give
partial credit: `cart` is the fraction of products (over both carts) with the
right quantity, `checkout` whether the checkout state is right.

Verify without an open cart (re-scoring a finished rollout with `reverify`,
or a session the idle time-out closed) replays the response's tool calls on
a scratch cart seeded from the task: the tools are deterministic, so the
replay ends where the rollout did. For the same reason a resumed rollout
whose session was lost with its replica gets a new one with its tool calls
replayed (`session_recovery = "replay"`): an order id depends on the task and
the cart, not on which session placed it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field

from gym_grpc import errors
from gym_grpc.resources import ResourcesServer, Session, Verification, tool
from gym_grpc.responses import function_calls, new_id
from gym_grpc.v1 import responses_pb2 as r


@dataclass(frozen=True)
class Product:
    name: str
    price: float
    #: Most of this product one cart may hold.
    limit: int


CATALOG: dict[str, Product] = {
    "MILK-1L": Product("Whole milk, 1 L", 1.29, 6),
    "OAT-1L": Product("Oat milk, 1 L", 2.19, 6),
    "EGG-12": Product("Free-range eggs, 12 pack", 3.99, 4),
    "BREAD-SD": Product("Sourdough loaf", 4.50, 3),
    "BAN-1KG": Product("Bananas, 1 kg", 1.69, 5),
    "APL-1KG": Product("Gala apples, 1 kg", 3.49, 5),
    "COF-250": Product("Ground coffee, 250 g", 6.99, 4),
    "PAS-500": Product("Spaghetti, 500 g", 1.49, 10),
    "TOM-400": Product("Chopped tomatoes, 400 g tin", 0.89, 12),
    "PARM-200": Product("Parmesan, 200 g", 4.79, 2),
    "OJ-1L": Product("Orange juice, 1 L", 2.89, 3),
    "YOG-500": Product("Greek yogurt, 500 g", 2.59, 4),
}


def _sku(sku: str) -> str:
    return sku.strip().upper()


def _product(sku: str) -> Product:
    product = CATALOG.get(_sku(sku))
    if product is None:
        raise ValueError(f"no product has the SKU {sku.strip()!r}; find SKUs with search_products")
    return product


def _money(cents: int) -> float:
    return cents / 100


@dataclass
class Cart:
    """One shopper's cart: quantities by SKU, and whether it was checked out."""

    id: str
    lines: dict[str, int] = field(default_factory=dict)
    checked_out: bool = False
    #: What an order id is made from beside the lines (the task, so that a replay of the same
    #: calls in a new session orders the same id); the cart's id when empty.
    order_key: str = ""

    def _open(self) -> None:
        if self.checked_out:
            raise ValueError("the cart is checked out and can no longer change")

    def add(self, sku: str, quantity: int) -> None:
        self._open()
        product = _product(sku)
        if quantity < 1:
            raise ValueError("quantity must be at least 1")
        have = self.lines.get(_sku(sku), 0)
        if have + quantity > product.limit:
            raise ValueError(
                f"a cart may hold at most {product.limit} of {_sku(sku)} ({product.name}); it holds {have}"
            )
        self.lines[_sku(sku)] = have + quantity

    def remove(self, sku: str, quantity: int) -> None:
        self._open()
        _product(sku)
        have = self.lines.get(_sku(sku), 0)
        if quantity < 1:
            raise ValueError("quantity must be at least 1")
        if quantity > have:
            raise ValueError(f"the cart holds {have} of {_sku(sku)}, not {quantity}")
        if quantity == have:
            del self.lines[_sku(sku)]
        else:
            self.lines[_sku(sku)] = have - quantity

    def checkout(self) -> str:
        """Place the order; return its id."""
        self._open()
        if not self.lines:
            raise ValueError("the cart is empty")
        self.checked_out = True
        key = self.order_key or self.id
        return "ORD-" + hashlib.sha256(f"{key}:{sorted(self.lines.items())}".encode()).hexdigest()[:8].upper()

    def view(self) -> dict[str, Any]:
        items, total = [], 0
        for sku, quantity in sorted(self.lines.items()):
            product = CATALOG[sku]
            line = round(product.price * 100) * quantity
            total += line
            items.append(
                {
                    "sku": sku,
                    "name": product.name,
                    "quantity": quantity,
                    "unit_price": product.price,
                    "line_total": _money(line),
                }
            )
        return {"items": items, "subtotal": _money(total), "checked_out": self.checked_out}


class CartStore:
    """The carts the server holds open, by cart id.

    Stands in for what a real environment acquires per rollout (a sandbox, a
    database, a browser): whatever seed_session opens must be released, and
    `live` shows what is still held.
    """

    def __init__(self) -> None:
        self._carts: dict[str, Cart] = {}

    def open(self, lines: dict[str, int], order_key: str = "") -> Cart:
        cart = Cart(id=new_id("cart"), lines=dict(lines), order_key=order_key)
        self._carts[cart.id] = cart
        return cart

    def get(self, cart_id: str) -> Cart | None:
        return self._carts.get(cart_id)

    def release(self, cart_id: str) -> None:
        self._carts.pop(cart_id, None)

    @property
    def live(self) -> dict[str, Cart]:
        return dict(self._carts)


def quantities(value: Any, key: str) -> dict[str, int]:
    """A task's {sku: quantity}, checked against the catalogue; a bad one names its key."""
    if not isinstance(value, dict):
        raise errors.TaskDataError(key, "must be an object of SKU to quantity")
    out = {}
    for sku, quantity in value.items():
        if _sku(sku) not in CATALOG:
            raise errors.TaskDataError(key, f"unknown SKU {sku!r}")
        if isinstance(quantity, bool) or not isinstance(quantity, int) or quantity < 0:
            raise errors.TaskDataError(key, f"quantity of {sku!r} must be a whole number >= 0")
        if quantity:
            out[_sku(sku)] = quantity
    return out


def score(cart: Cart, expected: dict[str, int], expect_checkout: bool) -> Verification:
    """Compare a cart with the state the task wants."""
    products = set(cart.lines) | set(expected)
    right = {sku for sku in products if cart.lines.get(sku, 0) == expected.get(sku, 0)}
    cart_matches = right == products
    checkout_matches = cart.checked_out == expect_checkout
    return Verification(
        reward=1.0 if cart_matches and checkout_matches else 0.0,
        fields={
            "cart_matches": cart_matches,
            "checked_out": cart.checked_out,
            "wrong_products": sorted(products - right),
            "items": sum(cart.lines.values()),
        },
        components={
            "cart": len(right) / len(products) if products else 1.0,
            "checkout": float(checkout_matches),
        },
    )


Sku = Annotated[str, Field(description="Product SKU, e.g. 'MILK-1L' (search_products finds them).")]
Quantity = Annotated[int, Field(description="How many units, 1 or more.")]


class ShoppingCartEnv(ResourcesServer):
    session_recovery = "replay"
    verifier_fields = {
        "cart_matches": "every product has the quantity the task expects",
        "checked_out": "the cart was checked out",
        "wrong_products": "the SKUs whose quantity is not the expected one",
        "items": "units in the final cart",
        "replayed": "the cart was rebuilt from the response's tool calls (no open session at Verify)",
        "tool_calls": "tool calls made",
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.carts = CartStore()

    async def seed_session(self, session: Session) -> None:
        initial = quantities(session.data.get("initial_cart", {}), "initial_cart")
        order_key = hashlib.sha256(session.task.SerializeToString(deterministic=True)).hexdigest()
        session.state["cart_id"] = self.carts.open(initial, order_key).id

    async def close_session(self, session: Session) -> None:
        self.carts.release(session.state.get("cart_id", ""))

    def _cart(self, session: Session) -> Cart:
        cart = self.carts.get(session.state.get("cart_id", ""))
        if cart is None:
            raise errors.FailedPrecondition(f"session {session.id!r} has no cart", field="session_id")
        return cart

    @tool
    async def search_products(
        self, query: Annotated[str, Field(description="Words of the product name, e.g. 'milk'; '' lists all.")]
    ) -> str:
        """Search the store's catalogue by name; returns SKU, name, price (USD) and the most one cart may hold."""
        words = query.lower().split()
        found = [
            {"sku": sku, "name": p.name, "price": p.price, "max_per_cart": p.limit}
            for sku, p in CATALOG.items()
            if all(w in p.name.lower() or w in sku.lower() for w in words)
        ]
        return json.dumps({"products": found})

    @tool
    async def view_cart(self, session: Session) -> str:
        """Show the cart: its items with quantities and prices, the subtotal, and whether it was checked out."""
        return json.dumps(self._cart(session).view())

    @tool
    async def add_item(self, sku: Sku, quantity: Quantity, session: Session) -> str:
        """Add units of a product to the cart; returns the cart."""
        cart = self._cart(session)
        cart.add(sku, quantity)
        return json.dumps(cart.view())

    @tool
    async def remove_item(self, sku: Sku, quantity: Quantity, session: Session) -> str:
        """Remove units of a product from the cart; returns the cart."""
        cart = self._cart(session)
        cart.remove(sku, quantity)
        return json.dumps(cart.view())

    @tool
    async def checkout(self, session: Session) -> str:
        """Place the order for everything in the cart. The cart cannot change afterwards."""
        cart = self._cart(session)
        order_id = cart.checkout()
        return json.dumps({"order_id": order_id, **cart.view()})

    async def verify(self, session: Session, response: r.Response) -> Verification:
        if "expected_cart" not in session.data:
            raise errors.TaskDataError("expected_cart", "is required")
        expected = quantities(session.data["expected_cart"], "expected_cart")
        expect_checkout = session.data.get("expect_checkout", False)
        if not isinstance(expect_checkout, bool):
            raise errors.TaskDataError("expect_checkout", f"must be true or false, got {expect_checkout!r}")
        cart = self.carts.get(session.state.get("cart_id", ""))
        if cart is not None:
            verdict = score(cart, expected, expect_checkout)
        else:
            verdict = score(await self._replay(session, response), expected, expect_checkout)
        verdict.fields["replayed"] = cart is None
        verdict.fields["tool_calls"] = len(function_calls(response))
        return verdict

    async def _replay(self, session: Session, response: r.Response) -> Cart:
        """The cart a response's tool calls leave, rebuilt on a scratch session seeded from the task."""
        scratch = Session(id=f"{session.id}/replay", task=session.task)
        await self.seed_session(scratch)
        try:
            for call in function_calls(response):
                try:
                    await self.call_tool(scratch, call.name, call.arguments)
                except errors.GymError:
                    pass  # it failed in the rollout too, and changed nothing
            return self._cart(scratch)
        finally:
            await self.close_session(scratch)
