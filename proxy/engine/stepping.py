"""Advancing a compaction flow by one command, on the event loop or in a worker thread.

A flow (``proxy.core.commands``) is pure code between its commands: hashing and counting a
history, the transcript of a span, the key facts and loss report, the summary checks. For a
large conversation that code takes from tens of milliseconds to seconds, and on the event
loop it would hold up every other request of the process (issue #29: a 100,000-message
request froze ``/healthz`` for seconds). So the driver can run each step of a flow in a
worker thread instead: everything the flow computes is then off the loop, however it grows,
and no step can be forgotten. Only the commands' I/O (``Read``, ``Complete``, ``Persist``...)
comes back to the loop. A flow is only ever advanced by one thread at a time (the driver
awaits each step), so it needs no lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.core.commands import Command, Compute, Flow


@dataclass(frozen=True)
class Done:
    """The flow returned ``value`` (a ``StopIteration`` cannot cross a thread's future)."""

    value: Any


def advance(
    flow: Flow[Any], reply: Any, failure: BaseException | None, *, compute: bool
) -> Command | Done:
    """Send ``reply`` into ``flow`` (or throw ``failure``) and return its next command, or
    ``Done``. ``compute``: also run the ``Compute`` commands it yields, here and now (in a
    worker thread: there is no point hopping to another one)."""
    try:
        command = flow.send(reply) if failure is None else flow.throw(failure)
        while compute and isinstance(command, Compute):
            command = flow.send(command.run())
    except StopIteration as done:
        return Done(done.value)
    return command
