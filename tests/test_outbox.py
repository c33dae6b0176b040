"""The outbox both ends of RunMany fill: items that come together go in one message, up to
MESSAGE_BYTES (under gRPC's default 4 MiB limit), and more go in the next."""

import pytest

from gym_grpc.rpc.outbox import MESSAGE_BYTES, Outbox
from gym_grpc.v1 import agent_service_pb2 as agent_pb


def test_items_go_in_the_newest_message_until_the_next_would_take_it_past_the_limit():
    outbox = Outbox(agent_pb.RunManyRequest)
    third = MESSAGE_BYTES // 3
    for run_id in range(4):
        outbox.filling(third).runs.add(id=run_id)
    outbox.filling().cancel_ids.append(9)  # no size: in the newest message
    first, second = outbox.take(), outbox.take()
    assert [r.id for r in first.runs] == [0, 1, 2] and [r.id for r in second.runs] == [3]
    assert list(second.cancel_ids) == [9] and not outbox


def test_an_item_larger_than_the_limit_goes_alone():
    outbox = Outbox(agent_pb.RunManyResponse)
    outbox.filling(10).results.add(id=1)
    outbox.filling(MESSAGE_BYTES + 1).results.add(id=2)
    outbox.filling(10).results.add(id=3)
    assert [[r.id for r in outbox.take().results] for _ in range(3)] == [[1], [2], [3]]


def test_once_the_filling_message_is_taken_the_next_item_starts_a_new_one():
    outbox = Outbox(agent_pb.RunManyRequest)
    outbox.filling(MESSAGE_BYTES - 10).runs.add(id=1)
    taken = outbox.take()
    outbox.filling(MESSAGE_BYTES - 10).runs.add(id=2)  # a fresh message: the bytes taken are not counted
    assert [r.id for r in taken.runs] == [1] and [r.id for r in outbox.take().runs] == [2]
    with pytest.raises(IndexError):
        outbox.take()


def test_its_size_is_the_bytes_of_the_items_not_taken():
    outbox = Outbox(agent_pb.RunManyResponse)
    third = MESSAGE_BYTES // 3
    for run_id in range(4):
        outbox.filling(third).results.add(id=run_id)
    assert outbox.size == 4 * third
    outbox.take()  # the first three
    assert outbox.size == third
    outbox.take()
    assert outbox.size == 0 and not outbox
