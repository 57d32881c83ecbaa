"""Workers of a caller's ``concurrent.futures.Executor`` (``AsyncRunner(executor=...)``)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
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


_submitting = threading.local()  # ``.now``: this thread is in ``executor.submit``


def _set_back() -> None:
    """In an executor's process forked by ``submit`` (a fork-context ``ProcessPoolExecutor``
    forks all its processes at the first call, from the event loop's thread), set back what the
    loop handed it by the fork: the signal wakeup fd, and asyncio's handlers, which ignore the
    signal (``loop.add_signal_handler(SIGTERM, ...)``, the README's recipe). With them, a process
    ended with SIGTERM (the pool ends the others so when one dies) lived on, and wrote the
    signal to the runner's loop, whose handler cancelled the whole run."""
    if getattr(_submitting, "now", False):
        _submitting.now = False
        signal.set_wakeup_fd(-1)
        for signum in signal.valid_signals():
            if getattr(signal.getsignal(signum), "__module__", None) == "asyncio.unix_events":
                signal.signal(signum, signal.SIG_DFL)


os.register_at_fork(after_in_child=_set_back)


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
                    _submitting.now = True
                    try:
                        future = self.executor.submit(fn, *args)
                    finally:
                        _submitting.now = False
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
