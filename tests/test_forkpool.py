"""The local pool of forked workers: calls, errors, deaths, cancellation, closing."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread
import pytest
from anyio import BrokenWorkerProcess

from asyncrunner._engine._envs import exclusive
from asyncrunner._pools import _fork
from asyncrunner._pools._fork import ForkPool, _kill

from .helpers import BOTH_LOOPS, alive, run_code, signalled

pytestmark = [pytest.mark.anyio, BOTH_LOOPS]


def pid_plus(value: int) -> tuple[int, int]:
    return os.getpid(), value + 1


def fails() -> None:
    raise KeyError("from the worker")


def cancelled() -> None:
    raise asyncio.CancelledError("the called code's own")


def has_a_child() -> bool:
    """Starts a process of its own (an agent's multiprocessing pool): a daemonic process may
    not. (Whether it exits 0 is not this test's: under coverage with warnings as errors, as the
    CI runs, coverage's own warning at its exit fails it.)"""
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    return child.exitcode is not None


_KEPT: list[Any] = []


def keeps_a_family(daemon: bool) -> list[int]:
    """Starts processes (an agent's helpers) and leaves them running: a multiprocessing child,
    its own ``subprocess`` child, and a ``subprocess`` child of this process."""
    receive, send = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(
        target=starts_a_sleeper, args=(send,), daemon=daemon
    )
    child.start()
    _KEPT.append(child)
    _KEPT.append(subprocess.Popen(["sleep", "60"]))
    assert child.pid is not None
    return [child.pid, receive.recv(), _KEPT[-1].pid]


def starts_a_sleeper(send: Any) -> None:
    send.send(subprocess.Popen(["sleep", "60"]).pid)
    time.sleep(60)


def keeps_a_family_then_sleeps(path: str) -> None:
    pids = keeps_a_family(daemon=True)
    with open(path, "w") as f:
        f.write(" ".join(map(str, pids)))
    time.sleep(60)


def unpicklable() -> Any:
    return threading.Lock()


def tracked_after_a_collection(ids: list[int]) -> tuple[list[bool], bool]:
    """Whether the collector still goes through the objects of ``ids``, and one made here."""
    made_here = [[0]]
    gc.collect()
    tracked = {id(o) for o in gc.get_objects()}
    return [i in tracked for i in ids], id(made_here[0]) in tracked


def dies() -> None:
    os._exit(3)


def sleeps(path: str) -> None:
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


async def test_calls_run_in_a_kept_forked_worker() -> None:
    pool = ForkPool(anyio.CapacityLimiter(1))
    first = await pool.call(pid_plus, 1)
    second = await pool.call(pid_plus, 41)
    assert first[0] != os.getpid() and first == (first[0], 2)
    assert second == (first[0], 42)  # the same worker, kept between calls
    await pool.aclose()
    assert not alive(first[0])


_LAST_POOL = """
import threading, anyio
from asyncrunner._pools._fork import ForkPool
from tests.test_forkpool import pid_plus

def forking() -> int:
    return sum(t.name == "asyncrunner-fork" for t in threading.enumerate())

async def main() -> None:
    first, second = ForkPool(anyio.CapacityLimiter(1)), ForkPool(anyio.CapacityLimiter(1))
    await first.call(pid_plus, 0)
    await second.call(pid_plus, 0)
    await first.aclose()
    print(forking(), (await second.call(pid_plus, 1))[1])  # the second pool forks on
    await second.aclose()
    with anyio.fail_after(5):
        while forking():
            await anyio.sleep(0.01)
    again = ForkPool(anyio.CapacityLimiter(1))  # a new pool forks as before
    value = (await again.call(pid_plus, 2))[1]
    print(forking(), value)
    await again.aclose()

anyio.run(main)
"""


async def test_the_thread_that_forks_ends_with_the_last_pool() -> None:
    # It lived as long as the process: a later fork of the program's (grid2op's Runner with
    # nb_process > 1) then warned of threads on Python >= 3.12 (found by a hunt). (In a process
    # of its own: this one's other tests may keep pools open.)
    done = await anyio.to_thread.run_sync(run_code, _LAST_POOL)
    assert done.stdout.split("\n")[-3:] == ["1 2", "1 3", ""], done.stderr


_PRINTS = """
import sys, anyio
sys.stdout = open("PATH", "w")  # block-buffered, as stdout to a file or a pipe
from asyncrunner._pools._fork import ForkPool

def chatty(sleep: float) -> None:
    print("from the worker")
    import time; time.sleep(sleep)

def lines() -> int:
    with open("PATH") as f:
        return f.read().count("from the worker")

async def main() -> None:
    pool = ForkPool(anyio.CapacityLimiter(1))
    await pool.call(chatty, 0)
    print(lines(), file=sys.stderr)  # the worker still runs
    with anyio.move_on_after(1):
        await pool.call(chatty, 60)  # killed
    print(lines(), file=sys.stderr)
    await pool.aclose()

anyio.run(main)
"""


async def test_what_a_worker_prints_to_a_file_is_there_when_its_call_returns(
    tmp_path: Any,
) -> None:
    # Its stdout, a file or a pipe (nohup, `| tee`, a container's log), is block-buffered: an
    # agent's prints waited in the worker until it ended, and a worker killed (episode_timeout)
    # lost them (found by a hunt).
    code = _PRINTS.replace("PATH", str(tmp_path / "out"))
    done = await anyio.to_thread.run_sync(run_code, code)
    assert done.stderr.split("\n")[-3:] == ["1", "2", ""], done.stderr


async def test_a_pool_stops_its_workers_though_another_forked_since() -> None:
    """A worker forked by another pool holds copies of this process's sockets: unless it
    closes the ends of every pool's workers, those workers never see their pool stop."""
    first, second = ForkPool(anyio.CapacityLimiter(1)), ForkPool(anyio.CapacityLimiter(1))
    try:
        pid = (await first.submit(pid_plus, 1))[0]
        worker = next(iter(first._idle))
        await second.submit(pid_plus, 1)  # forked while the first pool's worker lives
        await first.aclose()
        assert worker.exitcode == 0  # it saw its socket close: not killed after a grace
        assert not alive(pid)
    finally:
        await second.aclose()


def naps(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def keeps_a_thread(seconds: float) -> int:
    """Leaves a thread that the worker's end waits for (an agent's, not daemonic)."""
    threading.Thread(target=time.sleep, args=(seconds,), daemon=False).start()
    return os.getpid()


async def test_workers_that_do_not_end_share_one_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each worker that did not end at once was given a grace of its own, one after the other:
    # closing took 5 s per worker whose agent kept a thread going (found by a hunt).
    monkeypatch.setattr(_fork, "STOP_GRACE", 2.0)
    pool = ForkPool(anyio.CapacityLimiter(3))
    pids: list[int] = []

    async def call() -> None:
        pids.append(await pool.submit(keeps_a_thread, 60.0))
        await anyio.sleep(0.5)  # the three calls at once: three workers

    async with anyio.create_task_group() as group:
        for _ in range(3):
            group.start_soon(call)
    started = time.monotonic()
    await pool.aclose()
    took = time.monotonic() - started
    assert len(set(pids)) == 3 and not any(alive(pid) for pid in pids)
    assert 2.0 <= took < 5.0, took  # one after the other: 6 s


async def test_a_worker_busy_as_the_pool_stops_is_stopped_when_its_call_ends() -> None:
    # Stopping stopped the idle workers only: one busy then went back to the idle ones as its
    # call ended, alive for as long as the process.
    pool = ForkPool(anyio.CapacityLimiter(1))
    pid = 0

    async def call() -> None:
        nonlocal pid
        pid = await pool.submit(naps, 1.0)

    async with anyio.create_task_group() as group:
        group.start_soon(call)
        with anyio.fail_after(30):
            while not pool._busy:  # noqa: ASYNC110 - the pool has no event for it
                await anyio.sleep(0.01)
        await pool.aclose()  # the call goes on (it was not cancelled)
    assert pid and not alive(pid) and not pool._idle


# the workers collected unclosed: "unclosed socket"
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_workers_collected_unclosed_leave_no_number_a_new_worker_closes() -> None:
    # A pool dropped without closing it (a runner never closed): its workers' socket numbers
    # stayed listed as ends to close after a fork, and a later worker whose own socket got one
    # of them closed it at its start ("worker process ... ended (exit code 0)").
    dropped = ForkPool(anyio.CapacityLimiter(2))
    async with anyio.create_task_group() as group:
        for _ in range(2):
            group.start_soon(dropped.submit, naps, 0.2)
    del dropped, group
    gc.collect()
    pool = ForkPool(anyio.CapacityLimiter(1))
    try:
        assert (await pool.call(pid_plus, 1))[1] == 2
    finally:
        await pool.aclose()


async def test_an_error_comes_back_and_the_worker_stays() -> None:
    pool = ForkPool(anyio.CapacityLimiter(1))
    pid, _ = await pool.call(pid_plus, 0)
    with pytest.raises(KeyError, match="from the worker"):
        await pool.call(fails)
    with pytest.raises(RuntimeError, match="cannot be sent"):
        await pool.call(unpicklable)
    # Raised here, a CancelledError would look like the cancellation of the caller's task.
    with pytest.raises(RuntimeError, match="raised CancelledError: the called code's own"):
        await pool.call(cancelled)
    assert await pool.call(has_a_child)
    assert (await pool.call(pid_plus, 0))[0] == pid
    await pool.aclose()


async def test_a_worker_that_dies_fails_its_call_and_is_replaced() -> None:
    pool = ForkPool(anyio.CapacityLimiter(1))
    pid, _ = await pool.call(pid_plus, 0)
    with pytest.raises(BrokenWorkerProcess, match="exit code 3"):
        await pool.call(dies)
    assert pool.pids == set()
    new, _ = await pool.call(pid_plus, 0)
    assert new != pid
    await pool.aclose()


async def test_ended_workers_leave_no_file_descriptor_open() -> None:
    # Each worker's process object holds two pipes until it is collected: a failed run's
    # traceback (or anything else keeping a worker) kept them open after the runner closed
    # (found by the runtime hunt: 9 -> 17 descriptors after failed runs, the collector off).
    warm = ForkPool(anyio.CapacityLimiter(1))
    await warm.call(pid_plus, 0)
    await warm.aclose()
    before = sorted(os.listdir("/proc/self/fd"))
    pool = ForkPool(anyio.CapacityLimiter(2))
    with pytest.raises(BrokenWorkerProcess) as died:  # its traceback holds the worker
        await pool.call(dies)
    await pool.call(pid_plus, 0)
    stopped = next(iter(pool._idle))  # stopped as the pool closes
    await pool.aclose()
    assert sorted(os.listdir("/proc/self/fd")) == before
    assert stopped.exitcode == 0 and died.value is not None


_SHARED: list[Any] = []


def puts(value: int) -> None:
    _SHARED[0].put(value)
    _SHARED[1].send(value)


async def test_a_worker_holds_none_of_this_process_s_pipes_but_multiprocessing_s() -> None:
    # A subprocess that another thread of this process (or its event loop) started as a worker
    # forked: the worker held its pipes for its whole life, and `communicate()` waited for an
    # end of file that never came (found by the app hunt: a web app's event loop froze).
    cat = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # noqa: ASYNC220
    read_end, write_end = os.pipe()  # a pipe held whole (a subprocess's, as it starts)
    os.set_blocking(read_end, False)
    receive, send = multiprocessing.Pipe()
    _SHARED[:] = [multiprocessing.get_context("fork").Queue(), send]  # the workers put into them
    pool = ForkPool(anyio.CapacityLimiter(1))
    try:
        await pool.call(puts, 7)  # forked with all of them open
        worker = next(iter(pool._idle))
        os.close(write_end)
        assert os.read(read_end, 1) == b""  # no writer left: its end of file
        out, _ = await anyio.to_thread.run_sync(functools.partial(cat.communicate, b"x", 20))
        assert out == b"x"
        assert await anyio.to_thread.run_sync(_SHARED[0].get, True, 20) == 7
        assert receive.poll(20) and receive.recv() == 7
        # multiprocessing's own pipe to the worker is kept: it tells the worker's end
        assert not multiprocessing.connection.wait([worker.process.sentinel], 0)
    finally:
        cat.kill()
        cat.wait()
        for stream in (cat.stdin, cat.stdout):
            stream.close()  # type: ignore[union-attr]  # (both piped)
        os.close(read_end)
        await pool.aclose()
        _SHARED.clear()
        receive.close()
        send.close()


async def test_a_worker_holds_none_of_this_process_s_network_sockets() -> None:
    # A web app's connections as a worker forked (after a cancelled run): its closing sent the
    # client nothing while the worker lived (a kept-alive connection the server closed took the
    # client's next request, unanswered), and its listening socket took connections on.
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    pool = ForkPool(anyio.CapacityLimiter(1))
    try:
        await pool.call(pid_plus, 0)  # forked with them open
        accepted.close()
        client.settimeout(20)
        assert await anyio.to_thread.run_sync(client.recv, 1) == b""  # the end of the stream
        address = server.getsockname()
        server.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=20).close()
    finally:
        for sock in (client, accepted, server):
            sock.close()
        await pool.aclose()


def sends_and_shares_memory(address: tuple[str, int]) -> list[str]:
    """Sends a datagram on the parent's socket (``SysLogHandler``'s), and makes shared memory
    (which multiprocessing's resource tracker follows): what it was warned of."""
    from multiprocessing import shared_memory

    _SHARED[0].sendto(b"logged", address)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        memory = shared_memory.SharedMemory(create=True, size=16)
        memory.close()
        memory.unlink()
    return [str(warning.message) for warning in caught]


async def test_a_worker_keeps_this_process_s_datagram_sockets_and_resource_tracker() -> None:
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # (this process's, which a worker's memory reports to)
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.settimeout(20)
    _SHARED[:] = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM)]
    pool = ForkPool(anyio.CapacityLimiter(1))
    try:
        # (a resource tracker that a worker could not reach was relaunched, with a warning)
        assert await pool.call(sends_and_shares_memory, receiver.getsockname()) == []
        assert await anyio.to_thread.run_sync(receiver.recv, 16) == b"logged"
    finally:
        await pool.aclose()
        _SHARED[0].close()
        _SHARED.clear()
        receiver.close()


@pytest.fixture
def sigchld_ignored() -> Iterator[None]:
    """SIGCHLD ignored during the test: children reaped by the kernel. The workers the test
    forks stay in multiprocessing's list of children, their exit never known: they are dropped
    from it at the end, or each later start in this pytest worker polls (``waitpid``) their
    pids, and would reap whichever child of this process has one by then (pids wrap at 32,768
    on the CI's machine: a test's subprocess could lose its exit status)."""
    listed: set[Any] = vars(multiprocessing.process)["_children"]
    before = set(listed)
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, previous)
        for process in listed - before:
            if multiprocessing.connection.wait([process.sentinel], 0):  # it ended
                listed.discard(process)


@pytest.mark.usefixtures("sigchld_ignored")
async def test_workers_reaped_by_another_stop_cleanly() -> None:
    # A program that ignores SIGCHLD (its children reaped by the kernel), or reaps them with
    # waitpid(-1): a worker's exit code is then unknown, and closing its process raised
    # "Cannot close a process while it is still running" as the pool stopped (compat.Runner
    # lost its results), found by the review.
    pool = ForkPool(anyio.CapacityLimiter(2))
    assert (await pool.call(pid_plus, 1))[1] == 2
    worker = next(iter(pool._idle))
    await pool.aclose()
    assert worker.exitcode is None and not alive(worker.pid)


@pytest.mark.usefixtures("sigchld_ignored")
async def test_a_worker_reaped_by_another_is_not_signalled_nor_handed_a_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With SIGCHLD ignored, a worker that died idle (the OOM killer) looked alive (its exit code
    # unknown): the next call was handed to it and failed as if it had died playing it, and
    # the pool then stopped and killed its pid, which the kernel had freed at once (another
    # process's by then on a busy machine), and that pid's descendants.
    pool = ForkPool(anyio.CapacityLimiter(1))
    pid = (await pool.call(pid_plus, 1))[0]
    os.kill(pid, signal.SIGKILL)
    with anyio.fail_after(10):
        while alive(pid):  # noqa: ASYNC110
            await anyio.sleep(0.01)
    killed = signalled(monkeypatch)
    other, value = await pool.call(pid_plus, 2)
    assert value == 3 and other != pid
    await pool.aclose()
    assert pid not in killed


async def _cancelled_once_noted(pool: ForkPool, fn: Any, marker: Any) -> list[int]:
    """Call ``fn(marker)`` in ``pool``, cancel the call once it wrote pids there: those."""
    async with anyio.create_task_group() as group:
        group.start_soon(pool.call, fn, str(marker))
        with anyio.fail_after(30):
            while not marker.exists() or not marker.read_text():  # noqa: ASYNC110
                await anyio.sleep(0.01)
        group.cancel_scope.cancel()  # kills the worker
    return [int(pid) for pid in marker.read_text().split()]


async def test_a_cancelled_call_kills_its_worker(tmp_path: Any) -> None:
    pool = ForkPool(anyio.CapacityLimiter(2))
    (pid,) = await _cancelled_once_noted(pool, sleeps, tmp_path / "pid")
    assert not alive(pid)
    assert pool.pids == set()
    await pool.aclose()


async def test_processes_an_agent_left_end_with_its_worker(tmp_path: Any) -> None:
    # Its workers no longer daemonic (an agent may start processes), a worker's exit waited for
    # a helper the agent kept (the pool's close took its grace, 5 s per worker), and a killed
    # worker's helpers outlived it (found by review); at a worker's end, a subprocess child and
    # a child of a multiprocessing child outlived it (found by review).
    pool = ForkPool(anyio.CapacityLimiter(1))
    helpers = await pool.call(keeps_a_family, False)
    assert all(alive(pid) for pid in helpers)
    with anyio.fail_after(3):
        await pool.aclose()
    assert not any(alive(pid) for pid in helpers)
    pool = ForkPool(anyio.CapacityLimiter(1))
    helpers = await _cancelled_once_noted(pool, keeps_a_family_then_sleeps, tmp_path / "pid")
    with anyio.fail_after(5):
        while any(alive(pid) for pid in helpers):  # noqa: ASYNC110 - other processes' state
            await anyio.sleep(0.01)
    await pool.aclose()


async def test_a_call_from_a_cancelled_task_leaves_the_idle_worker_alone() -> None:
    # A run stopped (its first failure under "raise", or the user's cancel) just as one of its
    # dispatchers takes its next episode: that call must not start, nor kill the idle worker.
    pool = ForkPool(anyio.CapacityLimiter(1))
    pid, _ = await pool.call(pid_plus, 0)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await pool.call(pid_plus, 0)
    assert scope.cancelled_caught
    assert pool.pids == {pid} and alive(pid)
    assert (await pool.call(pid_plus, 0))[0] == pid
    await pool.aclose()


def echo_sum(blob: bytes) -> tuple[int, bytes]:
    return sum(blob[::4096]), blob[::-1]


async def test_a_worker_never_collects_what_it_inherited() -> None:
    # A worker's full collections would go through everything the parent held at the fork (an
    # env it built for its workers: 0.15 to 0.2 s, while a cold run waits for its first step)
    # and write to pages the fork shares. Objects made in the worker are collected as usual.
    held = [[i] for i in range(1000)]
    pool = ForkPool(anyio.CapacityLimiter(1))
    inherited, made_there = await pool.call(tracked_after_a_collection, [id(o) for o in held])
    assert not any(inherited) and made_there
    assert all(tracked_after_a_collection([id(o) for o in held])[0])  # still tracked here
    await pool.aclose()


def now() -> float:
    return time.monotonic()  # CLOCK_MONOTONIC: one clock for the whole machine


async def test_a_fork_waits_for_an_env_build_in_another_thread(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # A thread building an env (``_envs.hold``, under ``exclusive()``) runs pandapower's power
    # flows: scipy SuperLU factorizations, tracked in that thread's state. A child forked
    # meanwhile drops that state and frees them; scipy <= 1.17 leaves an exception set doing
    # so, and the child's first after-fork callback (random's or threading's) failed, printing
    # "Exception ignored ... SystemError" (seen with several runners opening at once). That
    # failure is a race (a fork inside a factorization, the GIL released); checked here: a
    # fork waits for the build.
    import pandapower  # type: ignore[import-untyped]
    import pandapower.networks  # type: ignore[import-untyped]

    net = pandapower.networks.case14()
    building = threading.Event()
    built: list[float] = []

    def build() -> None:
        with exclusive():
            building.set()
            end = now() + 0.5
            while now() < end:  # what a build runs: power flows
                pandapower.runpp(net)
            built.append(now())

    thread = threading.Thread(target=build)
    thread.start()
    await anyio.to_thread.run_sync(building.wait)
    pool = ForkPool(anyio.CapacityLimiter(1))
    try:
        called = await pool.call(now)  # forks the worker
    finally:
        await pool.aclose()
        await anyio.to_thread.run_sync(thread.join)
    assert called > built[0]
    assert "Exception ignored" not in capfd.readouterr().err


async def test_big_calls_and_replies_cross_whole() -> None:
    # Several times a socket's buffer each way: sent and read in pieces without blocking.
    blob = os.urandom(24 << 20)
    pool = ForkPool(anyio.CapacityLimiter(1))
    total, back = await pool.call(echo_sum, blob)
    assert total == sum(blob[::4096]) and back == blob[::-1]
    await pool.aclose()


async def test_a_small_call_to_a_started_worker_takes_no_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = ForkPool(anyio.CapacityLimiter(1))
    await pool.call(pid_plus, 0)  # forks the worker (in a thread)
    hops: list[Any] = []
    real = anyio.to_thread.run_sync

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(fn)
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    for value in range(20):
        assert (await pool.call(pid_plus, value))[1] == value + 1
    assert hops == []
    # Megabytes of arguments (a warm-up call's pickled agent instance) are framed off the loop.
    blob = os.urandom(2 << 20)
    assert (await pool.call(echo_sum, blob))[1] == blob[::-1]
    assert [fn.__name__ for fn in hops] == ["_call_frame"]
    monkeypatch.undo()
    await pool.aclose()


_GOMP = ctypes.util.find_library("gomp")
_REGION = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda data: None)


def openmp_region() -> int:
    """Runs a parallel region of two threads with libgomp (as torch's operations do)."""
    assert _GOMP is not None
    ctypes.CDLL(_GOMP).GOMP_parallel(_REGION, None, 2, 0)
    return os.getpid()


@pytest.mark.skipif(_GOMP is None, reason="no libgomp here")
async def test_a_worker_runs_openmp_though_this_process_ran_it_in_threads() -> None:
    """A worker was forked from one of anyio's worker threads: one that had run the caller's
    OpenMP region (torch off the event loop) gave the child its team's state, and the worker's
    first parallel region waited for ever (grid2op's Runner, forking from the main thread, plays)."""
    async with anyio.create_task_group() as group:
        for _ in range(4):  # every thread of anyio's pool here
            group.start_soon(anyio.to_thread.run_sync, openmp_region)
    pool = ForkPool(anyio.CapacityLimiter(2))
    try:
        with anyio.fail_after(30):
            pids = [await pool.submit(openmp_region) for _ in range(2)]
        assert os.getpid() not in pids
    finally:
        await pool.aclose()


async def test_a_worker_already_reaped_gets_no_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its pid may be another process's by now: _kill stopped it, and killed its children
    # (found by review).
    process = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    process.start()
    process.join()
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    _kill(process)
    assert sent == []
