"""``proxy.adapters.deadline.Deadline``: ``asyncio.timeout``'s behaviour from one sweep a
loop, on asyncio and uvloop (#28). No assertion on how soon: a busy machine only makes the
sweep later, never wrong."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop

from proxy.adapters import deadline
from proxy.adapters.deadline import Deadline
from proxy.adapters.forward import mapped_errors
from proxy.core.errors import UpstreamTimeout

WAIT_S = 30.0  # only ever reached when something is broken

LOOPS: dict[str, Callable[[Awaitable[Any]], Any]] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Callable[[Awaitable[Any]], Any]:
    return LOOPS[request.param]


def _table() -> dict[Deadline, None]:
    return deadline._sweepers[asyncio.get_running_loop()].blocks


def test_a_block_past_its_deadline_raises_timeout_error(run: Any) -> None:
    async def main() -> tuple[bool, bool, int]:
        never = asyncio.Event()
        block = Deadline(0.01)
        with pytest.raises(TimeoutError):
            async with block:
                await asyncio.wait_for(never.wait(), WAIT_S)
        task = asyncio.current_task()
        assert task is not None
        return block.expired(), task.cancelling() == 0, len(_table())

    assert run(main()) == (True, True, 0)


def test_a_block_done_in_time_is_left_alone_and_leaves_nothing_behind(run: Any) -> None:
    async def main() -> tuple[bool, int, bool]:
        block = Deadline(WAIT_S)
        async with block:
            await asyncio.sleep(0)
        await asyncio.sleep(deadline.TICK_S * 2)  # a sweep would come by now: none is due
        sweeper = deadline._sweepers[asyncio.get_running_loop()]
        return block.expired(), len(sweeper.blocks), sweeper._handle is None

    assert run(main()) == (False, 0, True)


def test_a_cancellation_from_outside_stays_one(run: Any) -> None:
    async def main() -> bool:
        started = asyncio.Event()

        async def inside() -> None:
            async with Deadline(WAIT_S):
                started.set()
                await asyncio.sleep(WAIT_S)

        task = asyncio.create_task(inside())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled()

    assert run(main()) is True


def test_an_inner_deadline_ends_its_block_only(run: Any) -> None:
    async def main() -> tuple[str, bool, bool]:
        outer = Deadline(WAIT_S)
        inner = Deadline(0.01)
        async with outer:
            try:
                async with inner:
                    await asyncio.sleep(WAIT_S)
                got = "no timeout"
            except TimeoutError:
                got = "inner timed out"
            await asyncio.sleep(0)  # the task goes on inside the outer block
        return got, inner.expired(), outer.expired()

    assert run(main()) == ("inner timed out", True, False)


def test_no_deadline_registers_nothing(run: Any) -> None:
    async def main() -> bool:
        async with Deadline(None):
            await asyncio.sleep(0)
        return asyncio.get_running_loop() in deadline._sweepers

    assert run(main()) is False


def test_mapped_errors_answers_a_passed_deadline_as_the_upstream_timeout(run: Any) -> None:
    async def main() -> str:
        with pytest.raises(UpstreamTimeout) as caught:
            async with mapped_errors(deadline_s=0.01):
                await asyncio.sleep(WAIT_S)
        return str(caught.value)

    assert run(main()) == "upstream did not answer within 0.01 s"


def test_a_deadline_beyond_the_first_sweep_is_met_by_a_later_one(run: Any) -> None:
    """The sweep goes on while any block is open (one due after several ticks)."""

    async def main() -> bool:
        block = Deadline(deadline.TICK_S * 3)
        with pytest.raises(TimeoutError):
            async with block:
                await asyncio.sleep(WAIT_S)
        return block.expired()

    assert run(main()) is True
