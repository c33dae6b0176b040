"""The customer-support environment: its chained tools, and what its verifier rewards."""

import json
import re
from pathlib import Path

import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.resources.multi_step.server import ORDERS, CustomerSupportEnv, find_customer, grade
from gym_grpc.client.stubs import AgentClient, ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message, tool_error_output
from gym_grpc.testing import ResourcesConformance, ScriptedModel, call, example_rows, say, static_registry
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

EXAMPLES = Path(__file__).resolve().parent.parent / "data" / "example.jsonl"


def _row(order_id: str = "ORD-19876", amount: float = 14.99, prompt: str = "") -> dict:
    prompt = prompt or "I'm b.okafor@example.net; only one of my two phone cases arrived. Refund the missing one."
    return {"responses_create_params": {"input": prompt}, "expected_order_id": order_id, "expected_amount": amount}


def _task(order_id: str = "ORD-19876", amount: float = 14.99) -> task_pb2.Task:
    return rows.task_from_row(_row(order_id, amount))


def _transcript(*steps: tuple[str, dict, str]) -> r.Response:
    """A response from (tool, arguments, output) steps, ending in a short answer."""
    items = []
    for name, arguments, output in steps:
        fc = call(name, json.dumps(arguments))
        items += [
            fc,
            r.Item(function_call_output=r.FunctionCallOutput(call_id=fc.function_call.call_id, output=output)),
        ]
    return r.Response(output=[*items, assistant_message("Done.")])


FOUND = ("find_user", {"email": "b.okafor@example.net"}, json.dumps({"user_id": "u_1002"}))
LISTED = ("list_orders", {"user_id": "u_1002"}, json.dumps({"user_id": "u_1002", "orders": []}))


def _refund(order_id: str, amount: float) -> tuple[str, dict, str]:
    return (
        "refund_order",
        {"order_id": order_id, "amount": amount, "reason": "missing"},
        '{"status": "refund_issued"}',
    )


# --- scoring ---------------------------------------------------------------


def test_the_whole_chain_with_the_right_refund_earns_the_reward():
    verdict = grade(_transcript(FOUND, LISTED, _refund("ORD-19876", 14.99)), "ORD-19876", 14.99)
    assert verdict.reward == 1.0
    assert verdict.components == {"found_user": 1.0, "listed_orders": 1.0, "right_order": 1.0, "right_amount": 1.0}
    assert verdict.fields["steps"] == 3 and verdict.fields["refund_calls"] == 1 and verdict.fields["refund_issued"]


def test_the_last_refund_call_decides_the_reward():
    right, wrong = _refund("ORD-19876", 14.99), _refund("ORD-19876", 39.97)
    assert grade(_transcript(FOUND, LISTED, wrong, right), "ORD-19876", 14.99).reward == 1.0
    corrected_away = grade(_transcript(FOUND, LISTED, right, wrong), "ORD-19876", 14.99)
    assert corrected_away.reward == 0.0
    assert corrected_away.fields["right_order"] and not corrected_away.fields["right_amount"]
    assert corrected_away.fields["refund_calls"] == 2


@pytest.mark.parametrize(
    "steps, components",
    [
        (
            [FOUND, LISTED, _refund("ORD-20950", 14.99)],
            {"found_user": 1.0, "listed_orders": 1.0, "right_order": 0.0, "right_amount": 1.0},
        ),
        (
            [FOUND, _refund("ORD-19876", 39.97)],
            {"found_user": 1.0, "listed_orders": 0.0, "right_order": 1.0, "right_amount": 0.0},
        ),
        ([FOUND, LISTED], {"found_user": 1.0, "listed_orders": 1.0, "right_order": 0.0, "right_amount": 0.0}),
        ([], {"found_user": 0.0, "listed_orders": 0.0, "right_order": 0.0, "right_amount": 0.0}),
    ],
)
def test_the_steps_on_the_way_earn_partial_credit_but_no_reward(steps, components):
    verdict = grade(_transcript(*steps), "ORD-19876", 14.99)
    assert verdict.reward == 0.0
    assert verdict.components == components
    assert verdict.fields["steps"] == len(steps)


def test_amounts_are_compared_to_the_cent_and_order_ids_loosely():
    assert grade(_transcript(_refund(" ord-19876 ", 14.990000001)), "ORD-19876", 14.99).reward == 1.0
    assert grade(_transcript(_refund("ORD-19876", 14.98)), "ORD-19876", 14.99).reward == 0.0


@pytest.mark.parametrize("amount", ["1e999", "-1e999", "NaN", "Infinity", "1" + "0" * 400])
def test_an_amount_that_is_no_finite_number_is_a_wrong_refund(amount):
    """The model's arguments are read liberally: 1e999 is infinity, NaN and Infinity are taken, an
    integer may have 400 digits."""
    fc = call("refund_order", '{"order_id": "ORD-19876", "amount": ' + amount + ', "reason": "x"}')
    verdict = grade(r.Response(output=[fc]), "ORD-19876", 14.99)
    assert verdict.reward == 0.0 and verdict.fields["right_order"] and not verdict.fields["right_amount"]


def test_a_failed_lookup_is_not_credited():
    error = "Error: tool 'find_user' raised ValueError: no customer has the email 'okafor@example.net'"
    missed = ("find_user", {"email": "okafor@example.net"}, error)
    wrong_user = ("list_orders", {"user_id": "u_1001"}, json.dumps({"user_id": "u_1001", "orders": []}))
    verdict = grade(_transcript(missed, wrong_user), "ORD-19876", 14.99)
    assert not verdict.fields["found_user"] and not verdict.fields["listed_orders"]


def test_refund_arguments_that_are_not_json_count_as_a_wrong_refund():
    fc = call("refund_order", '{"order_id": "ORD-19876", "amount": 14.99')
    verdict = grade(r.Response(output=[fc]), "ORD-19876", 14.99)
    assert verdict.reward == 0.0 and verdict.fields["refund_calls"] == 1


def test_refund_arguments_too_deep_to_parse_count_as_a_wrong_refund():
    fc = call("refund_order", '{"order_id": "ORD-19876", "amount": ' + "[" * 100_000 + "]" * 100_000 + "}")
    verdict = grade(r.Response(output=[fc]), "ORD-19876", 14.99)
    assert verdict.reward == 0.0 and verdict.fields["refund_calls"] == 1


def test_an_expected_order_the_store_does_not_have_is_the_tasks_fault():
    with pytest.raises(errors.TaskDataError, match="not an order of the store"):
        grade(_transcript(), "ORD-00000", 1.0)


# --- the tools and verify over gRPC ---------------------------------------------


@pytest.fixture
async def support(start):
    server = await start(CustomerSupportEnv())
    client = ResourcesClient(static_registry(multi_step=server), "multi_step")
    yield client
    await client.registry.close()


async def _call(client: ResourcesClient, name: str, **arguments) -> tuple[r.Item, r.Item, str, bool]:
    """Run a tool call as the agent would: the call item, its output item, the output and whether it failed."""
    fc = call(name, json.dumps(arguments))
    result = await client.call_tool("s", fc.function_call)
    output = tool_error_output(result.output) if result.error else result.output
    item = r.Item(function_call_output=r.FunctionCallOutput(call_id=fc.function_call.call_id, output=output))
    return fc, item, result.output, result.error


async def test_each_tools_output_feeds_the_next_call(support):
    assert (await support.describe_tools()).stateless
    *find, out, _ = await _call(support, "find_user", email="  B.Okafor@Example.NET ")
    user_id = json.loads(out)["user_id"]
    *listing, out, _ = await _call(support, "list_orders", user_id=user_id)
    orders = {o["order_id"]: o for o in json.loads(out)["orders"]}
    assert set(orders) == {"ORD-19876", "ORD-20950"}
    assert orders["ORD-19876"]["total"] == 39.97 and orders["ORD-19876"]["status"] == "delivered"
    case = next(i for i in orders["ORD-19876"]["items"] if i["name"] == "Phone case")
    *refund, out, error = await _call(
        support, "refund_order", order_id="ORD-19876", amount=case["unit_price"], reason="one case never arrived"
    )
    assert not error and json.loads(out)["status"] == "refund_issued" and json.loads(out)["amount"] == 14.99
    response = r.Response(output=[*find, *listing, *refund, assistant_message("Refunded $14.99.")])
    verdict = await support.verify("s", _task(), response)
    assert verdict.reward == 1.0
    assert dict(verdict.reward_components) == {
        "found_user": 1.0,
        "listed_orders": 1.0,
        "right_order": 1.0,
        "right_amount": 1.0,
    }
    assert rows.json_field(verdict, "fields")["steps"] == 3


@pytest.mark.parametrize(
    "order_id, amount, reason, message",
    [
        ("ORD-21003", 34.0, "late", "ORD-21003 has not been delivered yet"),
        ("ORD-20950", 24.99, "x", "ORD-20950 was cancelled"),
        ("ORD-20770", 22.0, "x", "ORD-20770 has already been refunded"),
        ("ORD-20417", 90.0, "x", "amount 90.00 exceeds the order total 89.99"),
        ("ORD-20417", 0.0, "x", "amount must be positive"),
        ("ORD-20417", float("inf"), "x", "amount must be a finite number"),
        ("ORD-20417", float("nan"), "x", "amount must be a finite number"),
        ("ORD-20417", 10.0, " ", "reason must not be empty"),
        ("ORD-99999", 10.0, "x", "no order has the id 'ORD-99999'"),
    ],
)
async def test_a_refund_the_store_cannot_make_is_a_tool_error_for_the_model(support, order_id, amount, reason, message):
    *_, out, error = await _call(support, "refund_order", order_id=order_id, amount=amount, reason=reason)
    assert error and message in out


async def test_unknown_customers_are_tool_errors(support):
    *_, out, error = await _call(support, "find_user", email="nobody@example.com")
    assert error and "no customer has the email 'nobody@example.com'" in out
    *_, out, error = await _call(support, "list_orders", user_id="alice.nguyen@example.com")
    assert error and "find it with find_user" in out


async def test_a_task_without_the_expected_refund_fails_verification_clearly(support):
    task = rows.task_from_row({"responses_create_params": {"input": "Refund me."}, "expected_order_id": "ORD-19876"})
    with pytest.raises(errors.InvalidArgument, match="task.data.expected_amount: is required") as error:
        await support.verify("s", task, r.Response(output=[assistant_message("Done.")]))
    assert error.value.field == "task.data.expected_amount"


# --- whole rollouts through the simple agent ------------------------------------


async def _rollout(start, turns, task: task_pb2.Task) -> task_pb2.Rollout:
    model = await start(ScriptedModel(turns))
    env = await start(CustomerSupportEnv())
    agent = SimpleAgent(
        {"model_server": "model", "resources_server": "multi_step", "max_steps": 8},
        name="agent",
        registry=static_registry(model=model, multi_step=env),
    )
    client = AgentClient(static_registry(agent=await start(agent)), "agent")
    try:
        return await client.run(task, timeout=30)
    finally:
        await client.registry.close()


async def test_a_scripted_agent_that_follows_the_chain_earns_the_reward(start):
    turns = [
        [call("find_user", '{"email": "b.okafor@example.net"}')],
        [call("list_orders", '{"user_id": "u_1002"}')],
        [call("refund_order", '{"order_id": "ORD-19876", "amount": 14.99, "reason": "one phone case never arrived"}')],
        say("I have refunded $14.99 for the missing phone case."),
    ]
    rollout = await _rollout(start, turns, _task())
    assert rollout.reward == 1.0
    assert rollout.stop_reason == task_pb2.STOP_REASON_FINAL_MESSAGE and rollout.model_calls == 4
    fields = rows.json_field(rollout, "verifier_fields")
    assert fields["found_user"] and fields["listed_orders"] and fields["refund_issued"] and fields["steps"] == 3
    assert dict(rollout.reward_components)["right_amount"] == 1.0


async def test_a_scripted_agent_that_refunds_the_whole_order_gets_partial_credit(start):
    turns = [
        [call("find_user", '{"email": "b.okafor@example.net"}')],
        [call("list_orders", '{"user_id": "u_1002"}')],
        [call("refund_order", '{"order_id": "ORD-19876", "amount": 39.97, "reason": "missing item"}')],
        say("I have refunded your whole order."),
    ]
    rollout = await _rollout(start, turns, _task())
    assert rollout.reward == 0.0
    assert dict(rollout.reward_components) == {
        "found_user": 1.0,
        "listed_orders": 1.0,
        "right_order": 1.0,
        "right_amount": 0.0,
    }


# --- the example rows -----------------------------------------------------------


def test_the_example_rows_are_tasks_with_the_servers_tools():
    assert len(example_rows(EXAMPLES, CustomerSupportEnv)) == 5


@pytest.mark.parametrize("row", example_rows(EXAMPLES, CustomerSupportEnv), ids=lambda row: row["expected_order_id"])
async def test_every_example_can_be_solved_from_its_prompt(row):
    env = CustomerSupportEnv()
    prompt = row["responses_create_params"]["input"][-1]["content"]
    email = re.search(r"[\w.+-]+@[\w-]+\.\w+", prompt).group()
    user_id = json.loads(await env.find_user(email))["user_id"]
    assert user_id == ORDERS[row["expected_order_id"]]["user_id"] == find_customer(email)[0]
    refund = await env.refund_order(row["expected_order_id"], row["expected_amount"], "as the customer asked")
    assert json.loads(refund)["status"] == "refund_issued"


class TestMultiStepConformance(ResourcesConformance):
    task_row = _row()

    def server(self) -> CustomerSupportEnv:
        return CustomerSupportEnv()
