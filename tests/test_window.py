"""The batch window (gym_grpc/batch/window.py): it starts small, widens as rollouts end well within
their deadline and narrows, once per window's worth, when they take more than half of it."""

import asyncio

import pytest

from gym_grpc.batch.window import START, Window


def test_it_starts_at_start_or_the_most_when_that_is_smaller():
    assert Window(4096, 60).size == START and Window(4, 60).size == 4


def test_a_given_max_in_flight_is_exactly_how_many_run_at_once_whatever_they_take():
    window = Window.sized(300, deadline=5)
    assert window.size == 300
    window.running = 1
    window.release(seconds=10, past_deadline=True)
    assert window.size == 300 and window.note() is None
    assert Window.sized(None, deadline=5).size == START


def test_rollouts_that_end_within_a_quarter_of_their_deadline_widen_it_up_to_the_most():
    window = Window(START + 3, deadline=100)
    for _ in range(10):
        window.running += 1
        window.release(seconds=1)
    assert window.size == START + 3 and window.note() is None


def test_a_slow_rollout_or_one_past_its_deadline_halves_it_once_per_window_of_rollouts():
    window = Window(4096, deadline=100)
    window.running = 1
    window.release(seconds=60)  # more than half the deadline
    assert window.size == START // 2
    for _ in range(START // 2 - 1):  # the rollouts of the old window end slow too: no second halving yet
        window.running += 1
        window.release(seconds=0, past_deadline=True)
    assert window.size == START // 2
    window.running += 1
    window.release(seconds=0, past_deadline=True)
    assert window.size == START // 4
    assert "at most 4 ran at once" in (window.note() or "")


def test_rollouts_between_a_quarter_and_half_of_their_deadline_leave_it_as_it_is():
    window = Window(4096, deadline=100)
    window.running = 1
    window.release(seconds=40)
    assert window.size == START


def test_without_a_deadline_it_stays_where_it_started():
    window = Window(4096, deadline=None)
    window.running = 1
    window.release(seconds=1e6)
    assert window.size == START


async def test_acquire_waits_for_room_and_a_release_makes_it():
    window = Window(1, deadline=100)
    await window.acquire()
    waiting = asyncio.ensure_future(window.acquire())
    await asyncio.sleep(0)
    assert not waiting.done()
    window.release(seconds=1)
    await asyncio.wait_for(waiting, 10)
    assert window.running == 1


def test_a_window_of_none_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        Window(0, deadline=100)
