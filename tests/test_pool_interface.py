"""The dispatcher through the ``WorkerPool`` interface, with a scripted pool: no process, no env.

The pool plays each episode by sending its events over the run's real channel (as a worker
would, on a socket of its own), or fails it as its script says: retries, timeouts and replays in milliseconds.
"""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import numpy as np
import pytest
from anyio import BrokenWorkerProcess

from asyncrunner._engine import _channel
from asyncrunner._engine._dispatch import Run, RunSettings
from asyncrunner._engine._pool import WorkerPool
from asyncrunner._engine._recipe import EpisodeJob
from asyncrunner._model import EpisodeFinished, EpisodeRequest, EpisodeStarted
from asyncrunner.sinks import CallbackSink

from .helpers import BOTH_LOOPS

# Cancelling and timing out calls is where the event loops differ.
pytestmark = [pytest.mark.anyio, BOTH_LOOPS]

T = TypeVar("T")


class ScriptedPool(WorkerPool):
    """Plays each attempt as ``script[(index, attempt)]`` says: "play", "die" or "hang"."""

    died = (BrokenWorkerProcess,)

    def __init__(self, script: dict[tuple[int, int], str], workers: int = 2) -> None:
        super().__init__(anyio.CapacityLimiter(workers))
        self.script = script
        self.calls: list[tuple[int, int]] = []

    async def submit(self, fn: Callable[..., T], *args: Any) -> T:
        raise AssertionError("the dispatcher plays episodes through submit_episodes")

    async def submit_episodes(self, jobs: Sequence[EpisodeJob]) -> None:
        async with self.limiter:
            for job in jobs:
                self.calls.append((job.index, job.attempt))
                action = self.script.get((job.index, job.attempt), "play")
                if action == "die":
                    raise BrokenWorkerProcess(f"worker of episode {job.index} killed")
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    await anyio.to_thread.run_sync(_hello, sock, job)
                    await anyio.to_thread.run_sync(_send, sock, _started(job))
                    if action == "hang":
                        await anyio.sleep_forever()
                    await anyio.to_thread.run_sync(_send, sock, _finished(job))

    async def stop(self) -> None:
        return None


def _hello(sock: socket.socket, job: EpisodeJob) -> None:
    # What a worker says when it connects (see _channel.connect): the run's token and its pid.
    sock.connect(job.address)
    sock.sendall(_channel.frame(f"{job.token} {os.getpid()}".encode()))


def _send(sock: socket.socket, event: Any) -> None:
    sock.sendall(_channel.frame(pickle.dumps(event, protocol=5)))


def _started(job: EpisodeJob) -> EpisodeStarted:
    return EpisodeStarted(
        run_id=job.run_id,
        index=job.index,
        attempt=job.attempt,
        chronics_path=f"chronics/{job.episode_id}",
        name=str(job.episode_id),
        max_ts=10,
        env_seed=job.env_seed,
        agent_seed=job.agent_seed,
        worker=0,
        env_builds=1,
        observation=np.zeros(0),
        parameters={},
        meta={},
    )


def _finished(job: EpisodeJob) -> EpisodeFinished:
    return EpisodeFinished(
        run_id=job.run_id,
        index=job.index,
        attempt=job.attempt,
        chronics_path=f"chronics/{job.episode_id}",
        name=str(job.episode_id),
        cum_reward=float(job.attempt),  # says which attempt finished
        cum_reward_type="float32",
        cum_reward64=float(job.attempt),
        nb_time_step=10,
        max_ts=10,
        env_seed=job.env_seed,
        agent_seed=job.agent_seed,
        nb_highres_sim=0,
        times={},
    )


def _run(pool: WorkerPool, nb: int, events: list[Any], **settings: Any) -> Run:
    requests = [EpisodeRequest(i, i, None, None, None, None, None) for i in range(nb)]
    options: dict[str, Any] = dict(
        sinks=[CallbackSink(events.append)],
        on_error="continue",
        retries=1,
        episode_timeout=None,
        detail=False,
        recipes={None: ("recipe", b"")},
        agent="scripted",
        central=None,
        env_for=lambda mix: None,
        spaces={},
        space_files={},
    )
    options.update(settings)
    return Run(pool, requests, RunSettings(**options))


async def test_a_dead_worker_is_retried_through_the_interface() -> None:
    pool = ScriptedPool({(1, 1): "die"})
    events: list[Any] = []
    with anyio.fail_after(10):
        results = await _run(pool, 3, events).execute()
    assert [r.ok for r in results] == [True, True, True]
    assert results[1].cum_reward == 2.0  # its second attempt
    assert sorted(pool.calls) == [(0, 1), (1, 1), (1, 2), (2, 1)]
    retried = [e for e in events if type(e).__name__ == "EpisodeFailed"]
    assert [(e.index, e.error_type, e.retrying) for e in retried] == [
        (1, "BrokenWorkerProcess", True)
    ]
    assert "worker of episode 1 killed" in retried[0].message


async def test_a_worker_dying_past_the_retries_fails_its_episode() -> None:
    pool = ScriptedPool({(0, 1): "die", (0, 2): "die"})
    with anyio.fail_after(10):
        results = await _run(pool, 1, []).execute()
    assert results[0].error is not None
    assert (results[0].error.error_type, results[0].error.retrying) == (
        "BrokenWorkerProcess",
        False,
    )


async def test_an_episode_past_its_timeout_is_stopped() -> None:
    pool = ScriptedPool({(0, 1): "hang"})
    with anyio.fail_after(10):
        results = await _run(pool, 2, [], episode_timeout=0.2).execute()
    assert results[0].error is not None and results[0].error.error_type == "EpisodeTimeout"
    assert results[1].ok
    assert sorted(pool.calls) == [(0, 1), (1, 1)]  # a timeout is not retried


async def test_other_errors_of_a_pool_are_not_retried() -> None:
    class Failing(ScriptedPool):
        async def submit_episodes(self, jobs: Sequence[EpisodeJob]) -> None:
            self.calls.extend((j.index, j.attempt) for j in jobs)
            raise ValueError("not a dead worker")

    pool = Failing({})
    with anyio.fail_after(10):
        results = await _run(pool, 1, []).execute()
    assert pool.calls == [(0, 1)]
    assert results[0].error is not None and results[0].error.error_type == "ValueError"
