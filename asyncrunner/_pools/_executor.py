"""Workers of a caller's ``concurrent.futures.Executor`` (``AsyncRunner(executor=...)``)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from .._engine import _channel
from .._engine._pool import WorkerPool
from .._engine._recipe import EpisodeJob

__all__ = ["ExecutorPool"]

T = TypeVar("T")

_SHUT_DOWN = (
    "the executor given to AsyncRunner was shut down (executor.shutdown()); pass an open one, "
    "or none (the default pool)"
)


class ExecutorPool(WorkerPool):
    """Calls submitted to ``executor``; it stays the caller's to shut down.

    A ``ProcessPoolExecutor`` that lost a process is broken for good (it fails every call,
    running, pending or later): no episode is replayed on it, each fails with a
    ``BrokenProcessPool`` that says so.
    """

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
            try:
                try:
                    future = self.executor.submit(fn, *args)
                except concurrent.futures.BrokenExecutor:
                    raise  # (a RuntimeError too) told below
                except RuntimeError as exc:  # "cannot schedule new futures after shutdown"
                    raise RuntimeError(f"{exc}: {_SHUT_DOWN}") from exc
                try:
                    return await anyio.to_thread.run_sync(
                        future.result, abandon_on_cancel=True, limiter=self._waits
                    )
                except concurrent.futures.CancelledError as exc:  # (not ours: see finally)
                    raise RuntimeError(
                        f"the executor cancelled this episode: {_SHUT_DOWN}"
                    ) from exc
                finally:
                    future.cancel()
            except BrokenProcessPool as exc:
                raise BrokenProcessPool(
                    f"{exc} A concurrent.futures pool cannot replace a dead process: this "
                    "executor fails every call from now on, and this episode cannot be "
                    "replayed on it. Pass a new executor, or none (the default pool replaces a "
                    "dead worker and replays its episode, as Dask does)"
                ) from exc

    async def submit_episodes(self, jobs: Sequence[EpisodeJob]) -> None:
        """Each attempt claimed: stopped (its episode timed out, the run ended), its connection
        is dropped and its worker stops at its next batch of steps (``Future.cancel`` cannot
        stop a running call: it played on, holding the executor's worker, the next episode
        waiting behind it)."""
        claimed = [replace(job, claim=True) for job in jobs]
        try:
            await super().submit_episodes(claimed)
        except BaseException:
            channel = _channel.listening(jobs[0].address)
            if channel is not None:
                for job in claimed:
                    channel.drop(job.claim_key)
            raise

    async def stop(self) -> None:
        return None  # the caller's executor: theirs to shut down
