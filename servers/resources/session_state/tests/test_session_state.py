"""The shopping-cart environment: a cart per session, changed by tools, checked by verify, released at the end."""

import asyncio
import json
import time
from pathlib import Path

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.resources.session_state.server import CATALOG, Cart, ShoppingCartEnv, quantities, score
from gym_grpc.client.stubs import AgentClient, ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message
from gym_grpc.rpc.transport import open_channel
from gym_grpc.testing import ResourcesConformance, ScriptedModel, call, example_rows, say, static_registry
from gym_grpc.v1 import resources_service_pb2 as res_pb
from gym_grpc.v1 import resources_service_pb2_grpc as res_grpc
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2
from tests.support import eventually

EXAMPLES = Path(__file__).resolve().parent.parent / "data" / "example.jsonl"


def _row(initial=None, expected=None, checkout=True) -> dict:
    return {
        "responses_create_params": {"input": "Make it 3 packs of spaghetti, add 2 tins of tomatoes, then order."},
        "initial_cart": {"PAS-500": 1} if initial is None else initial,
        "expected_cart": {"PAS-500": 3, "TOM-400": 2} if expected is None else expected,
        "expect_checkout": checkout,
    }


def _task(**kwargs) -> task_pb2.Task:
    return rows.task_from_row(_row(**kwargs))


# --- the cart and the scoring, without a server ----------------------------------


def test_a_cart_enforces_the_catalogue_and_freezes_at_checkout():
    cart = Cart(id="c", lines={"PAS-500": 1})
    cart.add(" pas-500 ", 2)
    cart.add("TOM-400", 2)
    cart.remove("TOM-400", 1)
    assert cart.lines == {"PAS-500": 3, "TOM-400": 1}
    with pytest.raises(ValueError, match="at most 2 of PARM-200"):
        cart.add("PARM-200", 3)
    with pytest.raises(ValueError, match="holds 1 of TOM-400, not 2"):
        cart.remove("TOM-400", 2)
    with pytest.raises(ValueError, match="no product has the SKU 'CAVIAR'"):
        cart.add("CAVIAR", 1)
    with pytest.raises(ValueError, match="at least 1"):
        cart.add("TOM-400", 0)
    cart.remove("TOM-400", 1)
    assert cart.lines == {"PAS-500": 3}
    assert cart.checkout().startswith("ORD-") and cart.checked_out
    with pytest.raises(ValueError, match="checked out"):
        cart.add("TOM-400", 1)
    with pytest.raises(ValueError, match="empty"):
        Cart(id="empty").checkout()


def test_the_cart_view_prices_the_lines():
    view = Cart(id="c", lines={"TOM-400": 3, "MILK-1L": 1}).view()
    assert [(i["sku"], i["quantity"], i["line_total"]) for i in view["items"]] == [
        ("MILK-1L", 1, 1.29),
        ("TOM-400", 3, 2.67),
    ]
    assert view["subtotal"] == 3.96 and view["checked_out"] is False


@pytest.mark.parametrize(
    "lines, checked_out, reward, components, wrong",
    [
        ({"PAS-500": 3, "TOM-400": 2}, True, 1.0, {"cart": 1.0, "checkout": 1.0}, []),
        ({"PAS-500": 3, "TOM-400": 2}, False, 0.0, {"cart": 1.0, "checkout": 0.0}, []),
        ({"PAS-500": 1, "TOM-400": 2}, True, 0.0, {"cart": 0.5, "checkout": 1.0}, ["PAS-500"]),
        ({"PAS-500": 3, "TOM-400": 2, "EGG-12": 1}, True, 0.0, {"cart": 2 / 3, "checkout": 1.0}, ["EGG-12"]),
        ({}, False, 0.0, {"cart": 0.0, "checkout": 0.0}, ["PAS-500", "TOM-400"]),
    ],
)
def test_the_reward_needs_the_exact_cart_and_checkout_state(lines, checked_out, reward, components, wrong):
    verdict = score(Cart(id="c", lines=lines, checked_out=checked_out), {"PAS-500": 3, "TOM-400": 2}, True)
    assert verdict.reward == reward
    assert verdict.components == pytest.approx(components)
    assert verdict.fields["wrong_products"] == wrong


@pytest.mark.parametrize(
    "value, message",
    [([1, 2], "must be an object"), ({"CAVIAR": 1}, "unknown SKU 'CAVIAR'"), ({"EGG-12": -1}, "whole number")],
)
def test_a_bad_cart_in_a_task_names_its_key(value, message):
    with pytest.raises(errors.InvalidArgument, match=message) as error:
        quantities(value, "initial_cart")
    assert error.value.field == "task.data.initial_cart"


# --- sessions over gRPC ------------------------------------------------------------


@pytest.fixture
async def shop(start):
    server = await start(ShoppingCartEnv())
    client = ResourcesClient(static_registry(shop=server), "shop")
    yield client, server.app
    await client.registry.close()


async def _use(client: ResourcesClient, session: str, name: str, **arguments) -> dict:
    result = await client.call_tool(session, r.FunctionCall(name=name, arguments=json.dumps(arguments)))
    assert not result.error, result.output
    return json.loads(result.output)


def _lines(view: dict) -> dict[str, int]:
    return {i["sku"]: i["quantity"] for i in view["items"]}


async def test_the_cart_persists_across_the_tool_calls_of_a_session(shop):
    client, env = shop
    await client.seed_session("s", _task())
    assert not (await client.describe_tools()).stateless
    await _use(client, "s", "add_item", sku="PAS-500", quantity=2)
    await _use(client, "s", "add_item", sku="TOM-400", quantity=3)
    await _use(client, "s", "remove_item", sku="TOM-400", quantity=1)
    assert _lines(await _use(client, "s", "view_cart")) == {"PAS-500": 3, "TOM-400": 2}
    assert [cart.lines for cart in env.carts.live.values()] == [{"PAS-500": 3, "TOM-400": 2}]


async def test_concurrent_sessions_have_separate_carts(shop):
    client, env = shop
    await asyncio.gather(
        client.seed_session("ann", _task(initial={})), client.seed_session("bob", _task(initial={"EGG-12": 1}))
    )
    await asyncio.gather(
        *[_use(client, "ann", "add_item", sku="MILK-1L", quantity=1) for _ in range(3)],
        *[_use(client, "bob", "add_item", sku="TOM-400", quantity=2) for _ in range(3)],
        _use(client, "bob", "checkout"),
    )
    ann, bob = await asyncio.gather(_use(client, "ann", "view_cart"), _use(client, "bob", "view_cart"))
    assert _lines(ann) == {"MILK-1L": 3} and not ann["checked_out"]
    assert _lines(bob)["EGG-12"] == 1 and bob["checked_out"]
    assert len(env.carts.live) == 2


async def test_verify_checks_the_cart_the_server_holds(shop):
    client, _ = shop
    await client.seed_session("s", _task())
    answer = r.Response(output=[assistant_message("Your order is placed.")])  # the words do not matter, the cart does
    await _use(client, "s", "add_item", sku="PAS-500", quantity=2)
    await _use(client, "s", "add_item", sku="TOM-400", quantity=2)
    before_checkout = await client.verify("s", _task(), answer)
    assert before_checkout.reward == 0.0 and dict(before_checkout.reward_components) == {"cart": 1.0, "checkout": 0.0}
    await _use(client, "s", "checkout")
    verdict = await client.verify("s", _task(), answer)
    assert verdict.reward == 1.0
    fields = rows.json_field(verdict, "fields")
    assert fields["cart_matches"] and fields["checked_out"] and not fields["replayed"] and fields["items"] == 5


async def test_closing_the_session_releases_its_cart(shop):
    client, env = shop
    await client.seed_session("s", _task())
    assert len(env.carts.live) == 1
    await client.close_session("s")
    assert env.carts.live == {}
    with pytest.raises(errors.FailedPrecondition, match="SeedSession first"):
        await client.call_tool("s", r.FunctionCall(name="view_cart", arguments="{}"))


async def test_a_cart_nobody_uses_is_released_by_the_idle_timeout(start):
    server = await start(ShoppingCartEnv({"session_idle_timeout_seconds": 0.2}))
    carts = server.app.carts
    client = ResourcesClient(static_registry(shop=server), "shop")
    await client.seed_session("abandoned", _task())
    await client.seed_session("busy", _task())
    abandoned = server.app.sessions["abandoned"].state["cart_id"]
    deadline = time.monotonic() + 3.0
    while abandoned in carts.live and time.monotonic() < deadline:
        await _use(client, "busy", "view_cart")  # a rollout that keeps calling keeps its cart
        await asyncio.sleep(0.05)
    assert abandoned not in carts.live
    assert set(server.app.sessions) == {"busy"} and len(carts.live) == 1
    with pytest.raises(errors.FailedPrecondition, match="idle sessions are closed"):
        await client.call_tool("abandoned", r.FunctionCall(name="view_cart", arguments="{}"))
    await client.registry.close()


async def test_a_tool_call_in_an_unknown_session_is_failed_precondition(start):
    server = await start(ShoppingCartEnv())
    async with open_channel(server.address) as channel:
        stub = res_grpc.ResourcesServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.CallTool(
                res_pb.CallToolRequest(
                    session_id="nobody", name="add_item", arguments='{"sku": "EGG-12", "quantity": 1}'
                )
            )
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert errors.field_of(error.value) == "session_id"
    assert server.app.carts.live == {}


async def test_verify_after_the_session_closed_replays_the_tool_calls(shop):
    client, env = shop
    await client.seed_session("s", _task())
    output = []
    for name, arguments in [
        ("add_item", {"sku": "PAS-500", "quantity": 2}),
        ("add_item", {"sku": "PARM-200", "quantity": 5}),  # refused: over the limit, changes nothing
        ("add_item", {"sku": "TOM-400", "quantity": 2}),
        ("checkout", {}),
    ]:
        fc = call(name, json.dumps(arguments))
        result = await client.call_tool("s", fc.function_call)
        done = r.FunctionCallOutput(call_id=fc.function_call.call_id, output=result.output)
        output += [fc, r.Item(function_call_output=done)]
    response = r.Response(output=[*output, assistant_message("Ordered.")])
    live = await client.verify("s", _task(), response)
    await client.close_session("s")
    replayed = await client.verify("s", _task(), response)
    assert live.reward == replayed.reward == 1.0
    assert dict(live.reward_components) == dict(replayed.reward_components)
    assert rows.json_field(replayed, "fields")["replayed"] and not rows.json_field(live, "fields")["replayed"]
    assert env.carts.live == {}  # the scratch cart was released too


async def test_a_task_with_an_unknown_product_cannot_seed_a_session(start):
    server = await start(ShoppingCartEnv())
    async with open_channel(server.address) as channel:
        stub = res_grpc.ResourcesServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.SeedSession(res_pb.SeedSessionRequest(session_id="s", task=_task(initial={"CAVIAR": 1})))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown SKU 'CAVIAR'" in error.value.details()
    assert errors.field_of(error.value) == "task.data.initial_cart"
    assert server.app.carts.live == {} and server.app.sessions == {}


async def test_stopping_the_server_releases_the_open_carts(start):
    server = await start(ShoppingCartEnv())
    client = ResourcesClient(static_registry(shop=server), "shop")
    await client.seed_session("left-open", _task())
    await client.registry.close()
    await server.stop(grace=0.1)
    assert server.app.carts.live == {}


# --- whole rollouts through the simple agent ---------------------------------------


async def _rollout(start, turns, task: task_pb2.Task) -> tuple[task_pb2.Rollout, ShoppingCartEnv]:
    model = await start(ScriptedModel(turns))
    env = await start(ShoppingCartEnv())
    agent = SimpleAgent(
        {"model_server": "model", "resources_server": "shop", "max_steps": 8},
        name="agent",
        registry=static_registry(model=model, shop=env),
    )
    client = AgentClient(static_registry(agent=await start(agent)), "agent")
    try:
        return await client.run(task, timeout=30), env.app
    finally:
        await client.registry.close()


async def test_a_scripted_agent_that_edits_and_checks_out_earns_the_reward(start):
    turns = [
        [call("search_products", '{"query": "tomatoes"}')],
        [call("add_item", '{"sku": "PAS-500", "quantity": 2}'), call("add_item", '{"sku": "TOM-400", "quantity": 2}')],
        [call("checkout", "{}")],
        say("Done: 3 packs of spaghetti and 2 tins of tomatoes are ordered."),
    ]
    rollout, env = await _rollout(start, turns, _task())
    assert rollout.reward == 1.0
    assert rollout.stop_reason == task_pb2.STOP_REASON_FINAL_MESSAGE and rollout.model_calls == 4
    fields = rows.json_field(rollout, "verifier_fields")
    assert fields["checked_out"] and not fields["replayed"] and fields["tool_calls"] == 4
    await eventually(lambda: env.carts.live == {}, "the agent closed its session (once the result went out)")


async def test_a_scripted_agent_that_forgets_to_check_out_gets_partial_credit(start):
    turns = [
        [call("add_item", '{"sku": "PAS-500", "quantity": 2}')],
        [call("add_item", '{"sku": "TOM-400", "quantity": 1}')],
        say("Your cart is ready."),
    ]
    rollout, env = await _rollout(start, turns, _task())
    assert rollout.reward == 0.0
    assert dict(rollout.reward_components) == {"cart": 0.5, "checkout": 0.0}
    assert rows.json_field(rollout, "verifier_fields")["wrong_products"] == ["TOM-400"]
    await eventually(lambda: env.carts.live == {}, "the agent closed its session (once the result went out)")


# --- the example rows ----------------------------------------------------------------


def test_the_example_rows_are_tasks_with_the_servers_tools():
    assert len(example_rows(EXAMPLES, ShoppingCartEnv)) == 5


@pytest.mark.parametrize("row", example_rows(EXAMPLES, ShoppingCartEnv), ids=lambda row: ",".join(row["expected_cart"]))
def test_every_example_asks_for_a_cart_the_store_allows(row):
    initial = quantities(row["initial_cart"], "initial_cart")
    expected = quantities(row["expected_cart"], "expected_cart")
    assert isinstance(row["expect_checkout"], bool)
    assert initial != expected or row["expect_checkout"], "the task asks for nothing"
    assert all(quantity <= CATALOG[sku].limit for sku, quantity in expected.items())


class TestSessionStateConformance(ResourcesConformance):
    task_row = _row()

    def server(self) -> ShoppingCartEnv:
        return ShoppingCartEnv()
