"""Hostile conditions around the channel and the pool: strangers on the socket, a 1,024 open-file
limit, more workers than anyio's thread pool, absurd `workers`, a Dask dashboard, killed runs."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import multiprocessing
import os
import pickle
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import psutil  # type: ignore[import-untyped]
import pytest
from grid2op.Agent import BaseAgent, DoNothingAgent

import asyncrunner._runner
from asyncrunner import AsyncRunner, RunFinished, RunStarted
from asyncrunner._engine import _channel
from asyncrunner._engine._channel import frame, open_channel

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The channel's loop matters: both loops (tests that spawn processes ask for asyncio)."""
    return str(request.param)


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def private_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Channel folders go to a temp dir of this test's own (other runs share the real one): a
    short one, where a socket's path fits (pytest's tmp_path may be too deep for one)."""
    folder = tempfile.mkdtemp(prefix="ar-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


def worker_children() -> set[int]:
    return {p.pid for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE}


def played(results: Any) -> list[tuple[float, int]]:
    return [(r.cum_reward, r.nb_time_step) for r in results]


def stranger(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    return sock


async def hung_up_on(sock: socket.socket) -> None:
    """Wait until the runner closes ``sock``."""
    with anyio.fail_after(5):
        await anyio.wait_readable(sock)
    assert closed_by_peer(sock)


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (without waiting when it did not)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


# --- 1. one connection's errors stay with that connection ------------------------------------


async def test_a_non_ascii_token_closes_that_connection_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, "asyncrunner")
    async with open_channel() as channel:
        # hmac.compare_digest raises TypeError on str holding non-ASCII characters.
        with stranger(channel.address) as bad:
            bad.sendall(frame("clé-privée 1".encode()))
            await hung_up_on(bad)
        with stranger(channel.address) as worker:
            worker.sendall(frame(f"{channel.token} {os.getpid()}".encode()))
            worker.sendall(frame(pickle.dumps({"step": 1})))
            with anyio.fail_after(5):
                assert await channel.receive.receive() == {"step": 1}
        assert channel.rejected == 1
    assert "1 connection(s) closed without serving them" in caplog.text


async def test_an_unreadable_frame_closes_that_connection_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with open_channel() as channel:
        # A worker with the token (another version of asyncrunner, say) sends what this
        # process cannot unpickle: its connection is closed, the channel goes on.
        with stranger(channel.address) as broken:
            broken.sendall(frame(f"{channel.token} 1".encode()))
            broken.sendall(frame(b"\x80\x05not a pickle"))
            await hung_up_on(broken)
        with stranger(channel.address) as worker:
            worker.sendall(frame(f"{channel.token} 2".encode()))
            worker.sendall(frame(pickle.dumps("still listening")))
            with anyio.fail_after(5):
                assert await channel.receive.receive() == "still listening"
        assert channel.rejected == 1
    assert "closing a worker's connection" in caplog.text


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_stranger_does_not_end_a_run(env: Any, private_tmp: Path) -> None:
    seeded: dict[str, Any] = dict(max_iter=10, env_seeds=[1, 2], episode_id=[0, 1])
    async with AsyncRunner(env, agent=DoNothingAgent, workers=1) as runner:
        undisturbed = await runner.run(2, **seeded)
        async with runner.stream(2, **seeded) as events:
            async for event in events:
                if isinstance(event, RunStarted):
                    [address] = [p async for p in anyio.Path(private_tmp).glob("*/channel")]
                    with stranger(str(address)) as bad:
                        bad.sendall(frame("ünïcode 1".encode()))
                elif isinstance(event, RunFinished):
                    results = event.results
    assert played(results) == played(undisturbed)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_temporary_folder_too_deep_for_a_unix_socket(
    env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch job's TMPDIR deep in a scratch folder: a Unix socket's path holds 107 bytes at
    # most, and binding the channel there failed every run ("AF_UNIX path too long").
    deep = tmp_path / ("scratch-" + "x" * max(1, 110 - len(str(tmp_path))))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        results = await runner.run(2, max_iter=5, path_save=tmp_path / "runs")
    assert [(r.nb_time_step, r.error) for r in results] == [(5, None), (5, None)]


# --- 2. idle connections and running out of open files ---------------------------------------


async def test_connections_waiting_for_their_hello_are_bounded() -> None:
    async with open_channel() as channel:
        idle = [stranger(channel.address) for _ in range(120)]  # within the listen backlog
        try:
            await hung_up_on(idle[0])
            await anyio.wait_all_tasks_blocked()
            # The oldest were dropped; the newest wait; the run's own workers still get in.
            dropped = len(idle) - _channel._MAX_WAITING
            assert channel.rejected == dropped
            assert all(closed_by_peer(s) for s in idle[:dropped])
            assert not any(closed_by_peer(s) for s in idle[dropped:])
            with stranger(channel.address) as worker:
                worker.sendall(frame(f"{channel.token} {os.getpid()}".encode()))
                worker.sendall(frame(pickle.dumps("in")))
                with anyio.fail_after(5):
                    assert await channel.receive.receive() == "in"
        finally:
            for s in idle:
                s.close()


async def test_accept_survives_running_out_of_open_files() -> None:
    async with open_channel() as channel:
        worker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # its file, made beforehand
        files = len(os.listdir("/proc/self/fd"))
        idle = [stranger(channel.address) for _ in range(3)]
        try:
            with anyio.fail_after(10):  # accepted: one more file each in this process
                while len(os.listdir("/proc/self/fd")) < files + 6:  # noqa: ASYNC110 - no event tells of an accept
                    await anyio.sleep(0.01)
            # This process may open no more file: the next one would be this number.
            lowest_free = os.dup(0)
            os.close(lowest_free)
            limits = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, limits[1]))
            try:
                # accept() fails with EMFILE: the oldest connection without a hello makes room.
                worker.connect(channel.address)
                worker.sendall(frame(f"{channel.token} {os.getpid()}".encode()))
                worker.sendall(frame(pickle.dumps("room made")))
                with anyio.fail_after(10):
                    assert await channel.receive.receive() == "room made"
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            assert closed_by_peer(idle[0])
            assert not closed_by_peer(idle[2])
        finally:
            worker.close()
            for s in idle:
                s.close()


FLOODED = """
import json, os, resource, sys, time, warnings
from pathlib import Path
import anyio, grid2op
from grid2op.Agent import BaseAgent
from lightsim2grid import LightSimBackend
import asyncrunner._runner
from asyncrunner import AsyncRunner, RunFinished, RunStarted

GO = Path(sys.argv[1])
SEEDED = dict(max_iter=20, env_seeds=[1, 2, 3, 4], episode_id=[0, 1, 0, 1])


class WaitsForGo(BaseAgent):
    # Holds its episode until the test says go: the run is still playing during the flood.
    def act(self, observation, reward, done=False):
        deadline = time.monotonic() + 120
        while not GO.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.action_space({})


async def main():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = grid2op.make("l2rpn_case14_sandbox", test=True, backend=LightSimBackend())
    async with AsyncRunner(env, agent=WaitsForGo, workers=2) as runner:
        GO.touch()
        undisturbed = await runner.run(4, **SEEDED)
        GO.unlink()
        async with runner.stream(4, **SEEDED) as events:
            async for event in events:
                if isinstance(event, RunStarted):
                    print("ready", *runner._pool.pids, flush=True)
                elif isinstance(event, RunFinished):
                    flooded = event.results
    print(json.dumps([[(r.cum_reward, r.nb_time_step) for r in rs] for rs in (undisturbed, flooded)]))

anyio.run(main)
"""


@pytest.mark.slow
def test_a_thousand_idle_connections_do_not_end_a_run(tmp_path: Path) -> None:
    # The run lives in a process limited to 1,024 open files; this one (the stranger) opens
    # 1,200 connections to its channel, and kills one of its workers meanwhile: the replacement
    # must get in, and the run must finish with the results of an undisturbed one.
    script = tmp_path / "flooded.py"
    script.write_text(FLOODED)
    go = tmp_path / "go"
    child_env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    victim = subprocess.Popen(
        [sys.executable, str(script), str(go)],
        stdout=subprocess.PIPE,
        env=child_env,
        text=True,
        cwd=tmp_path,
    )
    flood: list[socket.socket] = []
    try:
        assert victim.stdout is not None
        ready = victim.stdout.readline().split()
        assert ready[0] == "ready", ready
        [address] = tmp_path.glob("asyncrunner-*/channel")
        deadline = time.monotonic() + 120
        while len(flood) < 1200 and time.monotonic() < deadline:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(str(address))
            except BlockingIOError:  # the listen backlog is full: the run has to accept first
                sock.close()
                time.sleep(0.001)
                continue
            except OSError:
                sock.close()
                break  # the run is gone
            flood.append(sock)
            if len(flood) == 600:
                os.kill(int(ready[1]), signal.SIGKILL)
        assert len(flood) == 1200
        go.touch()
        out, _ = victim.communicate(timeout=300)
    finally:
        for sock in flood:
            sock.close()
        victim.kill()
        victim.wait()
    assert victim.returncode == 0
    undisturbed, flooded = json.loads(out.splitlines()[-1])
    assert len(flooded) == 4 and flooded == undisturbed


# --- 3. waiting for workers takes no thread the sinks need -----------------------------------


class Rendezvous(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Waits at its first step until ``expected`` episodes have started: they must run at once."""

    def __init__(self, folder: str, expected: int, action_space: Any) -> None:
        super().__init__(action_space)
        self.folder = Path(folder)
        self.expected = expected
        self.met = False

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        if not self.met:
            (self.folder / str(os.getpid())).touch()
            deadline = time.monotonic() + 20
            while len(list(self.folder.iterdir())) < self.expected:
                if time.monotonic() > deadline:
                    raise TimeoutError("the other episodes never started")
                time.sleep(0.01)
            self.met = True
        return self.action_space({})


@pytest.fixture
async def one_default_thread() -> AsyncIterator[None]:
    # anyio's default thread pool cut to one thread: what 41 workers against its 40 threads
    # hit, with two workers.
    limiter = anyio.to_thread.current_default_thread_limiter()
    total, limiter.total_tokens = limiter.total_tokens, 1
    yield
    limiter.total_tokens = total


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_more_workers_than_default_threads_play_at_once_and_save(
    env: Any, tmp_path: Path, one_default_thread: None
) -> None:
    meeting = tmp_path / "meeting"
    meeting.mkdir()
    agent = functools.partial(Rendezvous, str(meeting), 2)
    with anyio.fail_after(120):
        async with AsyncRunner(env, agent=agent, workers=2) as runner:
            results = await runner.run(2, path_save=tmp_path / "saved", max_iter=10)
    assert [r.nb_time_step for r in results] == [10, 10]
    assert all([r.path is not None and await anyio.Path(r.path).is_dir() for r in results])


class Unhurried(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Does nothing in 20 ms a step: each batch of steps leaves on its timer, a few steps long."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        time.sleep(0.02)
        return self.action_space({})


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("pool", ["forked", "executor"])
async def test_a_writer_waiting_for_a_thread_does_not_hang_the_run(
    env: Any, tmp_path: Path, pool: str
) -> None:
    # 41 workers against anyio's 40 threads, in small: 3 workers, 2 threads. The short first
    # episode ends; its writer waits for a thread behind the third worker; the two long
    # episodes playing then send more batches than the run buffers, and (when each held a
    # thread while it played) never ended to free one.
    limiter = anyio.to_thread.current_default_thread_limiter()
    total = limiter.total_tokens
    with contextlib.ExitStack() as stack:
        executor = None
        if pool == "executor":  # its futures were waited for in those threads too
            context = multiprocessing.get_context("fork")
            executor = stack.enter_context(ProcessPoolExecutor(3, mp_context=context))
        async with AsyncRunner(env, agent=Unhurried, workers=3, executor=executor) as runner:
            await runner.run(3, max_iter=1)  # every worker started, its env built
            limiter.total_tokens = 2
            try:
                with anyio.fail_after(120):
                    results = await runner.run(
                        3, path_save=tmp_path, reset_options=[{"max step": 2}, {}, {}]
                    )
            finally:
                limiter.total_tokens = total
    assert [r.nb_time_step for r in results] == [2, 575, 575]
    assert all([r.path is not None and await anyio.Path(r.path).is_dir() for r in results])


# --- 4. workers: no absurd values, no processes that cannot be used ---------------------------


def test_absurd_workers_are_rejected_before_anything_starts(env: Any) -> None:
    before = worker_children()
    with pytest.raises(ValueError, match=r"workers=10000 .* use at most \d+"):
        AsyncRunner(env, agent=DoNothingAgent, workers=10000)
    assert worker_children() == before


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_no_more_processes_than_can_be_used(
    env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a 2-CPU machine, workers=8 and a run of 3 episodes: the warm-up builds 2 envs (no more
    # would be ready sooner), the run adds one worker for its third episode, none for the rest.
    monkeypatch.setattr(asyncrunner._runner, "usable_cpus", lambda: 2)
    before = worker_children()
    async with AsyncRunner(env, agent=DoNothingAgent, workers=8) as runner:
        await runner.run(3, max_iter=5)
        assert len(worker_children() - before) == 3
        await runner.run(1, max_iter=5)
        assert len(worker_children() - before) == 3


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_workers_default_to_the_cpus_this_process_may_use(env: Any) -> None:
    # taskset, a Slurm job or a container's cpuset gives a process some of the machine's CPUs:
    # the default is one worker per CPU it may use, not per CPU of the machine (64 envs built
    # on a Slurm node's 64 cores for a job given 4).
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs a process allowed on 2 CPUs or more")
    before = worker_children()
    os.sched_setaffinity(0, {min(cpus)})  # this thread, where the runner is made and opened
    try:
        async with AsyncRunner(env, agent=DoNothingAgent) as runner:
            assert runner.workers == 1
            results = await runner.run(2, max_iter=5)
            assert [r.nb_time_step for r in results] == [5, 5]
            assert len(worker_children() - before) == 1
    finally:
        os.sched_setaffinity(0, cpus)


# --- 5. a local Dask cluster listens on this machine only -----------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_local_dask_cluster_listens_on_loopback_only() -> None:
    pytest.importorskip("distributed")
    from asyncrunner.dask import DaskExecutor

    executor = DaskExecutor(local_workers=1)
    try:
        client = await executor._get_client()
        dashboard = client.dashboard_link
        processes = [psutil.Process(), *psutil.Process().children(recursive=True)]
        listening = {
            (c.laddr.ip, c.laddr.port)
            for p in processes
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        }
    finally:
        await executor.aclose()
    ports = {port for _, port in listening}
    assert int(dashboard.split(":")[2].split("/")[0]) in ports  # the dashboard is among them
    assert {ip for ip, _ in listening} <= {"127.0.0.1", "::1"}


# --- 8 (first half). the socket folders of killed runs ---------------------------------------


HOLDS_A_CHANNEL = """
import anyio
from asyncrunner._engine._channel import open_channel

async def main():
    async with open_channel() as channel:
        print(channel.address, flush=True)
        await anyio.sleep(600)

anyio.run(main)
"""


def start_holding(script: str, tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)},
    )
    assert child.stdout is not None
    line = child.stdout.readline().split()
    assert line, "the child did not open its channel"
    return child, Path(line[-1]).parent


def check_only_the_killed_folder_goes(script: str, private_tmp: Path) -> None:
    killed, killed_folder = start_holding(script, private_tmp)
    live, live_folder = start_holding(script, private_tmp)

    async def next_run() -> None:
        async with open_channel() as channel:
            assert not killed_folder.exists()
            assert live_folder.is_dir() and (live_folder / "channel").exists()
            assert Path(channel.address).parent.is_dir()

    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()  # reaped: its pid is gone (a zombie's is not)
        assert killed_folder.is_dir()  # a killed run cannot clean up
        anyio.run(next_run)
    finally:
        for child in (killed, live):
            child.kill()
            child.wait()
            assert child.stdout is not None
            child.stdout.close()


def test_the_folder_of_a_killed_channel_is_removed(private_tmp: Path) -> None:
    check_only_the_killed_folder_goes(HOLDS_A_CHANNEL, private_tmp)


async def test_a_run_looks_for_stale_folders_in_its_temporary_folder_only(
    private_tmp: Path,
) -> None:
    # A folder in /tmp whose owner pid this process cannot see may be a live run's of another
    # PID namespace (a container sharing /tmp): a run with a TMPDIR of its own removed it too,
    # and that run's workers lost their channel ("No such file or directory").
    gone = await anyio.run_process([sys.executable, "-c", "import os; print(os.getpid())"])
    other = Path(tempfile.mkdtemp(prefix=f"asyncrunner-{int(gone.stdout)}-", dir="/tmp"))
    try:
        (other / "channel").touch()
        async with open_channel() as channel:
            assert Path(channel.address).parent.parent == private_tmp
        assert await anyio.Path(other).is_dir()
    finally:
        shutil.rmtree(other, ignore_errors=True)


HOLDS_A_RUN = """
import sys, time, warnings
import anyio, grid2op
from grid2op.Agent import BaseAgent
from asyncrunner import AsyncRunner, RunStarted
from asyncrunner._engine import _channel


class Sleeps(BaseAgent):
    def act(self, observation, reward, done=False):
        time.sleep(600)


async def main():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = grid2op.make("l2rpn_case14_sandbox", test=True)
    async with AsyncRunner(env, agent=Sleeps, workers=1) as runner:
        async with runner.stream(1) as events:
            async for event in events:
                if isinstance(event, RunStarted):
                    print(next(iter(_channel._OPEN)), flush=True)

anyio.run(main)
"""


@pytest.mark.slow
def test_the_folder_of_a_killed_run_is_removed(private_tmp: Path) -> None:
    check_only_the_killed_folder_goes(HOLDS_A_RUN, private_tmp)
