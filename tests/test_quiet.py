"""asyncrunner's threads and the program's warning filters: what one sets, the other keeps."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import pytest
from grid2op.Agent import DoNothingAgent

from asyncrunner import AsyncRunner
from asyncrunner._quiet import _InThisThread, quiet, strict


def the_programs(filters: Sequence[Any]) -> list[Any]:
    """``filters`` but asyncrunner's own (which match in its threads only)."""
    return [f for f in filters if not isinstance(f[1], _InThisThread)]


def test_a_thread_quiet_or_strict_changes_no_other() -> None:
    before = list(warnings.filters)
    inside, leave = threading.Event(), threading.Event()
    seen: list[str] = []

    def ours() -> None:
        with quiet():
            warnings.warn("ignored here", UserWarning, stacklevel=1)
            with strict(), pytest.raises(UserWarning):
                warnings.warn("raised here", UserWarning, stacklevel=1)
            inside.set()
            assert leave.wait(10)
        seen.append("done")

    thread = threading.Thread(target=ours)
    thread.start()
    assert inside.wait(10)
    # Meanwhile the program's thread sets a filter of its own for a moment, and warns: its
    # filters, not ours, hold here.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="the program's")
        leave.set()
        thread.join(10)
        with pytest.raises(UserWarning):
            warnings.warn("the program's", UserWarning, stacklevel=1)
    with pytest.warns(UserWarning, match="shown"):
        warnings.warn("shown", UserWarning, stacklevel=1)
    assert seen == ["done"]
    assert the_programs(warnings.filters) == before


def test_runners_leave_the_programs_warning_filters_as_they_were(env: Any) -> None:
    # A runner's threads (the env built for its workers, each fork) set filters with
    # warnings.catch_warnings, which saves the whole process's and puts them back: while the
    # program's thread held a filter of its own for a moment (grid2op's reset does), that
    # filter stayed for good (every later warning raised), or one of asyncrunner's did (every
    # later warning ignored) (found by a hunt: 3 runners of 3). Here, forks during runs (more
    # workers than CPUs): an env build parses its grid with pandas, whose own catch_warnings
    # can still do so (Python < 3.14).
    before = list(warnings.filters)

    async def busy(stop: asyncio.Event) -> None:
        while not stop.is_set():
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="the program's")
                time.sleep(0.0005)  # noqa: ASYNC251 - work under the filter, the GIL let go
            await asyncio.sleep(0)

    async def main() -> None:
        for _ in range(3):
            async with AsyncRunner(env, agent=DoNothingAgent, workers=6) as runner:
                await runner.run(1, max_iter=1)  # open, its env held, its first workers forked
                stop = asyncio.Event()
                task = asyncio.create_task(busy(stop))
                try:
                    results = await runner.run(6, max_iter=3)
                finally:
                    stop.set()
                    await task
                assert [r.nb_time_step for r in results] == [3] * 6

    asyncio.run(main())
    assert the_programs(warnings.filters) == before


def warns_once() -> None:
    warnings.warn("shown once", UserWarning, stacklevel=1)


def test_strict_raises_a_warning_already_shown_once() -> None:
    # Shown once under "default", a warning is in its module's registry, which let it pass
    # before any filter was read: an init state refused before the run was let through once the
    # program had built the same action (found by review).
    shown: list[Any] = []
    with warnings.catch_warnings():
        warnings.resetwarnings()  # no filter: "default"
        warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
        with strict():
            pass  # (its filter now first)
        warns_once()
        assert shown == ["shown once"]
        with strict(), pytest.raises(UserWarning):
            warns_once()


class WarnsAtStepTwo(DoNothingAgent):  # type: ignore[misc]  # grid2op is untyped
    def act(self, observation: Any, reward: Any, done: bool = False) -> Any:
        if observation.current_step == 2:
            warnings.warn("the agent's warning", UserWarning, stacklevel=1)
        return super().act(observation, reward, done)


def test_a_workers_warnings_follow_the_programs_filters(env: Any) -> None:
    # The worker was forked inside the forking thread's quiet(), which it never left: every
    # warning was ignored in every worker (an agent's warning under "error" played on, where
    # grid2op's Runner raises it) (found by review).
    async def main() -> Any:
        async with AsyncRunner(env, agent=WarnsAtStepTwo, workers=1) as runner:
            return await runner.run(1, max_iter=5, on_error="continue")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (result,) = asyncio.run(main())
    assert result.error is not None
    assert (result.error.error_type, result.error.message) == ("UserWarning", "the agent's warning")


def test_workers_forked_later_take_the_filters_the_event_loop_sees(env: Any) -> None:
    # A worker forked (from the thread that forks) while a task of the program held a filter of
    # its own for a moment kept it for its whole life: here its "ignore", and the agent's
    # warning, an error in grid2op's Runner, played on (found by review). Workers forked during
    # the run (more than the CPUs), with no env being built meanwhile.
    async def busy(stop: asyncio.Event) -> None:
        while not stop.is_set():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                time.sleep(0.005)  # noqa: ASYNC251 - the program's work, the GIL let go
            await asyncio.sleep(0.001)

    async def main() -> Any:
        async with AsyncRunner(env, agent=WarnsAtStepTwo, workers=8) as runner:
            await runner.run(1, max_iter=1)  # the runner open, its env held
            stop = asyncio.Event()
            task = asyncio.create_task(busy(stop))
            try:
                return await runner.run(8, max_iter=5, on_error="continue")
            finally:
                stop.set()
                await task

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = asyncio.run(main())
    assert [r.error.error_type if r.error else None for r in results] == ["UserWarning"] * 8
