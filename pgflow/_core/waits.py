"""What a workflow body waits on or publishes, journaled: durable sleep, events and messages.

A wait's end is written to the journal (on the server's clock) the first time the body reaches it, at
the body's next position, so a run that replays the body after a crash or a suspension waits only what
is left. A wait longer than the App's ``suspend_after`` does not hold its worker slot: the run ends by
raising ``Suspended`` and the workflow goes back to the queue, due when the wait ends; the claim that
takes it again replays the journal up to the wait, which then returns at once.
"""

from __future__ import annotations

from datetime import UTC, datetime

from ..errors import Suspended
from .engine import Fenced, Receipt, Wake
from .execution import Execution
from .signals import News
from .signals import keys as signal_keys

SLEEP = "pgflow.sleep"
SET_EVENT = "pgflow.set_event:"  # + the key
RECV = "pgflow.recv:"  # + the topic


async def sleep(execution: Execution, seconds: float) -> None:
    """Sleep until the wake-up time journaled on the first run: in the worker slot when the time left
    is short, otherwise with the slot given back."""
    position, record = execution.entry(SLEEP, "sleep")
    if record is None:
        store = execution.store

        async def journal() -> Fenced[Wake]:
            return await store.waits.record_wake(
                execution.workflow_id, execution.attempt, execution.lease_token, position, SLEEP, seconds)

        wake = await execution.fenced(journal, "journal a sleep")
        left, until = wake.left, wake.at
    else:
        left = execution.seconds_left(record.remaining) if record.remaining is not None else 0.0
        until = record.wake_at or datetime.now(UTC)
    await hold(execution, left, until, f"sleeping (position {position})")


async def hold(execution: Execution, left: float, until: datetime, reason: str) -> None:
    """Wait ``left`` seconds in the slot, or give the slot back until ``until`` when that is long."""
    if left > execution.suspend_after:
        raise Suspended(until, reason)
    clock = execution.runtime.hub.clock
    deadline = clock.monotonic() + max(0.0, left)
    await clock.sleep(max(0.0, left), owner=execution.workflow_id)
    # A wake-up journaled by the server may be a little later than this loop's clock says.
    await clock.sleep(max(0.0, deadline - clock.monotonic()), owner=execution.workflow_id)
    execution.state.check()


async def set_event(execution: Execution, key: str, value: bytes) -> None:
    """Publish ``value`` under ``key``, journaled with it in one statement: a replay, finding the
    entry, publishes nothing again."""
    name = SET_EVENT + key
    position, record = execution.entry(name, "set_event")
    if record is not None:
        return
    store = execution.store

    async def publish() -> Fenced[None]:
        fence = await store.waits.set_event(execution.workflow_id, execution.attempt, execution.lease_token, position,
                                      name, key, value)
        return fence.with_value(None)

    await execution.fenced(publish, f"publish event {key!r}")
    execution.runtime.signals.announce(News([signal_keys.event(execution.workflow_id)]))


async def recv(execution: Execution, topic: str, timeout: float) -> bytes | None:
    """The next message on ``topic`` (its stored form), or None when ``timeout`` passes first.

    Taking a message and journaling its receipt are one statement, so after a crash the replay
    returns the message the first run took, and no message is lost or taken twice. The deadline is
    journaled by the first look, so a replay waits only what is left of it; a wait longer than
    ``suspend_after`` gives the slot back (a send to the topic makes the workflow due at once).
    """
    name = RECV + topic
    position, record = execution.entry(name, "recv")
    if record is not None and not record.waiting:
        return record.output  # the message taken, or None for a receive that timed out
    store = execution.store

    async def receive(final: bool) -> Receipt:
        async def statement() -> Fenced[Receipt]:
            return await store.waits.receive(
                execution.workflow_id, execution.attempt, execution.lease_token, position, name, topic, timeout, final)

        return await execution.fenced(statement, f"receive a message on {topic!r}")

    first = await receive(False)
    if first.taken:
        return first.value
    if first.left > execution.suspend_after:
        raise Suspended(first.deadline, f"waiting for a message on {topic!r} (position {position})", topic)

    async def look() -> tuple[bytes | None] | None:
        receipt = await receive(False)
        return (receipt.value,) if receipt.taken else None

    got = await execution.runtime.wait_for([signal_keys.message(execution.workflow_id)], look,
                                           max(0.0, first.left))
    if got is not None:
        return got[0]
    last = await receive(True)
    return last.value if last.taken else None
