"""Episodes on a Dask cluster: a real LocalCluster, and one started with Dask's own commands."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from grid2op.Agent import BaseAgent, DoNothingAgent, RandomAgent

from asyncrunner import AsyncRunner, EpisodeFailed, EpisodeStarted, StepBatch
from asyncrunner.sinks import CallbackSink

from .helpers import BOTH_LOOPS, children, starts

distributed = pytest.importorskip("distributed")
dask = pytest.importorskip("dask")

pytestmark = [pytest.mark.anyio, pytest.mark.slow]  # Dask clusters and their processes

ROOT = Path(__file__).resolve().parent.parent
KWARGS: dict[str, Any] = dict(
    nb_episode=4,
    max_iter=30,
    env_seeds=[1, 2, 3, 4],
    agent_seeds=[11, 12, 13, 14],
    episode_id=[0, 1, 0, 1],
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with distributed.LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        # Any free port: None still binds 8787 (dask/distributed#8136), which
        # another cluster may hold.
        dashboard_address=":0",
    ) as c:
        yield c


class Slow(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Does nothing, slowly: episodes long enough to kill or cancel mid-way."""

    delay = 0.01

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        time.sleep(self.delay)
        return self.action_space({})


class Slower(Slow):
    """A whole chronic (575 steps) takes about 30 s: a run that is not stopped shows."""

    delay = 0.05


def executing(dask_worker: Any) -> list[str]:
    """The tasks a Dask worker is running (run there by ``client.run``)."""
    return [str(ts.key) for ts in dask_worker.state.executing]


def npz_arrays(folder: Path) -> dict[str, Any]:
    found = {}
    for path in sorted(folder.rglob("*.npz")):
        if "times" in path.name:
            continue  # wall-clock timings
        with np.load(path) as data:
            for name in data.files:
                found[f"{path.relative_to(folder)}:{name}"] = data[name]
    return found


async def test_parity_with_local_pool_and_one_env_per_worker(
    env: Any, cluster: Any, tmp_path: Path
) -> None:
    async with AsyncRunner(env, agent=RandomAgent, workers=2) as runner:
        local = await runner.run(**KWARGS, path_save=tmp_path / "local")
    started, sink = starts()
    async with (
        distributed.Client(cluster.scheduler_address, asynchronous=True) as client,
        AsyncRunner(env, agent=RandomAgent, workers=2, executor=client) as runner,
    ):
        pids = set((await client.run(os.getpid)).values())
        on_dask = await runner.run(**KWARGS, path_save=tmp_path / "dask", sinks=[sink])
        again = await runner.run(**KWARGS)
    assert [r.as_tuple() for r in on_dask] == [r.as_tuple() for r in local]
    assert [r.as_tuple() for r in again] == [r.as_tuple() for r in local]
    assert [r.error for r in on_dask] == [None] * 4
    # Episode by episode: a chronic played twice goes to <name> or <name>_1 by finishing order.
    for mine, theirs in zip(local, on_dask, strict=True):
        assert mine.path is not None and theirs.path is not None
        saved_local, saved_dask = npz_arrays(Path(mine.path)), npz_arrays(Path(theirs.path))
        assert saved_local.keys() == saved_dask.keys() and saved_local
        for name, array in saved_local.items():
            np.testing.assert_array_equal(array, saved_dask[name], err_msg=name)
    assert {e.worker for e in started} <= pids
    assert {e.env_builds for e in started} == {1}  # each worker built its env once


VERSIONED = """
from grid2op.Agent import BaseAgent


class Versioned(BaseAgent):
    LINE = {line}

    def act(self, observation, reward, done=False):
        if self.LINE >= 0 and observation.current_step == 2:
            return self.action_space({{"set_line_status": [(self.LINE, -1)]}})
        return self.action_space({{}})
"""


UPLOAD_AND_PLAY = """
import importlib, json, sys
import anyio, distributed, grid2op
from lightsim2grid import LightSimBackend
from asyncrunner import AsyncRunner

address, path = sys.argv[1:]
sys.path.insert(0, path.rpartition("/")[0])
kwargs = dict(nb_episode=1, max_iter=10, env_seeds=[1], episode_id=[0])


async def main():
    env = grid2op.make("l2rpn_case14_sandbox", test=True, backend=LightSimBackend())
    agent = importlib.import_module("versioned_agent").Versioned
    async with distributed.Client(address, asynchronous=True) as client:
        await client.upload_file(path)
        async with AsyncRunner(env, agent=agent, workers=2) as runner:
            (local,) = await runner.run(**kwargs)
        async with AsyncRunner(env, agent=agent, workers=2, executor=client) as runner:
            (on_dask,) = await runner.run(**kwargs)
    print(json.dumps([local.cum_reward, on_dask.cum_reward]))

anyio.run(main)
"""


def test_an_agent_module_uploaded_again_plays_its_new_version(cluster: Any, tmp_path: Path) -> None:
    # Two evaluations, one script each, on long-lived Dask workers: after `client.upload_file`
    # (which reloads the module there), the second script's recipe pickled as the first's (the
    # same key: a worker keeps its envs across runners), and the old class played on (found
    # by the Dask hunt).
    path = tmp_path / "versioned_agent.py"
    script = tmp_path / "evaluate.py"
    script.write_text(UPLOAD_AND_PLAY)
    played = []
    for line in (-1, 3):
        path.write_text(VERSIONED.format(line=line))
        done = subprocess.run(
            [sys.executable, str(script), cluster.scheduler_address, str(path)],
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        played.append(json.loads(done.stdout.splitlines()[-1]))
    assert played[0][0] != played[1][0]  # the new version plays otherwise
    assert [on_dask for _, on_dask in played] == [local for local, _ in played]


async def test_an_env_whose_grid_file_changed_is_built_again(cluster: Any, tmp_path: Path) -> None:
    # Dask workers keep their envs across runners: a grid file edited since was not read again
    # (the recipe, its path, was the same), and the old grid played (found by the Dask hunt).
    import grid2op
    import pandapower  # type: ignore[import-untyped]

    from .conftest import LightSimBackend, make_env

    folder = tmp_path / "env"
    source = make_env()
    shutil.copytree(source.get_path_env(), folder)
    source.close()
    kwargs: dict[str, Any] = dict(nb_episode=1, max_iter=10, env_seeds=[1], episode_id=[0])
    played = []
    async with distributed.Client(cluster.scheduler_address, asynchronous=True) as client:
        for edit in (False, True):
            if edit:
                grid = pandapower.from_json(str(folder / "grid.json"))
                grid.line["x_ohm_per_km"] *= 1.5  # (the loads are the chronics')
                pandapower.to_json(grid, str(folder / "grid.json"))
            env = grid2op.make(str(folder), backend=LightSimBackend())
            async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
                (local,) = await runner.run(**kwargs)
            async with AsyncRunner(env, agent=DoNothingAgent, workers=2, executor=client) as r:
                (on_dask,) = await r.run(**kwargs)
            env.close()
            played.append((local.cum_reward, on_dask.cum_reward))
    assert played[0][0] != played[1][0]  # the edited grid plays otherwise
    assert [on_dask for _, on_dask in played] == [local for local, _ in played]


def _workers_left(before: set[int]) -> set[int]:
    """Children started since ``before``, but multiprocessing's resource tracker (it stays)."""
    left = set()
    for pid in children() - before:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in command:
            left.add(pid)
    return left


async def test_a_runner_closed_while_its_local_cluster_starts_leaves_no_process(env: Any) -> None:
    from asyncrunner.dask import DaskExecutor

    for delay in (0.3, 0.6, 0.9):  # the cluster's workers not yet started, starting, started
        before = children()
        executor = DaskExecutor(local_workers=1)
        async with AsyncRunner(env, agent=DoNothingAgent, workers=1, executor=executor):
            await anyio.sleep(delay)  # a run refused at once, a cancelled request...
        with anyio.fail_after(15):
            while _workers_left(before):  # noqa: ASYNC110 - a process exit elsewhere has no event
                await anyio.sleep(0.05)


async def test_a_scheduler_address_plays_without_sniffio(
    env: Any, cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # anyio >= 4.12 no longer installs sniffio, nor does distributed: `pip install
    # asyncrunner[dask]` has none (every episode failed "No module named 'sniffio'"). Only on
    # asyncio: trio requires sniffio.
    monkeypatch.setitem(sys.modules, "sniffio", None)
    async with AsyncRunner(
        env, agent=DoNothingAgent, workers=1, executor=cluster.scheduler_address
    ) as runner:
        results = await runner.run(nb_episode=1, max_iter=5)
    assert [(r.nb_time_step, r.error) for r in results] == [(5, None)]


async def test_a_closed_client_is_refused_saying_so(env: Any, cluster: Any) -> None:
    client = await distributed.Client(cluster.scheduler_address, asynchronous=True)
    await client.close()
    with pytest.raises(ValueError, match="the Dask client is closed"):
        AsyncRunner(env, agent=DoNothingAgent, workers=1, executor=client)


async def test_killed_dask_worker_episode_is_retried_once(env: Any, cluster: Any) -> None:
    events: list[Any] = []
    killed: list[int] = []

    def kill_mid_episode(event: Any) -> None:
        events.append(event)
        if isinstance(event, StepBatch) and event.index == 1 and not killed:
            pid = next(e.worker for e in events if isinstance(e, EpisodeStarted) and e.index == 1)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    kwargs = dict(KWARGS, nb_episode=2, max_iter=200, env_seeds=[1, 2], agent_seeds=[3, 4])
    kwargs["episode_id"] = [0, 1]
    async with (
        distributed.Client(cluster.scheduler_address, asynchronous=True) as client,
        AsyncRunner(env, agent=Slow, workers=2, executor=client) as runner,
    ):
        pids = set((await client.run(os.getpid)).values())
        results = await runner.run(**kwargs, sinks=[CallbackSink(kill_mid_episode)])
    assert killed and killed[0] in pids
    assert [r.error for r in results] == [None, None]
    assert [r.nb_time_step for r in results] == [200, 200]
    retried = [e for e in events if isinstance(e, EpisodeFailed)]
    assert [(e.index, e.attempt, e.retrying) for e in retried] == [(1, 1, True)]
    # Steps of the final attempt: each exactly once.
    for index in (0, 1):
        attempt = 2 if index == 1 else 1
        firsts = [
            e.first_step
            for e in events
            if isinstance(e, StepBatch) and e.index == index and e.attempt == attempt
        ]
        lengths = sum(
            len(e)
            for e in events
            if isinstance(e, StepBatch) and e.index == index and e.attempt == attempt
        )
        assert firsts == sorted(firsts) and lengths == 200


class CrashesOnce(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Crashes its worker process at its first step, once (the first to make ``marker``)."""

    def __init__(self, action_space: Any, marker: str) -> None:
        super().__init__(action_space)
        self.marker = marker

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return self.action_space({})
        os._exit(3)


@BOTH_LOOPS  # the cluster on this loop (asyncio), or on a thread of its own (trio)
async def test_a_local_cluster_whose_worker_is_lost_for_good_gets_it_back(
    env: Any, tmp_path: Path
) -> None:
    # A LocalCluster closes a crashed worker's nanny for good when the restarted worker is not
    # back within lost-worker-timeout (15 s; an agent crashing its worker again and again did it
    # here): with no worker left the run waited for ever, without a word.
    from asyncrunner.dask import DaskExecutor

    agent = CrashesOnce(env.action_space, str(tmp_path / "crashed"))
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "0.1s"}):
        async with AsyncRunner(
            env, agent=agent, workers=1, executor=DaskExecutor(local_workers=1)
        ) as runner:
            with anyio.fail_after(120):
                results = await runner.run(2, max_iter=5, on_error="continue")
    assert [(r.error, r.nb_time_step) for r in results] == [(None, 5), (None, 5)]


@BOTH_LOOPS  # an asynchronous client (asyncio), a synchronous one in threads (trio)
async def test_a_cluster_of_yours_left_without_workers_mid_run_is_told(
    env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the runner's opening said a scheduler had no worker: one whose workers all left
    # mid-run kept the episodes waiting without a word.
    from asyncrunner._pools import _dask

    monkeypatch.setattr(_dask, "_WORKERLESS_TOLD", 2.0)
    playing = anyio.Event()

    def note(event: Any) -> None:
        if isinstance(event, StepBatch):
            playing.set()

    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0"
    ) as local:
        address = local.scheduler_address
        told = f"at {address} has had no worker since [0-9:]+: .*dask worker {address}"
        async with AsyncRunner(env, agent=Slow, workers=1, executor=address) as runner:
            with pytest.warns(UserWarning, match=told) as warned, anyio.fail_after(120):
                async with anyio.create_task_group() as group:

                    async def lose_then_get_back_workers() -> None:
                        await playing.wait()
                        local.scale(0)
                        while not warned.list:  # noqa: ASYNC110  (a warning: no event)
                            await anyio.sleep(0.1)
                        local.scale(1)

                    group.start_soon(lose_then_get_back_workers)
                    results = await runner.run(2, max_iter=100, sinks=[CallbackSink(note)])
    assert [(r.error, r.nb_time_step) for r in results] == [(None, 100), (None, 100)]


def test_the_no_worker_warning_never_fails_a_wait_when_warnings_are_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With warnings made errors (`-W error`, pytest's filterwarnings), the warning raised in
    # the wait of the episode that looked, and failed that episode (a script's run showed it:
    # a synchronous client, 14 s without a worker). Made an error, it is not told there.
    import warnings

    from asyncrunner._pools import _dask

    monkeypatch.setattr(_dask, "_WORKERLESS_TOLD", 0.0)
    monkeypatch.setattr(_dask, "_WATCH", 0.0)
    with (
        distributed.LocalCluster(
            n_workers=0, processes=True, host="127.0.0.1", dashboard_address=":0"
        ) as local,
        distributed.Client(local) as client,
    ):
        executor = _dask.DaskExecutor(client)
        for filters in ("always", "error"):
            executor._workerless = None
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter(filters)
                executor._look(client)  # (no worker since now)
                executor._look(client)  # (told)
            assert [type(w.message) for w in warned] == (
                [UserWarning] if filters == "always" else []
            )


async def test_episodes_cancelled_by_a_cluster_restart_are_retried(env: Any) -> None:
    """``client.restart()`` cancels every task ("Please re-run your work"): a worker loss."""
    events: list[Any] = []
    playing = anyio.Event()

    def note(event: Any) -> None:
        events.append(event)
        if isinstance(event, StepBatch) and event.attempt == 1:
            playing.set()

    kwargs = dict(KWARGS, nb_episode=2, max_iter=100, env_seeds=[1, 2], agent_seeds=[3, 4])
    kwargs["episode_id"] = [0, 1]
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0"
    ) as local:
        async with (
            distributed.Client(local.scheduler_address, asynchronous=True) as client,
            AsyncRunner(env, agent=Slow, workers=2, executor=client) as runner,
            anyio.create_task_group() as tg,
        ):

            async def restart() -> None:
                await playing.wait()
                await client.restart()

            tg.start_soon(restart)
            results = await runner.run(**kwargs, sinks=[CallbackSink(note)])
    assert [(r.error, r.nb_time_step) for r in results] == [(None, 100), (None, 100)]
    failed = [e for e in events if isinstance(e, EpisodeFailed)]
    assert failed and all(e.retrying and "Dask cancelled the task" in e.message for e in failed)


async def test_cancelling_a_run_stops_the_cluster_work(env: Any, cluster: Any) -> None:
    started = anyio.Event()
    seen: list[Any] = []

    def note(event: Any) -> None:
        seen.append(event)
        if sum(isinstance(e, EpisodeStarted) for e in seen) == 2:
            started.set()

    async with (
        distributed.Client(cluster.scheduler_address, asynchronous=True) as client,
        AsyncRunner(env, agent=Slower, workers=2, executor=client) as runner,
    ):
        with anyio.fail_after(60):  # the warm-up tasks (a restarted worker builds its env)
            while any((await client.processing()).values()):  # noqa: ASYNC110
                await anyio.sleep(0.05)
        async with anyio.create_task_group() as group:

            async def play() -> None:
                await runner.run(
                    nb_episode=2, max_iter=5000, episode_id=[0, 1], sinks=[CallbackSink(note)]
                )

            group.start_soon(play)
            with anyio.fail_after(60):
                await started.wait()
            group.cancel_scope.cancel()
        cancelled = time.perf_counter()
        # Dask forgets a cancelled task at once; the worker runs it until its next send fails.
        with anyio.fail_after(20):
            while any((await client.run(executing)).values()):  # noqa: ASYNC110
                await anyio.sleep(0.05)
        stopped = time.perf_counter() - cancelled
        # The workers are free again: a new run plays at once.
        results = await runner.run(nb_episode=1, max_iter=5, episode_id=[0])
    # ≈ 1 s on an idle machine (the next batch, sent every 0.1 s, fails); the episodes
    # themselves had about 30 s left to play.
    assert stopped < 15
    assert results[0].nb_time_step == 5


async def test_a_task_whose_channel_closed_ends_without_failing_and_the_runner_is_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The runner stops a task by closing its channel: a CentralAgent's task, waiting for its
    # action, found it closed at once and failed (ChannelClosed), at times before Dask's cancel
    # reached its worker, which then logged "Compute Failed" and the traceback at each timeout
    # or cancelled run. Here the task runs in this process, without the race.
    from asyncrunner._engine import _channel
    from asyncrunner._pools import _dask

    def closed(job: Any) -> str:
        raise _channel.ChannelClosed("the runner's channel closed: EOF")

    monkeypatch.setattr(_channel, "claim", lambda *args: True)
    monkeypatch.setattr(_dask, "run_episode", closed)
    job: Any = type(
        "Job", (), dict(address="", token=b"", claim_key="r/0/0", run_id="r", index=0, attempt=0)
    )()
    # returned (Dask logs no failure), saying why
    assert _dask._dask_episode(job) == "channel closed: the runner's channel closed: EOF"

    async def run(task: Any, args: Any, key: str, claim: Any) -> Any:
        return task(*args)

    executor = _dask.DaskExecutor("tcp://127.0.0.1:1")
    monkeypatch.setattr(executor, "_run", run)
    with pytest.raises(_channel.ChannelClosed, match=r"^the runner's channel closed: EOF$"):
        await executor.play(job)  # (the pool makes it a WorkerDied, as before)


def test_a_task_that_cannot_reach_its_runner_returns_saying_so(tmp_path: Path) -> None:
    # A task Dask re-ran after its run ended (its worker lost meanwhile; the run retried the
    # episode and closed) found the run's channel gone: it raised, and its worker logged
    # "Compute Failed" with the traceback. It returns why, raised in the runner as before.
    from asyncrunner._pools import _dask

    job: Any = type("Job", (), dict(address=str(tmp_path / "gone"), token="t", claim_key="r/0/0"))()
    said = _dask._dask_episode(job)
    assert said.startswith(f"channel closed: cannot reach the runner at {tmp_path / 'gone'}: ")


@dataclass
class Commands:
    """A cluster started with Dask's own commands: its scheduler's address and process."""

    address: str
    scheduler: subprocess.Popen[bytes]


@contextmanager
def started_with_dask_commands(tmp_path: Path, first_on_path: str = "") -> Iterator[Commands]:
    """A scheduler and two workers started with Dask's own commands (the workers with
    ``first_on_path`` first on their ``PYTHONPATH``)."""
    # This interpreter's own, first: a venv's python run without activating the venv would
    # otherwise start another Python's dask command (on PATH) with this one's packages.
    here = os.path.dirname(sys.executable)
    dask = shutil.which("dask", path=here) or shutil.which("dask") or pytest.skip("no dask command")
    file = tmp_path / "scheduler.json"
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    quiet: dict[str, Any] = dict(
        cwd=ROOT, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    scheduler = [dask, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard"]
    procs = [subprocess.Popen([*scheduler, "--scheduler-file", str(file)], **quiet)]
    try:
        # The scheduler writes the file in place: wait until it holds the whole JSON.
        deadline = time.monotonic() + 60
        while True:
            try:
                address = str(json.loads(file.read_text())["address"])
                break
            except (FileNotFoundError, json.JSONDecodeError):
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    raise
                time.sleep(0.1)
        assert address.startswith("tcp://127.0.0.1:")
        worker = [dask, "worker", address, "--nthreads", "1", "--host", "127.0.0.1"]
        if first_on_path:
            quiet["env"] = dict(
                environ, PYTHONPATH=os.pathsep.join([first_on_path, str(ROOT), *sys.path])
            )
        for _ in range(2):
            procs.append(subprocess.Popen([*worker, "--no-dashboard"], **quiet))
        yield Commands(address, procs[0])
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def dask_commands(tmp_path: Path) -> Iterator[Commands]:
    with started_with_dask_commands(tmp_path) as commands:
        yield commands


async def test_scheduler_and_workers_started_with_dask_commands(
    env: Any, dask_commands: Commands
) -> None:
    from asyncrunner._pools._dask import unreachable
    from asyncrunner.dask import DaskExecutor

    # What `asyncrunner run --scheduler` checks first: a real scheduler greets as it expects.
    assert unreachable(dask_commands.address) is None
    # The scheduler's address, and the channel on TCP as for workers on other machines.
    executor = DaskExecutor(dask_commands.address, listen="tcp://127.0.0.1:0")
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2, executor=executor) as runner:
        results = await runner.run(nb_episode=2, max_iter=10, episode_id=[0, 1])
    assert [(r.name, r.nb_time_step, r.error) for r in results] == [
        ("0000", 10, None),
        ("0001", 10, None),
    ]


@BOTH_LOOPS  # an asynchronous client's futures on asyncio, a synchronous one's under trio
async def test_a_run_whose_scheduler_dies_ends_saying_so(env: Any, dask_commands: Commands) -> None:
    def kill_the_scheduler(event: Any) -> None:
        if isinstance(event, StepBatch) and dask_commands.scheduler.poll() is None:
            dask_commands.scheduler.kill()

    # The client gives up reconnecting after this (30 s by default) and closes: the episodes
    # handed to it meanwhile or after stayed pending for ever, and so did the run.
    with dask.config.set({"distributed.comm.timeouts.connect": "3s"}):
        async with AsyncRunner(
            env, agent=Slower, workers=2, executor=dask_commands.address
        ) as runner:
            with anyio.fail_after(60):
                results = await runner.run(
                    nb_episode=4, on_error="continue", sinks=[CallbackSink(kill_the_scheduler)]
                )
    assert dask_commands.scheduler.poll() is not None
    assert [r.error is not None for r in results] == [True] * 4
    errors = [r.error for r in results if r.error is not None]
    assert {e.error_type for e in errors} == {"SchedulerLost"}
    assert "the Dask client closed (it lost its scheduler" in errors[0].message


SCRIPT = """
import asyncio, json, sys, warnings
warnings.filterwarnings("ignore")
import grid2op
from grid2op.Agent import RandomAgent
from grid2op.Reward import L2RPNReward
from grid2op.Runner import Runner
from asyncrunner import AsyncRunner

class MyReward(L2RPNReward):
    def __call__(self, action, env, has_error, is_done, is_illegal, is_ambiguous):
        return 2.0 * super().__call__(action, env, has_error, is_done, is_illegal, is_ambiguous)

class MyAgent(RandomAgent):
    pass

KWARGS = dict(max_iter=10, episode_id=[0, 1], env_seeds=[1, 2], agent_seeds=[3, 4])

async def main():
    env = grid2op.make("l2rpn_case14_sandbox", test=True, reward_class=MyReward)
    async with AsyncRunner(env, agent=MyAgent, workers=2, executor=sys.argv[1]) as runner:
        results = await runner.run(nb_episode=2, **KWARGS)
    mine = [[r.error and r.error.message, r.cum_reward, r.nb_time_step] for r in results]
    theirs = Runner(**env.get_params_for_runner(), agentClass=MyAgent).run(nb_episode=2, **KWARGS)
    print(json.dumps([mine, [[None, float(r[2]), int(r[3])] for r in theirs]]))

asyncio.run(main())
"""


def test_an_agent_and_reward_defined_in_the_script_play_on_dask_workers(
    dask_commands: Commands, tmp_path: Path
) -> None:
    """A Dask worker's ``__main__`` is Dask's command: it cannot import the script's classes (every
    episode failed with "Can't get attribute 'MyAgent' on <module '__mp_main__'>")."""
    script = tmp_path / "evaluate.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), dask_commands.address],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    mine, theirs = json.loads(done.stdout.splitlines()[-1])
    assert mine == theirs


async def test_a_scheduler_without_workers_is_told_at_open(env: Any) -> None:
    # A bare `dask scheduler`: the run waited for a worker, saying nothing (the Dask hunt).
    with distributed.LocalCluster(
        n_workers=0, host="127.0.0.1", dashboard_address=":0", processes=True
    ) as bare:
        address = bare.scheduler_address
        with pytest.warns(UserWarning, match=f"at {address} has no workers: .*dask worker"):
            async with AsyncRunner(env, agent=DoNothingAgent, workers=1, executor=address):
                pass


BUILDS_SCRIPT = """
import anyio, distributed, grid2op
from grid2op.Agent import DoNothingAgent
from asyncrunner import AsyncRunner, EpisodeStarted
from asyncrunner.sinks import CallbackSink

class ScriptAgent(DoNothingAgent):
    pass

async def main(address):
    env = grid2op.make("l2rpn_case14_sandbox", test=True)
    builds = []
    sink = CallbackSink(
        lambda e: builds.append(e.env_builds) if isinstance(e, EpisodeStarted) else None,
        needs_steps=False,
    )
    async with AsyncRunner(env, agent=ScriptAgent, workers=1, executor=address) as runner:
        for _ in range(2):
            await runner.run(3, max_iter=3, sinks=[sink])
    print(builds)

if __name__ == "__main__":
    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=1, host="127.0.0.1", dashboard_address=":0"
    ) as cluster:
        anyio.run(main, cluster.scheduler_address)
"""


def test_a_script_s_agent_class_keeps_its_worker_s_env(tmp_path: Path) -> None:
    # Sent by value, the class is not its worker's `__main__.ScriptAgent` (the script imported
    # again there): taken for a module reloaded since, every episode built its env again.
    script = tmp_path / "evaluate.py"
    script.write_text(BUILDS_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [1] * 6


async def test_a_scheduler_address_nothing_answers_at_fails_at_open(env: Any) -> None:
    """Dask retries a refused connection until its timeout (30 s), at every call: the run then
    failed after 91 s, each episode with "Timed out trying to connect"."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{free.getsockname()[1]}"  # closed again: nothing listens
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=1, executor=address)
    with anyio.fail_after(20), pytest.raises(ConnectionError, match="no Dask scheduler reachable"):
        async with runner:
            pass
    with pytest.raises(
        ConnectionError, match=r"no Dask scheduler reachable at tcp://nowhere\.invalid"
    ):
        AsyncRunner(env, agent=DoNothingAgent, workers=1, executor="tcp://nowhere.invalid:8786")


async def test_workers_with_other_versions_are_refused_at_open(env: Any, tmp_path: Path) -> None:
    """Workers with another grid2op (or numpy...) failed every episode ("No module named
    'grid2op.Environment.dispatch'"), with no warning: Dask checks only its own packages."""
    other = tmp_path / "other"
    (other / "grid2op-1.0.0.dist-info").mkdir(parents=True)  # what importlib.metadata finds first
    (other / "grid2op-1.0.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: grid2op\nVersion: 1.0.0\n"
    )
    with started_with_dask_commands(tmp_path, str(other)) as commands:
        client = await distributed.Client(commands.address, asynchronous=True)
        try:
            await client.wait_for_workers(2, timeout=60)
            runner = AsyncRunner(env, agent=DoNothingAgent, workers=2, executor=client)
            with pytest.raises(
                RuntimeError, match=r"grid2op 1\.0\.0 on tcp://[^ ]+, tcp://[^ ]+ \(here: 1\.12\."
            ) as caught:
                async with runner:
                    pass
            assert "Install the same versions on the workers" in str(caught.value)

            def clients(dask_scheduler: Any) -> int:
                return len(dask_scheduler.clients)

            before = await client.run_on_scheduler(clients)
            by_address = AsyncRunner(env, agent=DoNothingAgent, executor=commands.address)
            with pytest.raises(RuntimeError, match=r"grid2op 1\.0\.0 on tcp://"):
                async with by_address:
                    pass
            # The client the runner opened is closed again (it stayed connected).
            assert await client.run_on_scheduler(clients) == before
        finally:
            await client.close()


def _ends_just_before_the_watch(start: float) -> bytes:
    time.sleep(max(0.0, start + 0.97 - time.time()))  # the client's first look is at 1 s
    return b"x" * 100_000_000  # a gather of some length


async def test_a_look_at_the_client_never_cancels_another_tasks_result() -> None:
    """Two tasks ending together share the asynchronous client's gather: waiting with a 1 s
    timeout (to look at the client) cancelled it, and the other call got a bare CancelledError
    (2 trials in 3): a run then lost episodes without an error."""
    from asyncrunner.dask import DaskExecutor

    async with (
        distributed.LocalCluster(
            n_workers=1,
            threads_per_worker=2,
            processes=True,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
            asynchronous=True,
        ) as local,
        distributed.Client(local, asynchronous=True) as client,
    ):
        await client.submit(len, "connections up")
        executor = DaskExecutor(client)
        for _ in range(3):
            start = time.time()
            results = await asyncio.gather(
                *(executor.call(_ends_just_before_the_watch, start) for _ in range(2)),
                return_exceptions=True,
            )
            assert [len(r) if isinstance(r, bytes) else r for r in results] == [100_000_000] * 2


LOCAL_SCRIPT = """
import asyncio, threading, warnings
warnings.filterwarnings("ignore")
import grid2op
from grid2op.Agent import BaseAgent
from asyncrunner import AsyncRunner
from asyncrunner.dask import DaskExecutor

LOCK = threading.Lock()  # what the agent uses, and cannot be pickled

class Locked(BaseAgent):
    def act(self, observation, reward, done=False):
        with LOCK:
            return self.action_space({})

async def main():
    env = grid2op.make("l2rpn_case14_sandbox", test=True)
    executor = DaskExecutor(local_workers=1)
    async with AsyncRunner(env, agent=Locked, workers=1, executor=executor) as runner:
        results = await runner.run(nb_episode=1, max_iter=5)
    print([(r.nb_time_step, r.error) for r in results])

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_a_script_agent_using_a_global_that_does_not_pickle_plays_on_a_local_cluster(
    tmp_path: Path,
) -> None:
    """A local cluster's workers are spawned from the script: its classes load by reference
    there. By value only, such an agent was refused ("cannot pickle '_thread.lock'")."""
    script = tmp_path / "evaluate.py"
    script.write_text(LOCAL_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "[(5, None)]"
