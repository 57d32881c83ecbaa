"""A runner and the event loops that use it: one after another, never two at once, one async
library (its pool's limiter, locks and streams are that library's)."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import threading
from typing import Any

import anyio
import pytest
from grid2op.Agent import DoNothingAgent

from asyncrunner import AsyncRunner, AsyncRunnerError, EpisodeStarted
from asyncrunner.sinks import CallbackSink

from .helpers import alive


def steps(results: Any) -> list[int]:
    return [r.nb_time_step for r in results]


def test_a_runner_opened_in_one_asyncio_run_plays_in_the_next(env: Any) -> None:
    # The first loop ended before the warm-up's calls started (asyncio cancels them unstarted):
    # the next loop's first calls waited for ever for those calls' workers; and the calls never
    # started were printed when collected ("coroutine 'WorkerPool._warm_one' was never
    # awaited", anyio 4.16's tasks; found by a hunt: in another test, once collected later).
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=2)
    asyncio.run(runner.__aenter__())

    async def play() -> Any:
        return await asyncio.wait_for(runner.run(2, max_iter=5), 60)

    try:
        assert steps(asyncio.run(play())) == [5, 5]
        assert steps(asyncio.run(play())) == [5, 5]  # and the one after
    finally:
        asyncio.run(runner.aclose())
    assert not any(alive(pid) for pid in runner._pids)
    gc.collect()  # (what was left unawaited is reported here, as this test's)


def test_a_runner_closed_as_its_workers_fork_leaves_none_behind(env: Any) -> None:
    # The warm-up's calls as plain asyncio tasks (to close those never started) were cancelled
    # through their shield: a close during a fork left the worker forked after it, never joined
    # (a zombie), its socket to the collector (found by review: 5 closes of 5).
    def forked() -> set[int]:
        return {p.pid for p in multiprocessing.process._children}  # type: ignore[attr-defined]

    before = forked()  # (this process's other tests may leave some)

    async def main() -> set[int]:
        for i in range(3):
            with pytest.raises(RuntimeError):
                async with AsyncRunner(env, agent=DoNothingAgent, workers=2):
                    await asyncio.sleep(0.002 * (i + 1))  # the program's work, a few ms
                    raise RuntimeError("the program's task fails")
        await asyncio.sleep(0.3)
        return forked() - before

    assert asyncio.run(main()) == set()
    gc.collect()  # (a socket left to the collector is reported here, as this test's)


def test_a_runner_refuses_a_second_loop_while_one_uses_it(env: Any) -> None:
    # Two threads' asyncio.run on one runner (sync views, a thread pool): its limiter woke the
    # other loop from the wrong thread, and both waited for ever.
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=2)
    playing = threading.Event()
    results: list[Any] = []

    def on(event: Any) -> None:
        if isinstance(event, EpisodeStarted):
            playing.set()

    async def first() -> None:
        async with runner:
            results.extend(await runner.run(4, max_iter=20, sinks=[CallbackSink(on)]))

    thread = threading.Thread(target=asyncio.run, args=(first(),))
    thread.start()
    try:
        assert playing.wait(60)

        async def second() -> Any:
            return await asyncio.wait_for(runner.run(1, max_iter=5), 30)

        with pytest.raises(AsyncRunnerError, match="in use by another event loop"):
            asyncio.run(second())
    finally:
        thread.join(120)
    assert steps(results) == [20] * 4


def test_a_runner_opened_under_trio_refuses_asyncio(env: Any) -> None:
    # The run failed as if its first episode had ("must be called from async context"), and
    # the runner could not be closed any more: its workers lived on.
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=2)

    async def play() -> Any:
        return await runner.run(2, max_iter=5)

    anyio.run(runner.__aenter__, backend="trio")
    try:
        assert steps(anyio.run(play, backend="trio")) == [5, 5]
        with pytest.raises(AsyncRunnerError, match="opened under trio: it cannot serve asyncio"):
            asyncio.run(play())
        with pytest.raises(AsyncRunnerError, match="opened under trio"):
            asyncio.run(runner.aclose())
    finally:
        anyio.run(runner.aclose, backend="trio")
    assert runner._pids and not any(alive(pid) for pid in runner._pids)


def test_a_runner_under_trio_in_guest_mode_on_an_asyncio_loop(env: Any) -> None:
    # trio's guest mode (a Qt or asyncio host loop) runs trio's tasks on an asyncio loop: the
    # runner took asyncio's running loop for its own and started the warm-up's calls as asyncio
    # tasks, which failed ("must be called from async context", printed by asyncio).
    import trio

    errors: list[dict[str, Any]] = []
    results: list[Any] = []

    async def play() -> None:
        async with AsyncRunner(env, agent=DoNothingAgent, workers=1) as runner:
            results.extend(await runner.run(1, max_iter=3))

    async def host() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: errors.append(context))
        done: asyncio.Future[Any] = loop.create_future()
        trio.lowlevel.start_guest_run(
            play,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=done.set_result,
            host_uses_signal_set_wakeup_fd=True,
        )
        (await done).unwrap()
        gc.collect()  # an asyncio task's error never retrieved is said as it is collected

    asyncio.run(host())
    assert steps(results) == [3]
    assert errors == []


def test_a_loop_closed_with_the_runner_starting_is_said_so(env: Any) -> None:
    # loop.close() without cancelling its tasks (a sync wrapper's own loop) as the warm-up ran:
    # the next loop was told another loop used the runner (or, with the warm-up forgotten,
    # waited for ever for a worker the closed loop held).
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=1)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(runner.__aenter__())
    finally:
        loop.close()

    async def play() -> Any:
        return await asyncio.wait_for(runner.run(1, max_iter=5), 60)

    with pytest.raises(AsyncRunnerError, match="closed with its work unfinished"):
        asyncio.run(play())
