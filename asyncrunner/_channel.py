"""The channel that carries events from worker processes back to the event loop.

A run listens on a Unix socket inside a fresh private folder (mode 0700: other users of the machine
cannot connect). A worker connects once per run, sends a hello frame holding the run's secret
token, then length-prefixed pickled events. The token is checked before anything is unpickled;
connections that fail the check are closed and counted in ``rejected``. The loop only ever awaits
socket reads, so a busy worker never blocks it, and a full inbox stops the reads: the socket's
buffer fills and the worker waits (backpressure, nothing dropped).

For workers on other machines (a Dask cluster) the run listens on TCP instead
(``open_channel(listen="tcp://HOST:PORT")``, address ``tcp://HOST:PORT``); the token check is the
same, and comes before any unpickling. A worker may *claim* an episode attempt before playing it
(``claim``): the first connection to claim it owns it, later ones (a task that Dask re-ran after
its worker died) are refused, and ``Channel.drop`` closes the owner's connection, which stops the
episode at its next send.

An episode whose agent runs in the orchestrator (``CentralAgent``) sends an ``AgentCall`` (its
observation) and waits for one reply frame (the action) on the same connection: the connection
serves one episode at a time, so replies need no matching.
"""

from __future__ import annotations

import hmac
import os
import pickle
import secrets
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = ["AgentCall", "Channel", "ChannelClosed", "call", "claim", "connect", "open_channel"]

_HEADER = struct.Struct("!Q")
_HELLO_TIMEOUT = 10.0


class ChannelClosed(Exception):
    """Raised in a worker when the run's channel is gone (the run ended or was cancelled)."""


def _frame(payload: bytes) -> bytes:
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


def _tcp(address: str) -> tuple[str, int] | None:
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://") :].rpartition(":")
    return host.strip("[]"), int(port)


# --- worker side -----------------------------------------------------------------------------


class _Local(threading.local):
    # One connection per thread: a worker playing several episodes at once (one thread each)
    # has one connection per episode, so each gets its own replies.
    connection: tuple[str, socket.socket] | None = None


_local = _Local()


def connect(address: str, token: str) -> Callable[[Any], None]:
    """Return a function sending one event over the run's channel (connecting once per run)."""
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
            sock.sendall(_frame(f"{token} {os.getpid()}".encode()))
        except OSError as exc:
            sock.close()
            raise ChannelClosed(f"cannot reach the runner at {address}: {exc}") from exc
        _connection = _local.connection = (address, sock)
    sock = _connection[1]

    def send(event: Any) -> None:
        try:
            sock.sendall(_frame(pickle.dumps(event, protocol=5)))
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
            sock.sendall(_frame(pickle.dumps(_Claim(key), protocol=5)))
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


def _receive_frame(sock: socket.socket) -> bytes:
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


def call(address: str, token: str, message: Any) -> Any:
    """Send ``message`` to the runner and wait for its one-frame reply (unpickled)."""
    connect(address, token)
    assert _local.connection is not None
    sock = _local.connection[1]
    try:
        sock.sendall(_frame(pickle.dumps(message, protocol=5)))
        payload = _receive_frame(sock)
    except OSError as exc:
        _local.connection = None
        sock.close()
        raise ChannelClosed(f"the runner's channel closed: {exc}") from exc
    return pickle.loads(payload)


# --- event loop side -------------------------------------------------------------------------


@dataclass
class Channel:
    """A run's listening end: ``address`` and ``token`` go to the workers, events come out of
    ``receive``; ``send`` lets the orchestrator put its own events in the same ordered inbox."""

    address: str
    token: str
    send: MemoryObjectSendStream[Any]
    receive: MemoryObjectReceiveStream[Any]
    rejected: int = 0
    pids: set[int] = field(default_factory=set)
    claims: dict[str, anyio.CancelScope] = field(default_factory=dict)
    # Answers AgentCalls (set while a run's agent lives in the orchestrator).
    agent: Callable[[AgentCall], Awaitable[bytes]] | None = None

    def drop(self, key: str) -> None:
        """Close the connection that claimed ``key``: its worker stops at its next send."""
        scope = self.claims.get(key)
        if scope is not None:
            scope.cancel()

    async def _serve(self, sock: socket.socket) -> None:
        with sock:
            conn = _Connection(sock)
            try:
                with anyio.fail_after(_HELLO_TIMEOUT):
                    (size,) = _HEADER.unpack(await conn.receive_exactly(_HEADER.size))
                    if size > 200:
                        raise ValueError("hello too long")
                    token, _, pid = (await conn.receive_exactly(size)).decode().partition(" ")
                if not hmac.compare_digest(token, self.token):
                    raise ValueError("bad token")
                self.pids.add(int(pid))
            except (TimeoutError, ValueError, OSError, EOFError, UnicodeDecodeError):
                self.rejected += 1
                return
            async with self.send.clone() as send:
                with anyio.CancelScope() as scope:
                    try:
                        while True:
                            (size,) = _HEADER.unpack(await conn.receive_exactly(_HEADER.size))
                            event = pickle.loads(await conn.receive_exactly(size))
                            if isinstance(event, _Claim):
                                mine = event.key not in self.claims
                                if mine:
                                    self.claims[event.key] = scope
                                await conn.send(b"\x01" if mine else b"\x00")
                            elif isinstance(event, AgentCall):
                                if self.agent is None:
                                    reply = pickle.dumps(
                                        (
                                            "error",
                                            "RuntimeError",
                                            "this run has no central agent",
                                            "",
                                        )
                                    )
                                else:
                                    reply = await self.agent(event)
                                await conn.send(_frame(reply))
                            else:
                                await send.send(event)
                    except (OSError, EOFError):
                        return  # the worker went away; the dispatcher notices through its call

    async def _accept(self, listener: socket.socket, group: anyio.abc.TaskGroup) -> None:
        while True:
            await anyio.wait_readable(listener)
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                continue  # another process took it
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            group.start_soon(self._serve, sock)


class _Connection:
    """One worker's socket, read and written without blocking through ``anyio.wait_readable``.

    anyio's UNIX socket streams are not used: on asyncio, a read cancelled in the loop turn
    where its data arrives is completed by a loop callback anyway, which raises
    ``InvalidStateError`` (agronholm/anyio#1267).
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.buffer = bytearray()

    async def receive_exactly(self, n: int) -> bytes:
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

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view) :]
            except BlockingIOError:
                await anyio.wait_writable(self.sock)


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
    folder = tempfile.mkdtemp(prefix="asyncrunner-")
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
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# The channels open in this process, by address (the Dask executor drops claims through them).
_OPEN: dict[str, Channel] = {}


def listening(address: str) -> Channel | None:
    """The open channel at ``address`` in this process, if any."""
    return _OPEN.get(address)
