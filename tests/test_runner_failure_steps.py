"""A failure the orchestrator reports (a dead worker, ``episode_timeout``) names the last step
the sinks were given: the batches of that attempt still queued when it failed go first."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import numpy as np
import pytest
from grid2op.Agent import BaseAgent

from asyncrunner import (
    AsyncRunner,
    EpisodeFailed,
    EpisodeResult,
    EpisodeStarted,
    Event,
    RunFinished,
    StepBatch,
)
from asyncrunner._engine._channel import Channel
from asyncrunner._engine._dispatch import Run, RunSettings
from asyncrunner._engine._pool import WorkerDied, WorkerPool
from asyncrunner._engine._recipe import EpisodeJob
from asyncrunner._model import EpisodeRequest
from asyncrunner.sinks import CallbackSink

from .helpers import wait_dead

pytestmark = pytest.mark.anyio


def _last_row(batch: StepBatch) -> int:
    return batch.first_step + len(batch) - 1


# --- the dispatcher alone, on a pool that queues an attempt's events then fails ---------------


def _batch(run_id: str, index: int, attempt: int, first: int, rows: int) -> StepBatch:
    narrow = {name: np.zeros(rows) for name in ("rewards", "done", "legal", "ambiguous")}
    wide = ("actions", "env_actions", "observations", "disc_lines", "attacks", "other_rewards")
    return StepBatch(
        run_id,
        index,
        attempt,
        first,
        agent_times=np.zeros(rows),
        **narrow,
        **{name: np.zeros((0, 1)) for name in wide},
    )


def _started(job: EpisodeJob) -> EpisodeStarted:
    return EpisodeStarted(
        job.run_id, job.index, job.attempt, "p", "0000", 100, None, None, 1, 1, np.zeros(1), {}, {}
    )


class _Queues(WorkerPool):
    """Each call puts its attempt's start and steps 1 to 20 in the run's inbox, as a worker
    whose events wait there (a slow sink holds the collector), then fails: ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__(anyio.CapacityLimiter(1))
        self.how = how
        self.channel: Channel | None = None

    async def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError

    async def stop(self) -> None:
        pass

    async def play(self, jobs: Sequence[EpisodeJob]) -> None:
        assert self.channel is not None
        job = jobs[0]
        self.channel.send.send_nowait(_started(job))
        for first in range(1, 21, 5):
            self.channel.send.send_nowait(_batch(job.run_id, job.index, job.attempt, first, 5))
        if self.how == "timeout":
            await anyio.sleep_forever()  # until the watchdog's deadline
        await anyio.sleep(0.05)
        raise WorkerDied("BrokenWorkerProcess", "worker process 1 ended (exit code -9)")


@pytest.mark.parametrize("how", ["died", "timeout"])
async def test_a_failure_collected_after_its_queued_batches_names_their_last_step(
    how: str,
) -> None:
    pool = _Queues(how)
    settings = RunSettings(
        sinks=[],
        on_error="continue",
        retries=0,
        episode_timeout=0.1 if how == "timeout" else None,
        detail=True,
        recipes={None: ("recipe", b"")},
        agent=None,
        central=None,
        env_for=lambda mix: None,
        spaces={},
        space_files={},
    )
    run = Run(pool, [EpisodeRequest(0, 0, None, None, None, None, None)], settings)
    send, receive = anyio.create_memory_object_stream[Any](64)
    pool.channel = channel = Channel(address="", token="", send=send, receive=receive)
    emitted: list[Event] = []

    async def slow_emit(event: Event) -> None:
        if isinstance(event, StepBatch) and event.first_step == 1:
            await anyio.sleep(0.5)  # the failure comes meanwhile, behind the other batches
        emitted.append(event)

    async with send, receive:
        with anyio.fail_after(10):
            await run._dispatch_and_collect(channel, slow_emit)
    rows = [_last_row(e) for e in emitted if isinstance(e, StepBatch)]
    (failed,) = [e for e in emitted if isinstance(e, EpisodeFailed)]
    assert rows == [5, 10, 15, 20] and isinstance(emitted[-1], EpisodeFailed)
    assert failed.step == 20 and failed.steps_lost and not failed.retrying
    assert run.results[0].nb_time_step == 20 and run.results[0].error == failed
    if how == "died":
        assert failed.error_type == "BrokenWorkerProcess"
        assert "; step 20 was the last received: any steps" in failed.message
    else:
        assert failed.error_type == "EpisodeTimeout"
        assert failed.message.startswith("the episode ran longer than episode_timeout=0.1s")
    # What its worker sent after that (it wrote it before it was stopped) is dropped.
    await run._collect(_batch(run.run_id, 0, 1, 21, 5), slow_emit)
    assert len(emitted) == 6


# --- real runs ----------------------------------------------------------------------------------


class DiesAtStep400(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Takes 10 ms per action, and kills its own worker process at step 400 (a crash in a
    backend, an OOM kill): about 40 batches (one each 0.1 s) before it dies."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        time.sleep(0.01)
        if observation.current_step == 400:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.action_space({})


class TakesTenMs(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Takes 10 ms per action."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        time.sleep(0.01)
        return self.action_space({})


async def test_a_dead_worker_names_the_last_step_a_slow_sink_was_given(env: Any) -> None:
    # The sink holds its first batch until the worker is dead and its death told (the run
    # queues ~40 batches meanwhile: 32 for the sink, the rest in the channel's inbox).
    rows: list[int] = []
    failures: list[EpisodeFailed] = []
    pids: list[int] = []

    async def slow_sink(event: Event) -> None:
        if isinstance(event, EpisodeStarted):
            pids.append(event.worker)
        elif isinstance(event, StepBatch):
            if not rows:
                await wait_dead(pids, seconds=60)
                await anyio.sleep(1.0)  # the pool notices; the failure goes in the inbox
            rows.append(_last_row(event))
        elif isinstance(event, EpisodeFailed):
            failures.append(event)

    async with AsyncRunner(env, agent=DiesAtStep400, workers=1) as runner:
        with anyio.fail_after(120):
            (result,) = await runner.run(
                1, max_iter=500, retries=0, on_error="continue", sinks=[CallbackSink(slow_sink)]
            )
    (failed,) = failures
    assert result.error == failed and failed.steps_lost and failed.attempt == 1
    assert rows == sorted(rows) and rows[-1] > 300  # the steps the worker sent before dying
    assert failed.step == rows[-1] == result.nb_time_step
    assert f"; step {rows[-1]} was the last received: any steps" in failed.message


async def test_a_timed_out_episode_names_the_last_step_a_slow_stream_was_given(env: Any) -> None:
    # The stream's consumer holds its first batch past the episode's timeout (the run queues
    # ~25 batches meanwhile: 16 for the stream, the rest in the channel's inbox).
    seen: list[Any] = []
    sink_rows: list[int] = []

    def fast_sink(event: Event) -> None:
        if isinstance(event, StepBatch):
            sink_rows.append(_last_row(event))

    async with AsyncRunner(env, agent=TakesTenMs, workers=1) as runner:
        with anyio.fail_after(120):
            async with runner.stream(
                1,
                max_iter=500,
                episode_timeout=2.5,
                on_error="continue",
                sinks=[CallbackSink(fast_sink)],
            ) as events:
                async for event in events:
                    if isinstance(event, StepBatch) and not any(
                        isinstance(e, StepBatch) for e in seen
                    ):
                        await anyio.sleep(3.5)
                    seen.append(event)
    rows = [_last_row(e) for e in seen if isinstance(e, StepBatch)]
    (failed,) = [e for e in seen if isinstance(e, EpisodeFailed)]
    (finished,) = [e for e in seen if isinstance(e, RunFinished)]
    (result,) = finished.results
    assert isinstance(result, EpisodeResult) and result.error == failed
    assert failed.error_type == "EpisodeTimeout" and failed.steps_lost
    assert failed.message.endswith("its worker was stopped")
    # The steps played in its 2.5 s: many batches (one each 0.1 s) past the first, which the
    # stream held. (Counted in batches, not steps: a busy machine played fewer than 100.)
    assert rows[-1] > 5 * rows[0]
    assert failed.step == rows[-1] == sink_rows[-1] == result.nb_time_step
