"""Local worker processes forked from this one: grid2op is already imported, nothing to start.

A fresh interpreter (what ``anyio.to_process`` starts) spends about 2 s importing grid2op before it
can build an env; a forked child has it already, as in grid2op's own ``multiprocessing.Pool``. Each
worker serves one call at a time over a pipe; a call that is cancelled kills its worker (like
``anyio.to_process.run_sync(cancellable=True)``), and a worker that dies fails its call with
``BrokenWorkerProcess``.

Waiting for a worker's reply takes no thread (``anyio.wait_readable`` on its pipe): the threads
the pool does use (forking, sending a call, reading a reply that has arrived) come from a limiter
of its own. Waiting in anyio's default thread pool (40 threads, shared with the sinks' file work)
hung runs of more than 40 workers: the sinks got no thread, the workers' sends filled up, and no
call ever returned to free one.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from anyio import BrokenWorkerProcess

from .._engine._pool import STOP_GRACE, WorkerPool

__all__ = ["ForkPool", "available"]

T = TypeVar("T")


def available() -> bool:
    """Whether workers can be forked here (Linux: macOS system libraries are not fork-safe)."""
    return os.uname().sysname == "Linux" if hasattr(os, "uname") else False


def _serve(conn: Connection, inherited: list[int]) -> None:
    """A worker's life: run the calls that come over ``conn`` until it closes."""
    # Ctrl-C reaches the whole process group: the parent decides (it cancels, which kills us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)  # the parent's event loop's, not ours
    for fd in inherited:  # other workers' pipe ends: holding them would hide the parent's exit
        try:
            os.close(fd)
        except OSError:
            pass
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        fn, args = message
        try:
            reply: tuple[str, Any] = ("ok", fn(*args))
        except BaseException as exc:
            reply = ("error", exc)
        try:
            conn.send(reply)
        except OSError:  # the parent is gone (its end of the pipe closed): nobody to tell
            return
        except Exception as exc:  # a result or error that cannot be pickled
            text = "".join(traceback.format_exception(reply[1])) if reply[0] == "error" else ""
            conn.send(("error", RuntimeError(f"the worker's reply cannot be sent ({exc})\n{text}")))


class _Worker:
    def __init__(self, inherited: list[int]) -> None:
        self.conn, child = multiprocessing.Pipe()
        context = multiprocessing.get_context("fork")
        self.process = context.Process(
            target=_serve, args=(child, [*inherited, self.conn.fileno()]), daemon=True
        )
        with warnings.catch_warnings():
            # Python >= 3.12 warns when a multi-threaded process forks: the child only runs
            # _serve (no lock of another thread is taken there), as grid2op's own Pool does.
            warnings.filterwarnings(
                "ignore", "This process .* is multi-threaded", DeprecationWarning
            )
            self.process.start()
        child.close()
        assert self.process.pid is not None  # set by start()
        self.pid = self.process.pid

    async def call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], threads: anyio.CapacityLimiter
    ) -> Any:
        try:
            # A big call (an agent instance in the recipe) fills the pipe until the worker has
            # read it: sent from a thread.
            await anyio.to_thread.run_sync(self.conn.send, (fn, args), limiter=threads)
            await anyio.wait_readable(self.conn.fileno())
            status, value = await anyio.to_thread.run_sync(
                self.conn.recv, abandon_on_cancel=True, limiter=threads
            )
        except (EOFError, OSError) as exc:
            self.process.join(1.0)  # it is ending: its exit code tells how
            code = self.process.exitcode
            raise BrokenWorkerProcess(
                f"worker process {self.pid} ended (exit code {code})"
            ) from exc
        if status == "error":
            raise value
        return value

    def kill(self) -> None:
        # The pipe is left to the garbage collector: a reply's read abandoned on cancellation may
        # still be reading it in a thread (it sees EOF now), and a closed fd number can be reused.
        self.process.kill()
        self.process.join()


class ForkPool(WorkerPool):
    """At most ``limiter.total_tokens`` workers forked from this process, kept between calls."""

    died = (BrokenWorkerProcess,)
    forks_this_process = True

    def __init__(self, limiter: anyio.CapacityLimiter) -> None:
        super().__init__(limiter)
        self._threads = anyio.CapacityLimiter(limiter.total_tokens)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._forking = anyio.Lock()

    @property
    def pids(self) -> set[int]:
        """The pids of the live workers."""
        return {w.pid for w in (*self._idle, *self._busy)}

    async def submit(self, fn: Callable[..., T], *args: Any) -> T:
        async with self.limiter:
            if self._idle:
                worker = self._idle.pop()
            else:
                # One fork at a time, each child closing every other worker's parent-side
                # pipe end. Forking copies this process's page tables (tens of ms for a big
                # parent): off the event loop's thread.
                async with self._forking:
                    inherited = [w.conn.fileno() for w in (*self._idle, *self._busy)]
                    worker = await anyio.to_thread.run_sync(
                        _Worker, inherited, limiter=self._threads
                    )
            self._busy.add(worker)
            try:
                result: T = await worker.call(fn, args, self._threads)
            except BaseException as exc:
                self._busy.discard(worker)
                if isinstance(exc, Exception) and not isinstance(exc, BrokenWorkerProcess):
                    self._idle.append(worker)  # the function raised: the worker is fine
                else:  # cancelled (or dead): a worker mid-call is killed
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(worker.kill, limiter=self._threads)
                raise
            self._busy.discard(worker)
            self._idle.append(worker)
            return result

    async def stop(self) -> None:
        """Stop the idle workers: pipe closed (clean exit), killed if still there after a grace."""
        idle, self._idle = self._idle, []

        def stop() -> None:
            for worker in idle:
                worker.conn.close()
            for worker in idle:
                worker.process.join(STOP_GRACE)
                if worker.process.exitcode is None:
                    worker.process.kill()
                    worker.process.join()

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(stop, limiter=self._threads)
