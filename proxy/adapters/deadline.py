"""A deadline for a block of a task, as ``asyncio.timeout`` gives, without a timer per block.

Why: every non-streamed request bounds its whole upstream exchange (``upstream.timeout_s``),
and ``asyncio.timeout`` costs ~5 us a use on uvloop (a ``TimerHandle`` set and cancelled,
its state machine), a few percent of a request's CPU (#28). The deadlines of a loop's
blocks are kept in one table instead, and one sweep every ``TICK_S`` (only while the table
is not empty) cancels the tasks whose deadline passed: entering and leaving a block is a
dictionary insert and delete.

The price: a deadline is met up to ``TICK_S`` late. The bounds it serves are seconds to
minutes (an upstream's whole answer). The cancellation and its ``TimeoutError`` are
``asyncio.timeout``'s: the task is cancelled; the block's ``CancelledError`` becomes a
``TimeoutError`` only when this deadline caused it (``Task.uncancel``), so a cancellation
from outside stays one.
"""

from __future__ import annotations

import asyncio
import weakref
from types import TracebackType

TICK_S = 0.05


class Deadline:
    """``async with Deadline(seconds):`` (None: no deadline) raises ``TimeoutError`` out of
    the block once ``seconds`` passed, within ``TICK_S``."""

    __slots__ = ("_delay", "_when", "_task", "_cancelling", "_expired", "_sweeper")

    def __init__(self, delay: float | None) -> None:
        self._delay = delay
        self._when = 0.0
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._expired = False
        self._sweeper: _Sweeper | None = None

    async def __aenter__(self) -> Deadline:
        if self._delay is None:
            return self
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Deadline should be used inside a task")
        loop = asyncio.get_running_loop()
        self._task, self._cancelling = task, task.cancelling()
        self._when = loop.time() + self._delay
        sweeper = _sweepers.get(loop)
        if sweeper is None:
            sweeper = _sweepers[loop] = _Sweeper()
        self._sweeper = sweeper
        sweeper.add(self, loop)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._sweeper is None:
            return
        self._sweeper.blocks.pop(self, None)
        self._sweeper = None
        if self._expired and self._task is not None:
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

    def expired(self) -> bool:
        """Whether this deadline cancelled its task."""
        return self._expired

    def _expire(self) -> None:
        self._expired = True
        if self._task is not None:
            self._task.cancel()


class _Sweeper:
    """One loop's open deadlines, swept every ``TICK_S`` while there are any. (It holds no
    reference to its loop: ``_sweepers`` keys it by that loop, weakly.)"""

    __slots__ = ("blocks", "_handle")

    def __init__(self) -> None:
        self.blocks: dict[Deadline, None] = {}
        self._handle: asyncio.TimerHandle | None = None

    def add(self, block: Deadline, loop: asyncio.AbstractEventLoop) -> None:
        self.blocks[block] = None
        if self._handle is None:
            self._handle = loop.call_later(TICK_S, self._sweep)

    def _sweep(self) -> None:
        self._handle = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = [block for block in self.blocks if block._when <= now]
        for block in due:
            del self.blocks[block]
            block._expire()
        if self.blocks:
            self._handle = loop.call_later(TICK_S, self._sweep)


_sweepers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Sweeper] = (
    weakref.WeakKeyDictionary()
)
