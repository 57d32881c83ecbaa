"""``WorkerPool``: the one interface the dispatcher plays episodes through.

The kinds live in ``_pools/`` (forked processes, fresh interpreters, a ``concurrent.futures``
executor, Dask); ``AsyncRunner`` picks one. A pool says where a run's channel listens for its
workers, whether one call may play several episodes, and which of its errors mean "the worker
process is gone": ``play`` turns those into ``WorkerDied``, which the dispatcher retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._channel import ChannelClosed
from ._recipe import EpisodeJob
from ._worker import run_episode, run_episodes

__all__ = ["WorkerDied", "WorkerPool", "on_trio"]

T = TypeVar("T")

# Seconds an idle worker gets to exit on its own when its pool stops.
STOP_GRACE = 5.0

# The tasks ``_spawn`` started on asyncio, which keeps only weak references to them.
_SPAWNED: set[asyncio.Task[None]] = set()


def on_trio() -> bool:
    """Whether the calling task runs on trio (anyio's other backend), as anyio tells: by sniffio,
    which trio requires (trio's guest mode runs on an asyncio loop); without it, asyncio."""
    try:
        import sniffio
    except ImportError:
        return False
    return bool(sniffio.current_async_library() == "trio")


def _spawn(fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
    """Start ``fn(*args)`` in a task of its own, in none of the caller's task groups or cancel
    scopes (anyio has no call for that: it starts its process pool's shutdown task this way)."""
    if on_trio():
        import trio

        trio.lowlevel.spawn_system_task(fn, *args)
        return
    task = asyncio.get_running_loop().create_task(fn(*args))
    _SPAWNED.add(task)
    task.add_done_callback(_SPAWNED.discard)


def _itself(call: Coroutine[Any, Any, None]) -> Coroutine[Any, Any, None]:
    return call


class WorkerDied(Exception):
    """Raised by ``WorkerPool.play`` when the worker process playing the episodes is gone.

    ``kind``: the name of the pool's own error (``BrokenWorkerProcess``, ``KilledWorker``...),
    which the failed episode reports as its ``error_type``.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class WorkerPool(ABC):
    """At most ``limiter.total_tokens`` calls at once in worker processes, kept between calls.

    ``served``: the pids of the workers that served this pool (a worker says its pid when it
    connects to a run's channel; a warm-up call returns it).
    """

    # Where a run's channel listens for the workers ("tcp://HOST:PORT"); None: a Unix socket.
    listen: str | None = None
    # Whether one call may play several episodes (``CentralAgent(envs_per_worker=...)``).
    groups_episodes = True
    # Whether the workers are forked from this process: they start with what it holds (an env
    # held for them with ``_envs.hold`` needs no build in the worker).
    forks_this_process = False
    # Whether cancelling a call stops its worker where it stands (kills the process). Otherwise
    # (an executor's or Dask's: they cannot interrupt a running task) the episode stops at its
    # next batch of steps, when its channel is found closed, its worker busy until then.
    stops_calls = True
    # The errors of ``call`` meaning that its worker process is gone (ChannelClosed always is:
    # the worker lost the run's channel).
    died: tuple[type[BaseException], ...] = ()

    def __init__(self, limiter: anyio.CapacityLimiter) -> None:
        self.limiter = limiter
        self.served: set[int] = set()
        # The warm-up's cancel scope, and the event set once its calls have ended.
        self._warming: tuple[anyio.CancelScope, anyio.Event] | None = None
        # Warm-up calls not yet promised to a call, and their "ended" signals.
        self._warm_left = 0
        self._warm_send: MemoryObjectSendStream[None] | None = None
        self._warm_ready: MemoryObjectReceiveStream[None] | None = None

    @property
    def workers(self) -> int:
        """How many calls may run at once."""
        return int(self.limiter.total_tokens)

    @abstractmethod
    async def submit(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in a worker process; cancelling it stops that call's worker (at once
        where ``stops_calls``)."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop the worker processes this pool started (idle ones; none outlives the pool)."""

    async def warm_up(self, count: int, fn: Callable[..., int], *args: Any) -> None:
        """Start ``count`` calls of ``fn(*args)`` (returning its worker's pid) in the background.

        The first ``count`` calls then wait for one of them to end and take its (idle) worker
        rather than start more processes. They run in a task of their own, not in a task group
        of the caller's: a task group left open until ``aclose`` would have to be closed in the
        caller's task, after every one it opened since (a runner opened in a startup hook, two
        runners closed in the order opened). Once per pool: a runner entered again, or another
        runner on a shared pool, finds it warming or warm.
        """
        if self._warming is not None:
            return
        self._warm_left = count
        self._warm_send, self._warm_ready = anyio.create_memory_object_stream[None](count)
        self._warming = anyio.CancelScope(), anyio.Event()
        _spawn(self._warm, *self._warming, self._warm_send, count, fn, args)

    async def _warm(
        self,
        scope: anyio.CancelScope,
        ended: anyio.Event,
        ready: MemoryObjectSendStream[None],
        count: int,
        fn: Callable[..., int],
        args: tuple[Any, ...],
    ) -> None:
        calls = [self._warm_one(ready, fn, args) for _ in range(count)]
        try:
            with scope:
                async with anyio.create_task_group() as group:
                    for call in calls:
                        group.start_soon(_itself, call)  # (made above: closed below if unstarted)
        finally:
            for call in calls:
                # One the loop's end cancelled before it started (a runner opened in one
                # asyncio.run): closed, not printed when collected ("coroutine ... was never
                # awaited": anyio 4.16's tasks leave it so).
                if inspect.getcoroutinestate(call) == inspect.CORO_CREATED:
                    call.close()
            ended.set()

    async def _warm_one(
        self, ready: MemoryObjectSendStream[None], fn: Callable[..., int], args: tuple[Any, ...]
    ) -> None:
        try:
            self.served.add(await self.submit(fn, *args))
        except Exception:
            pass  # the first episode on this worker reports the same error, with its context
        finally:
            ready.send_nowait(None)  # its worker is free (or gone), even when cancelled

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``submit``, once a warm-up call has ended (its worker is idle) if any is running."""
        await self._warmed()
        return await self.submit(fn, *args)

    async def play(self, jobs: Sequence[EpisodeJob]) -> None:
        """Play ``jobs`` in one worker call; their events come over the run's channel."""
        await self._warmed()
        died: tuple[type[BaseException], ...] = (*self.died, ChannelClosed)
        try:
            await self.submit_episodes(jobs)
        except died as exc:
            raise WorkerDied(type(exc).__name__, str(exc) or repr(exc)) from exc

    async def submit_episodes(self, jobs: Sequence[EpisodeJob]) -> None:
        """One call playing ``jobs`` (a pool may play them its own way: Dask claims each)."""
        if len(jobs) == 1:
            await self.submit(run_episode, jobs[0])
        else:
            await self.submit(run_episodes, list(jobs))

    @property
    def warming(self) -> bool:
        """Whether the warm-up's calls are still running."""
        return self._warming is not None and not self._warming[1].is_set()

    async def _warmed(self) -> None:
        if self._warm_left and self._warm_ready is not None:
            self._warm_left -= 1
            if self.warming:
                await self._warm_ready.receive()
            else:  # ended: its calls sent what they could (none if its loop ended first)
                with contextlib.suppress(anyio.WouldBlock):
                    self._warm_ready.receive_nowait()

    async def aclose(self) -> None:
        """Stop the warm-up, then the worker processes."""
        warming, self._warming = self._warming, None
        with anyio.CancelScope(shield=True):
            if warming is not None:
                scope, ended = warming
                scope.cancel()
                await ended.wait()  # its calls' workers killed, and its streams no longer used
            for stream in (self._warm_send, self._warm_ready):
                if stream is not None:
                    stream.close()
            await self.stop()
