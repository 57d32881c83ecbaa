"""Workers of a caller's ``concurrent.futures.Executor`` (``AsyncRunner(executor=...)``)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from .._engine._pool import WorkerPool

__all__ = ["ExecutorPool"]

T = TypeVar("T")


class ExecutorPool(WorkerPool):
    """Calls submitted to ``executor``; it stays the caller's to shut down."""

    died = (BrokenProcessPool,)
    stops_calls = False  # Future.cancel() cannot stop a running call

    def __init__(
        self, executor: concurrent.futures.Executor, limiter: anyio.CapacityLimiter
    ) -> None:
        super().__init__(limiter)
        self.executor = executor
        # Threads waiting for a future, one per episode playing: never from anyio's default
        # pool, which the sinks need to finish (see _fork).
        self._waits = anyio.CapacityLimiter(limiter.total_tokens)

    async def submit(self, fn: Callable[..., T], *args: Any) -> T:
        async with self.limiter:
            future = self.executor.submit(fn, *args)
            try:
                return await anyio.to_thread.run_sync(
                    future.result, abandon_on_cancel=True, limiter=self._waits
                )
            finally:
                future.cancel()

    async def stop(self) -> None:
        return None  # the caller's executor: theirs to shut down
