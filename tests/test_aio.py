"""stop_loops ends a loop that swallowed its cancel (the Python 3.11 ``wait_for`` race); a
TaskSet says which of its tasks ended with an error nobody handled."""

from __future__ import annotations

import asyncio
import logging

import pytest

from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import TaskSet, stop_loops


async def _swallows_one_cancel(swallowed: list[int]) -> None:
    """A loop whose body lost a cancel once, as nats-py's request can on 3.11, then sleeps."""
    while True:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append(1)


async def test_a_loop_that_swallowed_its_cancel_is_cancelled_again_and_ends() -> None:
    swallowed: list[int] = []
    task = asyncio.create_task(_swallows_one_cancel(swallowed))
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_loops(task, within_s=5.0), 5.0)
    assert task.cancelled()
    assert swallowed == [1]


async def test_a_loop_that_never_ends_is_logged_not_awaited_for_ever(
    caplog: pytest.LogCaptureFixture,
) -> None:
    released = asyncio.Event()

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                if released.is_set():
                    raise

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="reach_agent.aio"):
        await asyncio.wait_for(stop_loops(task, within_s=0.3), 5.0)
    assert not task.done()
    assert [r.getMessage() for r in caplog.records] == ["loop_did_not_stop task=stubborn"]
    released.set()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()


async def test_a_loop_that_checks_each_turn_ends_on_one_cancel_even_when_it_was_swallowed() -> None:
    turns: list[int] = []

    async def loop() -> None:
        while True:
            raise_if_cancelled()
            turns.append(1)
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass  # lost, as a 3.11 wait_for loses a cancel racing its result

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    task.cancel()  # once, as asyncio.run's cleanup does
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5.0)
    assert task.cancelled()
    assert turns == [1]


async def test_a_task_set_says_a_task_that_failed_and_nothing_of_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fails() -> None:
        raise ValueError("no store")

    async def ends() -> int:
        return 1

    tasks = TaskSet()
    with caplog.at_level(logging.DEBUG, logger="reach_agent.aio"):
        spawned = [tasks.spawn(fails(), "reach-task"), tasks.spawn(ends(), "reach-dup"),
                   tasks.spawn(asyncio.sleep(30), "reach-claim-end")]  # fmt: skip
        await asyncio.sleep(0)
        spawned[2].cancel()
        await tasks.wait(5.0)
    assert len(tasks) == 0
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "reach_agent.aio"]
    assert said == [("ERROR", "task.failed name=reach-task error=ValueError('no store')")]
    [record] = [r for r in caplog.records if r.name == "reach_agent.aio"]
    assert record.exc_info is not None  # with its traceback
