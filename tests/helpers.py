"""Helpers shared by several test modules (test modules never import each other)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from grid2op.Agent import BaseAgent

# For a test whose behaviour depends on the event loop (channel, cancellation, streams, central
# agents, backpressure, the pool): run it on asyncio and trio. Everything else runs on asyncio.
BOTH_LOOPS = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])

ROOT = Path(__file__).resolve().parent.parent


def run_script(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` in the script's folder, as a user runs theirs (its classes in
    ``__main__``), with this checkout importable (``tests.conftest``); 300 s at most."""
    return _python([str(script), *args], script.parent)


def run_code(code: str) -> subprocess.CompletedProcess[str]:
    """``python -c CODE`` (a ``__main__`` without a file, as a notebook's), as ``run_script``."""
    return _python(["-c", code], ROOT)


def run_module(folder: Path, name: str) -> subprocess.CompletedProcess[str]:
    """``python -m NAME`` in ``folder``, as ``run_script``."""
    return _python(["-m", name], folder)


def _python(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, "PYTHONPATH": path},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def starts() -> tuple[list[Any], Any]:
    """``(started, sink)``: a sink that appends each ``EpisodeStarted`` of a run to ``started``."""
    from asyncrunner import EpisodeStarted
    from asyncrunner.sinks import CallbackSink

    started: list[EpisodeStarted] = []
    return started, CallbackSink(
        lambda e: started.append(e) if isinstance(e, EpisodeStarted) else None
    )


def quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` without the warnings grid2op gives on the way."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Coverage paused in this process while grid2op's own side of a comparison runs (grid2op's
    Runner, its score classes): coverage measures asyncrunner only, but its tracer slows every
    line of Python by half, grid2op's included. Worker processes are traced as before."""
    import coverage

    cov = coverage.Coverage.current()
    if cov is None:
        yield
        return
    cov.stop()
    try:
        yield
    finally:
        cov.start()


def grid2ops(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, grid2op's own code (no asyncrunner in it): quiet and untraced."""
    with untraced():
        return quiet(fn, *args, **kwargs)


class SampleAgent(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """A random agent that costs nothing to build: samples its (seeded) action space."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        return self.action_space.sample()


class CutsLines(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Disconnects the most loaded line it may each step: a game over within a few steps."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        free = observation.line_status & (observation.time_before_cooldown_line == 0)
        lines = np.flatnonzero(free)
        if len(lines) == 0:
            return self.action_space({})
        line = int(lines[np.argmax(observation.rho[lines])])
        return self.action_space({"set_line_status": [(line, -1)]})


class StorageAgent(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Charges every storage unit at each step: what a score's storage cost counts."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        n = type(observation).n_storage
        return self.action_space({"set_storage": [(i, 1.0) for i in range(n)]})


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def signalled(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pids ``os.kill`` signals from now on (each signal still sent), in order."""
    pids: list[int] = []
    kill = os.kill

    def recorded(pid: int, signum: int) -> None:
        pids.append(pid)
        kill(pid, signum)

    monkeypatch.setattr(os, "kill", recorded)
    return pids


def children() -> set[int]:
    """Pids of this process's live children (zombies excluded)."""
    me = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            found.add(int(entry))
    return found


async def wait_no_children(before: set[int], seconds: float = 10) -> None:
    """Wait until every child started since ``before`` has exited."""
    with anyio.fail_after(seconds):
        while children() - before:  # noqa: ASYNC110 - a process exit elsewhere has no event
            await anyio.sleep(0.05)


async def wait_dead(pids: list[int] | set[int], seconds: float = 10) -> None:
    """Wait until none of ``pids`` is alive (processes that are not our children)."""
    with anyio.fail_after(seconds):
        while any(alive(pid) for pid in pids):  # noqa: ASYNC110 - no event for another's exit
            await anyio.sleep(0.05)
