"""The channel that carries events from worker processes back to the event loop.

A run listens on a Unix socket inside a fresh private folder (mode 0700: other users of the machine
cannot connect), named after the process that owns it so that a later run removes the folders of
runs whose process is gone (a killed run cannot remove its own). A worker connects once per run,
sends a hello frame holding the run's secret token, then length-prefixed pickled events. The token
is checked before anything is unpickled. Whatever one connection does ends that connection only:
a bad or missing hello, a frame that cannot be read, or waiting for its hello while
``_MAX_WAITING`` newer connections arrived (strangers must not use up this process's open files)
closes it and counts it in ``rejected``; running out of open files while accepting drops the
connection waiting longest for its hello, or waits, rather than end the run. The loop only ever
awaits socket reads, so a busy worker never blocks it, and a full inbox stops the reads: the
socket's buffer fills and the worker waits (backpressure, nothing dropped).

For workers on other machines (a Dask cluster) the run listens on TCP instead
(``open_channel(listen="tcp://HOST:PORT")``, address ``tcp://HOST:PORT``); the token check is the
same, and comes before any unpickling. A worker may *claim* an episode attempt before playing it
(``claim``): the first connection to claim it owns it, later ones (a task that Dask re-ran after
its worker died) are refused, and ``Channel.drop`` closes the owner's connection, which stops the
episode at its next send.

An episode whose agent runs in the orchestrator (``CentralAgent``) sends an ``AgentCall`` (its
observation) and waits for one reply frame (the action) on the same connection: the connection
serves one episode at a time, so replies need no matching. A worker that has no env for a job's
recipe yet asks for the recipe the same way (``recipe``): jobs carry only its key, so that an
agent instance (megabytes, pickled) crosses to each worker once, not with every episode.
"""

from __future__ import annotations

import atexit
import errno
import hmac
import logging
import os
import pickle
import secrets
import shutil
import socket
import struct
import sys
import tempfile
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = [
    "SEND_FLAGS",
    "AgentCall",
    "AsyncSocket",
    "Channel",
    "ChannelClosed",
    "call",
    "claim",
    "connect",
    "frame",
    "open_channel",
    "receive_frame",
    "receive_soon",
    "recipe",
    "send_soon",
]

_HEADER = struct.Struct("!Q")
# The flags of every send on a socket: a write to a peer that is gone raises BrokenPipeError,
# even where SIGPIPE is at its default (a program piped to `head` sets it so, an embedding one
# never set it), where it would kill this process (the orchestrator, and every result with it).
SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)  # (Linux; macOS has no such flag)
# Frames longer than this are read into a buffer of their own, in as few reads as the socket allows.
_BIG = 1 << 16
_HELLO_TIMEOUT = 10.0
# Connections accepted that have not yet sent a valid hello: beyond this, the oldest is dropped.
# A worker sends its hello as it connects, so it waits for one turn of the event loop at most.
_MAX_WAITING = 64
# Seconds between tries of accept() while the process is out of open files with nothing to drop.
_ACCEPT_BACKOFF = 0.1
_OUT_OF_FILES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_PREFIX = "asyncrunner-"
# A Unix socket's path holds at most 107 bytes on Linux, 103 on macOS (their NUL apart): where
# the temporary folder is too deep for one, the channel's folder goes to /tmp.
_MAX_SOCKET_PATH = 107 if sys.platform.startswith("linux") else 103
_SHORT_ROOT = "/tmp"

_log = logging.getLogger(__name__)


class ChannelClosed(Exception):
    """Raised in a worker when the run's channel is gone (the run ended or was cancelled)."""


def frame(payload: bytes) -> bytes:
    """``payload`` with its length in front: one frame of a channel or of a forked worker's pipe."""
    return _HEADER.pack(len(payload)) + payload


@dataclass(frozen=True)
class _Claim:
    """Worker → runner: "may I play this attempt?"; answered with one byte (1 yes, 0 no)."""

    key: str


@dataclass(frozen=True)
class AgentCall:
    """Worker → runner: an episode's observation for the agent in the orchestrator.

    Answered with one frame: the pickled ``("ok", action_vector)`` or
    ``("error", type_name, message, traceback)``. ``agent_seed`` and ``first`` let the runner
    build, seed and reset a per-episode agent as the worker would have.
    """

    run_id: str
    index: int
    attempt: int
    observation: Any  # numpy vector, obs.to_vect()
    reward: float
    done: bool
    agent_seed: int | None
    first: bool
    # The observation's values its vector leaves out (its thermal limits, voltage angles, ...),
    # by attribute name: set on the observation rebuilt from the vector.
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _RecipeCall:
    """Worker → runner: "send me recipe ``key``"; answered with one frame of its pickled bytes
    (empty: this run has no such recipe)."""

    key: str


def _tcp(address: str) -> tuple[str, int] | None:
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://") :].rpartition(":")
    return host.strip("[]"), int(port)


# --- worker side -----------------------------------------------------------------------------


class _WorkerConnection(tuple[str, socket.socket]):
    """``(address, socket)``; the socket closes with it (a thread's, when the thread ends: a
    ``concurrent.futures`` thread pool's worker)."""

    def __del__(self) -> None:
        self[1].close()


class _Local(threading.local):
    # One connection per thread: a worker playing several episodes at once (one thread each)
    # has one connection per episode, so each gets its own replies.
    connection: _WorkerConnection | None = None


# This worker's sockets to the runner (its channel connections, its pool's socket): a process
# its agent forks (a pool of its own) closes its copies (``close_inherited``), or the runner
# would not see this worker's end (the OOM killer's) while that process lives.
WORKER_SOCKETS: weakref.WeakSet[socket.socket] = weakref.WeakSet()


def close_inherited() -> None:
    """In a process forked by a worker's agent: close the worker's sockets it inherited."""
    for sock in list(WORKER_SOCKETS):
        sock.close()


_local = _Local()


def connect(address: str, token: str) -> Callable[..., None]:
    """Return a function sending events over the run's channel (connecting once per run); the
    events of one call leave in one write."""
    _connection = _local.connection
    if _connection is None or _connection[0] != address:
        if _connection is not None:
            _connection[1].close()
            _local.connection = None
        tcp = _tcp(address)
        if tcp is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in tcp[0] else socket.AF_INET)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.connect(address if tcp is None else tcp)
            sock.sendall(frame(f"{token} {os.getpid()}".encode()), SEND_FLAGS)
        except OSError as exc:
            sock.close()
            hint = (
                " (a worker on this machine that does not see this process's files, in a "
                "container or with a private /tmp, needs the channel on TCP: "
                "DaskExecutor(..., listen='tcp://HOST:0'))"
                if tcp is None
                else " (the workers must reach it: give DaskExecutor(..., "
                "listen='tcp://HOST:0') an address of this machine they can connect to)"
            )
            raise ChannelClosed(f"cannot reach the runner at {address}: {exc}{hint}") from exc
        _connection = _local.connection = _WorkerConnection((address, sock))
        WORKER_SOCKETS.add(sock)
    sock = _connection[1]

    def send(*events: Any) -> None:
        try:
            sock.sendall(b"".join(frame(pickle.dumps(e, protocol=5)) for e in events), SEND_FLAGS)
        except OSError as exc:
            _local.connection = None
            sock.close()
            raise ChannelClosed(f"the runner's channel closed: {exc}") from exc

    return send


def claim(address: str, token: str, key: str) -> bool:
    """Ask the runner for attempt ``key``: True for the first connection that asks, else False."""
    error: Exception | None = None
    for _ in range(2):
        # A connection kept from an earlier run on the same address (a fixed TCP port) is
        # closed at the other end: reconnect once.
        reused = _local.connection is not None and _local.connection[0] == address
        connect(address, token)
        assert _local.connection is not None
        sock = _local.connection[1]
        try:
            sock.sendall(frame(pickle.dumps(_Claim(key), protocol=5)), SEND_FLAGS)
            answer = sock.recv(1)
        except OSError as exc:
            answer, error = b"", exc
        if answer:
            return answer == b"\x01"
        _local.connection = None
        sock.close()
        if not reused:
            break
    raise ChannelClosed(f"the runner's channel closed: {error or 'EOF'}")


def _end(sock: socket.socket) -> None:
    """Close a connection, shut down first: a process forked meanwhile (a forked pool's worker,
    a fork-context executor's) holds a copy of it, and its worker would see it closed only once
    that process exits; it played on, or waited for ever on a full socket."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # (closed by the other end already)
    sock.close()


@contextmanager
def _ending(sock: socket.socket) -> Iterator[None]:
    try:
        yield
    finally:
        _end(sock)


def receive_frame(sock: socket.socket) -> bytes:
    """One frame's payload from a blocking socket (``OSError`` when it closes first)."""

    def exactly(n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = sock.recv(min(left, 1 << 20))
            if not chunk:
                raise OSError("EOF")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    (size,) = _HEADER.unpack(exactly(_HEADER.size))
    return exactly(size)


def _ask(address: str, token: str, message: Any) -> bytes:
    """Send ``message`` to the runner and wait for its one-frame reply."""
    connect(address, token)
    assert _local.connection is not None
    sock = _local.connection[1]
    try:
        sock.sendall(frame(pickle.dumps(message, protocol=5)), SEND_FLAGS)
        return receive_frame(sock)
    except OSError as exc:
        _local.connection = None
        sock.close()
        raise ChannelClosed(f"the runner's channel closed: {exc}") from exc


def call(address: str, token: str, message: Any) -> Any:
    """Send ``message`` to the runner and wait for its one-frame reply (unpickled)."""
    return pickle.loads(_ask(address, token, message))


def recipe(address: str, token: str, key: str) -> bytes:
    """The pickled recipe ``key`` of the run at ``address`` (``EpisodeJob.recipe_key``)."""
    blob = _ask(address, token, _RecipeCall(key))
    if not blob:
        raise RuntimeError(f"the run at {address} has no recipe {key!r}")
    return blob


# --- event loop side -------------------------------------------------------------------------


@dataclass
class Channel:
    """A run's listening end: ``address`` and ``token`` go to the workers, events come out of
    ``receive``; ``send`` lets the orchestrator put its own events in the same ordered inbox.

    ``rejected`` counts the connections closed for what they did (see the module docstring).
    """

    address: str
    token: str
    send: MemoryObjectSendStream[Any]
    receive: MemoryObjectReceiveStream[Any]
    rejected: int = 0
    pids: set[int] = field(default_factory=set)
    claims: dict[str, anyio.CancelScope] = field(default_factory=dict)
    # Answers AgentCalls (set while a run's agent lives in the orchestrator).
    agent: Callable[[AgentCall], Awaitable[bytes]] | None = None
    # The run's pickled recipes by key, for the workers that ask (``recipe``).
    recipes: Mapping[str, bytes] = field(default_factory=dict)
    # Accepted connections waiting for their hello, oldest first.
    _waiting: dict[socket.socket, None] = field(default_factory=dict)
    _first_rejection: str = ""

    def drop(self, key: str) -> None:
        """Close the connection that claimed ``key``: its worker stops at its next send."""
        scope = self.claims.get(key)
        if scope is not None:
            scope.cancel()

    def _reject(self, why: str) -> None:
        self.rejected += 1
        self._first_rejection = self._first_rejection or why
        _log.debug("channel %s: connection closed: %s", self.address, why)

    def _drop_oldest(self) -> bool:
        """Close the connection waiting longest for its hello (its task sees it closed)."""
        if not self._waiting:
            return False
        sock = next(iter(self._waiting))
        del self._waiting[sock]
        anyio.notify_closing(sock)
        _end(sock)
        return True

    async def _serve(self, sock: socket.socket) -> None:
        # Any error here comes from what this connection sent (or failed to send): it closes
        # this connection only. Cancellation (the run ending) is not an Exception: it goes on.
        with _ending(sock):
            try:
                if sock.family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn = AsyncSocket(sock)
                with anyio.fail_after(_HELLO_TIMEOUT):
                    (size,) = _HEADER.unpack(await conn.receive_exactly(_HEADER.size))
                    if size > 200:
                        raise ValueError("hello too long")
                    hello = await conn.receive_exactly(size)
                # Bytes: compare_digest raises TypeError on str holding non-ASCII characters.
                token, _, pid = hello.partition(b" ")
                if not hmac.compare_digest(token, self.token.encode()):
                    raise ValueError("bad token")
                self.pids.add(int(pid))
            except Exception as exc:
                if sock in self._waiting:
                    self._reject(f"bad hello ({type(exc).__name__}: {exc})")
                else:
                    self._reject(
                        f"dropped: {_MAX_WAITING} newer connections waited for their hello"
                    )
                return
            finally:
                self._waiting.pop(sock, None)
            try:
                await self._events(conn)
            except (OSError, EOFError):
                return  # the worker went away; the dispatcher notices through its call
            except Exception as exc:
                # An authenticated worker sent what cannot be read: worth a warning of its own.
                _log.warning(
                    "channel %s: closing a worker's connection", self.address, exc_info=True
                )
                self._reject(f"unreadable frame ({type(exc).__name__}: {exc})")

    async def _events(self, conn: AsyncSocket) -> None:
        async with self.send.clone() as send:
            with anyio.CancelScope() as scope:
                while True:
                    event = pickle.loads(await conn.receive_frame())
                    if isinstance(event, _Claim):
                        mine = event.key not in self.claims
                        if mine:
                            self.claims[event.key] = scope
                        await conn.send(b"\x01" if mine else b"\x00")
                    elif isinstance(event, AgentCall):
                        if self.agent is None:
                            reply = pickle.dumps(
                                ("error", "RuntimeError", "this run has no central agent", "")
                            )
                        else:
                            reply = await self.agent(event)
                        await conn.send(frame(reply))
                    elif isinstance(event, _RecipeCall):
                        blob = self.recipes.get(event.key, b"")
                        await conn.send(_HEADER.pack(len(blob)))
                        await conn.send(blob)  # not joined to its header: it may be gigabytes
                    else:
                        await send_soon(send, event)

    async def _accept(self, listener: socket.socket, group: anyio.abc.TaskGroup) -> None:
        while True:
            await anyio.wait_readable(listener)
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                continue  # another process took it
            except OSError as exc:
                # Out of open files (idle connections, or the embedding app's own files):
                # free one by dropping the oldest connection without a hello, else wait for
                # some to close. Other errors are one pending connection's (reset by its peer).
                if exc.errno not in _OUT_OF_FILES:
                    self._reject(f"accept failed ({exc})")
                if exc.errno not in _OUT_OF_FILES or not self._drop_oldest():
                    await anyio.sleep(_ACCEPT_BACKOFF)
                continue
            if len(self._waiting) >= _MAX_WAITING:
                self._drop_oldest()
            self._waiting[sock] = None
            group.start_soon(self._serve, sock)

    def _report(self) -> None:
        if self.rejected:
            _log.warning(
                "channel %s: %d connection(s) closed without serving them (first: %s)",
                self.address,
                self.rejected,
                self._first_rejection,
            )


class AsyncSocket:
    """A socket read and written without blocking through ``anyio.wait_readable`` (a worker's
    connection to the channel; a forked worker's pipe).

    anyio's UNIX socket streams are not used: on asyncio, a read cancelled in the loop turn
    where its data arrives is completed by a loop callback anyway, which raises
    ``InvalidStateError`` (agronholm/anyio#1267).
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.buffer = bytearray()

    async def receive_exactly(self, n: int) -> bytes | bytearray:
        if n > _BIG and len(self.buffer) < n:
            return await self._receive_big(n)
        while len(self.buffer) < n:
            try:
                chunk = self.sock.recv(max(n - len(self.buffer), 1 << 16))
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
                continue
            if not chunk:
                raise EOFError
            self.buffer += chunk
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    async def receive_frame(self) -> bytes | bytearray:
        """The next frame's payload (``frame``)."""
        (size,) = _HEADER.unpack(await self.receive_exactly(_HEADER.size))
        return await self.receive_exactly(size)

    async def _receive_big(self, n: int) -> bytearray:
        """``n`` bytes read straight into their own buffer (an episode's files: megabytes)."""
        data = bytearray(n)
        view = memoryview(data)
        got = len(self.buffer)
        view[:got] = self.buffer
        self.buffer.clear()
        while got < n:
            try:
                k = self.sock.recv_into(view[got:])
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
                continue
            if not k:
                raise EOFError
            got += k
        return data

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view, SEND_FLAGS) :]
            except BlockingIOError:
                await anyio.wait_writable(self.sock)


async def send_soon(stream: MemoryObjectSendStream[Any], item: Any) -> None:
    """``await stream.send(item)``, without yielding to the event loop when there is room.

    A memory stream's ``send`` and ``receive`` first let every other task run (a checkpoint: a
    turn of the event loop, most of the orchestrator's CPU for an event). An event crosses two
    or three streams, and a short episode sends three: here a stream is used as a queue, and a
    task yields when it has to wait. Its buffer (tens of items) bounds how long it goes on
    without yielding.

    Anything but an immediate success goes through ``send``, whose checkpoint comes first: a
    cancelled task whose receiver is already gone (a cancelled run's sinks) sees its
    cancellation, as with ``send``, not ``BrokenResourceError``.
    """
    try:
        stream.send_nowait(item)
    except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
        await stream.send(item)


async def receive_soon(stream: MemoryObjectReceiveStream[Any]) -> Any:
    """``await stream.receive()``, without yielding to the event loop when an item is waiting
    (see ``send_soon``, also for a cancelled task); raises ``anyio.EndOfStream`` once the stream
    is closed and empty."""
    try:
        return stream.receive_nowait()
    except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
        return await stream.receive()


@asynccontextmanager
async def open_channel(max_buffer: int = 64, listen: str | None = None) -> AsyncIterator[Channel]:
    """Listen for a run's workers until the block exits.

    ``listen``: ``None`` for a Unix socket in a private folder (workers on this machine), or
    ``"tcp://HOST:PORT"`` (port 0: any free one) for workers elsewhere; ``HOST`` is both where
    the run listens and what workers connect to.
    """
    tcp = None if listen is None else _tcp(listen)
    if listen is not None and tcp is None:
        raise ValueError(f"`listen` must look like tcp://HOST:PORT, got {listen!r}")
    folder = await anyio.to_thread.run_sync(_channel_folder)
    _FOLDERS.add(folder)
    address = os.path.join(folder, "channel")
    send, receive = anyio.create_memory_object_stream[Any](max_buffer)
    try:
        if tcp is None:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(address)
            listener.listen()
        else:
            family = socket.AF_INET6 if ":" in tcp[0] else socket.AF_INET
            listener = socket.create_server(tcp, family=family)
            host = f"[{tcp[0]}]" if ":" in tcp[0] else tcp[0]
            address = f"tcp://{host}:{listener.getsockname()[1]}"
        listener.setblocking(False)
        channel = Channel(address=address, token=secrets.token_hex(16), send=send, receive=receive)
        _OPEN[address] = channel
        try:
            with listener:
                async with send, receive, anyio.create_task_group() as inner:
                    inner.start_soon(channel._accept, listener, inner)
                    try:
                        yield channel
                    finally:
                        inner.cancel_scope.cancel()
        finally:
            _OPEN.pop(address, None)
            channel._report()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        _FOLDERS.discard(folder)


def _channel_folder() -> str:
    """A new private folder for the channel's socket: in the temporary folder (``TMPDIR``), or
    in ``/tmp`` when the socket's path there would be too long for a Unix socket (a batch job's
    deep scratch folder). The stale folders of the one it uses are removed first."""
    root = tempfile.gettempdir()
    remove_stale_folders(root)
    folder = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=root)
    if len(os.fsencode(os.path.join(folder, "channel"))) <= _MAX_SOCKET_PATH:
        return folder
    os.rmdir(folder)
    remove_stale_folders(_SHORT_ROOT)
    try:
        return tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=_SHORT_ROOT)
    except OSError as exc:
        raise OSError(
            f"the temporary folder {tempfile.gettempdir()!r} is too long a path for the run's Unix "
            f"socket (at most {_MAX_SOCKET_PATH} bytes with its name), and {_SHORT_ROOT} cannot "
            f"hold it ({exc}): set TMPDIR to a shorter folder"
        ) from exc


def remove_stale_folders(root: str) -> None:
    """Remove this user's channel folders in ``root`` whose owner process is gone (killed runs
    leave them).

    The owner's pid is in the folder's name; a live run's folder is never removed (a pid reused
    by another process keeps a stale folder, which is the safe way round).
    """
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        owner = entry.name[len(_PREFIX) :].partition("-")[0]
        if not entry.name.startswith(_PREFIX) or not owner.isdigit():
            continue  # not ours, or made before folders were named after their owner
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
                continue
            os.kill(int(owner), 0)
            continue  # its owner lives
        except ProcessLookupError:
            pass
        except (OSError, OverflowError):
            continue  # alive (another user's pid), not a pid, or the folder just went
        try:
            if set(os.listdir(entry.path)) <= {"channel"}:  # only what a channel puts there
                shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            pass  # removed meanwhile


# The channels open in this process, by address (the Dask executor drops claims through them).
_OPEN: dict[str, Channel] = {}
# Their private folders, removed at this process's exit too: an event loop stopped with a run
# going (Jupyter's ``quit()``, a loop that never cancels its tasks) ran no cleanup.
_FOLDERS: set[str] = set()


os.register_at_fork(after_in_child=_FOLDERS.clear)  # (a forked process's are its parent's)


@atexit.register
def _remove_folders() -> None:
    for folder in list(_FOLDERS):
        shutil.rmtree(folder, ignore_errors=True)


def listening(address: str) -> Channel | None:
    """The open channel at ``address`` in this process, if any."""
    return _OPEN.get(address)
