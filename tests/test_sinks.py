from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from grid2op.Agent import BaseAgent, DoNothingAgent

from asyncrunner import (
    AsyncRunner,
    EpisodeError,
    EpisodeFailed,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    RunFinished,
    RunStarted,
    SinkError,
    StepBatch,
)
from asyncrunner._engine import _channel, _dispatch
from asyncrunner._engine._dispatch import SINK_BUFFER
from asyncrunner.sinks import (
    CallbackSink,
    CompactEpisodeWriter,
    EpisodeDataWriter,
    LoggingSink,
    ProgressBar,
    Sink,
)

from .conftest import make_env
from .helpers import CutsLines, run_code, starts

pytestmark = pytest.mark.anyio

TIMEOUT = 180  # generous: worker processes build their env on a shared machine


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
async def runner(anyio_backend: str) -> AsyncIterator[AsyncRunner]:
    """One warm DoNothing runner per backend, shared by the tests that only watch events."""
    env = make_env()
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as shared:
        yield shared
    env.close()


class Recorder:
    """A CallbackSink function that records events and lets a test wait for a count."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._changed = anyio.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, count: int) -> None:
        while len(self.events) < count:
            await self._changed.wait()


class FakeBar:
    """A tqdm-like class: records what a progress sink does with it."""

    instances: ClassVar[list[FakeBar]] = []

    def __init__(self, total: int | None = None, desc: str | None = None) -> None:
        self.total = total
        self.desc = desc
        self.n = 0
        self.totals: list[int | None] = [total]
        self.closed = False
        FakeBar.instances.append(self)

    def update(self, n: int = 1) -> None:
        self.n += n

    def refresh(self) -> None:
        self.totals.append(self.total)

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def _fresh_fake_bars() -> None:
    FakeBar.instances = []


# --- backpressure --------------------------------------------------------------------------


class HeldSink(Sink):
    """Holds its first event until the run can push no more, then keeps up.

    Records, at each event, how many events the run has emitted (seen by ``upstream``, a faster
    sink placed before it) that this sink has not finished handling.
    """

    def __init__(self, upstream: Recorder) -> None:
        self.upstream = upstream
        self.events: list[Event] = []
        self.max_lag = 0
        self.emitted_while_held: int | None = None

    async def send(self, event: Event) -> None:
        if self.emitted_while_held is None:
            with anyio.fail_after(TIMEOUT):
                await self.upstream.wait_for(SINK_BUFFER + 1)
            # The run must now be stuck on us: give it a chance to (wrongly) push past the bound
            # (the workers keep playing and sending events meanwhile).
            with anyio.move_on_after(0.5):
                await self.upstream.wait_for(SINK_BUFFER + 3)
            self.emitted_while_held = len(self.upstream.events)
        self.max_lag = max(self.max_lag, len(self.upstream.events) - len(self.events))
        self.events.append(event)


async def test_slow_sink_applies_backpressure_and_others_get_every_event(
    runner: AsyncRunner,
) -> None:
    fast = Recorder()
    slow = HeldSink(fast)
    nb_episode = 16  # 50 events: well over the bound
    with anyio.fail_after(TIMEOUT):
        results = await runner.run(nb_episode, max_iter=2, sinks=[CallbackSink(fast), slow])

    assert len(fast.events) == 2 + 3 * nb_episode
    # Bound: SINK_BUFFER queued + the one being handled + the one the fan-out gave the first sink
    # while it waits for room in this one.
    assert slow.emitted_while_held is not None
    assert SINK_BUFFER + 1 <= slow.emitted_while_held <= SINK_BUFFER + 2
    assert slow.max_lag <= SINK_BUFFER + 2
    assert slow.events == fast.events
    assert isinstance(fast.events[0], RunStarted) and isinstance(fast.events[-1], RunFinished)
    assert all(r.error is None and r.nb_time_step == 2 for r in results)


# --- CallbackSink --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [EpisodeDataWriter, CompactEpisodeWriter])
async def test_a_writer_s_failure_names_its_folder(
    runner: AsyncRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: Any
) -> None:
    # (it said "sink <asyncrunner.sinks._episode_data.EpisodeDataWriter object at 0x7f...>")
    writer = kind(tmp_path / "runs")

    def disk_full(*args: Any) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "_place", disk_full)
    named = f"sink {kind.__name__}({str(tmp_path / 'runs')!r}) failed on EpisodeFinished: OSError"
    with pytest.raises(SinkError, match=re.escape(named)), anyio.fail_after(TIMEOUT):
        await runner.run(1, max_iter=3, sinks=[writer])


async def test_callback_sink_calls_sync_and_async_functions(runner: AsyncRunner) -> None:
    sync_events: list[Event] = []
    async_events: list[Event] = []

    async def record(event: Event) -> None:
        await anyio.lowlevel.checkpoint()
        async_events.append(event)

    with anyio.fail_after(TIMEOUT):
        await runner.run(
            2, max_iter=3, sinks=[CallbackSink(sync_events.append), CallbackSink(record)]
        )

    assert sync_events == async_events
    assert isinstance(sync_events[0], RunStarted) and isinstance(sync_events[-1], RunFinished)
    finished = [e for e in sync_events if isinstance(e, EpisodeFinished)]
    assert sorted(e.index for e in finished) == [0, 1]
    assert sum(len(e) for e in sync_events if isinstance(e, StepBatch)) == 6


async def test_callback_sink_without_steps_gets_batches_without_their_arrays(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    """``needs_steps=False``: no wide arrays cross, even while the run saves its episodes."""
    events: list[Event] = []
    with anyio.fail_after(TIMEOUT):
        results = await runner.run(
            2,
            max_iter=3,
            path_save=tmp_path,
            sinks=[CallbackSink(events.append, needs_steps=False)],
        )
    batches = [e for e in events if isinstance(e, StepBatch)]
    assert sum(len(b) for b in batches) == 6 and all(b.rewards.size for b in batches)
    for name in ("actions", "env_actions", "observations", "disc_lines", "attacks"):
        assert all(getattr(b, name).shape[0] == 0 for b in batches), name
    assert all(r.path is not None for r in results)  # saved all the same, from the workers' files
    assert sorted(os.listdir(results[0].path)) == sorted(
        [
            *("_parameters.json", "episode_meta.json", "episode_times.json", "grid2op.info"),
            *("other_rewards.json", "asyncrunner.json", "agent_exec_times.npz", "actions.npz"),
            *("env_modifications.npz", "observations.npz", "opponent_attack.npz"),
            *("disc_lines_cascading_failure.npz", "rewards.npz"),
        ]
    )
    # The files' bytes went to the writer only: a sink holding its events holds none of them.
    assert [e.files for e in events if isinstance(e, EpisodeFinished)] == [{}, {}]


# --- LoggingSink ---------------------------------------------------------------------------


async def test_logging_sink_logs_episode_start_and_finish_with_times(
    runner: AsyncRunner, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="asyncrunner")
    with anyio.fail_after(TIMEOUT):
        results = await runner.run(2, max_iter=3, sinks=[LoggingSink()])

    ours = [r for r in caplog.records if r.name == "asyncrunner"]
    messages = [r.getMessage() for r in ours]
    assert all(r.levelno == logging.INFO for r in ours)
    for result in results:
        started = [
            m for m in messages if m.startswith(f"episode {result.index} ({result.name}) started")
        ]
        finished = [
            m for m in messages if m.startswith(f"episode {result.index} ({result.name}) finished")
        ]
        assert len(started) == 1 and len(finished) == 1
        assert f"cumulative reward {result.cum_reward:f}, 3/3 steps" in finished[0]
        for part in ("Env:", "apply act:", "run pf:", "observation:", "Agent:", "Total time:"):
            assert part in finished[0]
    assert any(re.match(r"run \w+ finished: 2 episodes, 0 failed", m) for m in messages)


async def test_logging_sink_uses_the_given_logger_and_level(
    runner: AsyncRunner, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="myapp")
    with anyio.fail_after(TIMEOUT):
        await runner.run(1, max_iter=2, sinks=[LoggingSink("myapp", level=logging.DEBUG)])

    ours = [r for r in caplog.records if r.name == "myapp"]
    assert any("finished" in r.getMessage() for r in ours)
    assert all(r.levelno == logging.DEBUG for r in ours)


# --- ProgressBar ---------------------------------------------------------------------------


async def test_pbar_class_builds_an_episode_bar_and_a_step_bar(runner: AsyncRunner) -> None:
    with anyio.fail_after(TIMEOUT):
        await runner.run(3, max_iter=4, pbar=FakeBar)

    episodes, steps = FakeBar.instances
    assert (episodes.desc, episodes.total, episodes.n, episodes.closed) == ("episode", 3, 3, True)
    assert (steps.desc, steps.total, steps.n, steps.closed) == ("step", 12, 12, True)
    # The step total grows by max_ts as episodes start.
    assert steps.totals[0] == 0 and steps.totals[1] == 4 and max(t or 0 for t in steps.totals) == 12


async def test_a_pbar_that_is_no_bar_is_refused_before_the_run(runner: AsyncRunner) -> None:
    # It failed the run at the first episode's end, that episode played (and saved).
    started, sink = starts()
    for pbar in (1, "yes"):
        with pytest.raises(TypeError, match="a bar with an update"):
            await runner.run(2, max_iter=2, pbar=pbar, sinks=[sink])
    assert started == []


def _tqdm_with_its_own_file() -> Any:
    """A tqdm class that gives itself a default file (``written``, a new one each call), as a
    user's drawing to a log or os.devnull does."""
    import io

    from tqdm import tqdm

    class ToItsOwnFile(tqdm):  # type: ignore[misc]  # tqdm is untyped
        written = io.StringIO()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("file", ToItsOwnFile.written)
            super().__init__(*args, **kwargs)

    return ToItsOwnFile


async def test_a_tqdm_class_choosing_its_own_file_draws_there(
    runner: AsyncRunner, capsys: pytest.CaptureFixture[str]
) -> None:
    # grid2op's Runner calls a pbar class with total= and desc= only; a tqdm subclass giving
    # itself a default file (a log, os.devnull) was made to draw on sys.stderr instead.
    ToItsOwnFile = _tqdm_with_its_own_file()

    capsys.readouterr()
    with anyio.fail_after(TIMEOUT):
        await runner.run(2, max_iter=2, pbar=ToItsOwnFile)
    assert "episode: 100%" in ToItsOwnFile.written.getvalue()
    assert "episode" not in capsys.readouterr().err


async def test_pbar_instance_is_the_episode_bar(runner: AsyncRunner) -> None:
    bar = FakeBar(total=3, desc="mine")
    with anyio.fail_after(TIMEOUT):
        await runner.run(3, max_iter=2, pbar=bar)

    assert FakeBar.instances == [bar]
    assert (bar.total, bar.n, bar.closed) == (3, 3, True)


_NO_STDERR = """
import os, sys, warnings
warnings.simplefilter("ignore")
STDERR
from grid2op.Agent import DoNothingAgent
from tqdm import tqdm
from asyncrunner import compat
from tests.conftest import make_env


class Quiet(tqdm):  # a subclass of yours, with an __init__ of its own (its file: tqdm's default)
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("mininterval", 0)
        super().__init__(*args, **kwargs)


env = make_env()
for nb_process, pbar in ((1, True), (2, True), (2, tqdm), (1, Quiet), (1, Quiet)):
    runner = compat.Runner(**env.get_params_for_runner(), agentClass=DoNothingAgent)
    print([r[3] for r in runner.run(nb_episode=2, nb_process=nb_process, max_iter=3, pbar=pbar)])
    runner.close()
"""


@pytest.mark.parametrize(
    "stderr",
    [
        "sys.stderr = None  # pythonw, `python script.py 2>&-`, a daemon that closed its fd 2",
        "sys.stderr = open(os.devnull, 'w'); sys.stderr.close()  # closed by a library",
        "r, w = os.pipe(); os.close(r); os.dup2(w, 2)  # its reader gone (`| head`)",
    ],
)
def test_pbar_true_without_a_stderr_plays_without_a_bar(stderr: str) -> None:
    # tqdm failed on the ``None`` stream (the run with it) and left its lock held by the thread
    # that drew the bar: the next bar waited forever, and so did the process at its exit (found
    # by the runtime hunt; grid2op's Runner with nb_process=2 plays, drawing no bar). A closed
    # stream (or a pipe whose reader left) failed the run: a bar's drawing never does now.
    done = run_code(_NO_STDERR.replace("STDERR", stderr))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[3,", "3]"] * 5


class NoStepsRecorder(Sink):
    needs_steps = False

    def __init__(self) -> None:
        self.batches: list[StepBatch] = []

    async def send(self, event: Event) -> None:
        if isinstance(event, StepBatch):
            self.batches.append(event)


async def test_progress_and_logging_sinks_do_not_ask_for_observations(runner: AsyncRunner) -> None:
    recorder = NoStepsRecorder()
    with anyio.fail_after(TIMEOUT):
        await runner.run(2, max_iter=3, pbar=FakeBar, sinks=[LoggingSink(), recorder])

    assert sum(len(b) for b in recorder.batches) == 6
    assert all(b.observations.size == 0 for b in recorder.batches)
    assert FakeBar.instances[1].n == 6


def _event(cls: type[Any], **given: Any) -> Any:
    """An event with ``given`` fields; the others (which ProgressBar does not read) zeroed."""
    values = {f.name: given.get(f.name, 0) for f in dataclasses.fields(cls)}
    return cls(**values)


def _batch(index: int, attempt: int, first_step: int, n: int) -> StepBatch:
    batch: StepBatch = _event(
        StepBatch, index=index, attempt=attempt, first_step=first_step, rewards=np.zeros(n)
    )
    return batch


async def test_progress_bar_uncounts_a_retried_attempt_and_shrinks_on_game_over() -> None:
    sink = ProgressBar(FakeBar)
    events = [
        _event(RunStarted, nb_episode=2),
        _event(EpisodeStarted, index=0, attempt=1, max_ts=10),
        _event(EpisodeStarted, index=1, attempt=1, max_ts=10),
        _batch(0, 1, 1, 5),
        _batch(1, 1, 1, 4),
        _event(EpisodeFailed, index=0, attempt=1, step=5, retrying=True),
        _event(EpisodeStarted, index=0, attempt=2, max_ts=10),
        _batch(0, 2, 1, 10),
        _event(EpisodeFinished, index=0, attempt=2, nb_time_step=10, max_ts=10),
        _batch(1, 1, 5, 3),  # game over at step 7 of 10
        _event(EpisodeFinished, index=1, attempt=1, nb_time_step=7, max_ts=10),
    ]
    for event in events:
        await sink.send(event)

    episodes, steps = FakeBar.instances
    assert (episodes.total, episodes.n) == (2, 2)
    assert (steps.total, steps.n) == (17, 17)
    totals = [t for t in steps.totals if t is not None]
    assert totals == steps.totals  # every refresh had a total
    assert max(totals) == 20  # the retried attempt's share was taken back
    await sink.send(_event(RunFinished, results=()))
    assert episodes.closed and steps.closed


async def test_progress_bar_counts_a_failed_episode_as_done() -> None:
    sink = ProgressBar(FakeBar)
    for event in [
        _event(RunStarted, nb_episode=1),
        _event(EpisodeStarted, index=0, attempt=1, max_ts=10),
        _batch(0, 1, 1, 3),
        _event(EpisodeFailed, index=0, attempt=1, step=3, retrying=False),
    ]:
        await sink.send(event)
    episodes, steps = FakeBar.instances
    assert (episodes.total, episodes.n) == (1, 1)
    assert (steps.total, steps.n) == (3, 3)
    await sink.aclose()
    assert episodes.closed and steps.closed


# --- failures (own runners, run last: a failed run and a closed runner stop their workers) ---


class ExplodingSink(Sink):
    def __init__(self) -> None:
        self.closed = False

    def __repr__(self) -> str:
        return "<ExplodingSink>"

    async def send(self, event: Event) -> None:
        if isinstance(event, EpisodeStarted):
            raise ValueError("boom")

    async def aclose(self) -> None:
        self.closed = True


async def test_failing_sink_fails_the_run_with_sink_error_naming_it(env: Any) -> None:
    sink = ExplodingSink()
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        with anyio.fail_after(TIMEOUT), pytest.raises(SinkError, match="ExplodingSink") as info:
            await runner.run(2, max_iter=3, sinks=[sink])
    assert "boom" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert sink.closed


class FailingToClose(Sink):
    """Fails in ``aclose`` only (a file it cannot flush, a connection already gone), and in
    ``send`` too with ``on_send``."""

    def __init__(self, on_send: bool = False) -> None:
        self.on_send = on_send

    def __repr__(self) -> str:
        return "<FailingToClose>"

    async def send(self, event: Event) -> None:
        if self.on_send and isinstance(event, EpisodeStarted):
            raise ValueError("boom in send")

    async def aclose(self) -> None:
        raise OSError("boom in aclose")


class SlowWriter(EpisodeDataWriter):
    """Saves as ``EpisodeDataWriter`` does, after a pause per episode (a slow disk)."""

    async def send(self, event: Event) -> None:
        if isinstance(event, EpisodeFinished):
            await anyio.sleep(0.3)
        await super().send(event)


class FailsOnSecondEnd(Sink):
    """Fails on the second episode end it gets; notes the ends it took."""

    def __init__(self) -> None:
        self.ended: list[int] = []

    def __repr__(self) -> str:
        return "<FailsOnSecondEnd>"

    async def send(self, event: Event) -> None:
        if isinstance(event, EpisodeFinished):
            self.ended.append(event.index)
            if len(self.ended) == 2:
                raise ValueError("boom on the second end")


async def test_a_failing_sink_leaves_the_other_sinks_their_events(env: Any, tmp_path: Path) -> None:
    """A sink failing (in aclose, or in send: the run stops) cancelled the others: a writer
    behind lost the episodes it had been given, played and reported finished."""
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        writer = SlowWriter(tmp_path / "closing")
        with anyio.fail_after(TIMEOUT), pytest.raises(SinkError, match="failed closing"):
            await runner.run(3, max_iter=3, sinks=[FailingToClose(), writer])
        assert sorted(writer.paths) == [0, 1, 2]
        writer, failing = SlowWriter(tmp_path / "sending"), FailsOnSecondEnd()
        with anyio.fail_after(TIMEOUT), pytest.raises(SinkError, match="second end") as info:
            await runner.run(4, max_iter=3, sinks=[writer, failing])
    # The writer got each end before the failing sink: it saved those, and the results say so.
    assert len(failing.ended) == 2 and set(failing.ended) <= set(writer.paths)
    saved = {r.index: r.path for r in info.value.results if r.path is not None}
    assert saved == writer.paths
    assert all([await anyio.Path(p, "episode_meta.json").is_file() for p in saved.values()])


class FailsOnFirstEnd(FailsOnSecondEnd):
    async def send(self, event: Event) -> None:
        if isinstance(event, EpisodeFinished):
            raise ValueError("boom on the first end")


class Stuck(Sink):
    """Never gets past the first episode end (a connection that hangs)."""

    async def send(self, event: Event) -> None:
        if isinstance(event, EpisodeFinished):
            await anyio.sleep_forever()


async def test_a_sink_failure_is_told_though_another_sink_is_stuck(
    env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other sinks get a grace to finish their events; a caller giving up meanwhile (a
    timeout, a request gone) gets the sink's failure, not a bare cancellation."""
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        await runner.run(1, max_iter=2)  # workers up: the failure comes well within 5 s
        with pytest.raises(SinkError, match="first end"), anyio.fail_after(5):
            await runner.run(2, max_iter=3, sinks=[FailsOnFirstEnd(), Stuck()])
        monkeypatch.setattr(_dispatch, "SINK_DRAIN_GRACE", 0.5)
        with anyio.fail_after(TIMEOUT), pytest.raises(SinkError, match="first end"):
            await runner.run(2, max_iter=3, sinks=[FailsOnFirstEnd(), Stuck()])


async def test_a_sink_failing_to_close_fails_the_run_with_sink_error_and_results(
    env: Any, tmp_path: Path
) -> None:
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        with anyio.fail_after(TIMEOUT), pytest.raises(SinkError, match="FailingToClose") as info:
            await runner.run(3, max_iter=3, path_save=tmp_path, sinks=[FailingToClose()])
        assert "failed closing (aclose): OSError: boom in aclose" in str(info.value)
        # Played and saved before the sink closed: nothing lost.
        assert [r.nb_time_step for r in info.value.results] == [3, 3, 3]
        saved = [r.path for r in info.value.results]
        assert None not in saved and all([await anyio.Path(p).is_dir() for p in saved if p])
        # Failing in send first: that error is the one raised, the closing's a note on it.
        with anyio.fail_after(TIMEOUT), pytest.raises(SinkError, match="boom in send") as info:
            await runner.run(1, max_iter=3, sinks=[FailingToClose(on_send=True)])
        assert "failed closing: OSError: boom in aclose" in "".join(info.value.__notes__)


class NeverCloses(Sink):
    """Its ``aclose`` never returns (a flush to a server that is down)."""

    def __repr__(self) -> str:
        return "<NeverCloses>"

    async def send(self, event: Event) -> None:
        pass

    async def aclose(self) -> None:
        await anyio.sleep_forever()


@pytest.mark.timeout(90)  # (the runs below hung for ever)
async def test_a_sink_that_never_closes_holds_a_stopped_run_only_its_grace(
    env: Any, monkeypatch: pytest.MonkeyPatch, anyio_backend: str
) -> None:
    # Its close was shielded without a deadline: the caller's timeout, or another sink's
    # failure, waited for ever.
    monkeypatch.setattr(_dispatch, "SINK_DRAIN_GRACE", 0.5)
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        await runner.run(1, max_iter=2)  # workers up: the runs end well within 3 s
        with pytest.raises(TimeoutError) as timed_out, anyio.fail_after(3):
            await runner.run(2, max_iter=3, sinks=[NeverCloses()])
        with pytest.raises(SinkError, match="first end") as info:
            await runner.run(2, max_iter=3, sinks=[FailsOnFirstEnd(), NeverCloses()])
        with pytest.raises(SinkError, match="first end") as failed:
            await runner.run(2, max_iter=3, sinks=[FailsOnFirstEnd(), ClosesSlowly()])
    if anyio_backend == "asyncio":  # (trio raises its Cancelled anew in each scope it leaves)
        cancelled = timed_out.value.__context__
        notes = "".join(getattr(cancelled, "__notes__", []))
        assert "NeverCloses> failed closing: TimeoutError: still closing 0.5 s after" in notes
    # The other sink's stuck close is told with the failure that stopped the run.
    assert "NeverCloses> failed closing (aclose): TimeoutError" in "".join(info.value.__notes__)
    # A sink still draining when the run's grace ended gets its own grace to close: its close
    # was cut at once (a writer left the episodes it had in its temporary folder).
    assert "ClosesSlowly" not in "".join(getattr(failed.value, "__notes__", []))
    assert ClosesSlowly.closed


class WantsTheEnd(Sink):
    """Fails to close when it was not given the run's end (a report it cannot complete)."""

    def __init__(self) -> None:
        self.ended = False

    async def send(self, event: Event) -> None:
        self.ended = self.ended or isinstance(event, RunFinished)

    async def aclose(self) -> None:
        if not self.ended:
            raise RuntimeError("closed before RunFinished")


async def test_a_sink_failing_to_close_on_the_callers_cancellation_is_told_on_it(
    runner: AsyncRunner,
) -> None:
    # The caller's cancellation became that SinkError (found by review): move_on_after let it
    # out instead of absorbing its own cancellation.
    with anyio.move_on_after(0.3) as scope:
        await runner.run(2, sinks=[WantsTheEnd()])  # (575 steps each: far longer)
    assert scope.cancelled_caught


class ClosesSlowly(Stuck):
    """Stuck on its first episode end (cancelled once the run's grace is over), then takes a
    little time to close."""

    closed = False

    def __repr__(self) -> str:
        return "<ClosesSlowly>"

    async def aclose(self) -> None:
        await anyio.sleep(0.2)
        ClosesSlowly.closed = True


class FailingAgent(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Raises on its second action."""

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        self.calls = 0

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("agent exploded")
        return self.action_space({})


async def test_logging_sink_logs_failures_with_traceback(
    env: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="asyncrunner")
    async with AsyncRunner(env, agent=FailingAgent, workers=2) as runner:
        with anyio.fail_after(TIMEOUT):
            results = await runner.run(1, max_iter=5, on_error="continue", sinks=[LoggingSink()])

    assert results[0].error is not None
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert errors[0].startswith(
        "episode 0 (attempt 1) failed after 1 step: RuntimeError: agent exploded"
    )
    assert "Traceback (most recent call last)" in errors[0]
    assert errors[0].rstrip().endswith("RuntimeError: agent exploded")


class DiesOnceThenCutsLines(CutsLines):
    """Kills its worker at its first step unless ``died`` (a file) is there, which it creates
    first; then disconnects the most loaded line it may each step (a game over within a few)."""

    died = ""  # set before the runner forks its workers

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        if not os.path.exists(self.died):
            Path(self.died).touch()
            os._exit(1)
        return super().act(observation, reward, done)


async def test_logging_sink_warns_of_a_retried_failure_and_says_a_game_overs_steps(
    env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(DiesOnceThenCutsLines, "died", str(tmp_path / "died"))
    caplog.set_level(logging.INFO, logger="asyncrunner")
    async with AsyncRunner(env, agent=DiesOnceThenCutsLines, workers=1, retries=1) as runner:
        with anyio.fail_after(TIMEOUT):
            (result,) = await runner.run(1, max_iter=20, sinks=[LoggingSink()])
    assert result.ok and 0 < result.nb_time_step < result.max_ts == 20  # a game over
    ours = [r for r in caplog.records if r.name == "asyncrunner"]
    (failed,) = [r for r in ours if " failed after " in r.getMessage()]
    # Retried: a warning, which says so (its attempt 2 played the episode).
    assert failed.levelno == logging.WARNING
    message = failed.getMessage()
    assert message.startswith("episode 0 (attempt 1) failed after 0 steps: ")
    assert message.rstrip().endswith("; retrying") or "; retrying\n" in message
    assert [r.levelno for r in ours if r is not failed] == [logging.INFO] * (len(ours) - 1)
    (finished,) = [
        r.getMessage() for r in ours if " finished: cumulative reward " in r.getMessage()
    ]
    assert finished.startswith("episode 0 (0000) finished: ")
    assert f", {result.nb_time_step}/20 steps\n" in finished


class FailsWithSeedOne(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Does nothing; in the episode seeded 1, raises once the episode seeded 0 has played 20
    steps (``playing``: a file that episode creates)."""

    playing = ""  # set before the runner forks its workers

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        self.calls, self.seeded = 0, None

    def seed(self, seed: Any) -> tuple[Any, ...]:
        self.seeded = seed
        return (seed,)

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        self.calls += 1
        if self.seeded == 0 and self.calls == 20:
            Path(self.playing).touch()
        if self.seeded == 1 and self.calls == 20:
            deadline = time.monotonic() + TIMEOUT
            while not os.path.exists(self.playing) and time.monotonic() < deadline:
                time.sleep(0.01)
            raise RuntimeError("agent exploded")
        return self.action_space({})


async def test_an_episode_stopped_by_another_ones_failure_ends_with_an_event_too(
    env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FailsWithSeedOne, "playing", str(tmp_path / "playing"))
    record = Recorder()
    async with AsyncRunner(env, agent=FailsWithSeedOne, workers=2) as runner:
        with anyio.fail_after(TIMEOUT), pytest.raises(EpisodeError, match="agent exploded"):
            await runner.run(2, agent_seeds=[0, 1], sinks=[CallbackSink(record)])
    started = [e.index for e in record.events if isinstance(e, EpisodeStarted)]
    ends = [e for e in record.events if isinstance(e, EpisodeFinished | EpisodeFailed)]
    assert sorted(started) == [0, 1]  # episode 0 (575 steps) was playing
    assert sorted(e.index for e in ends) == [0, 1]  # one end each
    assert isinstance(record.events[-1], RunFinished)
    stopped = next(e for e in ends if e.index == 0)
    assert isinstance(stopped, EpisodeFailed) and stopped.error_type == "Stopped"
    assert "episode 1 failed first" in stopped.message
    assert stopped.steps_lost and not stopped.retrying
    assert [r.index for r in record.events[-1].results] == [1]  # a stopped episode has no result


async def test_an_episode_stopped_by_another_ones_failure_is_no_failure_of_its_own(
    env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # What the user sees of it: the bar counts one failed episode, the log one error (the
    # stopped episode's end is a warning).
    ToItsOwnFile = _tqdm_with_its_own_file()

    monkeypatch.setattr(FailsWithSeedOne, "playing", str(tmp_path / "playing"))
    caplog.set_level(logging.INFO, logger="asyncrunner")
    async with AsyncRunner(env, agent=FailsWithSeedOne, workers=2) as runner:
        with anyio.fail_after(TIMEOUT), pytest.raises(EpisodeError, match="agent exploded"):
            await runner.run(2, agent_seeds=[0, 1], sinks=[LoggingSink()], pbar=ToItsOwnFile)
    failed = {
        r.getMessage().split(" ")[1]: r
        for r in caplog.records
        if r.name == "asyncrunner" and " failed after " in r.getMessage()
    }
    assert sorted(failed) == ["0", "1"]
    assert failed["1"].levelno == logging.ERROR
    assert failed["1"].getMessage().startswith("episode 1 (attempt 1) failed after 19 steps: ")
    assert failed["0"].levelno == logging.WARNING
    assert ": Stopped: " in failed["0"].getMessage().split("\n")[0]
    drawn = ToItsOwnFile.written.getvalue()
    last = [line for line in re.split(r"[\r\n]", drawn) if line.startswith("episode")][-1]
    assert "2/2" in last and last.rstrip().endswith("failed=1]"), drawn
    assert "failed=2" not in drawn


async def test_a_sink_serves_one_run_at_a_time(env: Any, tmp_path: Path) -> None:
    """A sink holds its run's state: a second run cannot share it while the first plays."""
    from asyncrunner.sinks import EpisodeDataWriter

    writer = EpisodeDataWriter(tmp_path)
    record = Recorder()
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2, sinks=[writer]) as runner:
        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as group:
                first: list[Any] = []

                async def play_first() -> None:
                    first.extend(await runner.run(1, episode_id=[0], sinks=[CallbackSink(record)]))

                group.start_soon(play_first)
                await record.wait_for(2)  # RunStarted, EpisodeStarted: the first run plays
                with pytest.raises(RuntimeError, match="already serving a run"):
                    await runner.run(1, episode_id=[1], max_iter=5)
            # The first run's episode is saved where its result says.
            assert first[0].path == str(tmp_path / "0000") and first[0].nb_time_step == 575
            saved = [p.name async for p in anyio.Path(tmp_path).iterdir() if await p.is_dir()]
            assert saved == ["0000"]
            # One run after the other, as the runner's sinks are for.
            second = await runner.run(1, episode_id=[1], max_iter=5)
            assert second[0].path == str(tmp_path / "0001")
            # the runner's, and again (it was told "already serving a run": no other run was)
            with pytest.raises(RuntimeError, match=r"is given twice to this run .*: give it once"):
                await runner.run(1, max_iter=3, sinks=[writer])


async def test_events_arrays_are_read_only(runner: AsyncRunner) -> None:
    """Every sink gets the same event: one scaling ``rewards`` in place would change the others'."""
    record = Recorder()
    with anyio.fail_after(TIMEOUT):
        await runner.run(1, max_iter=3, sinks=[CallbackSink(record)])
    arrays = [
        (type(e).__name__, name, value)
        for e in record.events
        if isinstance(e, EpisodeStarted | StepBatch)
        for name, value in vars(e).items()
        if isinstance(value, np.ndarray)
    ]
    assert {name for _, name, _ in arrays} >= {"observation", "observations", "rewards", "done"}
    assert [(kind, name) for kind, name, a in arrays if a.flags.writeable] == []


def test_logging_sink_takes_an_adapter_and_a_numpy_level() -> None:
    adapter = logging.LoggerAdapter(logging.getLogger("asyncrunner.mine"), {})
    sink = LoggingSink(adapter, level=np.int64(logging.WARNING))  # type: ignore[arg-type]
    assert sink.level == logging.WARNING and repr(sink).endswith("level=WARNING)")


@pytest.mark.parametrize(
    ("sink", "kwargs", "message"),
    [
        (CallbackSink, dict(fn=None), r"CallbackSink\(fn\) needs a function"),
        (LoggingSink, dict(logger=3), r"LoggingSink\(logger\) needs a logging.Logger"),
        (LoggingSink, dict(level="x"), r"LoggingSink\(level=\) needs a logging level"),
        (LoggingSink, dict(level=None), r"LoggingSink\(level=\) needs a logging level"),
    ],
)
def test_sinks_refuse_what_they_cannot_use(
    sink: type[Any], kwargs: dict[str, Any], message: str
) -> None:
    # They failed at the run's first event, with a raw error (or one of their repr).
    with pytest.raises(TypeError, match=message):
        sink(**kwargs)


@pytest.mark.parametrize("writer", [EpisodeDataWriter, CompactEpisodeWriter])
def test_a_writer_refuses_an_empty_path_or_a_file(writer: type[Any], tmp_path: Path) -> None:
    # An empty path (an unset shell variable) saved into the current folder.
    with pytest.raises(ValueError, match=r'\(""\) is an empty path: give a folder'):
        writer("")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        writer(tmp_path / "file")


@pytest.mark.parametrize("writer", [EpisodeDataWriter, CompactEpisodeWriter])
async def test_a_writer_whose_folder_cannot_be_made_is_refused_before_the_run(
    runner: AsyncRunner, writer: type[Any], tmp_path: Path
) -> None:
    # As path_save is: it failed at the run's start with a SinkError naming a hidden temporary
    # file, and no word of what to do.
    await anyio.Path(tmp_path / "file").write_text("")
    told = f"`{writer.__name__}.path` .* cannot be created: .* is a file, not a folder"
    with pytest.raises(ValueError, match=told):
        await runner.run(1, max_iter=3, sinks=[writer(tmp_path / "file" / "runs")])


@pytest.mark.parametrize("writer", [EpisodeDataWriter, CompactEpisodeWriter])
async def test_a_folder_removed_mid_run_gets_its_space_files_again(
    env: Any, writer: type[Any], tmp_path: Path
) -> None:
    # A cleanup job removing the folder mid-run: the later episodes were saved without the
    # dict_*_space.json files, and no reader could open them (grid2op's Runner writes them with
    # each episode).
    from grid2op.Episode import CompactEpisodeData, EpisodeData

    folder = tmp_path / "runs"

    class RemovesTheFolder(DoNothingAgent):  # type: ignore[misc]  # grid2op is untyped
        resets = 0  # in its worker: this runner's only one

        def reset(self, obs: Any) -> None:
            type(self).resets += 1
            if type(self).resets == 3:
                shutil.rmtree(folder)

    async with AsyncRunner(env, agent=RemovesTheFolder, workers=1) as removing:
        with anyio.fail_after(TIMEOUT):
            results = await removing.run(4, max_iter=3, sinks=[sink := writer(folder)])
    assert all(r.error is None for r in results)
    reader: Any = EpisodeData if writer is EpisodeDataWriter else CompactEpisodeData
    placed = [p for p in sink.paths.values() if await anyio.Path(p).exists()]
    assert sink.paths[3] in placed  # (placed after the removal: the first ones may be gone)
    for path in placed:
        name = os.path.basename(path).removesuffix(".npz")
        await anyio.to_thread.run_sync(reader.from_disk, str(folder), name)


def test_removing_work_in_progress_that_was_never_made_raises_nothing(tmp_path: Path) -> None:
    # A temporary name given but never made, where the disk says so other than by "no such
    # file" (read-only: EROFS; under a file: ENOTDIR): the writer's close failed on it, and the
    # interpreter's exit printed a traceback for it.
    from asyncrunner.sinks._writer import _delete

    (tmp_path / "file").write_text("")
    _delete(str(tmp_path / "file" / ".asyncrunner-tmp-x.part"))
    _delete(str(tmp_path / ".asyncrunner-tmp-y.part"))
    (tmp_path / "made").write_text("")
    _delete(str(tmp_path / "made"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def _rename_lines(event: Event) -> None:
    """A sink that "prettifies" the line names of the spaces it is given, in place."""
    if isinstance(event, RunStarted):
        names = event.spaces["dict_observation_space.json"]["name_line"]
        names[:] = [f"line {name}" for name in names]


async def test_a_sink_changing_the_spaces_changes_no_saved_file(
    runner: AsyncRunner, env: Any, tmp_path: Path
) -> None:
    # RunStarted.spaces was the runner's own dicts, the writers' too: a sink changing them
    # changed the dict_*_space.json of every later run.
    rename, record = CallbackSink(_rename_lines), Recorder()
    with anyio.fail_after(TIMEOUT):
        await runner.run(1, max_iter=2, sinks=[rename])
        await runner.run(1, max_iter=2, path_save=tmp_path / "later")
        await runner.run(
            1, max_iter=2, path_save=tmp_path / "same", sinks=[rename, CallbackSink(record)]
        )
    name = "dict_observation_space.json"
    expected = json.loads(json.dumps(env.observation_space.cls_to_dict()))
    for folder in ("later", "same"):
        assert json.loads((tmp_path / folder / name).read_text()) == expected
    started = record.events[0]
    assert isinstance(started, RunStarted)
    with pytest.raises(TypeError):  # the files the writers write: read-only (found by review)
        started.space_files[name] = b"{}"  # type: ignore[index]
    # Every event pickles (a sink forwarding them to another process failed on this first one).
    for event in record.events:
        again = pickle.loads(pickle.dumps(event))
        assert type(again) is type(event)
    assert dict(pickle.loads(pickle.dumps(started)).space_files) == dict(started.space_files)


class PlainSend(Sink):
    def send(self, event: Event) -> None:  # type: ignore[override]  # the mistake under test
        pass


async def test_a_sink_whose_send_is_not_async_is_refused_before_the_run(
    runner: AsyncRunner,
) -> None:
    record = Recorder()
    with pytest.raises(TypeError, match=r"PlainSend.send must be a coroutine function.*Callback"):
        await runner.run(1, max_iter=3, sinks=[CallbackSink(record), PlainSend()])
    assert record.events == []
    with pytest.raises(TypeError, match=r"PlainSend\.send"):
        AsyncRunner(runner.env, agent=DoNothingAgent, sinks=[PlainSend()])


async def test_two_writers_of_one_folder_are_refused_before_the_run(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    # Each saved every episode, the second as 0000_1: twice the files, for a slip.
    with pytest.raises(ValueError, match=r"would both save every episode in .*keep one of them"):
        await runner.run(1, max_iter=3, path_save=tmp_path, sinks=[EpisodeDataWriter(tmp_path)])
    with pytest.raises(ValueError, match=r"would both save every episode"):
        await runner.run(
            1, max_iter=3, sinks=[CompactEpisodeWriter(tmp_path), CompactEpisodeWriter(tmp_path)]
        )
    assert os.listdir(tmp_path) == []
    # One of each format may share it, as path_save and a writer of another folder may.
    [result] = await runner.run(
        1,
        max_iter=3,
        path_save=tmp_path,
        sinks=[CompactEpisodeWriter(tmp_path), EpisodeDataWriter(tmp_path / "copy")],
    )
    assert result.nb_time_step == 3 and result.path == str(tmp_path / "0000")
    assert await anyio.Path(tmp_path / "copy" / "0000").is_dir()


_SCRIPT = """
import asyncio
import warnings

warnings.simplefilter("ignore")
import grid2op
from grid2op.Agent import DoNothingAgent

from asyncrunner import AsyncRunner


async def main():
    kwargs = {{}}
    try:
        from lightsim2grid import LightSimBackend
        kwargs["backend"] = LightSimBackend()
    except ImportError:
        pass
    env = grid2op.make("l2rpn_case14_sandbox", test=True, **kwargs)
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        results = await runner.run({nb_episode}, max_iter={max_iter}, pbar=True)
    assert [r.nb_time_step for r in results] == [{max_iter}] * {nb_episode}


if __name__ == "__main__":
    asyncio.run(main())
"""

_BAR = re.compile(r"(episode|step):\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)")


@pytest.mark.slow  # a Python subprocess
def test_pbar_true_in_a_script_shows_both_bars_reaching_their_totals(tmp_path: Path) -> None:
    script = tmp_path / "run_with_pbar.py"
    script.write_text(_SCRIPT.format(nb_episode=3, max_iter=5))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    last: dict[str, tuple[int, int]] = {}
    for desc, n, total in _BAR.findall(done.stderr):
        last[desc] = (int(n), int(total))
    assert last == {"episode": (3, 3), "step": (15, 15)}, done.stderr


@pytest.mark.parametrize("no_links", [False, True], ids=["hard links", "no hard links"])
def test_compact_files_are_placed_without_replacing_any(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_links: bool
) -> None:
    import errno

    from asyncrunner.sinks import _compact

    if no_links:  # e.g. a file system without hard links: move, after checking

        def refuse(src: Any, dst: Any) -> None:
            raise OSError(errno.EPERM, "no hard links here")

        monkeypatch.setattr(os, "link", refuse)
    first, second, target = tmp_path / "a.tmp", tmp_path / "b.tmp", tmp_path / "ep.npz"
    first.write_text("first")
    second.write_text("second")
    assert _compact._move_unless_taken(str(first), str(target)) is True
    assert _compact._move_unless_taken(str(second), str(target)) is False  # taken: never replaced
    assert target.read_text() == "first" and not first.exists()


def test_compact_placing_raises_other_errors(tmp_path: Path) -> None:
    from asyncrunner.sinks import _compact

    with pytest.raises(FileNotFoundError):
        _compact._move_unless_taken(str(tmp_path / "missing.tmp"), str(tmp_path / "ep.npz"))


@pytest.mark.parametrize("detail", [False, True], ids=["quiet", "detail"])
async def test_an_episodes_last_steps_leave_with_its_end_in_one_write(
    monkeypatch: pytest.MonkeyPatch, detail: bool
) -> None:
    # Thread workers: the workers' sends are seen here. One write for the last batch and the
    # end: the orchestrator wakes once for both.
    writes: list[tuple[Any, ...]] = []
    connect = _channel.connect

    def recording(address: str, token: str) -> Any:
        send = connect(address, token)

        def recorded(*events: Any) -> None:
            writes.append(events)
            send(*events)

        return recorded

    monkeypatch.setattr(_channel, "connect", recording)
    env = make_env()
    sinks = [CallbackSink(lambda event: None, needs_steps=True)] if detail else []
    with ThreadPoolExecutor(1) as executor:
        async with AsyncRunner(env, agent=DoNothingAgent, workers=1, executor=executor) as runner:
            results = await runner.run(2, max_iter=150, episode_id=[0, 1], sinks=sinks)
    env.close()
    assert [r.nb_time_step for r in results] == [150, 150]
    ends = [w for w in writes if isinstance(w[-1], EpisodeFinished)]
    assert [tuple(map(type, w)) for w in ends] == [(StepBatch, EpisodeFinished)] * 2
    for result in results:
        batches = [
            e for w in writes for e in w if isinstance(e, StepBatch) and e.index == result.index
        ]
        assert [b.first_step for b in batches] == list(
            np.cumsum([1] + [len(b) for b in batches[:-1]])
        )
        assert sum(len(b) for b in batches) == 150
        if detail:  # by size (64 steps) or age (0.1 s): at least three for 150 steps
            assert len(batches) >= 3 and all(len(b) <= 64 for b in batches)
