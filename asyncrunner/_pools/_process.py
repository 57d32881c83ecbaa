"""Local workers as fresh interpreters (``anyio.to_process``): where forking is not safe."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_process
from anyio import BrokenWorkerProcess
from anyio.abc import Process

from .._engine._pool import STOP_GRACE, WorkerPool

__all__ = ["ProcessPool"]

T = TypeVar("T")


class ProcessPool(WorkerPool):
    """anyio's pool of worker interpreters (each first spends about 2 s importing grid2op)."""

    died = (BrokenWorkerProcess,)

    async def submit(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await anyio.to_process.run_sync(
                fn, *args, cancellable=True, limiter=self.limiter
            )
        except BrokenWorkerProcess as exc:
            # A new worker runs this process's main script by its file first (as
            # ``__mp_main__``): what it raised there was a worker death with no cause given.
            if str(exc) != "Error during worker process initialization" or exc.__cause__ is None:
                raise
            script = getattr(sys.modules["__main__"], "__file__", None)
            raise RuntimeError(
                f"a worker process could not run your main script {script} "
                f"({type(exc.__cause__).__name__}: {exc.__cause__}): each worker runs it by its "
                'file, as "__mp_main__" (this process does not fork its workers here); make it '
                "run that way: absolute imports rather than relative ones, and the script's "
                'own work under `if __name__ == "__main__":`'
            ) from exc.__cause__

    async def stop(self) -> None:
        # anyio keeps its process pool per event loop and has no public way to stop it; we stop
        # the idle processes that served this pool so none outlives it.
        try:
            workers = anyio.to_process._process_pool_workers.get()
            idle = anyio.to_process._process_pool_idle_workers.get()
        except LookupError:
            return
        mine = [entry for entry in idle if entry[0].pid in self.served]
        for entry in mine:
            idle.remove(entry)
            workers.discard(entry[0])
        async with anyio.create_task_group() as group:
            for process, _ in mine:
                group.start_soon(_stop_process, process)


async def _stop_process(process: Process) -> None:
    # Closing its stdin ends an anyio worker cleanly (it exits on EOF, running atexit hooks);
    # one that does not exit in time is killed.
    if process.stdin is not None:
        await process.stdin.aclose()
    with anyio.move_on_after(STOP_GRACE):
        await process.wait()
    if process.returncode is None:
        process.kill()
    await process.aclose()
