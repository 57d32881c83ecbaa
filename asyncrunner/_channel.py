"""The channel that carries events from worker processes back to the event loop.

A run listens on a Unix socket inside a fresh private folder (mode 0700: other users of the machine
cannot connect). A worker connects once per run, sends a hello frame holding the run's secret
token, then length-prefixed pickled events. The token is checked before anything is unpickled;
connections that fail the check are closed and counted in ``rejected``. The loop only ever awaits
socket reads, so a busy worker never blocks it, and a full inbox stops the reads: the socket's
buffer fills and the worker waits (backpressure, nothing dropped).
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
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = ["Channel", "ChannelClosed", "connect", "open_channel"]

_HEADER = struct.Struct("!Q")
_HELLO_TIMEOUT = 10.0


class ChannelClosed(Exception):
    """Raised in a worker when the run's channel is gone (the run ended or was cancelled)."""


def _frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload)) + payload


# --- worker side -----------------------------------------------------------------------------

_connection: tuple[str, socket.socket] | None = None


def connect(address: str, token: str) -> Callable[[Any], None]:
    """Return a function sending one event over the run's channel (connecting once per run)."""
    global _connection
    if _connection is None or _connection[0] != address:
        if _connection is not None:
            _connection[1].close()
            _connection = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)
            sock.sendall(_frame(f"{token} {os.getpid()}".encode()))
        except OSError as exc:
            sock.close()
            raise ChannelClosed(f"cannot reach the runner at {address}: {exc}") from exc
        _connection = (address, sock)
    sock = _connection[1]

    def send(event: Any) -> None:
        global _connection
        try:
            sock.sendall(_frame(pickle.dumps(event, protocol=5)))
        except OSError as exc:
            _connection = None
            sock.close()
            raise ChannelClosed(f"the runner's channel closed: {exc}") from exc

    return send


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

    async def _serve(self, stream: SocketStream) -> None:
        async with stream:
            buffered = BufferedByteReceiveStream(stream)
            try:
                with anyio.fail_after(_HELLO_TIMEOUT):
                    (size,) = _HEADER.unpack(await buffered.receive_exactly(_HEADER.size))
                    if size > 200:
                        raise ValueError("hello too long")
                    token, _, pid = (await buffered.receive_exactly(size)).decode().partition(" ")
                if not hmac.compare_digest(token, self.token):
                    raise ValueError("bad token")
                self.pids.add(int(pid))
            except (
                TimeoutError,
                ValueError,
                anyio.IncompleteRead,
                anyio.EndOfStream,
                anyio.BrokenResourceError,
                UnicodeDecodeError,
            ):
                self.rejected += 1
                return
            async with self.send.clone() as send:
                while True:
                    try:
                        header = await buffered.receive_exactly(_HEADER.size)
                    except (anyio.IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError):
                        return  # the worker went away; the dispatcher notices through its call
                    (size,) = _HEADER.unpack(header)
                    payload = await buffered.receive_exactly(size)
                    await send.send(pickle.loads(payload))


@asynccontextmanager
async def open_channel(max_buffer: int = 64) -> AsyncIterator[Channel]:
    """Listen for a run's workers until the block exits."""
    folder = tempfile.mkdtemp(prefix="asyncrunner-")
    address = os.path.join(folder, "channel")
    send, receive = anyio.create_memory_object_stream[Any](max_buffer)
    channel = Channel(address=address, token=secrets.token_hex(16), send=send, receive=receive)
    try:
        listener = await anyio.create_unix_listener(address)
        async with listener, send, receive, anyio.create_task_group() as inner:
            inner.start_soon(listener.serve, channel._serve, inner)
            try:
                yield channel
            finally:
                inner.cancel_scope.cancel()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
