"""A ``compat.Runner``'s event loop (in a thread of its own) and the pool it keeps across calls."""

from __future__ import annotations

import copy
import functools
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .._engine._recipe import class_attributes, dumps
from .._model import EpisodeResult
from .._runner import AsyncRunner

__all__ = ["AgentClass", "AgentCopies", "EnvView", "Session"]

T = TypeVar("T")


class Session:
    """An event loop in a thread of its own (anyio's blocking portal) and the pool it hosts.

    The pool is an entered ``AsyncRunner``'s: opening it, each run and closing it are tasks of
    their own on that loop.
    """

    def __init__(self) -> None:
        from anyio.from_thread import start_blocking_portal

        self._portal_cm = start_blocking_portal(name="asyncrunner-compat")
        self.portal = self._portal_cm.__enter__()
        self.runner: AsyncRunner | None = None

    def run(self, runner: AsyncRunner, kwargs: dict[str, Any]) -> list[EpisodeResult]:
        """``runner.run(**kwargs)`` on the pool (``runner``'s, unless one alike is already up)."""
        current = self.runner
        if (
            current is None
            or current._recipes != runner._recipes
            or current.workers != runner.workers
        ):
            self._stop_pool()
            self.portal.call(runner.__aenter__)
            self.runner = current = runner
        return self._call(functools.partial(current.run, **kwargs))

    def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` on the loop and wait; interrupted (Ctrl+C), it cancels the run."""
        finished = threading.Event()

        async def task() -> T:
            try:
                return await fn()
            finally:
                finished.set()

        future = self.portal.start_task_soon(task)
        try:
            return future.result()
        except BaseException:
            if not future.done():
                future.cancel()
                finished.wait(30)
            raise

    def _stop_pool(self) -> None:
        runner, self.runner = self.runner, None
        if runner is not None:
            self.portal.call(runner.aclose)

    def close(self) -> None:
        try:
            self._stop_pool()
        finally:
            self._portal_cm.__exit__(None, None, None)


class AgentClass:
    """Builds ``cls(action_space)`` in the worker, with the class attributes ``cls`` has here.

    grid2op's processes are forked (on Linux): they see class attributes set at run time, such as
    the action ``OneChangeThenNothing.gen_next(...)`` stores on the class. A worker imports the
    class afresh, so the picklable ones are sent along and set before the agent is built.
    """

    def __init__(self, cls: type) -> None:
        self.cls = self._named_after = cls  # (``agent_name``: what saved episodes record)
        self.state = {}
        for name, value in class_attributes(cls).items():
            try:
                dumps(value)
            except Exception:
                continue
            self.state[name] = value
        self._set_in: int | None = None  # the process the attributes were set in

    def __call__(self, action_space: Any) -> Any:
        # Once per process, as a fork sees them: what its episodes set on the class then stays
        # for its next ones, as in a grid2op process (set before each, a class's episode counter
        # counted one episode only).
        if self._set_in != os.getpid():
            for name, value in self.state.items():
                setattr(self.cls, name, value)
            self._set_in = os.getpid()
        return self.cls(action_space)


class AgentCopies:
    """An agent instance as grid2op's Runner plays it in one process: each episode a shallow copy
    of the agent the episode before played (``Runner.init_env`` keeps the copy it makes), so
    that what an episode sets on its agent (``self.count += 1``) carries over to the next, in
    the worker that plays them."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self._named_after = type(agent)  # (``agent_name``: what saved episodes record)

    def __call__(self, action_space: Any) -> Any:
        self.agent = copy.copy(self.agent)
        return self.agent


class EnvView:
    """The runner's env, giving the runner's own parameters as ``get_params_for_runner()``."""

    def __init__(self, env: Any, params: dict[str, Any]) -> None:
        self._env = env
        self._params = params

    def get_params_for_runner(self) -> dict[str, Any]:
        return dict(self._params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)
