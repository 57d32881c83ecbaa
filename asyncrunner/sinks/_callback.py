"""``CallbackSink``: hands each event to a function (sync or async)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

from .._model import Event
from ._base import Sink

__all__ = ["CallbackSink"]


class CallbackSink(Sink):
    """Calls ``fn(event)`` for every event; awaits it when ``fn`` is async.

    ``needs_steps=False`` when ``fn`` reads no step arrays (it still gets every ``StepBatch``,
    without the actions', observations' and other wide arrays' rows): if no sink of a run reads
    them, the workers do not send them. It keeps nothing per run: one may serve overlapping
    runs (``fn`` gets each run's events, told apart by their ``run_id``).
    """

    one_run_at_a_time = False

    def __init__(
        self, fn: Callable[[Event], Awaitable[None] | None], *, needs_steps: bool = True
    ) -> None:
        if not callable(fn):
            raise TypeError(f"CallbackSink(fn) needs a function of the event, got {fn!r}")
        self.fn = fn
        self.needs_steps = needs_steps

    async def send(self, event: Event) -> None:
        result = self.fn(event)
        if inspect.isawaitable(result):
            await result
