"""Local worker processes forked from this one: grid2op is already imported, nothing to start.

A fresh interpreter (what ``anyio.to_process`` starts) spends about 2 s importing grid2op before it
can build an env; a forked child has it already, as in grid2op's own ``multiprocessing.Pool``. Each
worker serves one call at a time over a socket pair (frames of pickled calls and replies); a call
that is cancelled kills its worker (like ``anyio.to_process.run_sync(cancellable=True)``), and a
worker that dies fails its call with ``BrokenWorkerProcess``.

A call is sent and its reply read on the event loop's thread, without blocking
(``anyio.wait_writable`` / ``wait_readable``): no thread per call (each hop to a thread and back
cost about 140 µs of CPU, a tenth of the parent's work for a short episode), and none held while a
worker plays. The threads the pool does use (forking, stopping workers) come from a limiter of its
own: waiting in anyio's default thread pool (40 threads, shared with the sinks' file work) hung
runs of more than 40 workers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import fcntl
import functools
import gc
import multiprocessing
import multiprocessing.connection
import multiprocessing.queues
import multiprocessing.util
import os
import pickle
import queue
import signal
import socket
import stat
import sys
import threading
import time
import traceback
import types
import warnings
import weakref
from collections.abc import Callable
from multiprocessing import forkserver, resource_tracker
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
from anyio import BrokenWorkerProcess

from .._engine._channel import (
    SEND_FLAGS,
    WORKER_SOCKETS,
    AsyncSocket,
    close_inherited,
    frame,
    receive_frame,
)
from .._engine._envs import exclusive
from .._engine._pool import STOP_GRACE, WorkerPool
from .._quiet import programs_filters, quiet

__all__ = ["ForkPool", "available", "forked", "forker_done"]

T = TypeVar("T")


def available() -> bool:
    """Whether workers can be forked here (Linux: macOS system libraries are not fork-safe)."""
    return os.uname().sysname == "Linux" if hasattr(os, "uname") else False


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@functools.cache
def _prctl() -> Callable[..., int]:
    """Linux's ``prctl``, looked up in the parent: a child of a process with threads must not
    load libraries (another thread may have held the loader's lock at the fork)."""
    return ctypes.CDLL(None, use_errno=True).prctl


def _serve(
    sock: socket.socket,
    parent_ends: list[int],
    parent: int,
    prctl: Callable[..., int],
    filters: list[Any],
) -> None:
    """A worker's life: run the calls that come over ``sock`` until it closes (``filters``: the
    parent's warning filters as its event loop saw them, ``programs_filters``)."""
    # Killed when the thread that forked it ends (``_Forker``'s, which lives as long as its
    # process): a worker busy in an agent's act() (slow, hung, or stopped) outlived a killed
    # parent, holding its env, until it next wrote to it. A parent gone already: leave now.
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)
    _release_inherited(sock)
    # What the parent held at the fork (its env, grid2op, the caller's objects) is never
    # collected here: a full collection would go through all of it (0.15 to 0.2 s after a
    # parent built an env) and write to every object's pages, which the fork shares until then.
    gc.freeze()
    # An agent may start processes of its own (a multiprocessing pool in its act), as it can in
    # grid2op's Runner with one process: a daemonic process may not. This one is stopped by its
    # parent, or with it (above).
    multiprocessing.current_process().daemon = False
    # Ctrl-C reaches the whole process group: the parent decides (it cancels, which kills us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)  # the parent's event loop's, not ours
    # The fork copied the filters as they were at that instant: with a filter another thread
    # of the parent held for a moment (its own `catch_warnings`, grid2op's reset), which this
    # worker kept for its whole life.
    warnings.resetwarnings()
    warnings.filters.extend(filters)  # type: ignore[attr-defined]  # (a list)
    # What an agent prints goes out line by line, as in a terminal: to a file or a pipe (nohup,
    # `| tee`, a container's log) it waited in this process's buffer until the worker ended,
    # and was lost when it was killed (the line before an episode_timeout).
    with contextlib.suppress(AttributeError, ValueError):  # (a stream that cannot be set so)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    for fd in parent_ends:  # workers' parent-side ends: holding them would hide their closing
        try:
            os.close(fd)
        except OSError:
            pass
    # The parent sees this worker end when its socket closes: not while a process the agent
    # forked holds a copy of it (a ProcessPoolExecutor of its own), which outlived a worker
    # killed from outside (the OOM killer): the run waited for ever.
    global _worker_pid, _worker_thread
    _worker_pid, _worker_thread = os.getpid(), threading.get_ident()
    WORKER_SOCKETS.add(sock)
    os.register_at_fork(before=_agent_forks, after_in_child=functools.partial(_agents_child, prctl))
    try:
        _answer(sock)
    finally:
        _end_children()


def _release_inherited(sock: socket.socket) -> None:
    """Let go of the pipes and network connections this worker got from its parent by the fork,
    but those it needs: ``sock``, its standard streams, multiprocessing's (its sentinels, its
    resource tracker's and forkserver's pipes, the parent's queues, unnamed socket pairs such
    as ``multiprocessing.Pipe()`` and an event loop's own).

    A subprocess that another thread of the parent (or its event loop) was starting as this
    worker forked left its pipes here, for this worker's whole life: its ``communicate()`` waited
    for an end of file that never came (a web app's event loop froze for good). A web app's
    connections did too: closing one sent its client nothing (a kept-alive connection then took
    the client's next request, unanswered), and its listening socket took connections on. Each
    is replaced, at its number, by an end of a pipe or a socket pair with nothing at the other
    side (a write fails with ``BrokenPipeError``, a read finds the end of the stream, as on a
    closed connection): an object of the parent's still holding that number can never reach a
    file this worker opens later."""
    keep = {0, 1, 2, sock.fileno()}
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and "child_w" not in frame.f_locals:  # popen_fork's _launch
        frame = frame.f_back
    if frame is None:  # (a multiprocessing that forks otherwise: left as it is)
        return
    keep |= {frame.f_locals["child_w"], frame.f_locals["child_r"]}
    for holder, name in (
        (resource_tracker._resource_tracker, "_fd"),
        (forkserver._forkserver, "_forkserver_alive_fd"),
    ):
        fd = getattr(holder, name, None)
        if isinstance(fd, int):
            keep.add(fd)
    for kept in list(multiprocessing.util._afterfork_registry.values()):  # type: ignore[attr-defined]
        if isinstance(kept, multiprocessing.queues.Queue):
            for end in (kept._reader, kept._writer):  # type: ignore[attr-defined]
                with contextlib.suppress(OSError):  # (closed)
                    keep.add(end.fileno())
    released: dict[int, str] = {}  # each number: what replaces it
    for fd in map(int, os.listdir("/proc/self/fd")):
        with contextlib.suppress(OSError):  # (the listing's own descriptor, closed)
            mode = os.fstat(fd).st_mode
            if fd in keep:
                continue
            if stat.S_ISFIFO(mode):
                reading = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
                released[fd] = "read end" if reading else "write end"
            elif stat.S_ISSOCK(mode) and _connection(fd):
                released[fd] = "socket"
    for kind in set(released.values()):
        if kind == "socket":
            nowhere, other = (s.detach() for s in socket.socketpair())
        else:
            read_end, write_end = os.pipe()
            nowhere, other = (read_end, write_end) if kind == "read end" else (write_end, read_end)
        os.close(other)
        for fd in (fd for fd, replaced_by in released.items() if replaced_by == kind):
            os.dup2(nowhere, fd, inheritable=False)
        os.close(nowhere)


def _connection(fd: int) -> bool:
    """Whether socket ``fd`` is a network connection's or a server's: a stream socket, on the
    Internet or at a Unix socket's address (not a socket pair's end; datagrams hold nobody)."""
    sock = socket.socket(fileno=fd)
    try:
        if sock.type != socket.SOCK_STREAM:
            return False
        if sock.family != socket.AF_UNIX:
            return True
        try:
            peer = sock.getpeername()
        except OSError:  # (not connected: a listening one)
            peer = ""
        return bool(sock.getsockname() or peer)
    finally:
        sock.detach()


# This worker's pid and main thread (a child keeps the ident of the thread that forked it), and
# the process a fork under way is made from (``_forking``: each thread's own).
_worker_pid = 0
_worker_thread = 0
_forking = threading.local()


def _agent_forks() -> None:
    _forking.pid = os.getpid()


def _agents_child(prctl: Callable[..., int]) -> None:
    """In a process a worker's agent forks (and those it forks): hold none of the worker's
    sockets (``close_inherited``); forked by the worker's main thread (another thread's child
    would end with that thread), end with the worker: a worker killed from outside left its
    agent's pool running for ever. (What those processes fork, a daemon's double fork, lives
    on as it would in grid2op's Runner; what the agent starts with ``subprocess`` runs no
    Python here: killed with the worker when its runner stops it, not otherwise.)"""
    close_inherited()
    # The runner's handlers (``asyncrunner run``'s for SIGTERM and SIGHUP, an event loop's)
    # were the worker's by its fork: its agent's processes take the default, as under grid2op's
    # Runner, or their ``terminate()`` did nothing. (Ignored ones stay so: ``nohup``.)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if callable(signal.getsignal(signum)):
            signal.signal(signum, signal.SIG_DFL)
    if getattr(_forking, "pid", 0) == _worker_pid and threading.get_ident() == _worker_thread:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != _worker_pid:  # it ended since the fork
            os._exit(1)


def _answer(sock: socket.socket) -> None:
    """Run the calls that come over ``sock``, and send their replies, until it closes."""
    while True:
        try:
            fn, args = pickle.loads(receive_frame(sock))
        except OSError:
            return  # the parent closed its end (the pool stops) or is gone
        try:
            reply: tuple[str, Any] = ("ok", fn(*args))
        except BaseException as exc:
            reply = ("error", exc)
        with contextlib.suppress(Exception):  # (a line not ended, a closed stream)
            sys.stdout.flush()
        try:
            data = pickle.dumps(reply, protocol=5)
        except Exception as exc:  # a result or error that cannot be pickled
            text = "".join(traceback.format_exception(reply[1])) if reply[0] == "error" else ""
            error = RuntimeError(f"the worker's reply cannot be sent ({exc})\n{text}")
            data = pickle.dumps(("error", error), protocol=5)
        try:
            sock.sendall(frame(data), SEND_FLAGS)
        except OSError:  # the parent is gone: nobody to tell
            return


def _end_children() -> None:
    """Kill the processes an agent started and left running (with multiprocessing: this
    worker's exit would wait for those that are not daemonic; or a ``subprocess`` child, a
    child of one of those: they would outlive it), each stopped first, as ``_kill`` does: a
    process whose parent ended first would no longer be found under this worker."""
    for pid in _stopped_below(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for child in multiprocessing.active_children():
        child.join()


def _ended(process: Any) -> bool:
    """Whether a worker process ended: reaped here (``exitcode`` reaps a dead one), or its
    sentinel closed, reaped by another (SIGCHLD ignored, a ``waitpid(-1)``: its exit code is
    never known, and ``is_alive()`` stays true). Either way its pid may be another process's."""
    if process.exitcode is not None:
        return True
    return bool(multiprocessing.connection.wait([process.sentinel], 0))


def _kill(process: Any) -> None:
    """Kill a worker process and the processes it started (an agent's, which would outlive it):
    each stopped first, so that none starts another meanwhile. Not one that ended
    (``_ended``): its pid may be another process's now."""
    if _ended(process):
        return
    with contextlib.suppress(OSError):
        os.kill(process.pid, signal.SIGSTOP)
    _wait_stopped([process.pid])
    for pid in _stopped_below(process.pid):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    process.kill()


def _stopped_below(pid: int) -> list[int]:
    """The processes under ``pid``, each stopped (``SIGSTOP``) as it is found: listed again,
    each time once those found are stopped, until a listing finds no other (a process stopping
    at that moment may have started one; a stopped one starts none)."""
    found: list[int] = []
    while new := [p for p in _descendants(pid) if p not in found]:
        for p in new:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGSTOP)
        _wait_stopped(new)
        found += new
    return found


def _wait_stopped(pids: list[int], timeout: float = 0.5) -> None:
    """Wait until each of ``pids`` is stopped or gone (a signal takes effect a moment after it
    is sent), at most ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while _state(pid) not in "TtZX" and time.monotonic() < deadline:
            time.sleep(0.001)


def _state(pid: int) -> str:
    """Process ``pid``'s state letter, as Linux lists it ("X" where it is gone or unlisted)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid``, as Linux lists them (none where ``/proc`` does not)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for thread in threads:
            try:
                with open(f"/proc/{parent}/task/{thread}/children") as f:
                    children = [int(child) for child in f.read().split()]
            except (OSError, ValueError):
                continue
            found += children
            todo += children
    return found


# The thread this process forks from, which runs nothing else. A child starts as a copy of the
# thread that forked it, and anyio's worker threads run whatever ``to_thread`` gets: one that
# ran an OpenMP region (torch's, off the event loop) left libgomp's state of its thread team in
# the child, whose first parallel region then waited for ever for threads it does not have.
class _Forker:
    """A thread that runs the calls it is given one at a time, and nothing else (not a
    ``ThreadPoolExecutor``'s: a child forked from one would try to join it at exit)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Any] | None]
        self._calls = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="asyncrunner-fork", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:  # (``stop``)
                return
            fn, args, done = call
            del call
            try:
                done.set_result(fn(*args))
            except BaseException as exc:
                done.set_exception(exc)
            del fn, args, done  # kept until the next call, a worker would outlive its pool

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._calls.put((fn, args, done))
        return done.result()

    def stop(self) -> None:
        """End the thread once the calls given before are done (and with it, the processes it
        forked: ``_serve``)."""
        self._calls.put(None)


_forker: _Forker | None = None
_forker_lock = threading.Lock()
# What forks through the thread (pools): it ends when the last of them is done (``forker_done``),
# as no later fork of the program's, grid2op's Runner's, would then find it (Python >= 3.12 warns
# of a fork in a process with threads).
_forker_owners: weakref.WeakSet[Any] = weakref.WeakSet()  # (one dropped unclosed is collected)


def _reset_forker() -> None:
    global _forker, _forker_lock
    _forker, _forker_lock = None, threading.Lock()  # its thread is not in a forked child
    _forker_owners.clear()


os.register_at_fork(after_in_child=_reset_forker)


async def forked(
    fn: Callable[..., T],
    *args: Any,
    owner: object,
    limiter: anyio.CapacityLimiter | None = None,
) -> T:
    """``fn(*args)``, which forks, run in the thread that runs nothing else (waited for from a
    thread of ``limiter``'s, off the event loop), which lives until ``forker_done(owner)``."""
    global _forker
    with _forker_lock:
        if _forker is None:
            _forker = _Forker()
        forker = _forker
        _forker_owners.add(owner)
    return await anyio.to_thread.run_sync(forker.call, fn, *args, limiter=limiter)


def forker_done(owner: object) -> None:
    """``owner`` forks no more: the last one ends the thread that forks."""
    global _forker
    with _forker_lock:
        _forker_owners.discard(owner)
        if _forker is not None and not _forker_owners:
            _forker.stop()
            _forker = None


# Bytes beyond this in a call's arguments are framed in a thread (a warm-up call's recipe).
_BIG_ARGUMENT = 1 << 20


def _call_frame(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    return frame(pickle.dumps((fn, args), protocol=5))


# The parent-side socket ends of this process's live workers, every pool's: a worker forked
# later closes its copies, or the worker at the other end would not see its pool stop (closing
# a runner waited its grace, then killed, each worker another runner's later fork held). The
# sockets, not their numbers: a worker collected unclosed (a runner never closed) left its
# number here, which a later worker's own socket could get, and close at its start.
_PARENT_ENDS: weakref.WeakSet[socket.socket] = weakref.WeakSet()
_PARENT_ENDS_LOCK = threading.Lock()


class _Worker:
    def __init__(self, filters: list[Any]) -> None:
        mine, child = socket.socketpair()
        context = multiprocessing.get_context("fork")
        # Not while a thread of this process builds an env (``hold``, under this lock): the
        # child drops the other threads' states, and a power flow's scipy SuperLU state then
        # freed (scipy <= 1.17 leaves an exception set doing so) failed the child's first
        # after-fork callback, random's or threading's ("Exception ignored ... SystemError").
        with exclusive(), quiet():
            # (Python >= 3.12 warns when a multi-threaded process forks: the child only runs
            # _serve, where no lock of another thread is taken, as grid2op's own Pool does.)
            with _PARENT_ENDS_LOCK:
                _PARENT_ENDS.add(mine)
                ends = [fd for fd in (s.fileno() for s in _PARENT_ENDS) if fd != -1]
            args = (child, ends, os.getpid(), _prctl(), filters)
            self.process = context.Process(target=_serve, args=args, daemon=True)
            self.process.start()
        child.close()
        self.conn = AsyncSocket(mine)
        assert self.process.pid is not None  # set by start()
        self.pid = self.process.pid
        self.exitcode: int | None = None  # once reaped

    async def call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], threads: anyio.CapacityLimiter
    ) -> Any:
        if any(isinstance(a, bytes) and len(a) > _BIG_ARGUMENT for a in args):
            # A pickled agent instance can be gigabytes: copied into the frame off the loop.
            data = await anyio.to_thread.run_sync(_call_frame, fn, args, limiter=threads)
        else:
            data = _call_frame(fn, args)
        try:
            await self.conn.send(data)
            status, value = pickle.loads(await self.conn.receive_frame())
        except (EOFError, OSError) as exc:
            # It is ending: its exit code tells how.
            await anyio.to_thread.run_sync(self.process.join, 1.0, limiter=threads)
            code = self.process.exitcode
            raise BrokenWorkerProcess(
                f"worker process {self.pid} ended (exit code {code})"
            ) from exc
        if status == "error":
            if not isinstance(value, Exception):
                # (a CancelledError raised here would look like this task's cancellation)
                raise RuntimeError(
                    f"a call in worker process {self.pid} raised {type(value).__name__}: {value}"
                )
            raise value
        return value

    def kill(self) -> None:
        _kill(self.process)
        self.process.join()
        self.close()
        self.reap()

    def reap(self) -> None:
        """The process ended (joined): keep its exit code and close its pipes now, not when the
        garbage collector gets to them (a failed run's traceback kept them: 2 per worker)."""
        self.exitcode = self.process.exitcode
        if self.exitcode is not None:  # None: reaped by another (SIGCHLD ignored, a
            self.process.close()  # waitpid(-1)): close() would raise, and lose the run

    def close(self) -> None:
        """Close this side of the worker's socket (it then exits, once idle)."""
        with _PARENT_ENDS_LOCK:  # not while a fork lists the ends' numbers
            self.conn.sock.close()


class ForkPool(WorkerPool):
    """At most ``limiter.total_tokens`` workers forked from this process, kept between calls."""

    died = (BrokenWorkerProcess,)
    forks_this_process = True

    def __init__(self, limiter: anyio.CapacityLimiter) -> None:
        super().__init__(limiter)
        self._threads = anyio.CapacityLimiter(limiter.total_tokens)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._forking = anyio.Lock()
        self._stopped = False  # a worker whose call ends after ``stop`` is stopped, not kept

    @property
    def pids(self) -> set[int]:
        """The pids of the live workers."""
        return {w.pid for w in (*self._idle, *self._busy)}

    async def submit(self, fn: Callable[..., T], *args: Any) -> T:
        # A free slot is taken without a turn of the event loop (``async with limiter`` takes
        # one, and a short episode's call makes few others); a cancelled task still stops
        # here, before its call reaches a worker (and has it killed).
        try:
            self.limiter.acquire_nowait()
        except anyio.WouldBlock:
            await self.limiter.acquire()
        try:
            await anyio.lowlevel.checkpoint_if_cancelled()
            worker = self._idle_worker()
            if worker is None:
                # One fork at a time. Forking copies this process's page tables (tens of ms
                # for a big parent): off the event loop's thread.
                async with self._forking:
                    worker = await forked(
                        _Worker, programs_filters(), owner=self, limiter=self._threads
                    )
            self._busy.add(worker)
            try:
                result: T = await worker.call(fn, args, self._threads)
            except BaseException as exc:
                self._busy.discard(worker)
                if isinstance(exc, Exception) and not isinstance(exc, BrokenWorkerProcess):
                    await self._free(worker)  # the function raised: the worker is fine
                else:  # cancelled (or dead): a worker mid-call is killed
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(worker.kill, limiter=self._threads)
                    self._done_if_stopped()
                raise
            self._busy.discard(worker)
            await self._free(worker)
            return result
        finally:
            self.limiter.release()

    async def _free(self, worker: _Worker) -> None:
        """``worker`` ended its call: idle, or stopped if the pool stopped meanwhile."""
        self._idle.append(worker)
        if self._stopped:
            await self.stop()

    def _idle_worker(self) -> _Worker | None:
        """An idle worker that is alive: one that died idle (the OOM killer, between runs) is
        dropped here, not handed a call that would fail as if it had died playing it."""
        while self._idle:
            worker = self._idle.pop()
            if not _ended(worker.process):
                return worker
            worker.kill()  # already reaped (or ended): closes its socket
        return None

    async def stop(self) -> None:
        """Stop the idle workers (and the busy ones as their calls end): socket closed (clean
        exit), killed if still there after a grace."""
        self._stopped = True
        idle, self._idle = self._idle, []

        def stop() -> None:
            for worker in idle:
                worker.close()
            deadline = time.monotonic() + STOP_GRACE  # one grace for all, not one each
            for worker in idle:
                worker.process.join(max(0.0, deadline - time.monotonic()))
                if worker.process.exitcode is None:
                    _kill(worker.process)
                    worker.process.join()
                worker.reap()

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(stop, limiter=self._threads)
        self._done_if_stopped()

    def _done_if_stopped(self) -> None:
        """Stopped with no worker left (a worker dies with the thread that forked it:
        ``_serve``): done with that thread."""
        if self._stopped and not self._busy and not self._idle and not self._forking.locked():
            forker_done(self)
